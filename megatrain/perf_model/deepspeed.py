"""Performance model of DeepSpeed ZeRO-3 offload's step (and ZeRO-Offload's), beside the engine's (model.py): a case's
step time from the same measured ingredients, as megatrain.systems.deepspeed_zero3 configures DeepSpeed and
DeepSpeed 0.19.8 runs it on one GPU (deepspeed/runtime/zero/stage3.py, partitioned_param_coordinator.py,
partition_parameters.py; stage_1_and_2.py for ZeRO-Offload).

ZeRO-3 with parameters and optimizer offloaded to pinned host memory, per micro-batch:
- forward: the root module's weights (the embedding, and the head matrix the loss reads, registered on the root)
  cross first, before any compute; then each layer's bf16 weights are copied host to device on the all-gather stream
  (one rank: no gather, a `.to(device)` of the pinned partition) and prefetched a module ahead, so a layer's copy
  runs beside the previous layer's compute; the step waits for a copy only where it takes longer than that compute;
- backward: the head matrix crosses again (the root's backward hook), then layer by layer: its weights again (for the
  checkpoint's recompute and the backward), the recompute and backward, then its gradients on the reduce stream
  (overlap_comm), in buckets: the bf16 gradient to the pinned host partition (D2H) and back (H2D, `grad_buffer.to`),
  and at the accumulation boundary cast to fp32 on the GPU and copied out again (D2H 4 B) into the optimizer's fp32
  gradient; a later micro-batch of an accumulated batch brings the host partition up, adds, and sends it back. Both
  directions are in use: each runs at half the probe's both-ways rate. The backward ends when the reduce stream does;
- the optimizer step, on the host after the backward with the GPU idle (DeepSpeed overlaps none of it): the fp32
  gradients scaled in place by the clip (8 B/param, read and written), DeepSpeedCPUAdam over fp32 master, gradient
  and moments (28 B/param, as torch's fused AdamW, whose rate the probe measures), and the updated master cast to the
  pinned bf16 partition the next forward copies from (4 B read, 2 written);
- a compiled layer is a ZeRO-3 leaf (gathered whole), its copy a layer ahead as the eager modules' are.
ZeRO-Offload (zero_stage=2) keeps the bf16 weights on the GPU: no copies in; gradients leave as fp32 (D2H 4 B; an
accumulated batch's bf16 partial sums go out and come back per micro-batch); the same host step; then the bf16
weights copied up before the next forward (H2D 2 B/param, after the step).
Partial optimizer offload (option optimizer_ratio) keeps the first sub-groups' fp32 state on the GPU
(deepspeed_zero3.optimizer_sub_groups): their fp32 gradients stay there, torch AdamW steps them on the GPU (at the
GPU AdamW rate of the engine's resident units, its stand-in) after the backward, and each updated fp32 sub-group is
copied into its host parameter partition: in a bf16 run a blocking copy that changes dtype, which PyTorch converts on
the host through a fresh pageable fp32 temporary (the ingredients' gpu_to_host_convert_gbs, 4 B/param; a model whose
ingredients lack that rate does not predict the mode), in fp32 a pinned copy; the host steps the rest as above.
ZeRO-3 without parameter offload (option offload_param=false; its first record, partial offload at b96 on the H200,
came within 3.4% of the prediction made before it) keeps the bf16 parameter partitions on the GPU: no weights cross
before a layer's use; the gradients leave as with offload; after its step the host writes each updated fp32 master up
into its partition on the GPU, a blocking copy that changes dtype (cast on the host, then copied from pageable memory:
gpu_from_host_convert_gbs, 4 B/param counted) in place of the host-side cast; a GPU sub-group of partial offload
writes its partition on the device (left out).
SuperOffload (option super_offload) sends each sub-group to DeepSpeedCPUAdam in a worker process on a share of the
cores (its Adam pass here at the probe's rate times that share, an assumption its records test): the worker copies
the gradient into its own pinned buffer and the updated master is copied back over the partition (16 B/param more at
the copy rate, superoffload_utils.py and superoffload_stage3.py). With clipping, as every case clips, it steps after
the backward like ZeRO-3 (DeepSpeed 0.19.8 speculates only without clipping); without, each sub-group's step runs as
its gradients complete, beside the backward, and only what outlasts the backward (at least the last sub-group's
step) stays in the step.

Not modelled: ZeRO-3's hooks on the host (a Python fetch, release and prefetch per module and pass, a gradient hook
per parameter, each a few hundred microseconds): hidden while a layer's GPU work outlasts them, they bound the step
at small batches (the validation's residual per layer says how much); the GPU-side bucket copies, casts and norms of
the reduce stream; the embedding's own forward and backward; several ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.config import CaseConfig
from megatrain.engine.layout import build_units
from megatrain.models.flops import model_flops
from megatrain.optim.state_bytes import FP32_BYTES
from megatrain.perf_model.model import Model
from megatrain.systems.deepspeed_zero3 import SUPER_OFFLOAD_CORES_PERC, gpu_sub_groups, optimizer_sub_groups

ADAM_BYTES_PER_PARAM = 28  # DeepSpeedCPUAdam: fp32 master, gradient, m, v read; master, m, v written
CLIP_BYTES_PER_PARAM = 2 * FP32_BYTES  # the fp32 gradient scaled in place (unscale_and_clip_grads)
CAST_BYTES_PER_PARAM = FP32_BYTES + 2  # fp32 master read, bf16 partition written (_reassign_or_swap_out_...)
# SuperOffload's worker: the gradient copied into its pinned scratch (read, write), the updated master copied back
# over the partition it was sent (read, write)
SUPER_OFFLOAD_COPY_BYTES_PER_PARAM = 4 * FP32_BYTES
# Records before the stateless compiled template compiled each layer's own forward: Dynamo guarded on each layer's
# ZeRO-3 parameters, so every layer was a new compile until torch._dynamo's recompile limit (8, its default), the
# layers after it eager (megatrain.systems.deepspeed_zero3._compile_layers says so)
DYNAMO_RECOMPILE_LIMIT = 8


@dataclass(frozen=True)
class HostStep:
    """The host's rates for DeepSpeed's optimizer step: DeepSpeedCPUAdam in G params/s, and the STREAM rates (GB/s,
    1e9 B/s) of the clip's in-place scaling ("update": read, modify, write) and of the cast ("copy")."""

    adam_gparams_s: float
    update_gbs: float
    copy_gbs: float

    @staticmethod
    def from_probe(probe: dict, reference: dict) -> HostStep:
        """From a record's probe (megatrain.probe.Machine.to_dict): DeepSpeedCPUAdam at the probe's torch fused AdamW
        rate (both move 28 B/param); its host memory's best update (else triad) and copy rates. A probe from before
        the memory rates were probed takes them from `reference` (a probe that has both), scaled by the ratio of the
        two probes' AdamW rates, as the engine's kernel rate is (model.Machine.from_probe)."""
        adam = probe.get("cpu_adamw_gparams_s") or reference["cpu_adamw_gparams_s"]
        mem, scale = probe.get("host_mem_gbs"), 1.0
        if not mem:
            mem, scale = reference["host_mem_gbs"], adam / reference["cpu_adamw_gparams_s"]
        update = max(mem.get("update") or mem["triad"])
        return HostStep(adam, update * scale, max(mem["copy"]) * scale)

    @staticmethod
    def at_bandwidth(reference: dict, update_gbs: float) -> HostStep:
        """A host we have no probe of, whose memory sustains `update_gbs` on the update kernel: every rate of the
        `reference` probe scaled by it, so each part of the step moves the bytes per parameter it moved there (all
        three are memory-bound passes)."""
        ref = HostStep.from_probe(reference, reference)
        scale = update_gbs / ref.update_gbs
        return HostStep(ref.adam_gparams_s * scale, update_gbs, ref.copy_gbs * scale)

    def adam_bytes_per_param(self) -> float:
        """The Adam pass's bytes per parameter at this host's update rate: 28 counted, more where it runs below the
        update kernel's rate."""
        return self.update_gbs / self.adam_gparams_s

    def seconds(self, numel: int, clip: bool = True, adam_share: float = 1.0, copy_bytes_per_param: int = 0) -> dict:
        """The optimizer step over `numel` parameters, by part. clip: the gradients scaled first; adam_share: the
        share of the host's Adam rate it runs at (SuperOffload's worker's cores); copy_bytes_per_param: more bytes
        a parameter moves at the copy rate (SuperOffload's worker's copies)."""
        return {"clip_s": numel * CLIP_BYTES_PER_PARAM / (self.update_gbs * 1e9) if clip else 0.0,
                "adam_s": numel / (self.adam_gparams_s * adam_share * 1e9),
                "cast_s": numel * (CAST_BYTES_PER_PARAM + copy_bytes_per_param) / (self.copy_gbs * 1e9)}


