"""The per-step stream schedule of the streaming engine.

Shape legend: B micro-batch, S sequence, H hidden, V vocab. Units: 0 embed, 1..L layers, L+1 head.

Per step the GPU *uses* units in this order: layers 1..L forward, the head (forward, loss and
backward fused, so its weights cross PCIe once), layers L..1 backward. Two weight slots hold
consecutive uses; while use k computes, the weights of use k+1 stream into the other slot (H2D
stream). A slot that still holds the unit a use needs is reused without a copy (layer L after the
head). Backward recomputes each layer from its saved input with grad enabled on views of the slot,
so every layer crosses PCIe exactly twice per step. Saved layer inputs stay on the GPU or, for long
contexts, go to pinned host memory and come back one layer ahead of backward, or are not kept at all: the first R
layers then run forward a third time ('refwd', their weights loaded again) just before their backward, once the
later layers' backward has freed the memory their regenerated inputs take (engine/activations.py).
Gradients accumulate over micro-batches in an fp32 GPU buffer (two, alternating), their squared
norm is summed on the GPU, and they leave in the streamed dtype on the D2H stream while the next
layer's backward runs. The embedding stays in its
own buffer for the whole step (the tied LM head reads it too) and its buffer is reused as the
staging area for its gradient. Resident units (`resident_embedding`, `resident_layers=K`: the
first K layers) keep weights, fp32 gradients and AdamW state on the GPU: they are never loaded or
offloaded and are updated on the GPU as soon as the norm is known, so the next forward starts on
them while the host optimizer updates the streamed units behind it.
"""

from __future__ import annotations

import math
import time
import warnings

import torch
import torch.nn.functional as F

from megatrain.engine.activations import ActivationStore
from megatrain.engine.config import EngineConfig
from megatrain.engine.host_optimizer import HostOptimizer, torch_adamw_unit
from megatrain.engine.layout import Unit
from megatrain.engine.store import OPT_CHUNK, HostStore
from megatrain.engine.streams import StreamSet
from megatrain.engine.templates import HeadTemplate, LayerTemplate, bind
from megatrain.models import rotary_tables
from megatrain.models.transformer import packed_rope_and_mask
from megatrain.optim.host_adamw import FlatAdamW


def plan_uses(num_layers: int, resident: frozenset = frozenset(), recomputed: int = 0
              ) -> list[tuple[int, str, int | None, bool]]:
    """(unit index, phase, weight slot, needs a load) for every use of a step; resident units (weights
    kept on the GPU) take no slot (None) and no load. With `recomputed` inputs, layers 1..recomputed run forward
    again ('refwd') right before layer recomputed+1's backward, to regenerate them."""
    uses = [(u, "fwd") for u in range(1, num_layers + 1)] + [(num_layers + 1, "head")]
    uses += [(u, "bwd") for u in range(num_layers, recomputed + 1, -1)]
    uses += [(u, "refwd") for u in range(1, recomputed + 1)]
    uses += [(u, "bwd") for u in range(min(recomputed + 1, num_layers), 0, -1)]
    content: list[int | None] = [None, None]
    plan, prev = [], None
    for unit, phase in uses:
        if unit in resident:
            plan.append((unit, phase, None, False))
            continue
        if unit in content:
            slot, load = content.index(unit), False
        else:
            slot, load = (0 if prev is None else 1 - prev), True
            content[slot] = unit
        plan.append((unit, phase, slot, load))
        prev = slot
    return plan


