"""Compact AdamW moments (--moments bf16 / int8) and the host kernel's thread setting: unbiased stochastic rounding,
the C++ kernel against the torch reference, tracking fp32 AdamW, bytes per parameter, checkpoints, and `train` with
the option. CPU only, ~30 s: pytest tests/unit/test_compact_moments.py (the `train` one is marked subprocess)"""

import subprocess
import sys

import pytest
import torch

from megatrain.engine.config import EngineConfig
from megatrain.engine.host_optimizer import update_compact
from megatrain.engine.layout import Unit
from megatrain.engine.plan import plan_memory
from megatrain.models import model_shape
from megatrain.optim import fused
from megatrain.optim.compact import Moments, round_bf16_stochastic
from megatrain.optim.config import OptimConfig
from megatrain.optim.host_adamw import FlatAdamW
from megatrain.optim.state_bytes import MOMENT_BYTES, adamw_traffic_bytes_per_param, state_bytes_per_param

from engine_helpers import built, train  # isort: skip

needs_kernel = pytest.mark.skipif(not fused.available(), reason="no C++ compiler for the host AdamW kernel")


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    # 1 + 2**-10 lies an eighth of the way from 1 to the next bf16 (1 + 2**-7): nearest always gives 1
    for value in (1 + 2**-10, -3.3e-5, 7.77e3):
        x = torch.full((200_000,), value)
        rounded = round_bf16_stochastic(x, 12345, torch.tensor(7.0), 0).float()
        assert len(rounded.unique()) == 2  # the two neighbours
        spacing = (rounded.max() - rounded.min()).item()
        assert abs(rounded.double().mean().item() - value) < 0.01 * spacing
        assert abs(x.bfloat16().float().double().mean().item() - value) > 0.1 * spacing


def _mlp_problem():
    """A two-layer MLP regression as one flat parameter region (matrices decayed, the bias not)."""
    torch.manual_seed(0)
    d_in, hidden, d_out = 32, 64, 8
    x = torch.randn(512, d_in)
    y = torch.tanh(x @ torch.randn(d_in, d_out))
    a, b = hidden * d_in, hidden * d_in + d_out * hidden

    def loss_of(flat):
        w1, w2, b1 = flat[:a].view(hidden, d_in), flat[a:b].view(d_out, hidden), flat[b:]
        return ((torch.relu(x @ w1.T + b1) @ w2.T - y) ** 2).mean()

    return loss_of, torch.randn(b + hidden) * 0.1, b


def _train_mlp(moments: str, steps: int = 300) -> list[float]:
    loss_of, p, decay_numel = _mlp_problem()
    unit = Unit(1, "layer", (), 0, p.numel(), decay_numel)
    state, adamw, losses = Moments.zeros(p.numel(), moments), FlatAdamW(OptimConfig(lr=3e-3)), []
    for _ in range(steps):
        q = p.clone().requires_grad_()
        loss = loss_of(q)
        loss.backward()
        losses.append(loss.item())
        update_compact(adamw, unit, 0, p, q.grad, state, 0.1, 3e-3) if moments != "fp32" else [
            adamw.update((1, lo), p[lo:hi], q.grad[lo:hi], state.exp_avg[lo:hi], state.exp_avg_sq[lo:hi], wd)
            for lo, hi, wd in ((0, decay_numel, 0.1), (decay_numel, p.numel(), 0.0))]
    return losses


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_compact_moments_track_fp32_adamw_within_5_percent(moments):
    exact, compact = _train_mlp("fp32"), _train_mlp(moments)
    assert exact[-1] < 0.1 * exact[0]  # it learns
    for step in range(0, 300, 25):
        assert compact[step] == pytest.approx(exact[step], rel=0.05), step


@needs_kernel
@pytest.mark.parametrize("moments", ["bf16", "int8"])
@pytest.mark.parametrize("mixed", [True, False])
def test_host_kernel_equals_the_torch_reference(moments, mixed):
    n, decay, offset = 1000, 700, 256  # a partial last block; decay ends inside a block
    unit = Unit(3, "layer", (), offset, n, decay)
    torch.manual_seed(0)
    p0 = torch.randn(n)
    kernel_p, ref_p = (p0.clone(), p0.clone()) if mixed else (p0.bfloat16(), p0.bfloat16())
    kernel_m, ref_m = Moments.zeros(n, moments), Moments.zeros(n, moments)
    copy_out = torch.empty(n, dtype=torch.bfloat16) if mixed else None
    adamw = FlatAdamW(OptimConfig(lr=1e-2))
    for step in range(1, 6):
        g = torch.randn(n).bfloat16()
        fused.compact_adamw(kernel_p, g, kernel_m, copy_out, decay, offset, step, 0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1)
        p32 = ref_p if mixed else ref_p.float()
        update_compact(adamw, unit, 0, p32, g.float() * 0.5, ref_m, 0.1, 1e-2)
        if not mixed:
            ref_p.copy_(p32)
    # an ulp of the update may move an int8 code by one level, and that element's next steps by a little more
    torch.testing.assert_close(kernel_p.float(), ref_p.float(), rtol=1e-5, atol=1e-3 if moments == "int8" else 1e-6)
    if mixed:
        assert torch.equal(copy_out, kernel_p.bfloat16())
    for name, t in kernel_m.tensors().items():
        assert (t.float() - getattr(ref_m, name).float()).abs().max() <= (1 if t.dtype in (torch.int8, torch.uint8)
                                                                           else 1e-5), name


