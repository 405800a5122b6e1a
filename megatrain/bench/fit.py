"""Pre-flight: can this system run this case here, and does it fit this machine's memory?

`plan_memory(case, machine)` returns {host_bytes, gpu_bytes, fits, reason, source}. The suite
runner asks before every case and records a case that cannot fit as `skipped` with the reason,
instead of letting it take the host down. The estimates below are deliberately simple (bytes per
parameter for the training state, plus activations); each record keeps its plan beside the
measured peaks, so the estimates can be checked against measurement.

MegaTrain's sizes come from its own planner, `megatrain.engine.plan.plan_memory(case)` (the
engine's exact tiles); the fixed process overheads below are the engine plan's, counted for every system.

Symbols: N parameters, L layers, H hidden, I SwiGLU width, V vocabulary, T = micro_batch * seq
tokens per forward/backward, e bytes per activation element (2 for bf16 compute, 4 for fp32).
"""

from __future__ import annotations

import importlib.util

from baselines.protocol import SYSTEMS
from megatrain.config import CaseConfig
from megatrain.engine.plan import GPU_RESERVE_BYTES, PROCESS_OVERHEAD_BYTES
from megatrain.engine.plan import plan_memory as engine_plan_memory
from megatrain.models.loss import chunk_tokens_for

GIB = 2**30
# Leave this share of the measured host budget free: estimates are estimates, and a host OOM kills more
# than the case. The GPU budget is the whole GPU: a CUDA OOM ends only its case (recorded `oom`), and a
# margin there would refuse batches that fit, which is what a largest-batch ladder measures.
SAFETY = 0.92
# Packages a system needs beyond torch.
REQUIRED_PACKAGES = {"deepspeed": "deepspeed"}


def unavailable(system: str) -> str | None:
    """Why `system` cannot run in this environment (its package or module is missing), or None."""
    package = REQUIRED_PACKAGES.get(system)
    if package and importlib.util.find_spec(package) is None:
        return f"package {package!r} is not installed (pip install -e '.[{package}]')"
    module = SYSTEMS[system].split(":")[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"module {module} does not exist in this checkout"


def activation_bytes(case: CaseConfig) -> int:
    """Activations with every layer checkpointed (all four systems do this).

    Saved: each layer's input [T, H] until backward. Working set of one layer's recompute plus
    backward: q/k/v/attention output and the MLP's gate/up/product, with their gradients,
    ~2 * (6H + 3I) elements per token (flash-style SDPA keeps no [S, S] scores). Loss: one fp32
    [chunk, V] logits block and its gradient (megatrain.models.loss).
    """
    cfg = case.model_config()
    e = case.dtype_bytes
    tokens = case.micro_batch * case.seq
    saved = cfg.num_layers * tokens * cfg.hidden_size * e
    working = tokens * 2 * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * e
    loss = 2 * min(tokens, chunk_tokens_for(cfg.vocab_size)) * cfg.vocab_size * 4
    return saved + working + loss


def _largest_unit_params(case: CaseConfig) -> int:
    """The largest block a sharding/streaming system gathers at once: a decoder layer or the embedding."""
    cfg = case.model_config()
    return max(cfg.layer_params(), cfg.embedding_params())


def _native(case: CaseConfig) -> tuple[int, int]:
    # Whole model on one device. mixed: fp32 weights, grads, Adam m and v = 16 B/param.
    # bf16: bf16 weights, grads, m, v = 8 B/param (torch AdamW keeps moments in the param dtype).
    n = case.model_config().num_params()
    state = n * (16 if case.precision == "mixed" else 8) + activation_bytes(case)
    return 0, state


def _deepspeed(case: CaseConfig) -> tuple[int, int]:
    # ZeRO-3 with params and optimizer offloaded to CPU. DeepSpeed's own estimator
    # (deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs, zero_init=True) puts
    # the host at 18 B/param: fp32 master weights, Adam m and v (12), fp32 gradient partition (4),
    # bf16 parameter partition (2); its `additional_buffer_factor` (1.5) is a worst case for
    # pinned swap and bucket buffers, we add 2 B/param for those. GPU: 4 B per parameter of the
    # largest module (bf16 params and grads, gathered), plus the prefetch buffers, plus activations.
    n = case.model_config().num_params()
    host = n * 20
    gpu = 4 * _largest_unit_params(case) * 2 + activation_bytes(case)
    return host, gpu


def _fsdp(case: CaseConfig) -> tuple[int, int]:
    # FSDP2 with CPUOffloadPolicy(pin_memory=True): the fp32 sharded parameters and their fp32
    # gradients live in pinned host memory (8 B/param), AdamW runs on the host with fp32 m and v
    # (8 B/param): 16 B/param. Pinned blocks come from torch's caching host allocator, which rounds
    # sizes up to powers of two; we allow 25% for that, hence 20 B/param. GPU: the gathered bf16
    # unit being computed plus the prefetched one, its bf16 gradient before the reduce, activations.
    n = case.model_config().num_params()
    host = n * 20
    gpu = 3 * 2 * _largest_unit_params(case) + activation_bytes(case)
    return host, gpu


# Each baseline's estimate returns (host bytes beyond the process overhead, bytes on the compute device).
ESTIMATES = {"native": _native, "deepspeed": _deepspeed, "fsdp": _fsdp}


def plan_memory(case: CaseConfig, machine: dict) -> dict:
    """Estimated peak host and GPU bytes of `case`, and whether they fit `machine`.

    Every system is judged against the same budget: SAFETY x the host memory available at the
    probe, and the GPU's memory. MegaTrain's sizes come from megatrain.engine.plan.

    Args:
        case: the case to run.
        machine: a megatrain.bench.hardware.measure() result (host_available_gib, gpu_mem_gib).

    Returns:
        {host_bytes, gpu_bytes, fits, reason, source} (plus the engine plan's own keys): on a CPU
        case everything counts as host memory and gpu_bytes is 0; reason says which budget is
        exceeded (None when it fits).
    """
    if case.system == "megatrain":
        plan = dict(engine_plan_memory(case), source="megatrain.engine.plan")
        host, gpu = plan["host_bytes"], plan["gpu_bytes"] - GPU_RESERVE_BYTES  # its reserve is added back below
    else:
        plan = {"source": "estimate (megatrain.bench.fit)"}
        state_host, state_gpu = ESTIMATES[case.system](case)
        host, gpu = state_host + PROCESS_OVERHEAD_BYTES, state_gpu
    if case.device == "cpu":
        host, gpu = host + gpu, 0
    else:
        gpu += GPU_RESERVE_BYTES
    host_budget = SAFETY * machine["host_available_gib"] * GIB
    reasons = []
    if host > host_budget:
        reasons.append(f"needs ~{host / GIB:.0f} GiB host memory, {host_budget / GIB:.0f} GiB usable here")
    if case.device == "cuda":
        gpu_budget = (machine["gpu_mem_gib"] or 0) * GIB
        if gpu > gpu_budget:
            reasons.append(f"needs ~{gpu / GIB:.0f} GiB GPU memory, {gpu_budget / GIB:.0f} GiB usable here")
    plan.update(host_bytes=int(host), gpu_bytes=int(gpu), fits=not reasons, reason="; ".join(reasons) or None)
    return plan


def plan_case(case: CaseConfig, machine: dict) -> dict:
    """plan_memory, or for a system this environment cannot run, a plan that does not fit and says why."""
    missing = unavailable(case.system)
    if missing:
        return {"fits": False, "reason": f"{case.system} cannot run here: {missing}"}
    return plan_memory(case, machine)
