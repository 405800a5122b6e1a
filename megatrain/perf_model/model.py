"""Performance model of the streaming engine: a case's step time from measured ingredients and the engine's schedule.

Ingredients (`python -m megatrain.perf_model.ingredients`, results/ingredients/<profile>.json), all measured on one GPU
and host: one decoder layer's forward and recompute + backward per shape and token count (eager and compiled), the
head's fused forward + loss + backward, attention alone per sequence length, the engine's host AdamW rate in each
precision, the GPU AdamW rate of resident units, the pinned PCIe rates each way and both at once.

The machine a case runs on (`Machine`) scales them: PCIe and host AdamW from that machine's own probe (every record
keeps one; the engine's kernel rate scales with the probe's torch AdamW rate), GPU time split into matmul time
(layer FLOPs at the ingredient GPU's measured GEMM rate) scaled by the GEMM rate, and the rest scaled by memory
bandwidth. `simulate` then replays one step as the engine issues it (megatrain.engine.schedule):
- the previous step's host AdamW runs unit by unit in forward order from the step's start; loading a streamed unit
  waits on the host for its update, and the loop asks for use k+1's load before queueing use k's compute, so a
  late update holds the GPU's next launch too (what bounds small batches);
- two weight slots on the H2D stream: use k+1's weights load once use k-1 has freed the slot (with one slot,
  weight_slots=1, once use k has run); compute waits for them; the head and each backward use send their gradients
  out on the D2H stream, into two alternating slots;
- offloaded layer inputs leave on D2H after their layer's forward and come back on H2D two backward uses ahead;
  recomputed inputs add layer forwards ('refwd'), in the engine's use order (megatrain.engine.uses);
- transfers in both directions at once share the link (the probe's both-ways rate);
- the step ends when the compute stream (embedding backward, resident units' GPU AdamW) and the D2H stream are done.
Not modelled: the embedding's forward and backward (a gather and a scatter-add), host launch overhead, the first
step's compilation. Those are what a miss on a very small case points at.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from megatrain.config import CaseConfig
from megatrain.engine.layout import build_units
from megatrain.engine.uses import use_order
from megatrain.models import ModelConfig, model_shape
from megatrain.models.flops import attention_flops_per_seq, hardware_flops, model_flops
from megatrain.optim.state_bytes import MOMENT_BYTES, state_bytes_per_param

BASE_SEQ = 1024  # the sequence length of the layer and head ingredients


def layer_key(cfg: ModelConfig) -> tuple:
    return (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias,
            cfg.o_bias, cfg.mlp_bias, cfg.qk_norm) + ((cfg.num_experts, cfg.num_experts_per_tok,
                                                      cfg.moe_intermediate_size, cfg.moe_bias, cfg.attention_sinks)
                                                     if cfg.is_moe else ())


def head_key(cfg: ModelConfig) -> tuple:
    return (cfg.hidden_size, cfg.vocab_size)


def layer_matmul_flops(cfg: ModelConfig, tokens: int) -> float:
    return 2.0 * cfg.layer_matmul_params() * tokens


def _linear(points: list[tuple[int, float]], x: float) -> float:
    """Through two measured points (tokens, seconds); below the first, proportional to it (a kernel's fixed cost
    is not measured, so small token counts are predicted at the first point's rate)."""
    by_x: dict = {}
    for px, py in points:  # shapes measured twice (two models with one head shape): their mean
        by_x.setdefault(px, []).append(py)
    (x1, y1), (x2, y2) = sorted((px, sum(ys) / len(ys)) for px, ys in by_x.items())[:2]
    if x <= x1:
        return y1 * x / x1
    return y1 + (x - x1) * (y2 - y1) / (x2 - x1)


def _loglog(points: list[tuple[int, float]], x: float) -> float:
    """Piecewise power law through measured (seq, seconds); beyond the last point seconds grow as seq^2 (attention
    at fixed efficiency), below the first as seq^2 too."""
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1] * (x / pts[0][0]) ** 2
    if x >= pts[-1][0]:
        return pts[-1][1] * (x / pts[-1][0]) ** 2
    for (x1, y1), (x2, y2) in zip(pts, pts[1:], strict=False):
        if x1 <= x <= x2:
            return math.exp(math.log(y1) + (math.log(x) - math.log(x1)) * (math.log(y2) - math.log(y1))
                            / (math.log(x2) - math.log(x1)))
    raise AssertionError("unreachable")


