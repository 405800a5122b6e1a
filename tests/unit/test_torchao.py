"""The torchao system's CPU-checkable parts: its options, pre-flight estimate and refusals, and the clipping path of
megatrain.systems.common it steps through (the coefficient its host gradient copies are multiplied by). CPU, seconds,
torchao not needed: pytest tests/unit/test_torchao.py (its training runs on a GPU: tests/gpu/test_baselines_gpu.py)"""

import dataclasses
import importlib.util
import math

import pytest
import torch

from megatrain import preflight
from megatrain.config import CaseConfig
from megatrain.data import make_batches
from megatrain.engine import distributed
from megatrain.memory import GPU_RESERVE_BYTES, PROCESS_OVERHEAD_BYTES, Budget
from megatrain.optim.config import OptimConfig
from megatrain.probe import Machine
from megatrain.systems import build_system, native, parse_options, torchao_offload
from megatrain.systems.common import accumulate_and_step, clip_coefficient

GIB = 2**30
ROOMY = Budget(host_bytes=64 * GIB, gpu_bytes=80 * GIB, host_source="test")


def _gpu_case(**kw) -> CaseConfig:
    return CaseConfig(system="torchao", model="tiny", batch=4, micro_batch=2, seq=64, device="cuda",
                      dtype="bfloat16", **kw)


def test_options_are_natives_and_minimal_size():
    opts = parse_options("torchao", {"minimal_size": 1024, "mlp_chunk_tokens": 8})
    assert (opts.minimal_size, opts.mlp_chunk_tokens, opts.activation_checkpointing) == (1024, 8, True)
    assert parse_options("torchao", {}).minimal_size == 4096  # torchao's own default
    with pytest.raises(ValueError, match="minimal_size must be >= 0"):
        parse_options("torchao", {"minimal_size": -1})
    with pytest.raises(ValueError, match="torchao has no option 'offload_gradients'; its options: .*minimal_size"):
        parse_options("torchao", {"offload_gradients": True})
    with pytest.raises(ValueError, match="minimal_size=1.5: expected an integer"):
        parse_options("torchao", {"minimal_size": 1.5})


def test_estimate_counts_pinned_power_of_two_blocks_on_the_host_and_the_rest_on_the_gpu():
    # tiny: 162,624 parameters; at least 4096 elements: embed_tokens and lm_head (16384 each) and per layer q_proj and
    # o_proj (4096) and gate, up and down (10240): 149,504 in 17 tensors. Mixed precision keeps them fp32: a pinned
    # weight and a pinned gradient each (16384 -> 64 KiB, 4096 -> 16 KiB, 10240 -> 40 KiB rounded up to 64 KiB) and
    # 8 B/param of AdamW moments: 2 (2*65536 + 8*16384) + 3 [2 (2*16384 + 8*4096) + 3 (2*65536 + 8*10240)] bytes.
    case = _gpu_case()
    host, gpu = torchao_offload.memory_bytes(case)
    assert host == 2 * 262144 + 3 * (2 * 65536 + 3 * 212992) == 2_834_432
    # the GPU: every fp32 weight and gradient (8 B/param), the moments of the 13,120 small ones (8 B/param)
    assert gpu - preflight.activation_bytes(case) == 8 * 162_624 + 8 * 13_120
    bf16 = dataclasses.replace(case, precision="bf16")  # 2-byte weights, gradients and moments: every block halves
    assert torchao_offload.memory_bytes(bf16)[0] == host // 2


def test_estimate_is_natives_with_nothing_offloaded_and_sheds_the_moments_with_everything():
    native_bytes = native.memory_bytes(dataclasses.replace(_gpu_case(), system="native"))
    nothing = _gpu_case(options={"minimal_size": 1 << 20})  # beyond the largest tensor: all on the device optimizer
    assert torchao_offload.memory_bytes(nothing) == (0, native_bytes[1])
    everything = _gpu_case(options={"minimal_size": 0})
    host, gpu = torchao_offload.memory_bytes(everything)
    n = everything.shape().num_params()
    assert gpu == native_bytes[1] - 8 * n
    assert 16 * n < host < 24 * n  # fp32 weight, gradient, m, v; the pinned two rounded up to powers of two


def test_the_plan_adds_the_process_and_the_reserve():
    case = _gpu_case()
    plan = torchao_offload.plan_memory(case, ROOMY)
    host, gpu = torchao_offload.memory_bytes(case)
    assert plan["fits"] and plan["reason"] is None
    assert (plan["host_bytes"], plan["gpu_bytes"]) == (host + PROCESS_OVERHEAD_BYTES, gpu + GPU_RESERVE_BYTES)


