"""Two GPUs of one host (NCCL): every system on 2 GPUs trains as on 1 at the same global batch (fp32, losses and
gradient norms to float noise), and for MegaTrain a rank killed mid-run ends the other within a bounded time with one
line, and the run resumes bitwise on 2 GPUs and to float noise on 1. Needs 2 CUDA GPUs (skipped with fewer), about 5
minutes (each run is a torchrun launch; DeepSpeed's needs it installed):
    MEGATRAIN_GPU_CHECKS=results/gpu_checks/records.jsonl pytest tests/gpu/test_multi_gpu.py -m gpu
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import ROOT, metrics, pretokenized

pytestmark = [pytest.mark.gpu, pytest.mark.subprocess,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]
needs_deepspeed = [pytest.mark.deepspeed, pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                                             reason="deepspeed not installed")]
SYSTEMS = ["megatrain", "native", "fsdp", pytest.param("deepspeed", marks=needs_deepspeed)]
# the checkout first, and whatever the host's PYTHONPATH holds after it (the GPU hosts' DeepSpeed wheels)
ENV = {**{k: v for k, v in os.environ.items() if k != "MEGATRAIN_FAULT"},
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
BOUND_S = 120  # a survivor must be gone this long after its peer died (NCCL's own timeout is 30 min)


def train_args(system: str, data, out, steps: int = 6) -> list[str]:
    """A small registry model on the GPU in fp32, 12 rows a step in micro-batches of 2 (3 per rank on 2 GPUs:
    accumulation), clipping below the gradient norm, a checkpoint every 2 steps."""
    return ["train", "--system", system, "--model", "tiny", "--data", str(data), "--no-shuffle", "--seq", "64",
            "--batch", "12", "--micro-batch", "2", "--steps", str(steps), "--lr", "3e-3", "--lr-schedule", "cosine",
            "--warmup-steps", "1", "--min-lr", "3e-4", "--weight-decay", "0.1", "--max-grad-norm", "1.5",
            "--save-every", "2", "--out", str(out), "--dtype", "float32", "--device", "cuda"]


def launch(nproc: int, args: list[str], fault: str | None = None) -> subprocess.Popen:
    """`python -m megatrain ARGS` on one GPU (nproc 0, no torchrun) or through torchrun on nproc GPUs."""
    env = {**ENV, **({"MEGATRAIN_FAULT": fault} if fault else {})}
    runner = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc else []
    return subprocess.Popen([sys.executable, *runner, "-m", "megatrain", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(nproc: int, args: list[str]) -> None:
    proc = launch(nproc, args)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]


def _series(out, key: str) -> list[float]:
    return [m[key] for m in metrics(out) if key in m]


def _weights(out) -> dict:
    return load_file(out / "hf" / "model.safetensors")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs(system, nproc): the output directory of a 6-step run on nproc GPUs (0: one process, one GPU), once."""
    root = tmp_path_factory.mktemp("multi-gpu")
    data = pretokenized(root / "data.jsonl", rows=24)

    def trained(system: str, nproc: int):
        out = root / f"{system}-{nproc}"
        if not out.exists():
            run(nproc, train_args(system, data, out))
        return out

    trained.root, trained.data = root, data
    return trained


@pytest.mark.parametrize("system", SYSTEMS)
def test_two_gpus_train_as_one_at_the_same_global_batch(runs, system, check):
    two, one = runs(system, 2), runs(system, 0)
    check.update(system=system, one_gpu_losses=_series(one, "loss"), two_gpu_losses=_series(two, "loss"),
                 one_gpu_grad_norms=_series(one, "grad_norm"), two_gpu_grad_norms=_series(two, "grad_norm"))
    for key in ("loss", "grad_norm"):  # the ranks sum in another order than one GPU: float noise, not more
        torch.testing.assert_close(torch.tensor(_series(two, key)), torch.tensor(_series(one, key)), rtol=1e-5, atol=0)
    a, b = _weights(two), _weights(one)
    diffs = {name: (a[name] - b[name]).abs().max().item() for name in a}
    check.update(max_weight_diff=max(diffs.values()))
    assert a.keys() == b.keys() and max(diffs.values()) <= 1e-5, diffs


def test_a_killed_rank_ends_the_other_and_the_run_resumes_on_two_and_on_one_gpu(runs, check):
    straight, cut = runs("megatrain", 2), runs.root / "cut"
    proc = launch(2, train_args("megatrain", runs.data, cut), fault="rank-1-step-3")
    t0 = time.perf_counter()
    stdout, stderr = proc.communicate(timeout=600)
    ended_s = time.perf_counter() - t0  # from launch: it includes the 3 steps before the kill
    lines = [line for line in stderr.splitlines() if "checkpoint" in line and "intact" in line]
    check.update(exit_code=proc.returncode, ended_after_s=round(ended_s, 1), message=lines[:1],
                 checkpoints=sorted(p.name for p in (cut / "checkpoints").iterdir()))
    assert proc.returncode != 0 and ended_s < BOUND_S, stderr[-3000:]
    assert len(lines) >= 1 and f"{cut / 'checkpoints' / 'step-2'} is intact" in lines[0], stderr[-3000:]
    on_one = runs.root / "cut-resumed-on-1"
    shutil.copytree(cut, on_one)
    run(2, ["train", "--resume", cut])
    run(0, ["train", "--resume", on_one])
    check.update(straight_losses=_series(straight, "loss"), resumed_on_2=_series(cut, "loss"),
                 resumed_on_1=_series(on_one, "loss"))
    assert _series(cut, "loss") == _series(straight, "loss")
    assert all(torch.equal(a, b) for a, b in zip(_weights(cut).values(), _weights(straight).values(), strict=True))
    torch.testing.assert_close(torch.tensor(_series(on_one, "loss")), torch.tensor(_series(straight, "loss")),
                               rtol=1e-5, atol=0)
