"""The baselines data parallel over torchrun ranks on CPU (gloo): native (DDP), FSDP2 and DeepSpeed ZeRO-3 on N
ranks train as one process does at the same global batch, a dead rank stops the run in one line, and a checkpoint
resumes on as many ranks (on another number where the system's format allows). CPU only; the subprocess ones start
torchrun (5-25 s each on two cores; DeepSpeed's need it installed): pytest tests/unit/test_distributed_baselines.py"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from test_distributed import _ok, _weights, torchrun
from train_helpers import ROOT, metrics, pretokenized

from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.memory import GIB, GPU_RESERVE_BYTES, PROCESS_OVERHEAD_BYTES, Budget
from megatrain.systems import deepspeed_zero3, fsdp_offload, native

NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
needs_deepspeed = [pytest.mark.deepspeed, pytest.mark.skipif(NO_DEEPSPEED, reason="deepspeed not installed")]
SYSTEMS = ["native", "fsdp", pytest.param("deepspeed", marks=needs_deepspeed)]
ENV = {**{k: v for k, v in os.environ.items() if k != "MEGATRAIN_FAULT"}, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT)}


def train_args(system: str, data, out, steps: int = 4) -> list[str]:
    """A tiny registry model, 12 rows a step in micro-batches of 2 (several per rank on 2 or 3 ranks: accumulation,
    DDP's no_sync), clipping below the gradient norm, a checkpoint every 2 steps."""
    return ["train", "--system", system, "--model", "tiny", "--data", data, "--no-shuffle", "--seq", "16", "--batch",
            "12", "--micro-batch", "2", "--steps", str(steps), "--lr", "3e-3", "--lr-schedule", "cosine",
            "--warmup-steps", "1", "--min-lr", "3e-4", "--weight-decay", "0.1", "--max-grad-norm", "1.5",
            "--save-every", "2", "--out", out, "--dtype", "float32", "--device", "cpu"]


def one_process(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m megatrain ARGS` without torchrun, in a fresh process (DeepSpeed and FSDP2 own a process group)."""
    return subprocess.run([sys.executable, "-m", "megatrain", *map(str, args)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(system, nproc): the output directory of a 4-step run on nproc ranks (0: one process without torchrun),
    trained once per module."""
    root = tmp_path_factory.mktemp("baselines-dp")
    data = pretokenized(root / "data.jsonl", rows=24)

    def run(system: str, nproc: int):
        out = root / f"{system}-{nproc}"
        if not out.exists():
            args = train_args(system, data, out)
            _ok(one_process(args) if nproc == 0 else torchrun(nproc, args))
        return out

    run.root, run.data = root, data
    return run


def _assert_close_runs(out, ref):
    """Losses and gradient norms to 1e-6 relative (the ranks sum in another order than one process: float noise),
    weights to float noise (Adam turns a ~0 gradient's noise into steps, as in test_distributed)."""
    for key in ("loss", "grad_norm"):  # the norm also tells a summed gradient from an averaged one
        torch.testing.assert_close(torch.tensor([m[key] for m in metrics(out) if key in m]),
                                   torch.tensor([m[key] for m in metrics(ref) if key in m]), rtol=1e-6, atol=0)
    a, b = _weights(out), _weights(ref)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.subprocess
@pytest.mark.parametrize("system, nproc", [("native", 2), ("fsdp", 2), ("fsdp", 3),
                                           pytest.param("deepspeed", 2, marks=needs_deepspeed)])
def test_n_ranks_train_as_one_process_at_the_same_global_batch(runs, system, nproc):
    _assert_close_runs(runs(system, nproc), runs(system, 0))


@pytest.mark.subprocess
@pytest.mark.parametrize("system", SYSTEMS)
def test_a_dead_rank_stops_the_run_in_one_line_and_it_resumes_on_as_many_ranks_bitwise(runs, system):
    straight, cut = runs(system, 2), runs.root / f"{system}-cut"
    killed = torchrun(2, train_args(system, runs.data, cut), fault="rank-1-step-3")
    assert killed.returncode != 0
    assert re.search(r"error: rank 0 of 2 lost rank 1 \(pid \d+, ended\) mid-step: ", killed.stderr), killed.stderr
    assert f"its last complete checkpoint {cut / 'checkpoints' / 'step-2'} is intact" in killed.stderr
    _ok(torchrun(2, ["train", "--resume", cut]))  # the system's own checkpoint format, written by both ranks
    assert [m["loss"] for m in metrics(cut)] == [m["loss"] for m in metrics(straight)]
    assert all(torch.equal(a, b) for a, b in zip(_weights(cut).values(), _weights(straight).values(), strict=True))


def _at_step_2(run, to):
    """A copy of a finished run with its step-4 checkpoint gone: a resume trains steps 3 and 4 again."""
    shutil.copytree(run, to)
    shutil.rmtree(to / "checkpoints" / "step-4")
    return to


@pytest.mark.subprocess
@pytest.mark.parametrize("system", ["native", "fsdp"])
def test_a_whole_or_resharded_checkpoint_resumes_on_another_number_of_ranks(runs, system):
    """native's checkpoint is the whole state, FSDP2's torch.distributed.checkpoint reshards as it loads."""
    straight = runs(system, 2)
    other = _at_step_2(straight, runs.root / f"{system}-2-on-3")
    _ok(torchrun(3, ["train", "--resume", other]))
    _assert_close_runs(other, straight)


@pytest.mark.subprocess
@pytest.mark.deepspeed
@pytest.mark.skipif(NO_DEEPSPEED, reason="deepspeed not installed")
def test_deepspeed_refuses_to_resume_its_partitions_on_another_number_of_ranks(runs):
    other = _at_step_2(runs("deepspeed", 2), runs.root / "deepspeed-2-on-1")
    proc = one_process(["train", "--resume", other])
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {other / 'checkpoints' / 'step-2'} holds DeepSpeed ZeRO-3 partitions of 2 rank(s) and this run has "
        "1: resume it on 2 (torchrun --nproc-per-node 2)")


def test_the_plans_share_the_offloaded_state_among_the_ranks_and_give_each_gpu_a_whole_native_copy(monkeypatch):
    """Under torchrun the pre-flight plans this launch's ranks on the host: DeepSpeed and FSDP2 each hold their
    share of the state there, native holds the whole model and its state on every GPU (host: the processes)."""
    def case(system, device="cuda"):
        return CaseConfig(system=system, model="qwen2.5-1.5b", batch=8, micro_batch=1, seq=512, device=device)

    def plan(system, device="cuda"):
        return dict(native=native, fsdp=fsdp_offload, deepspeed=deepspeed_zero3)[system].SPEC.plan_memory(
            case(system, device), Budget(10**4 * GIB, 10**3 * GIB, "test"))

    one = {s: plan(s) for s in ("native", "fsdp", "deepspeed")}
    monkeypatch.setattr(distributed, "launch_size", lambda: (4, 4))
    four = {s: plan(s) for s in ("native", "fsdp", "deepspeed")}
    overhead = 3 * PROCESS_OVERHEAD_BYTES  # the three more processes
    ds_state = deepspeed_zero3.memory_bytes(case("deepspeed"))[0]
    assert four["deepspeed"]["host_bytes"] - overhead == pytest.approx(one["deepspeed"]["host_bytes"], abs=4)
    assert deepspeed_zero3.memory_bytes(case("deepspeed"), 4)[0] == pytest.approx(ds_state / 4, abs=1)
    assert four["fsdp"]["host_bytes"] - overhead == pytest.approx(one["fsdp"]["host_bytes"], rel=1e-3)
    assert four["native"]["host_bytes"] == one["native"]["host_bytes"] + overhead
    for system in one:
        assert four[system]["gpu_bytes"] == one[system]["gpu_bytes"], "per GPU, at the same micro-batch"
    per_gpu = one["native"]["gpu_bytes"] - GPU_RESERVE_BYTES
    assert plan("native", "cpu")["host_bytes"] == 4 * (PROCESS_OVERHEAD_BYTES + per_gpu), "on CPU, four copies"
    assert deepspeed_zero3.deepspeed_config(case("deepspeed"), 4)["gradient_accumulation_steps"] == 2