@needs_kernel
def test_the_kernel_thread_count_does_not_change_the_fp32_result(monkeypatch):
    n = 10_000
    runs = []
    for threads in ("1", "0", "3"):
        monkeypatch.setenv(fused.THREADS_ENV, threads)
        torch.manual_seed(0)
        p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
        w = torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 4):
            fused.fused_adamw(p, torch.linspace(-1, 1, n).bfloat16(), m, v, w, step, 0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1)
        runs.append(torch.cat([p, m, v, w.float()]))
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    monkeypatch.setenv(fused.THREADS_ENV, "many")
    with pytest.raises(ValueError, match=fused.THREADS_ENV):
        fused.threads()


@needs_kernel
@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_the_kernel_thread_count_does_not_change_the_compact_result(monkeypatch, moments):
    # 1000 elements: 8 blocks, the last partial, split unevenly between threads; decay ends inside a block
    n, decay, offset = 1000, 700, 256
    runs = []
    for threads in ("1", "2", "3", "5"):
        monkeypatch.setenv(fused.THREADS_ENV, threads)
        torch.manual_seed(0)
        p, state, w = torch.randn(n), Moments.zeros(n, moments), torch.empty(n, dtype=torch.bfloat16)
        for step in range(1, 4):
            g = torch.randn(n).bfloat16()
            fused.compact_adamw(p, g, state, w, decay, offset, step, 0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1)
        runs.append([p, w, *state.tensors().values()])
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run, strict=True))


@pytest.mark.parametrize("moments, moment_bytes", [("fp32", 8), ("bf16", 4), ("int8", 2 + 8 / 128)])
def test_state_bytes_are_what_the_store_holds_and_the_plan_counts(moments, moment_bytes):
    per = state_bytes_per_param(2, "mixed", MOMENT_BYTES[moments])
    assert per["exp_avg"] + per["exp_avg_sq"] == moment_bytes
    assert adamw_traffic_bytes_per_param(per) == 12 + 2 * moment_bytes  # 28 with fp32 moments
    optim = OptimConfig(moments=moments)
    with built("megatrain", 1, model="tiny", batch=1, seq=8, optim=optim) as (trainer, _):
        n = trainer.store.weights.numel()
        assert trainer.store.host_bytes() == n * (4 + 4 + moment_bytes)  # fp32 weights, grads (CPU), moments
        assert trainer.plan.host_state_bytes == trainer.store.host_bytes()
    big = dict(model=model_shape("qwen2.5-7b"), batch=1, micro_batch=1, seq=1024, dtype="bfloat16")
    fp32, compact = (plan_memory(EngineConfig(**big, optim=OptimConfig(moments=m))) for m in ("fp32", moments))
    assert fp32.host_state_bytes - compact.host_state_bytes == pytest.approx(
        (8 - moment_bytes) * fp32.host_state_bytes / 16, rel=1e-6)  # 16 B/param in mixed with fp32 moments


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_the_engine_with_compact_moments_tracks_fp32_and_resumes_bitwise(tmp_path, moments):
    case = dict(model="tiny", batch=2, seq=32, steps=6, optim=OptimConfig(lr=1e-3, moments=moments))
    exact = train("megatrain", **{**case, "optim": OptimConfig(lr=1e-3)})[0]
    straight = train("megatrain", **case)[:2]
    assert straight[0] == pytest.approx(exact, rel=0.02)
    with built("megatrain", **case) as (trainer, data):
        losses = [trainer.step(*data.batch_at(i)) for i in range(3)]
        trainer.save_state(tmp_path)
    with built("megatrain", **case) as (trainer, data):
        trainer.load_state(tmp_path)
        assert trainer.store.moments.format == moments
        losses += [trainer.step(*data.batch_at(i)) for i in range(3, 6)]
        params = trainer.named_parameters_fp32()
    assert losses == straight[0]
    assert all(torch.equal(params[k], straight[1][k]) for k in params)
    with built("megatrain", **{**case, "optim": OptimConfig(lr=1e-3)}) as (trainer, _):
        with pytest.raises(ValueError, match="another model, dtype or precision"):
            trainer.load_state(tmp_path)  # fp32 moments cannot take a compact state


def test_only_the_engine_takes_compact_moments():
    from megatrain.config import CaseConfig

    with pytest.raises(ValueError, match="--moments fp32"):
        CaseConfig(system="native", model="tiny", optim=OptimConfig(moments="int8"))
    with pytest.raises(ValueError, match="moments must be one of"):
        OptimConfig(moments="fp8")


@pytest.mark.subprocess
def test_train_with_int8_moments_runs_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    from train_helpers import STEPS, hf_model, metrics, pretokenized, train_args

    init, data, out = hf_model("qwen2", tmp_path / "init"), pretokenized(tmp_path / "data.jsonl"), tmp_path / "run"

    def train_cli(*argv):
        done = subprocess.run([sys.executable, "-m", "megatrain", *argv], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]

    train_cli(*train_args(init, data, out, extra=["--moments", "int8"]))
    train_cli("train", "--resume", str(out), "--steps", str(STEPS + 2))  # the run's int8 moments, from its state
    assert [m["step"] for m in metrics(out)] == list(range(1, STEPS + 3))