def test_a_cpu_case_is_refused_saying_it_needs_a_cuda_gpu():
    case = dataclasses.replace(_gpu_case(), device="cpu")
    assert torchao_offload.plan_memory(case, ROOMY) == {  # the refusal alone: no setting of memory makes it run
        "fits": False, "reason": "torchao's CPUOffloadOptimizer needs a CUDA GPU (it asserts a CUDA or XPU device): "
                                 "run it with --device cuda"}
    with pytest.raises(ValueError, match="needs a CUDA GPU .*--device cuda"):
        build_system(case)  # refused before torchao is imported or anything is built


def test_several_ranks_are_refused_saying_what_to_run_instead(monkeypatch):
    monkeypatch.setattr(distributed, "launch_size", lambda: (2, 2))
    case = _gpu_case()
    plan = torchao_offload.plan_memory(case, ROOMY)
    assert not plan["fits"] and "host_bytes" not in plan
    assert "single-GPU" in plan["reason"] and "run torchao as one process without torchrun" in plan["reason"]
    with pytest.raises(ValueError, match="this launch has 2 ranks: run torchao as one process without torchrun"):
        build_system(case)


def test_missing_torchao_is_named_with_its_extra(monkeypatch):
    found = importlib.util.find_spec

    def torchao_installed(installed: bool):
        spec = object() if installed else None
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "torchao" else found(name))

    torchao_installed(False)
    assert preflight.unavailable("torchao") == "package 'torchao' is not installed (pip install -e '.[torchao]')"
    machine = Machine(cpu="test", cpu_cores=2, host_mem_gib=64.0, host_available_gib=64.0, gpu_mem_gib=80.0)
    plan = preflight.plan_case(_gpu_case(), machine)
    assert not plan["fits"] and plan["reason"].startswith("torchao cannot run here: package 'torchao' is not installed")
    torchao_installed(True)
    assert preflight.unavailable("torchao") is None


def _native_step(precision: str = "mixed", max_grad_norm: float = 0.05):
    """A tiny native system on CPU and one step's batch: 2 micro-batches, clipping far below the gradient norm."""
    case = CaseConfig(system="native", model="tiny", batch=4, micro_batch=2, seq=32, precision=precision,
                      dtype="bfloat16" if precision == "bf16" else "float32",
                      optim=OptimConfig(lr=1e-3, max_grad_norm=max_grad_norm))
    system = build_system(case)
    return case, system, make_batches(case, case.shape().vocab_size).batch_at(0)


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_a_gradient_read_before_clipping_times_the_coefficient_is_the_clipped_gradient(precision):
    """What the torchao system does with its host copies: read before clip_grad_norm_, multiplied by
    clip_coefficient in the step. Bit for bit torch's clipped gradient, in fp32 and in bf16."""
    case, system, batch = _native_step(precision)
    read, clipped, coefs = {}, {}, []

    def step(norm):
        coefs.append(clip_coefficient(norm, case.optim))
        clipped.update({n: p.grad.clone() for n, p in system.model.named_parameters()})
        system.optimizer.step()

    _, stepped, norm = accumulate_and_step(
        system.model, system.optimizer, case, system.device, *batch, before_clip=lambda: read.update(
            {n: p.grad.clone() for n, p in system.model.named_parameters()}), step=step)
    assert stepped and len(coefs) == 1 and coefs[0].dtype == system.param_dtype
    assert float(coefs[0]) == pytest.approx(0.05 / norm, rel=1e-2) and float(coefs[0]) < 0.1, "clipping scales it"
    for name, grad in read.items():
        assert torch.equal(grad.mul_(coefs[0]), clipped[name]), name


def test_with_clipping_off_the_coefficient_is_exactly_one():
    case, system, batch = _native_step(max_grad_norm=0.0)
    coefs = []
    accumulate_and_step(system.model, system.optimizer, case, system.device, *batch,
                        step=lambda norm: coefs.append(clip_coefficient(norm, case.optim)))
    assert len(coefs) == 1 and coefs[0].item() == 1.0


def test_the_default_step_is_the_optimizers_and_a_non_finite_norm_steps_nothing():
    case, default, batch = _native_step()
    _, given, _ = _native_step()
    accumulate_and_step(default.model, default.optimizer, case, default.device, *batch)
    accumulate_and_step(given.model, given.optimizer, case, given.device, *batch,
                        step=lambda norm: given.optimizer.step())
    for (name, p), q in zip(default.model.named_parameters(), given.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert default.optimizer.state, "the default stepped the optimizer"

    calls = []
    weights = {n: p.detach().clone() for n, p in given.model.named_parameters()}
    poison = given.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    _, stepped, norm = accumulate_and_step(given.model, given.optimizer, case, given.device, *batch,
                                           before_clip=lambda: calls.append("before_clip"),
                                           step=lambda norm: calls.append("step"))
    poison.remove()
    assert not stepped and not math.isfinite(norm) and calls == ["before_clip"]
    for name, p in given.model.named_parameters():
        assert torch.equal(p, weights[name]) and p.grad is None, name
