"""Pre-flight memory plan of the streaming engine: refuse what cannot fit before allocating anything.

Host: the store's tiles exactly (see engine/store.py), offloaded activations, and a fixed process
overhead. GPU: the two weight slots, the embedding (with its AdamW state when resident), fp32
gradient accumulators and staging, the saved layer inputs (those neither offloaded nor recomputed; at least
about three when any are offloaded; in backward the recomputed ones and the embedding's output), and the
working set of one micro-batch's layer recompute + backward or chunked loss (megatrain.memory's count, which every
system's pre-flight uses).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatrain.engine.config import EngineConfig
from megatrain.engine.layout import Unit, build_units, total_numel
from megatrain.engine.store import OPT_CHUNK
from megatrain.engine.uses import use_order
from megatrain.memory import (
    GIB,
    GPU_RESERVE_BYTES,
    PROCESS_OVERHEAD_BYTES,
    Budget,
    backward_work_bytes,
    budget,
    layer_input_bytes,
)
from megatrain.optim.state_bytes import FP32_BYTES, MOMENT_BYTES, state_bytes_per_param


@dataclass(frozen=True)
class MemoryPlan:
    """The engine's memory for one configuration and the placement behind it (plan_memory). A record keeps it as a
    dict (dataclasses.asdict): these names are its keys, which the perf model and the analysis read.

    Attributes:
        host_bytes: what the host holds: the tiles, the optimizer's scratch, the process overhead and the offloaded
            activations.
        host_state_bytes: the store's tiles alone.
        host_bytes_per_param: host_bytes over the model's parameters.
        host_tiles_bytes_per_param: bytes per parameter of each tile (host_bytes_per_param()).
        gpu_bytes: buffers, checkpoints, the working set, the computing layer's input and output gradient and the
            reserve.
        gpu_buffers_bytes: weight slots, gradient accumulators and staging, resident units.
        gpu_checkpoint_bytes: the saved layer inputs on the GPU at their peak.
        gpu_work_bytes: one micro-batch's layer recompute + backward or loss (megatrain.memory.backward_work_bytes).
        host_activation_bytes: the offloaded layer inputs in pinned host memory.
        offloaded_layers, recomputed_inputs: the placement of the saved inputs (activation_placement).
        extra_h2d_bytes: weight bytes a step loads beyond two per layer, for the recomputed inputs.
        resident_units: units kept and updated on the GPU (resident_unit_indices).
    """

    host_bytes: int
    host_state_bytes: int
    host_bytes_per_param: float
    host_tiles_bytes_per_param: dict[str, int]
    gpu_bytes: int
    gpu_buffers_bytes: int
    gpu_checkpoint_bytes: int
    gpu_work_bytes: int
    host_activation_bytes: int
    offloaded_layers: int
    recomputed_inputs: int
    extra_h2d_bytes: int
    resident_units: list[int]


@dataclass(frozen=True)
class CheckedPlan(MemoryPlan):
    """A MemoryPlan judged against a budget (check_fits).

    Attributes:
        fits: both budgets hold it.
        reason: which budget is exceeded and by how much (None when it fits).
        advice: what to change (None when it fits).
        host_need_bytes: what counts against the host (on CPU, the GPU's share too).
        host_available_bytes, gpu_available_bytes: the budget judged against (gpu None without a GPU).
    """

    fits: bool
    reason: str | None
    advice: str | None
    host_need_bytes: int
    host_available_bytes: int
    gpu_available_bytes: int | None


def host_bytes_per_param(config: EngineConfig) -> dict[str, int]:
    """Bytes per parameter of each persistent host tile (megatrain.optim.state_bytes: the streamed weights and
    gradients in the compute dtype)."""
    return state_bytes_per_param(config.dtype_bytes, config.precision, MOMENT_BYTES[config.optim.moments],
                                 config.options.update_delay)


def resident_bytes(config: EngineConfig, unit: Unit) -> int:
    """GPU bytes a resident unit adds: its moments and master (where there is one), and for a layer its own weights
    and fp32 gradient accumulator (the embedding has both already). bf16 mode adds one shared fp32 update chunk
    (plan_memory)."""
    per = host_bytes_per_param(config)
    on_gpu = per["exp_avg"] + per["exp_avg_sq"] + per.get("master", 0)
    if unit.index != 0:
        on_gpu += per["weights"] + FP32_BYTES
    return int(unit.numel * on_gpu)


@dataclass(frozen=True)
class Placement:
    """Where a plan puts things: how many saved layer inputs go to pinned host memory and how many are recomputed
    instead of kept (megatrain.engine.activations says which), and the units kept and updated on the GPU."""

    offloaded: int = 0
    recomputed: int = 0
    resident: tuple[int, ...] = ()


def plan_memory(config: EngineConfig, limits: Budget | None = None) -> MemoryPlan:
    """Host and GPU bytes of `config` and the placement behind them, planned for `limits` (default: this machine).

    One pass: the saved inputs' placement first (with nothing resident), then the resident units beside it; each
    choice weighs the bytes of the placements it could make (_bytes), which decides nothing itself."""
    limits = limits or budget_here(config)
    offloaded, recomputed = activation_placement(config, limits)
    resident = resident_unit_indices(config, limits, Placement(offloaded, recomputed))
    return _bytes(config, Placement(offloaded, recomputed, tuple(resident)))


def resident_unit_indices(config: EngineConfig, limits: Budget | None = None,
                          placement: Placement | None = None) -> list[int]:
    """Units whose weights, gradients and AdamW state stay on the GPU and update there, beside the saved inputs'
    `placement` (default: activation_placement's) on `limits` (default: this machine, budget_here).

    Options: resident_embedding (true, false, or 'auto': when it fits) and resident_layers (K: the first K layers,
    or 'auto': as many as fit). Both default to 'auto': the embedding first, then leading layers, up to
    megatrain.memory.GPU_FILL of the GPU beside everything else the plan counts (so a batch that needs the memory gets
    none). Without a GPU nothing is resident, nor with update_delay=1 (every update then runs a step late on the
    host; MegaTrainOptions refuses an explicit resident unit with it)."""
    if config.options.update_delay:
        return []
    limits = limits or budget_here(config)
    placement = placement or Placement(*activation_placement(config, limits))
    layers = config.model.num_layers
    gpu = limits.gpu_fill_bytes

    def room(resident: tuple[int, ...]) -> int:  # the GPU's resident share less what the plan needs so
        return gpu - _bytes(config, dataclasses.replace(placement, resident=resident)).gpu_bytes

    embedding = config.options.resident_embedding
    if embedding == "auto":
        embedding = gpu is not None and room((0,)) >= 0
    k = config.options.resident_layers
    if k == "auto" and gpu is None:
        k = 0
    elif k == "auto":
        per = max(resident_bytes(config, u) for u in build_units(config.model)[1:-1])  # a generic model's differ
        k = max(0, min(layers, int(room((0,) if embedding else ()) // per)))
    if k > layers:
        raise ValueError(f"resident_layers must be 'auto' or an integer from 0 to the model's {layers} layers, "
                         f"got {k}")
    return ([0] if embedding else []) + list(range(1, k + 1))


def activation_placement(config: EngineConfig, limits: Budget | None = None) -> tuple[int, int]:
    """(K, R): how many saved layer inputs go to pinned host memory and how many are not kept but recomputed
    (megatrain.engine.activations says which).

    offload_activations: true (all), false (none), K, or 'auto': the fewest that let the plan fit the GPU's share
    (megatrain.memory.GPU_FILL) with nothing resident, all when none does (the plan then refuses with its numbers).
    recompute_inputs: R, or 'auto': none when the host holds the offloaded inputs, else as many of them as the host
    lacks room for are recomputed instead (each costs one more layer forward and one more weight load a step).
    Without a GPU 'auto' means none. limits: the machine planned for (default: this one, budget_here)."""
    layers = config.model.num_layers
    option, recompute = config.options.offload_activations, config.options.recompute_inputs
    if recompute != "auto" and recompute > layers - 1:
        raise ValueError(f"recompute_inputs must be 'auto' or an integer from 0 to the model's {layers} layers less "
                         f"one, got {recompute}")
    if not isinstance(option, bool) and option != "auto" and option > layers:
        raise ValueError(f"offload_activations must be true, false, 'auto' or a layer count from 0 to the model's "
                         f"{layers} layers, got {option}")
    limits = limits or budget_here(config)
    r = 0 if recompute == "auto" else recompute

    def offloading(k: int) -> Placement:  # with inputs recomputed the embedding's output stays on the GPU
        return Placement(min(k, layers - 1 - r) if r else k, r)

    if isinstance(option, bool):
        k = layers if option else 0
    elif option != "auto":
        k = option
    elif limits.gpu_fill_bytes is None:
        k = 0
    else:  # the plan's GPU bytes fall as k grows: the first k that fits is the fewest
        k = next((k for k in range(layers + 1) if _bytes(config, offloading(k)).gpu_bytes <= limits.gpu_fill_bytes),
                 layers)
    k = offloading(k).offloaded
    if recompute == "auto" and k and limits.gpu_fill_bytes is not None:
        short = _bytes(config, offloading(k)).host_bytes - limits.host_bytes
        if short > 0:
            r = min(k, layers - 1, -(-short // _step_input_bytes(config)))
            k = min(k - r, layers - 1 - r)
    return k, r


def _loaded_numel(units: list[Unit], resident: list[int], recomputed: int) -> int:
    """Weight elements a step loads into the slots (recomputed layers' weights cross a third time, less the loads
    the slots' reuse saves)."""
    uses = use_order(len(units) - 2, frozenset(resident), recomputed)
    return sum(units[use.unit].numel for use in uses if use.load)


def _step_input_bytes(config: EngineConfig) -> int:
    """One saved layer input for every micro-batch of a step."""
    return layer_input_bytes(config.model, config.batch * config.seq, config.dtype_bytes)


def _bytes(config: EngineConfig, placement: Placement) -> MemoryPlan:
    """Host and GPU bytes of `config` with `placement` (its placement options are not read: plan_memory decided
    them)."""
    model, dtype_bytes = config.model, config.dtype_bytes
    units = build_units(model)
    per = host_bytes_per_param(config)
    slot_numel = max(u.numel for u in units[1:])
    embed_numel = units[0].numel
    # the torch optimizer kernel's fp32 scratch (one chunk of gradients, and of weights in bf16 mode)
    torch_kernel = config.options.optimizer_kernel == "torch"
    scratch = min(OPT_CHUNK, max(u.numel for u in units)) * FP32_BYTES * torch_kernel * (
        (dtype_bytes == 2) + (config.precision == "bf16"))
    host_state = int(total_numel(units) * sum(per.values()))

    tokens_mb = config.micro_batch * config.seq
    offloaded, recomputed, resident = placement.offloaded, placement.recomputed, list(placement.resident)
    # the weight slots (two; one with weight_slots=1) and the embedding's buffer, two fp32 gradient slots and the
    # embedding's accumulator, and (bf16) the staging of the streamed gradients
    buffers = (config.options.weight_slots * slot_numel + embed_numel) * dtype_bytes + \
        (2 * slot_numel + embed_numel) * FP32_BYTES + (2 * slot_numel * dtype_bytes if dtype_bytes == 2 else 0)
    buffers += sum(resident_bytes(config, units[u]) for u in resident)
    if resident and config.precision == "bf16":  # the fp32 chunk resident bf16 weights are updated in
        buffers += min(OPT_CHUNK, max(units[u].numel for u in resident)) * FP32_BYTES
    if resident and config.optim.moments != "fp32":  # compact moments: one chunk decoded to fp32 (and its int64
        # random bits or block temporaries) beside the update
        buffers += min(OPT_CHUNK, max(units[u].numel for u in resident)) * 4 * FP32_BYTES
    activation = _step_input_bytes(config)
    # the kept inputs (and the head's: the early layers' dropped or offloaded ones have left before the later kept
    # ones exist); with any offloaded, at least an offloaded layer's input and output and the next input streaming
    # back; in backward the recomputed ones regenerated beside the embedding's output, the rest freed by then
    kept = model.num_layers + 1 - offloaded - recomputed
    checkpoints = max(kept, 3 if offloaded else 0, recomputed + 1) * activation
    work = backward_work_bytes(model, tokens_mb, dtype_bytes, config.options.mlp_chunk_tokens)
    # beside it, the input and output gradient of the layer computing
    gpu = buffers + checkpoints + work + 2 * layer_input_bytes(model, tokens_mb, dtype_bytes) + GPU_RESERVE_BYTES
    # the state crossing layers (per-layer inputs, shared keys and values): every micro-batch's, kept all the step
    gpu += config.batch * config.seq * model.crossing_numel_per_token * dtype_bytes
    # a mixture of experts' routing, every layer's, kept for the recompute to replay
    gpu += config.batch * config.seq * model.replayed_bytes_per_token
    # the state once for the host; each rank's process, scratch and offloaded activations beside it
    host = host_state + config.ranks * (scratch + PROCESS_OVERHEAD_BYTES + offloaded * activation)
    extra_loads = _loaded_numel(units, resident, recomputed) - _loaded_numel(units, resident, 0)
    return MemoryPlan(
        host_bytes=host, host_state_bytes=host_state, host_bytes_per_param=host / model.num_params(),
        host_tiles_bytes_per_param=per, gpu_bytes=gpu, gpu_buffers_bytes=buffers, gpu_checkpoint_bytes=checkpoints,
        gpu_work_bytes=work, host_activation_bytes=offloaded * activation, offloaded_layers=offloaded,
        recomputed_inputs=recomputed, extra_h2d_bytes=extra_loads * dtype_bytes, resident_units=resident)


def budget_here(config: EngineConfig) -> Budget:
    """The memory this run may use here (megatrain.memory's one rule; option host_mem_gib declares the host)."""
    return budget(config.device, config.options.host_mem_gib)


def check_fits(config: EngineConfig, limits: Budget | None = None) -> CheckedPlan:
    """The plan judged against `limits` (default: this machine now, megatrain.memory's rule): whether it fits, which
    budget is exceeded and by how much, what to change (a precision only when it fits) and the bytes counted
    against each budget; raises nothing. On CPU the GPU's share of the plan (buffers, checkpoints, working set) is
    host memory too."""
    limits = limits or budget_here(config)
    plan = plan_memory(config, limits)
    cpu = config.device == "cpu"
    host_need = plan.host_bytes + ((plan.gpu_bytes - GPU_RESERVE_BYTES) * config.ranks if cpu else 0)
    reasons, advice = [], []
    if host_need > limits.host_bytes:
        bf16 = dataclasses.replace(config, precision="bf16", dtype="bfloat16")
        bf16_need = host_need - plan.host_bytes + plan_memory(bf16, limits).host_bytes
        reasons.append(
            f"host memory: needs {host_need / GIB:.1f} GiB ({plan.host_bytes_per_param:.1f} B/param of state"
            + (", activations included" if cpu else "") + f") but {limits.host_bytes / GIB:.1f} GiB is usable here")
        bf16_fits = config.precision == "mixed" and bf16_need <= limits.host_bytes
        smaller = "a smaller model" + (", --batch or --seq" if cpu else "")
        advice.append("use --precision bf16 (12 B/param)" if bf16_fits else
                      f"no precision fits: use {smaller} or a host with more memory "
                      "(on a VM whose memory grows on use, set --option host_mem_gib=N)")
    if not cpu and limits.gpu_bytes is not None and plan.gpu_bytes > limits.gpu_bytes:
        reasons.append(
            f"GPU memory: needs {plan.gpu_bytes / GIB:.1f} GiB (checkpoints {plan.gpu_checkpoint_bytes / GIB:.1f}, "
            f"buffers {plan.gpu_buffers_bytes / GIB:.1f}, working {plan.gpu_work_bytes / GIB:.1f}) but the GPU has "
            f"{limits.gpu_bytes / GIB:.1f} GiB")
        advice.append("lower --batch or --seq, a smaller --micro-batch, or for long contexts "
                      "--option offload_activations=auto --option recompute_inputs=auto --option mlp_chunk_tokens=N")
    return CheckedPlan(**vars(plan), fits=not reasons, reason="; ".join(reasons) or None,
                       advice="; ".join(advice) or None, host_need_bytes=host_need,
                       host_available_bytes=limits.host_bytes, gpu_available_bytes=limits.gpu_bytes)