@dataclass
class Ingredients:
    """One ingredients file: measured times by layer shape, head shape and attention heads."""

    path: str
    data: dict

    @staticmethod
    def load(*paths: str | Path) -> Ingredients:
        """One file, or several of one machine kind: their measurement lists joined, other keys from the first
        file that has them (a later run adding rates the first did not measure)."""
        data: dict = {}
        for path in paths:
            more = json.loads(Path(path).read_text())
            for key, value in more.items():
                if key in ("layers", "heads", "attention"):
                    data.setdefault(key, []).extend(value)
                else:
                    data.setdefault(key, value)
            if "host_adamw_gparams_s" in more:  # each run's engine rate beside its own probe's torch rate
                data.setdefault("host_adamw_runs", []).append((more["host_adamw_gparams_s"],
                                                               more["machine"]["cpu_adamw_gparams_s"]))
        return Ingredients(", ".join(str(Path(p).name) for p in paths), data)

    @cached_property
    def machine(self) -> dict:
        return self.data["machine"]

    @cached_property
    def layers(self) -> dict:
        out: dict = {}
        for r in self.data["layers"]:
            if "error" not in r:
                key = (layer_key(model_shape(r["model"])), r["compiled"])
                out.setdefault(key, []).append((r["tokens"], r["fwd_ms"] / 1e3, r["bwd_ms"] / 1e3))
        return out

    @cached_property
    def heads(self) -> dict:
        out: dict = {}
        for r in self.data["heads"]:
            if "error" not in r:
                out.setdefault(head_key(model_shape(r["model"])), []).append((r["tokens"], r["ms"] / 1e3))
        return out

    @cached_property
    def attention(self) -> dict:
        out: dict = {}
        for r in self.data["attention"]:
            if "error" not in r:
                cfg = model_shape(r["model"])
                key = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
                out.setdefault(key, []).append((r["seq"], r["fwd_ms"] / 1e3, r["fwd_bwd_ms"] / 1e3))
        return out

    def layer_s(self, cfg: ModelConfig, tokens: int, seq: int, compiled: bool, mlp_chunk_tokens: int = 0
                ) -> tuple[float, float]:
        """(forward, recompute + backward) seconds of one layer call on `tokens` tokens in rows of `seq`.

        Beyond seq 1024 the attention of the longer rows is added and the seq-1024 rows' own taken out. That
        share is scaled down from the shortest measured sequence of at least 4096 at its efficiency: one
        1024-token sequence alone is launch-bound, not what a layer call over many rows pays. A chunked MLP
        (mlp_chunk_tokens below the call's tokens) is recomputed chunk by chunk in backward: one more MLP forward.
        """
        points = self.layers.get((layer_key(cfg), compiled))
        if not points:
            raise KeyError(f"no layer ingredients for the shape of H={cfg.hidden_size} I={cfg.intermediate_size} "
                           f"({'compiled' if compiled else 'eager'}) in {self.path}; run "
                           "megatrain.perf_model.ingredients with a model of that shape")
        fwd = _linear([(t, f) for t, f, _ in points], tokens)
        bwd = _linear([(t, b) for t, _, b in points], tokens)
        if mlp_chunk_tokens and tokens > mlp_chunk_tokens:
            bwd += fwd * 3 * cfg.hidden_size * cfg.intermediate_size / (layer_matmul_flops(cfg, 1) / 2)
        if seq != BASE_SEQ:  # attention beyond what the seq-1024 rows hold
            attn = self.attention.get((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
            if not attn:
                raise KeyError(f"no attention ingredients for {cfg.num_heads}/{cfg.num_kv_heads} heads in {self.path}")
            ref_seq, *ref = min((r for r in attn if r[0] >= 4 * BASE_SEQ), default=min(attn))
            for i, (f, ref_s) in enumerate(zip((_loglog([(s, v[i]) for s, *v in attn], seq) for i in (0, 1)), ref,
                                               strict=True)):
                extra = tokens / seq * f - tokens / BASE_SEQ * ref_s * (BASE_SEQ / ref_seq) ** 2
                fwd, bwd = (fwd + extra, bwd) if i == 0 else (fwd, bwd + extra)
        return max(fwd, 0.0), max(bwd, 0.0)

    def head_s(self, cfg: ModelConfig, tokens: int) -> float:
        points = self.heads.get(head_key(cfg))
        if not points:
            raise KeyError(f"no head ingredients for H={cfg.hidden_size} V={cfg.vocab_size} in {self.path}")
        return _linear(points, tokens)


@dataclass
class Machine:
    """Rates of the machine a case runs on, and how its GPU's times relate to the ingredients' GPU.

    gemm_scale, bandwidth_scale: the ingredient GPU's rate over this GPU's (matmul time and the rest of a layer's
    time are multiplied by them). host_adamw_gparams_s: the engine's kernel, by precision; gpu_adamw_gparams_s: a
    resident unit's update on the GPU, by precision."""

    name: str
    h2d_gbs: float
    d2h_gbs: float
    both_gbs: float
    host_adamw_gparams_s: dict
    gpu_adamw_gparams_s: dict
    gemm_tflops: float
    # a blocking copy of fp32 on the GPU into a pinned bf16 host tensor, GB/s of fp32 (ingredients'
    # gpu_to_host_convert_gbs; None where its ingredients predate it)
    gpu_to_host_convert_gbs: float | None = None
    gpu_from_host_convert_gbs: float | None = None  # the other way: pinned fp32 on the host into bf16 on the GPU
    gemm_scale: float = 1.0
    bandwidth_scale: float = 1.0

    @staticmethod
    def from_probe(ing: Ingredients, probe: dict | None, name: str) -> Machine:
        """The machine a record ran on, from its probe (megatrain.probe.measure) and the ingredients of
        its GPU kind: rates the probe lacks are the ingredients'. The host AdamW is the probe's own timing of the
        engine's kernel where it has one; older probes timed only torch's fused AdamW, and the engine's rate is
        then that times the ratio of the two in the ingredient runs (their mean: the ratio varies between VMs)."""
        base = ing.machine
        probe = {k: v for k, v in (probe or {}).items() if v is not None}
        host = probe.get("engine_adamw_gparams_s")
        if not host:
            runs = ing.data.get("host_adamw_runs") or [(ing.data["host_adamw_gparams_s"], base["cpu_adamw_gparams_s"])]
            torch_rate = probe.get("cpu_adamw_gparams_s", base["cpu_adamw_gparams_s"])
            host = {p: torch_rate * sum(r[p] / t for r, t in runs) / len(runs) for p in runs[0][0]}
        return Machine(
            name=name, h2d_gbs=probe.get("h2d_gbs", base["h2d_gbs"]), d2h_gbs=probe.get("d2h_gbs", base["d2h_gbs"]),
            both_gbs=probe.get("both_gbs", base["both_gbs"]), host_adamw_gparams_s=host,
            gpu_adamw_gparams_s=ing.data.get("gpu_adamw_gparams_s") or {}, gemm_tflops=base["gemm_bf16_tflops"],
            gpu_to_host_convert_gbs=ing.data.get("gpu_to_host_convert_gbs"),
            gpu_from_host_convert_gbs=ing.data.get("gpu_from_host_convert_gbs"))


@dataclass
class Model:
    ing: Ingredients
    machine: Machine

    def _scaled(self, seconds: float, tensor_flops: float) -> float:
        """Ingredient seconds on this machine's GPU: the tensor-core share (matmuls and attention, at the
        ingredient GPU's GEMM rate) by the GEMM rate, the rest by memory bandwidth."""
        mm = min(seconds, tensor_flops / (self.machine.gemm_tflops * 1e12))
        return mm * self.machine.gemm_scale + (seconds - mm) * self.machine.bandwidth_scale

    def layer_s(self, cfg: ModelConfig, tokens: int, seq: int, compiled: bool, mlp_chunk_tokens: int = 0
                ) -> tuple[float, float]:
        f, b = self.ing.layer_s(cfg, tokens, seq, compiled, mlp_chunk_tokens)
        tensor = layer_matmul_flops(cfg, tokens) + attention_flops_per_seq(cfg, seq) / cfg.num_layers * tokens / seq
        return self._scaled(f, tensor), self._scaled(b, 3 * tensor)

    def head_s(self, cfg: ModelConfig, tokens: int) -> float:
        return self._scaled(self.ing.head_s(cfg, tokens), 6.0 * cfg.vocab_size * cfg.hidden_size * tokens)


# The host AdamW kernel's rate beside the step's pinned copies, as a share of its rate alone: 0.74 beside copies both
# ways and GEMM launches, 0.88 beside the copies alone (scripts/host_contention.py, results/host_contention, one H100
# host at 3a2d6d9); the delayed update runs beside every copy of the step
DELAYED_HOST_RATE = 0.74


def gpu_update_bytes(case: CaseConfig) -> tuple[float, float]:
    """Bytes per parameter of a streamed unit updated on the GPU: its optimizer state in (the moments, and the fp32
    master in mixed precision; bf16 precision's master is the weights already loaded), and out again with the
    updated weights in the compute dtype."""
    per = state_bytes_per_param(case.dtype_bytes, case.precision, MOMENT_BYTES[case.optim.moments])
    state = per["exp_avg"] + per["exp_avg_sq"] + per.get("master", 0)
    return state, state + per["weights"]


def simulate(case: CaseConfig, plan: dict, model: Model) -> dict:
    """One steady-state step of `case` under its memory plan, as a record keeps it (resident_units, offloaded_layers,
    recomputed_inputs: dataclasses.asdict of a megatrain.engine.plan.MemoryPlan, or a record's system_config's):
    seconds, and where they went."""
    cfg = case.shape()
    m = model.machine
    units = build_units(cfg)
    layers = cfg.num_layers
    resident = frozenset(plan.get("resident_units") or [])
    recomputed = int(plan.get("recomputed_inputs") or 0)
    offloaded = int(plan.get("offloaded_layers") or 0)
    first = recomputed + 1 if recomputed else 0
    host_acts = set(range(first, min(first + offloaded, layers)))
    w = case.dtype_bytes
    micro = case.batch // case.micro_batch
    tokens = case.micro_batch * case.seq
    f_s, b_s = model.layer_s(cfg, tokens, case.seq, case.compile, case.opts.mlp_chunk_tokens)
    head = model.head_s(cfg, tokens) * micro
    act_bytes = tokens * cfg.hidden_size * w * micro
    rate = m.host_adamw_gparams_s[case.precision] * 1e9
    # streamed units whose AdamW runs on the GPU (a design under study, not the engine yet): their optimizer state
    # comes in during backward behind their weights, their gradient stays on the GPU until the norm is known, the
    # update runs after the backward; the updated weights stay on the GPU for the next forward, and the state with
    # the weights goes back to the host during it, before the next backward loads them
    gpu_updated = frozenset(plan.get("gpu_updated_units") or []) - resident
    state_in, state_out = gpu_update_bytes(case)
    opt_end, t = {}, 0.0
    for u in units:  # the previous step's update, in forward order
        if u.index not in resident and u.index not in gpu_updated:
            t += u.numel / rate
        opt_end[u.index] = t
    host_opt_s = t
    delayed = bool(case.opts.update_delay)
    if delayed:  # the previous step's update writes the next step's weights: this step's loads wait for none of it
        opt_end = dict.fromkeys(opt_end, 0.0)
    slots = case.opts.weight_slots
    uses = use_order(layers, resident, recomputed, slots)
    back = next(k for k, (_, phase, _, _) in enumerate(uses) if phase == "head")
    h2d_free = d2h_free = compute = host = 0.0
    slot_free, gslot_free, ready, act_back, act_out = [0.0] * slots, [0.0, 0.0], {}, {}, {}
    gslot = 0

    def link(nbytes: float, one_way: float, both: bool) -> float:
        return nbytes / ((m.both_gbs / 2 if both else one_way) * 1e9)

    back_on_host = {}  # the previous step's GPU-updated units: on the host again, in forward order, from the start
    for u in sorted(gpu_updated):
        d2h_free = back_on_host[u] = d2h_free + link(units[u].numel * state_out, m.d2h_gbs, True)

    def load(k: int) -> None:
        nonlocal host, h2d_free
        if k >= len(uses) or not uses[k][3]:
            return
        u, phase, slot, _ = uses[k]
        if u in gpu_updated and phase == "fwd":  # its updated weights stayed on the GPU
            ready[k] = 0.0
            return
        host = max(host, opt_end[u])  # _load waits for the unit's update on the host
        start = max(h2d_free, host, slot_free[slot], back_on_host.get(u, 0.0))
        h2d_free = start + link(units[u].numel * w, m.h2d_gbs, k > back or bool(host_acts))
        ready[k] = h2d_free
        if u in gpu_updated and phase in ("head", "bwd"):  # its optimizer state follows its weights in
            h2d_free += link(units[u].numel * state_in, m.h2d_gbs, True)

    if 0 not in resident and 0 not in gpu_updated:  # the embedding's weights (its forward itself is not modelled)
        host = max(host, opt_end[0])
        h2d_free = link(units[0].numel * w, m.h2d_gbs, False)
        compute = h2d_free
    if 0 in host_acts:
        d2h_free = act_out[0] = compute + link(act_bytes, m.d2h_gbs, True)
    load(0)
    busy = 0.0
    for k, (u, phase, slot, _) in enumerate(uses):
        ahead = slot is not None and slots > 1  # the next use loads into the other slot beside this one
        if ahead:
            load(k + 1)
        start = max(compute, host, ready.get(k, 0.0))
        if phase == "fwd" or phase == "refwd":
            dur = f_s * micro
        elif phase == "head":
            dur = head
        else:
            dur = b_s * micro
            start = max(start, act_back.get(u - 1, 0.0))
        if phase in ("head", "bwd") and u not in resident:
            start = max(start, gslot_free[gslot])
        compute = start + dur
        busy += dur
        if slot is not None:
            slot_free[slot] = compute
        if phase == "fwd" and u in host_acts:  # this layer's output is an offloaded input
            d2h_free = act_out[u] = max(d2h_free, compute) + link(act_bytes, m.d2h_gbs, True)
        if phase in ("head", "bwd"):
            nxt = layers - 1 if phase == "head" else u - 2  # the input the next backward needs, back from the host
            if nxt in host_acts:
                s = max(h2d_free, host, act_out[nxt])
                h2d_free = act_back[nxt] = s + link(act_bytes, m.h2d_gbs, True)
            if u not in resident and u not in gpu_updated:
                d2h_free = gslot_free[gslot] = max(d2h_free, compute) + link(units[u].numel * w, m.d2h_gbs, True)
                gslot = 1 - gslot
        if not ahead:
            load(k + 1)
    if 0 not in resident:  # the embedding's gradient leaves after its backward
        d2h_free = max(d2h_free, compute) + link(units[0].numel * w, m.d2h_gbs, True)
    resident_numel = sum(units[u].numel for u in resident | gpu_updated)
    resident_s = resident_numel / (m.gpu_adamw_gparams_s[case.precision] * 1e9) if resident_numel else 0.0
    if gpu_updated:  # the update waits for the last state in; the state then leaves for the next step
        compute = max(compute, h2d_free)
    compute += resident_s
    step = max(compute, d2h_free)
    if delayed:  # the update ran beside the whole step, sharing host memory with its copies; the step ends with it
        step = max(step, host_opt_s / DELAYED_HOST_RATE)
    n = cfg.active_params()
    return {
        "step_s": step, "tflops": model_flops(n, case.batch * case.seq) / step / 1e12,
        "hw_tflops": hardware_flops(cfg, case.batch, case.seq, extra_layer_forwards=recomputed) / step / 1e12,
        "compute_s": busy + resident_s, "host_opt_s": host_opt_s, "resident_opt_s": resident_s,
        "exposed_s": step - busy - resident_s,
        "layer_fwd_s": f_s * micro, "layer_bwd_s": b_s * micro, "head_s": head,
    }
