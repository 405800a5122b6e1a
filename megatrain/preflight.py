"""Pre-flight: can this system run this case here, and does it fit this machine's memory?

`plan_memory(case, machine)` returns {host_bytes, gpu_bytes, fits, reason, source}. `bench` and `train` refuse a
case that cannot fit (`preflight`); the suite runner asks before every case and records one that cannot fit as
`skipped` with the reason, instead of letting it take the host down. Each system's estimate is its SystemSpec's
plan_memory (megatrain.systems), declared beside the system. The baselines' are deliberately simple (bytes per
parameter for the training state, plus activations, from the helpers below, judged by estimate_plan; under torchrun
DeepSpeed and FSDP2 share the state out among the ranks, native holds a whole copy on each GPU);
each record keeps its plan beside the measured peaks, so the estimates can be checked against measurement.

MegaTrain's sizes and verdict come from its own planner, `megatrain.engine.plan.check_fits` (the
engine's exact tiles); the fixed process overheads estimate_plan adds are the engine plan's, counted for every
system. Every system is judged against one budget (megatrain.memory).

Symbols: N parameters, L layers, H hidden, I SwiGLU width, V vocabulary, T = micro_batch * seq
tokens per forward/backward, e bytes per activation element (2 for bf16 compute, 4 for fp32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable

from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.memory import (
    GIB,
    GPU_RESERVE_BYTES,
    PROCESS_OVERHEAD_BYTES,
    Budget,
    backward_work_bytes,
    host_memory_gib,
    layer_input_bytes,
)
from megatrain.probe import Machine, measure
from megatrain.systems_registry import system_spec


def unavailable(system: str) -> str | None:
    """Why `system` cannot run in this environment (a package it needs is missing), or None."""
    package = system_spec(system).package
    if package and importlib.util.find_spec(package) is None:
        return f"package {package!r} is not installed (pip install -e '.[{package}]')"
    return None


def activation_bytes(case: CaseConfig) -> int:
    """Activations with every layer checkpointed (every system does this), counted as the engine's plan counts them
    (megatrain.memory: the same layer and loss): the L + 1 saved layer inputs of one micro-batch (the last layer's
    output is the head's), and the larger working set of a layer's recompute + backward or the loss, beside the input
    and output gradient of what computes.
    """
    cfg = case.shape()
    e = case.dtype_bytes
    tokens = case.micro_batch * case.seq
    mlp_chunk_tokens = getattr(case.opts, "mlp_chunk_tokens", 0)  # native's option; the others run the MLP whole
    saved = (cfg.num_layers + 1) * layer_input_bytes(cfg, tokens, e)
    return saved + backward_work_bytes(cfg, tokens, e, mlp_chunk_tokens) + 2 * layer_input_bytes(cfg, tokens, e)


def largest_unit_params(case: CaseConfig) -> int:
    """The largest block a sharding/streaming system gathers at once: a decoder layer or the embedding."""
    cfg = case.shape()
    return max(cfg.layer_params(), cfg.embedding_params())


def pinned_bytes(nbytes: int) -> int:
    """Host bytes a pinned tensor of `nbytes` takes: torch's pinned (page-locked) caching allocator rounds every block
    up to a power of two."""
    return 1 << (nbytes - 1).bit_length()


def estimate_plan(estimate: Callable[[CaseConfig, int], tuple[int, int]], case: CaseConfig, limits: Budget,
                  refusal: Callable[[CaseConfig, int], str | None] | None = None) -> dict:
    """The pre-flight plan of a system whose `estimate` gives, for a case on N ranks, (host bytes of a rank beyond its
    process overhead, bytes on a rank's compute device): for the ranks of this launch on this host (one process
    without torchrun), the fixed overheads added, on CPU everything counted as host memory, judged against `limits`
    (a baseline's SystemSpec.plan_memory is this with its estimate bound). host_bytes is the node's, gpu_bytes a
    GPU's. refusal: why the system cannot run a case on N ranks whatever the memory (a device, a launch or a batch
    split it does not support), or None; where it says why, the plan is that reason alone, as for a missing package
    (no memory figures: the pre-flight then suggests no other precision or micro-batch)."""
    world, local_world = distributed.launch_size()
    if refusal is not None and (reason := refusal(case, world)):
        return {"fits": False, "reason": reason}
    state_host, state_gpu = estimate(case, world)
    host, gpu = local_world * (state_host + PROCESS_OVERHEAD_BYTES), state_gpu + GPU_RESERVE_BYTES
    if case.device == "cpu":
        host, gpu = host + local_world * state_gpu, 0
    reasons = []
    if host > limits.host_bytes:
        reasons.append(f"needs ~{host / GIB:.0f} GiB host memory, {limits.host_bytes / GIB:.0f} GiB usable here")
    if case.device == "cuda" and gpu > (limits.gpu_bytes or 0):
        reasons.append(f"needs ~{gpu / GIB:.0f} GiB GPU memory, {(limits.gpu_bytes or 0) / GIB:.0f} GiB usable here")
    return {"source": "estimate (megatrain.preflight)", "host_bytes": int(host), "gpu_bytes": int(gpu),
            "fits": not reasons, "reason": "; ".join(reasons) or None}


def plan_memory(case: CaseConfig, machine: Machine) -> dict:
    """Estimated peak host and GPU bytes of `case`, and whether they fit `machine`.

    Args:
        case: the case to run.
        machine: the probe's (megatrain.probe.measure; host_available_gib, gpu_mem_gib); a case's
            option host_mem_gib replaces its host figure.

    Returns:
        {host_bytes, gpu_bytes, fits, reason, source} (plus the engine plan's own keys): on a CPU
        case everything counts as host memory and gpu_bytes is 0; reason says which budget is
        exceeded and what to change (None when it fits).
    """
    declared = case.opts.host_mem_gib
    available = host_memory_gib(declared)[1] if declared else machine.host_available_gib
    limits = Budget.of(available, machine.gpu_mem_gib if case.device == "cuda" else None)
    if case.device == "cuda" and case.ranks > max(machine.gpu_count, 1):
        return {"fits": False, "reason": f"{case.ranks} ranks need {case.ranks} GPUs; this machine has "
                f"{machine.gpu_count}"}
    # a case of N ranks planned from one process (the suite runner's) is planned for its launch
    planning = distributed.as_launch(case.ranks) if case.ranks > 1 and not distributed.launched() else \
        contextlib.nullcontext()
    with planning:
        return system_spec(case.system).plan_memory(case, limits)


def plan_case(case: CaseConfig, machine: Machine) -> dict:
    """plan_memory, or for a case this environment lacks something to run (a package, the system's code), a plan
    that does not fit, says why, and is marked `missing`: a suite that resumes plans such a case again."""
    if missing := unavailable(case.system):
        return {"fits": False, "reason": f"{case.system} cannot run here: {missing}", "missing": True}
    spec = system_spec(case.system)
    if spec.missing is not None and (missing := spec.missing(case)):
        return {"fits": False, "reason": missing, "missing": True}
    return plan_memory(case, machine)


def preflight(case: CaseConfig) -> list[str]:
    """Refuse (ValueError: exit 2) a case this system cannot run here or that does not fit this machine's memory,
    before anything is allocated; the message suggests a setting that fits, or says that none of those does.
    Returns notes to show before the run (a sequence beyond the model's published context)."""
    notes = []
    cfg = case.shape()
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