class Schedule:
    def __init__(self, config: EngineConfig, store: HostStore, optimizer: HostOptimizer, streams: StreamSet,
                 device: torch.device, resident_units: list[int], offloaded_layers: int = 0,
                 recomputed_inputs: int = 0):
        cfg = config.model
        self.config, self.store, self.optimizer, self.streams, self.device = config, store, optimizer, streams, device
        self.cfg = cfg
        dt = store.compute_dtype
        self.units = store.units
        self.embed, self.head = self.units[0], self.units[-1]
        slot_numel = max(u.numel for u in self.units[1:])
        self.wbuf = [torch.empty(slot_numel, dtype=dt, device=device) for _ in range(2)]
        self.embed_buf = torch.empty(self.embed.numel, dtype=dt, device=device)
        self.gacc = [torch.empty(slot_numel, dtype=torch.float32, device=device) for _ in range(2)]
        self.embed_gacc = torch.empty(self.embed.numel, dtype=torch.float32, device=device)
        grad_dt = store.grads.dtype
        self.stage = None if grad_dt == torch.float32 else \
            [torch.empty(slot_numel, dtype=grad_dt, device=device) for _ in range(2)]
        self.layer_t = LayerTemplate(cfg, compile_layer=config.compile,
                                     mlp_chunk_tokens=config.options.mlp_chunk_tokens)
        self.acts = ActivationStore(streams, device, offloaded_layers, cfg.num_layers, config.micro_batches,
                                    (config.micro_batch, config.seq, cfg.hidden_size), dt, recomputed_inputs)
        self.head_t = HeadTemplate(cfg)
        self.cos, self.sin = rotary_tables(cfg, config.seq, device, dt)
        self.plan = plan_uses(cfg.num_layers, frozenset(resident_units), self.acts.recomputed)
        self.slot_free = [None, None]  # compute-stream event: last use of the weight slot finished
        self.gslot_free = [None, None]  # d2h-stream event: last gradient copied out of the grad slot
        self.embed_free = None  # d2h-stream event: the embedding gradient left the embedding buffer
        self.resident: dict[int, dict] = {u: self._make_resident(self.units[u]) for u in resident_units}
        self.resident_adamw = FlatAdamW(config.optim)
        # bf16 mode updates resident weights in fp32 one chunk at a time
        self.resident_scratch = torch.empty(min(OPT_CHUNK, max(self.units[u].numel for u in resident_units)),
                                            dtype=torch.float32, device=device) \
            if resident_units and store.master is None and dt != torch.float32 else None
        self.elsize = torch.empty((), dtype=dt).element_size()
        self.history: list[dict] = []
        self.timeline: list[dict] = []
        self.skipped_steps = 0  # steps whose gradient norm was not finite: no update applied
        self.lr = config.optim.lr  # of the next update (a learning-rate schedule sets it before each step)
        if streams.cuda:  # the rotary tables and resident copies above ran on the default stream, which the
            torch.cuda.synchronize(device)  # side streams do not wait for

    # ---- transfers -------------------------------------------------------------------------------
    def _load(self, unit: Unit, dst: torch.Tensor, after) -> object:
        """Stream unit's weights into dst on the H2D stream once `after` (last reader of dst) is done."""
        self.stats["optim_wait_s"] += self.optimizer.wait(unit.index)
        s = self.streams
        s.wait("h2d", after)
        start = s.record("h2d")
        with s.use("h2d"):
            dst[:unit.numel].copy_(self.store.tile(self.store.weights, unit), non_blocking=True)
        end = s.record("h2d")
        s.span("h2d", unit.index, "load", start, end)
        self.stats["h2d_bytes"] += unit.numel * self.elsize
        return end

    def _offload(self, unit: Unit, src: torch.Tensor, gslot: int | None) -> object:
        """Copy unit's gradient from src to the host tile on the D2H stream; returns its done event."""
        s = self.streams
        ready = s.record("compute")
        s.wait("d2h", ready)
        start = s.record("d2h")
        with s.use("d2h"):
            self.store.tile(self.store.grads, unit).copy_(src[:unit.numel], non_blocking=True)
        end = s.record("d2h")
        s.span("d2h", unit.index, "offload", start, end)
        self.stats["d2h_bytes"] += unit.numel * src.element_size()
        self.grad_ready[unit.index] = end
        if gslot is not None:
            self.gslot_free[gslot] = end
        return end

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: int,
             segments_BS: torch.Tensor | None = None) -> float:
        s, dev = self.streams, self.device
        host_t0 = time.perf_counter()
        s.begin_step()
        self.stats = {"h2d_bytes": 0, "d2h_bytes": 0, "optim_wait_s": 0.0, "compute_wait_h2d_ms": 0.0}
        self.acts.stats = self.stats
        self.grad_ready = [None] * len(self.units)
        self.stall_events = []
        mb = self.config.micro_batch
        with s.use("compute"):
            tokens = [inputs_BS[i:i + mb].to(dev, non_blocking=True) for i in range(0, inputs_BS.shape[0], mb)]
            labels = [labels_BS[i:i + mb].to(dev, non_blocking=True) for i in range(0, labels_BS.shape[0], mb)]
            self.rope = self._rope(segments_BS, len(tokens))
        embed_ready = None if 0 in self.resident else self._load(self.embed, self.embed_buf, self.embed_free)
        first_unit, _, first_slot, first_load = self.plan[0]
        ready = {0: self._load(self.units[first_unit], self.wbuf[first_slot], self.slot_free[first_slot])} \
            if first_load else {}
        embed_w = self.embed.view(self.embed_buf, self.embed.params[0])
        with s.use("compute"):
            s.wait("compute", embed_ready)
            s.wait("compute", self.embed_free)  # embed_gacc was the D2H source in fp32 runs
            start = s.record("compute")
            self.acts.put(0, [F.embedding(t, embed_w) for t in tokens])
            self.embed_gacc.zero_()
            self.sumsq = torch.zeros((), dtype=torch.float32, device=dev)
            self.loss_sum = torch.zeros((), dtype=torch.float32, device=dev)
            s.span("compute", 0, "fwd", start, s.record("compute"))
        self.dys: list[torch.Tensor] = []
        gslot = 0
        for k, (u, phase, slot, _) in enumerate(self.plan):
            if slot is not None:  # prefetch the next use's weights while this one computes
                self._prefetch(k + 1, ready)
            unit = self.units[u]
            with s.use("compute"):
                if k in ready:
                    before = s.record("compute")
                    s.wait("compute", ready[k])
                    after = s.record("compute")
                    self.stall_events.append((before, after))
                start = s.record("compute")
                weights = self.resident[u]["w"] if slot is None else self.wbuf[slot]
                if phase in ("fwd", "refwd"):
                    self._forward(unit, weights, regenerate=phase == "refwd")
                elif phase == "head":
                    self._head(unit, weights, gslot, labels, normalizer, embed_w)
                else:
                    self._backward(unit, weights, gslot)
                if phase in ("head", "bwd") and slot is not None:  # streamed head/backward fill alternating grad slots
                    gslot = 1 - gslot
                end = s.record("compute")
                s.span("compute", u, phase, start, end)
                if slot is not None:
                    self.slot_free[slot] = end
            if slot is None:  # resident: queue its compute first, since _load may wait for the host optimizer
                self._prefetch(k + 1, ready)
        with s.use("compute"):
            start = s.record("compute")
            self._embed_backward(tokens)
            s.span("compute", 0, "bwd", start, s.record("compute"))
        # the global norm is known only now: one synchronisation per step. The read must run on the compute
        # stream: the default stream does not wait for the side streams, so reading there could take the
        # sum before the last backward and the embedding's gradient were added to it.
        with s.use("compute"):
            norm_sq, loss = torch.stack([self.sumsq, self.loss_sum]).tolist()
        total_norm = math.sqrt(norm_sq)
        max_norm = self.config.optim.max_grad_norm
        clip = min(1.0, max_norm / (total_norm + 1e-6)) if max_norm > 0 else 1.0
        skip = not math.isfinite(total_norm)  # a NaN/inf gradient: leave weights and moments as they are
        if self.resident and not skip:
            with s.use("compute"):
                for u in self.resident:
                    start = s.record("compute")
                    self._update_resident(u, clip)
                    s.span("compute", u, "opt", start, s.record("compute"))
        if s.cuda:
            torch.cuda.synchronize(dev)
        step_s = time.perf_counter() - host_t0
        if skip:
            self.skipped_steps += 1
            warnings.warn(f"step {len(self.history)}: gradient norm is {total_norm}; update skipped "
                          f"({self.skipped_steps} skipped so far)", stacklevel=2)
        else:
            self.optimizer.submit(clip, self.grad_ready, self.lr)
        self._record_step(host_t0, step_s, total_norm, skip)
        return loss

    def _prefetch(self, k: int, ready: dict) -> None:
        """Start loading use k's weights into its slot, if it needs a load."""
        if k < len(self.plan) and self.plan[k][3]:
            u, _, slot, _ = self.plan[k]
            ready[k] = self._load(self.units[u], self.wbuf[slot], self.slot_free[slot])

    def _forward(self, unit: Unit, wbuf: torch.Tensor, regenerate: bool = False) -> None:
        """Layer u reads activations u-1 and writes activations u. regenerate: a recomputed input's second forward
        in backward ('refwd'), whose input stays on the GPU for that layer's own backward."""
        params = bind(unit, wbuf, requires_grad=False)
        layer = unit.index
        with torch.no_grad():
            outputs = [self.layer_t(params, x, *self.rope[m]) for m, x in enumerate(self.acts.gpu[layer - 1])]
        self.acts.put(layer, outputs)
        if not regenerate:
            self.acts.consumed(layer - 1)

    def _accumulate(self, gacc: torch.Tensor, unit: Unit, names: list[str], grads) -> None:
        views = bind(unit, gacc, requires_grad=False)
        torch._foreach_add_([views[n] for n in names], list(grads))

    def _grad_buffer(self, unit: Unit, gslot: int) -> torch.Tensor:
        """The zeroed fp32 buffer this use accumulates its gradient in: the unit's own when resident, else
        grad slot `gslot` once its last gradient has left for the host."""
        if unit.index in self.resident:
            return self.resident[unit.index]["gacc"].zero_()
        self.streams.wait("compute", self.gslot_free[gslot])
        return self.gacc[gslot][:unit.numel].zero_()

    def _head(self, unit: Unit, wbuf: torch.Tensor, gslot: int, labels, normalizer: int, embed_w) -> None:
        gacc = self._grad_buffer(unit, gslot)
        params = bind(unit, wbuf, requires_grad=True)
        tied = "lm_head.weight" not in params
        head_w = embed_w.detach().requires_grad_() if tied else params["lm_head.weight"]
        hidden = self.acts.take(self.cfg.num_layers)
        self.acts.prefetch(self.cfg.num_layers - 1)  # the first backward layer's input
        for m, h in enumerate(hidden):
            h = h.detach().requires_grad_()
            with torch.enable_grad():
                loss = self.head_t.loss(params["norm.weight"], head_w, h, labels[m], normalizer)
                dh, dnorm, dw = torch.autograd.grad(loss, [h, params["norm.weight"], head_w])
            self.dys.append(dh)
            self.loss_sum += loss.detach()
            if tied:
                self._accumulate(gacc, unit, ["norm.weight"], [dnorm])
                self.embed_gacc.view_as(dw).add_(dw)
            else:
                self._accumulate(gacc, unit, ["norm.weight", "lm_head.weight"], [dnorm, dw])
            hidden[m] = None
        self._finish_grads(unit, gacc, gslot)

    def _backward(self, unit: Unit, wbuf: torch.Tensor, gslot: int) -> None:
        gacc = self._grad_buffer(unit, gslot)
        params = bind(unit, wbuf, requires_grad=True)
        names, tensors = list(params), list(params.values())
        inputs = self.acts.take(unit.index - 1)  # this layer's inputs; its outputs were consumed already
        self.acts.prefetch(unit.index - 2)  # the next layer's, streaming in while this backward runs
        for m, x in enumerate(inputs):
            x = x.detach().requires_grad_()
            with torch.enable_grad():
                y = self.layer_t(params, x, *self.rope[m])
                grads = torch.autograd.grad(y, [x, *tensors], self.dys[m])
            self.dys[m] = grads[0]
            self._accumulate(gacc, unit, names, grads[1:])
            inputs[m] = None
        self._finish_grads(unit, gacc, gslot)

    def _finish_grads(self, unit: Unit, gacc: torch.Tensor, gslot: int) -> None:
        self.sumsq += torch.linalg.vector_norm(gacc).square()
        if unit.index in self.resident:  # stays on the GPU: updated there once the norm is known
            return
        src = gacc
        if self.stage is not None:
            src = self.stage[gslot][:unit.numel]
            src.copy_(gacc)
        self._offload(unit, src, gslot)

    def _embed_backward(self, tokens) -> None:
        gacc = self.embed_gacc.view(self.cfg.vocab_size, self.cfg.hidden_size)
        for t, dy in zip(tokens, self.dys, strict=True):
            rows = dy.flatten(0, 1).float()
            # repeatable sums: on the GPU index_put_'s accumulate sorts, where index_add_ uses atomics; on the CPU
            # index_put_ adds with atomics across threads (from 32768 elements), where index_add_ adds in token order
            if self.streams.cuda:
                gacc.index_put_((t.flatten(),), rows, accumulate=True)
            else:
                gacc.index_add_(0, t.flatten(), rows)
        self.dys = []
        self.sumsq += torch.linalg.vector_norm(self.embed_gacc).square()
        if 0 in self.resident:  # stays on the GPU: updated there once the norm is known
            return
        src = self.embed_gacc
        if self.stage is not None:  # the embedding weights are not needed again this step: stage in place
            src = self.embed_buf.copy_(self.embed_gacc)
        self.embed_free = self._offload(self.embed, src, None)

    # ---- resident units ---------------------------------------------------------------------------
    def _make_resident(self, unit: Unit) -> dict:
        """Move a unit's training state to the GPU: weights (the embedding keeps its buffer), an fp32
        gradient buffer, the fp32 master (mixed precision) and moments; the host optimizer skips it."""
        store, dev = self.store, self.device
        if unit.index == 0:
            w, gacc = self.embed_buf, self.embed_gacc
        else:
            w = torch.empty(unit.numel, dtype=store.compute_dtype, device=dev)
            gacc = torch.empty(unit.numel, dtype=torch.float32, device=dev)
        w.copy_(store.tile(store.weights, unit))
        return {
            "w": w, "gacc": gacc,
            "master": store.tile(store.master, unit).to(dev, copy=True) if store.master is not None else None,
            "exp_avg": store.tile(store.exp_avg, unit).to(dev, copy=True),
            "exp_avg_sq": store.tile(store.exp_avg_sq, unit).to(dev, copy=True),
        }

    def _update_resident(self, index: int, clip: float) -> None:
        """AdamW of a resident unit on the compute stream, before the next step's forward reads it."""
        r = self.resident[index]
        torch_adamw_unit(self.resident_adamw, self.units[index], r["w"], r["gacc"], r["master"], r["exp_avg"],
                         r["exp_avg_sq"], clip, self.config.optim.weight_decay, None, self.resident_scratch, self.lr)

    def _rope(self, segments_BS: torch.Tensor | None, micro_batches: int) -> list[tuple]:
        """(cos, sin, mask) of each micro-batch: the shared tables, or for packed rows per-document positions and
        a document mask (models.transformer.packed_rope_and_mask), on the compute stream."""
        if segments_BS is None:
            return [(self.cos, self.sin, None)] * micro_batches
        mb = self.config.micro_batch
        return [packed_rope_and_mask(self.cos, self.sin, segments_BS[i:i + mb].to(self.device))
                for i in range(0, segments_BS.shape[0], mb)]

    @torch.no_grad()
    def evaluate(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: int,
                 segments_BS: torch.Tensor | None = None) -> float:
        """The summed token loss over `normalizer`, without gradients or an update. Occasional (held-out loss), so
        simple: after every pending host update, on the compute stream, each streamed unit's weights are copied to
        a temporary GPU buffer in turn (resident units are read where they live) and every micro-batch passes it."""
        self.optimizer.flush()
        s, dev, mb, units = self.streams, self.device, self.config.micro_batch, self.units
        with s.use("compute"):
            def weights(unit):
                if unit.index in self.resident:
                    return self.resident[unit.index]["w"]
                return self.store.tile(self.store.weights, unit).to(dev)

            rope = self._rope(segments_BS, -(-inputs_BS.shape[0] // mb))
            embed_w = self.embed.view(weights(self.embed), self.embed.params[0])
            xs = [F.embedding(inputs_BS[i:i + mb].to(dev), embed_w) for i in range(0, inputs_BS.shape[0], mb)]
            for unit in units[1:-1]:
                params = bind(unit, weights(unit), requires_grad=False)
                xs = [self.layer_t(params, x, *rope[m]) for m, x in enumerate(xs)]
            head = units[-1]
            params = bind(head, weights(head), requires_grad=False)
            head_w = params.get("lm_head.weight", embed_w)
            total = sum(self.head_t.loss(params["norm.weight"], head_w, x, labels_BS[m * mb:(m + 1) * mb].to(dev),
                                         normalizer) for m, x in enumerate(xs))
            return float(total)

    def load_resident_from_host(self) -> None:
        """Refresh the resident units' GPU state from their host tiles (after new weights or a resumed state)."""
        store = self.store
        with self.streams.use("compute"):
            for index, r in self.resident.items():
                unit = self.units[index]
                r["w"].copy_(store.tile(store.weights, unit))
                if r["master"] is not None:
                    r["master"].copy_(store.tile(store.master, unit))
                r["exp_avg"].copy_(store.tile(store.exp_avg, unit))
                r["exp_avg_sq"].copy_(store.tile(store.exp_avg_sq, unit))
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)

    def sync_resident_to_host(self) -> None:
        """Write the resident units' state back to their host tiles (for reading or saving the model)."""
        store = self.store
        with self.streams.use("compute"):  # after the updates queued there; blocking copies wait for them
            for index, r in self.resident.items():
                unit = self.units[index]
                store.tile(store.weights, unit).copy_(r["w"])
                if r["master"] is not None:
                    store.tile(store.master, unit).copy_(r["master"])
                store.tile(store.exp_avg, unit).copy_(r["exp_avg"])
                store.tile(store.exp_avg_sq, unit).copy_(r["exp_avg_sq"])

    # ---- measurement -------------------------------------------------------------------------------
    def _record_step(self, host_t0: float, step_s: float, grad_norm: float, skipped: bool) -> None:
        s = self.streams
        timeline = s.resolve_timeline()
        host_end = host_t0 + step_s
        for unit, a, b in self.optimizer.spans:
            if b >= host_t0 - 1.0 and a <= host_end:
                timeline.append({"stream": "optim", "unit": unit, "phase": "opt",
                                 "start_ms": (a - host_t0) * 1e3, "end_ms": (b - host_t0) * 1e3})
        self.optimizer.spans = [sp for sp in self.optimizer.spans if sp[2] > host_end]
        compute_busy_ms = sum(t["end_ms"] - t["start_ms"] for t in timeline if t["stream"] == "compute")
        stall_ms = sum(b_ms - a_ms for a_ms, b_ms in
                       ((s.origin.elapsed_time(a), s.origin.elapsed_time(b)) for a, b in self.stall_events))
        self.timeline = timeline
        self.history.append({
            "step_s": step_s,
            "h2d_bytes": self.stats["h2d_bytes"],
            "d2h_bytes": self.stats["d2h_bytes"],
            "compute_busy_s": compute_busy_ms / 1e3,
            "gpu_idle_s": max(step_s - compute_busy_ms / 1e3, 0.0),
            "compute_wait_h2d_s": stall_ms / 1e3,
            "optim_wait_s": self.stats["optim_wait_s"],
            "grad_norm": grad_norm,
            "skipped": skipped,
        })