def _converted_s(m, params: float, rate: str, what: str) -> float:
    """Seconds of a blocking copy of `params` fp32 values across the link into bf16 that PyTorch converts on the host
    (copy_kernel_cuda), at the machine's measured `rate` (a Machine field, GB/s of fp32); KeyError naming the rate
    where its ingredients never measured it (`what`: who copies what so)."""
    gbs = getattr(m, rate)
    if not gbs:
        raise KeyError(f"{what}, and {m.name}'s ingredients lack its rate ({rate}): "
                       f"measure it on that GPU kind, python -m megatrain.perf_model.ingredients --models '' --rates "
                       f"{rate} --out results/ingredients/FILE, FILE the kind's owed file in megatrain.hardware.LENT")
    return params * FP32_BYTES / (gbs * 1e9)


def write_up_s(m, params: float) -> float:
    """Seconds to copy `params` updated fp32 master values from the host into bf16 parameter partitions on the GPU
    (ZeRO-3 without parameter offload, its host sub-groups after their step): PyTorch casts on the host, then copies
    from pageable memory (Machine.gpu_from_host_convert_gbs)."""
    return _converted_s(m, params, "gpu_from_host_convert_gbs",
                        "ZeRO-3 with its parameters on the GPU writes its host sub-groups up with a dtype-changing "
                        "host-to-GPU copy")


