"""Pre-flight: can this system run this case here, and does it fit this machine's memory?

`plan_memory(case, machine)` returns {host_bytes, gpu_bytes, fits, reason, source}. The suite
runner asks before every case and records a case that cannot fit as `skipped` with the reason,
instead of letting it take the host down. The estimates below are deliberately simple (bytes per
parameter for the training state, plus activations); each record keeps its plan beside the
measured peaks, so the estimates can be checked against measurement.

MegaTrain's sizes and verdict come from its own planner, `megatrain.engine.plan.check_fits` (the
engine's exact tiles); the fixed process overheads below are the engine plan's, counted for every system.
Every system is judged against one budget (megatrain.memory).

Symbols: N parameters, L layers, H hidden, I SwiGLU width, V vocabulary, T = micro_batch * seq
tokens per forward/backward, e bytes per activation element (2 for bf16 compute, 4 for fp32).
"""

from __future__ import annotations

import dataclasses
import importlib.util

from megatrain.config import CaseConfig
from megatrain.engine.plan import GPU_RESERVE_BYTES, PROCESS_OVERHEAD_BYTES, check_fits
from megatrain.memory import GIB, Budget, host_memory_gib
from megatrain.models.loss import chunk_tokens_for
from megatrain.systems import SYSTEMS

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
    # (deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs, zero_init=True) puts the host at
    # 18 B/param: fp32 master weights, Adam m and v (12), fp32 gradient partition (4), bf16 parameter partition (2).
    # Measured peak RSS beyond the process overhead is 24.4-24.9 B/param (1.5B, 3B and 14B at batches 8-512, H200
    # and H100 hosts: results/smoke_gpu, results/reproduce_14b): its pinned swap and bucket buffers; we count 25.
    # GPU: 4 B per parameter of the largest module (bf16 params and grads, gathered), plus the prefetch buffers,
    # plus activations.
    n = case.model_config().num_params()
    host = n * 25
    gpu = 4 * _largest_unit_params(case) * 2 + activation_bytes(case)
    return host, gpu


def _fsdp(case: CaseConfig) -> tuple[int, int]:
    # FSDP2 with CPUOffloadPolicy(pin_memory=True): the fp32 sharded parameters and their fp32 gradients live in
    # pinned host memory, whose caching allocator rounds every block up to a power of two, and AdamW runs on the
    # host with fp32 m and v (8 B/param). Per parameter tensor: 2 * next_pow2(4 * numel) + 8 * numel; this gives
    # 18.1, 19.7 and 21.8 B/param for 1.5B, 3B and 14B, measured 16.9, 19.1 and 21.7 beyond the process overhead
    # (results/smoke_gpu, results/reproduce_14b). GPU: the gathered bf16 unit being computed plus the prefetched
    # one, its bf16 gradient before the reduce, activations.
    sizes = case.model_config().param_numels()
    host = sum(2 * (1 << (4 * k - 1).bit_length()) + 8 * k for k in sizes)
    gpu = 3 * 2 * _largest_unit_params(case) + activation_bytes(case)
    return host, gpu


# Each baseline's estimate returns (host bytes beyond the process overhead, bytes on the compute device).
ESTIMATES = {"native": _native, "deepspeed": _deepspeed, "fsdp": _fsdp}


def plan_memory(case: CaseConfig, machine: dict) -> dict:
    """Estimated peak host and GPU bytes of `case`, and whether they fit `machine`.

    Args:
        case: the case to run.
        machine: a megatrain.bench.probe.measure() result (host_available_gib, gpu_mem_gib); a case's
            option host_mem_gib replaces its host figure.

    Returns:
        {host_bytes, gpu_bytes, fits, reason, source} (plus the engine plan's own keys): on a CPU
        case everything counts as host memory and gpu_bytes is 0; reason says which budget is
        exceeded and what to change (None when it fits).
    """
    declared = case.opts.host_mem_gib
    available = host_memory_gib(declared)[1] if declared else machine["host_available_gib"]
    limits = Budget.of(available, machine["gpu_mem_gib"] if case.device == "cuda" else None)
    if case.system == "megatrain":
        plan = dict(check_fits(case, limits), source="megatrain.engine.plan")
        host, gpu = plan["host_need_bytes"], plan["gpu_bytes"] if case.device == "cuda" else 0
        plan.update(host_bytes=int(host), gpu_bytes=int(gpu))
        return plan
    state_host, state_gpu = ESTIMATES[case.system](case)
    host, gpu = state_host + PROCESS_OVERHEAD_BYTES, state_gpu + GPU_RESERVE_BYTES
    if case.device == "cpu":
        host, gpu = host + state_gpu, 0
    reasons = []
    if host > limits.host_bytes:
        reasons.append(f"needs ~{host / GIB:.0f} GiB host memory, {limits.host_bytes / GIB:.0f} GiB usable here")
    if case.device == "cuda" and gpu > (limits.gpu_bytes or 0):
        reasons.append(f"needs ~{gpu / GIB:.0f} GiB GPU memory, {(limits.gpu_bytes or 0) / GIB:.0f} GiB usable here")
    return {"source": "estimate (megatrain.bench.fit)", "host_bytes": int(host), "gpu_bytes": int(gpu),
            "fits": not reasons, "reason": "; ".join(reasons) or None}


def plan_case(case: CaseConfig, machine: dict) -> dict:
    """plan_memory, or for a system this environment cannot run, a plan that does not fit and says why."""
    missing = unavailable(case.system)
    if missing:
        return {"fits": False, "reason": f"{case.system} cannot run here: {missing}"}
    return plan_memory(case, machine)


def preflight(case: CaseConfig) -> list[str]:
    """Refuse (ValueError: exit 2) a case this system cannot run here or that does not fit this machine's memory,
    before anything is allocated; the message suggests a setting that fits, or says that none of those does.
    Returns notes to show before the run (a sequence beyond the model's published context)."""
    from megatrain.bench.probe import measure

    notes = []
    cfg = case.model_config()
    if case.seq > cfg.max_seq_len:
        notes.append(f"note: seq {case.seq} is beyond {case.model}'s published context of {cfg.max_seq_len} tokens "
                     "(RoPE extrapolates; attention grows with seq^2, so a step can take minutes on a CPU)")
    machine = measure(rates=False)
    plan = plan_case(case, machine)
    if plan["fits"]:
        return notes
    if "host_bytes" not in plan:  # the system cannot run here at all
        raise ValueError(plan["reason"])
    tries = [("--precision bf16", dataclasses.replace(case, precision="bf16"))] if case.precision == "mixed" else []
    half = case.micro_batch // 2
    if half >= 1 and case.batch % half == 0:
        tries.append((f"--micro-batch {half}", dataclasses.replace(case, micro_batch=half)))
    fixes = [flag for flag, other in tries if plan_memory(other, machine)["fits"]]
    hint = f"try {' or '.join(fixes)}" if fixes else \
        "no precision or micro-batch of this case fits: a smaller model, --batch or --seq, or a larger machine"
    raise ValueError(f"{case.system} {case.model} b{case.batch} s{case.seq} does not fit here: {plan['reason']}; "
                     f"{hint}")
