"""The N-rank GPU path (NCCL, the shared host store page-locked per rank, gradients reduce-scattered on the GPU) run
with N=1 through torchrun equals the plain one-process engine. Needs one CUDA GPU, about a minute:
    MEGATRAIN_GPU_CHECKS=results/gpu_checks/records.jsonl pytest tests/gpu/test_distributed_gpu.py -m gpu
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain.bench.case import run_case
from megatrain.config import CaseConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.subprocess]

CASES = {  # streamed and resident units, fp32 (exact) and bf16 in both precisions, gradient accumulation
    "fp32-resident-layer": dict(dtype="float32", options={"resident_embedding": False, "resident_layers": 1}),
    "bf16-mixed-streamed": dict(dtype="bfloat16", options={"resident_embedding": False, "resident_layers": 0}),
    "bf16-bf16-auto-resident": dict(dtype="bfloat16", precision="bf16", options={}),
}
BASE = dict(system="megatrain", model="tiny", num_layers=4, batch=4, micro_batch=2, seq=256, steps=6, warmup=1,
            device="cuda")


def _flags(case: dict) -> list[str]:
    flags = ["--system", "megatrain", "--model", "tiny", "--num-layers", "4", "--batch", "4", "--micro-batch", "2",
             "--seq", "256", "--steps", "6", "--device", "cuda", "--dtype", case["dtype"],
             "--precision", case.get("precision", "mixed"), "--json"]
    for key, value in case["options"].items():
        flags += ["--option", f"{key}={json.dumps(value)}"]
    return flags


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_rank_through_torchrun_equals_the_plain_engine(name, check):
    case = CASES[name]
    plain = run_case(CaseConfig(**BASE, **case))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # --standalone: a free port, so another torchrun on the machine (a second group of checks) cannot take it
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           "-m", "megatrain", "bench", *_flags(case)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ranked = json.loads(proc.stdout.strip().splitlines()[-1])
    check.update(case=name, plain_losses=plain["losses"], torchrun_losses=ranked["losses"],
                 resident_units=ranked["system_config"]["resident_units"], ranks=ranked["metrics"]["ranks"])
    assert plain["status"] == ranked["status"] == "ok"
    assert ranked["metrics"]["ranks"] == 1 and ranked["metrics"]["pinned_host_bytes"] > 0
    assert ranked["system_config"]["resident_units"] == plain["system_config"]["resident_units"]
    torch.testing.assert_close(torch.tensor(ranked["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=0)