def write_back_s(m, params: float, width: int) -> float:
    """Seconds to copy `params` updated fp32 master values from the GPU into host parameter partitions of `width`
    bytes a value (partial offload's GPU sub-groups after their AdamW): a pinned copy where the partition is fp32 too,
    else the dtype-changing copy that PyTorch converts on the host (Machine.gpu_to_host_convert_gbs; without it the
    mode is not predicted: the pinned rate in its place missed the mode's three records by 50-74%)."""
    if width == FP32_BYTES:
        return params * FP32_BYTES / (m.d2h_gbs * 1e9)
    return _converted_s(m, params, "gpu_to_host_convert_gbs",
                        "partial offload writes its GPU sub-groups back with a dtype-changing GPU-to-host copy")


def step(case: CaseConfig, model: Model, host: HostStep, compiled_layers: int | None = None,
         host_call_s: float = 0.0) -> dict:
    """One steady-state step of a DeepSpeed case (ZeRO-3 offload, or ZeRO-Offload with option zero_stage=2): seconds,
    and where they went. compiled_layers: how many layers (the first ones) ran compiled; None: all of them when the
    case compiles, none when it does not. host_call_s: the host's own time per layer call (forward and backward of
    one layer on one micro-batch: ZeRO-3's hooks), a floor under a micro-batch's layer work; 0 (no ingredient measures
    it) except in what-ifs. The phases (forward_s, backward_s, optimizer_s) are those a record's phase_times_s
    measures: the engine's forward, backward and step calls."""
    cfg = case.shape()
    o = case.opts
    m = model.machine
    units = build_units(cfg)
    embed, layers, head = units[0].numel, [u.numel for u in units[1:-1]], units[-1].numel
    w = case.dtype_bytes
    micro = case.batch // case.micro_batch
    tokens = case.micro_batch * case.seq
    if compiled_layers is None:
        compiled_layers = len(layers) if case.compile else 0
    f_s, b_s = zip(*(model.layer_s(cfg, tokens, case.seq, i < compiled_layers) for i in range(len(layers))),
                   strict=True)
    head_s = model.head_s(cfg, tokens)
    zero3 = o.zero_stage == 3
    fetching = zero3 and o.offload_param  # ZeRO-3's weights come up from the host before each use
    both_ways = zero3 or micro > 1  # gradients go out while weights or partial sums come in
    total = sum(u.numel for u in units)
    sub_groups = optimizer_sub_groups(case) if o.optimizer_ratio < 1 or o.super_offload else [total]
    on_gpu = sum(sub_groups[:gpu_sub_groups(o.optimizer_ratio, len(sub_groups))])
    host_share = 1 - on_gpu / total  # of each unit's fp32 gradient, which leaves for the host (spread evenly)

    moved = {"h2d_bytes": 0.0, "d2h_bytes": 0.0}

    def up(nbytes: float, both: bool) -> float:
        moved["h2d_bytes"] += nbytes
        return nbytes / ((m.both_gbs / 2 if both else m.h2d_gbs) * 1e9)

    def down(nbytes: float) -> float:
        moved["d2h_bytes"] += nbytes
        return nbytes / ((m.both_gbs / 2 if both_ways else m.d2h_gbs) * 1e9)

    t = fetch_wait = host_bound = ready = forward_s = 0.0
    h2d_free = d2h_free = reduce_free = 0.0

    def fetch(n: int, after: float, both: bool) -> float:
        """A unit's weights up on the all-gather stream, issued at `after`; when they are there."""
        nonlocal h2d_free
        h2d_free = max(h2d_free, after) + up(n * w, both)
        return h2d_free

    def reduce(n: int, ready: float, k: int) -> None:
        """A unit's gradients through the reduce stream once computed (`ready`), in micro-batch k: the first's bf16
        out (ZeRO-3: and back up, grad_buffer.to); a later one's partial sum up, added and out again; at the
        boundary, cast to fp32 on the GPU, out again."""
        nonlocal h2d_free, d2h_free, reduce_free
        s = max(ready, reduce_free)
        if both_ways:
            if k > 0:
                s = h2d_free = max(s, h2d_free) + up(n * w, True)
            s = d2h_free = max(s, d2h_free) + down(n * w)
            if zero3 and k == 0:
                s = h2d_free = max(s, h2d_free) + up(n * w, True)
        if k == micro - 1:
            s = d2h_free = max(s, d2h_free) + down(n * FP32_BYTES * host_share)
        reduce_free = s

    for k in range(micro):
        micro_start = t
        # forward: ZeRO-3 brings the root's weights (embedding, head matrix) up first, then each layer's during the
        # previous layer's compute
        if fetching:
            start = t
            t = fetch(embed + head, t, False)
            fetch_wait += t - start
            ready = fetch(layers[0], t, False)
        for i in range(len(layers)):
            start = max(t, ready) if fetching else t
            fetch_wait += start - t
            if fetching and i + 1 < len(layers):
                ready = fetch(layers[i + 1], start, False)
            t = start + f_s[i]
        forward_s += t - micro_start
        # backward: the head matrix again (the root's backward hook), the head; the last layer's weights come up
        # during it, and each layer's during the backward of the one after it
        if fetching:
            start = t
            t = fetch(head, t, False)
            fetch_wait += t - start
            ready = fetch(layers[-1], t, True)
        t += head_s
        reduce(head, t, k)
        for i in reversed(range(len(layers))):
            start = max(t, ready) if fetching else t
            fetch_wait += start - t
            if fetching:
                ready = fetch(layers[i - 1] if i else embed, start, True)
            t = start + b_s[i]
            reduce(layers[i], t, k)
        if fetching:  # the embedding's backward hook waits for its weights
            fetch_wait += max(t, ready) - t
            t = max(t, ready)
        reduce(embed, t, k)
        t = max(t, reduce_free)  # the backward's epilogue waits for the reduce stream
        floor = max(0.0, len(layers) * host_call_s - sum(f_s) - sum(b_s))
        host_bound += floor
        t += floor
    compute_s = micro * (sum(f_s) + sum(b_s) + head_s)
    backward_end = t
    clip = case.optim.max_grad_norm > 0
    share = (o.cpuadam_cores_perc or SUPER_OFFLOAD_CORES_PERC) if o.super_offload else 1.0
    host_parts = host.seconds(total - on_gpu, clip, share, SUPER_OFFLOAD_COPY_BYTES_PER_PARAM * o.super_offload)
    if zero3 and not fetching:  # the host sub-groups' masters into bf16 partitions on the GPU, cast on the host
        host_parts["cast_s"] = write_up_s(m, total - on_gpu)
        moved["h2d_bytes"] += (total - on_gpu) * 2
    host_step_s = sum(host_parts.values())
    if o.super_offload and not clip:  # speculative: each sub-group's step beside the rest of the backward
        host_step_s = max(host_step_s - (backward_end - forward_s),
                          host_step_s * max(sub_groups) / sum(sub_groups))
    # partial offload: its GPU share's AdamW, then each updated sub-group to its parameter partition (on the host; on
    # the GPU without parameter offload, a device copy left out)
    gpu_step_s = on_gpu / (m.gpu_adamw_gparams_s[case.precision] * 1e9) + \
        (write_back_s(m, on_gpu, w) if fetching else 0.0) if on_gpu else 0.0
    moved["d2h_bytes"] += on_gpu * 4 if fetching else 0
    upload_s = 0.0 if zero3 else up(total * w, False)  # ZeRO-Offload: the new weights up
    t += host_step_s + gpu_step_s + upload_s
    return {
        "step_s": t, "tflops": model_flops(cfg.num_params(), case.batch * case.seq) / t / 1e12,
        "compute_s": compute_s, "fetch_wait_s": fetch_wait, "host_bound_s": host_bound,
        "grad_tail_s": backward_end - compute_s - fetch_wait - host_bound,
        "host_step_s": host_step_s, **host_parts, "gpu_step_s": gpu_step_s, "upload_s": upload_s,
        "optimizer_params_on_gpu": on_gpu,
        "forward_s": forward_s, "backward_s": backward_end - forward_s, "optimizer_s": t - backward_end,
        "layers_fwd_s": sum(f_s) * micro, "layers_bwd_s": sum(b_s) * micro, "head_s": head_s * micro, **moved,
    }
