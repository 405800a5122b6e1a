"""The per-step stream schedule of the streaming engine.

Shape legend: B micro-batch, S sequence, H hidden, V vocab. Units: 0 embed, 1..L layers, L+1 head.

Per step the GPU *uses* units in this order (engine/uses.py): layers 1..L forward, the head (forward, loss and
backward fused, so its weights cross PCIe once), layers L..1 backward. Two weight slots hold
consecutive uses; while use k computes, the weights of use k+1 stream into the other slot (H2D
stream). A slot that still holds the unit a use needs is reused without a copy (layer L after the
head; with one slot, the option weight_slots=1, use k+1's weights load only once use k has run). Backward recomputes
each layer from its saved input with grad enabled on views of the slot,
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
them while the host optimizer updates the streamed units behind it. With update_delay=1 every unit streams and
each step's update (of the previous step's gradient) runs on the host behind the whole next step, which waits for it
only at its end (engine/host_optimizer.py).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import torch

from megatrain.engine.activations import ActivationStore
from megatrain.engine.config import EngineConfig
from megatrain.engine.distributed import Ranks
from megatrain.engine.host_optimizer import HostOptimizer, torch_adamw_unit
from megatrain.engine.layout import Unit
from megatrain.engine.programs import AuxLoss, Program, build_program
from megatrain.engine.resident import ResidentUnit
from megatrain.engine.store import OPT_CHUNK, HostStore
from megatrain.engine.streams import StreamSet
from megatrain.engine.templates import bind
from megatrain.engine.uses import Use, use_order
from megatrain.optim.host_adamw import FlatAdamW


@dataclass
class StepState:
    """What one step carries from phase to phase; a new one every step."""

    stats: dict  # h2d_bytes, d2h_bytes, optim_wait_s of the step (the activation store adds its transfers)
    tokens: list[torch.Tensor]  # per micro-batch, on the device
    labels: list[torch.Tensor]
    contexts: list  # per micro-batch, what its layers need besides their input (the program's contexts)
    embed_params: dict  # views of the embedding unit's buffer (a tied head reads its matrix too)
    grad_ready: list  # per unit: the D2H event after which its gradient is on the host
    aux: AuxLoss  # what the step adds to the cross-entropy (its program's aux_loss: a MoE's load-balancing loss)
    weights_ready: dict = field(default_factory=dict)  # use index -> H2D event: its weights are in its slot
    stall_events: list = field(default_factory=list)  # (before, after) compute events around each wait for weights
    grad_sumsq: torch.Tensor | None = None  # the squared global gradient norm, summed on the device
    loss_sum: torch.Tensor | None = None
    output_grads: list = field(default_factory=list)  # per micro-batch: the gradient into the current layer's output
    grad_slot: int = 0  # the gradient slot the next streamed head or backward use accumulates in


class Schedule:
    def __init__(self, config: EngineConfig, store: HostStore, optimizer: HostOptimizer, streams: StreamSet,
                 device: torch.device, resident_units: list[int], offloaded_layers: int, recomputed_inputs: int,
                 ranks: Ranks):
        model = config.model
        self.config, self.store, self.optimizer, self.streams, self.device = config, store, optimizer, streams, device
        # this process's place among the ranks (engine/distributed.py; one process started alone is the one rank):
        # gradients summed across them, each offloads its shard
        self.ranks = ranks
        self.model = model
        dt = store.compute_dtype
        self.units = store.units
        self.embed, self.head = self.units[0], self.units[-1]
        slot_numel = max(u.numel for u in self.units[1:])
        self.weight_slots = [torch.empty(slot_numel, dtype=dt, device=device)
                             for _ in range(config.options.weight_slots)]
        self.embed_buf = torch.empty(self.embed.numel, dtype=dt, device=device)
        self.grad_slots = [torch.empty(slot_numel, dtype=torch.float32, device=device) for _ in range(2)]
        self.embed_grad = torch.empty(self.embed.numel, dtype=torch.float32, device=device)
        grad_dt = store.grads.dtype  # the streamed gradients leave through staging in their own dtype
        self.grad_staging = None if grad_dt == torch.float32 else \
            [torch.empty(slot_numel, dtype=grad_dt, device=device) for _ in range(2)]
        self.program: Program = build_program(config, device)
        self.draws = self.program.draws  # dropout's seeds (megatrain.models.draws; None: the model draws nothing)
        if self.draws is not None:  # under torchrun: this rank's rows come after the lower ranks' micro-batches
            self.draws.first_micro_batch = ranks.rank * config.micro_batches
        self.acts = ActivationStore(streams, device, offloaded_layers, model.num_layers, config.micro_batches,
                                    (config.micro_batch, config.seq, model.hidden_size), dt, recomputed_inputs)
        self.uses = use_order(model.num_layers, frozenset(resident_units), self.acts.recomputed,
                              len(self.weight_slots))
        self.slot_free = [None] * len(self.weight_slots)  # compute-stream event: last use of the weight slot finished
        self.grad_slot_free = [None, None]  # d2h-stream event: last gradient copied out of the gradient slot
        self.embed_free = None  # d2h-stream event: the embedding gradient left the embedding buffer
        self.resident: dict[int, ResidentUnit] = {}
        for u in resident_units:  # a resident embedding keeps its streaming buffers
            buffers = (self.embed_buf, self.embed_grad) if u == 0 else (None, None)
            self.resident[u] = ResidentUnit.from_host(store, self.units[u], device, *buffers)
        self.resident_adamw = FlatAdamW(config.optim)
        # bf16 mode updates resident weights in fp32 one chunk at a time
        self.resident_scratch = torch.empty(min(OPT_CHUNK, max(self.units[u].numel for u in resident_units)),
                                            dtype=torch.float32, device=device) \
            if resident_units and store.master is None and dt != torch.float32 else None
        self.weight_elem_bytes = torch.empty((), dtype=dt).element_size()
        self.history: list[dict] = []
        self.timeline: list[dict] = []
        self._late_optim_spans: list = []  # host updates still running when the last step ended: in the next too
        self.skipped_steps = 0  # steps whose gradient norm was not finite: no update applied
        self.lr = config.optim.lr  # of the next update (a learning-rate schedule sets it before each step)
        # update_delay: from which update on each applies the previous step's gradient (None: every update exact)
        self.delay_from = config.options.update_delay_warmup if config.options.update_delay else None
        self.training_forward = config.options.forward_graph == "training"
        if streams.cuda:  # the program's tables and resident copies above ran on the default stream, which the
            torch.cuda.synchronize(device)  # side streams do not wait for

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: int,
             segments_BS: torch.Tensor | None = None) -> float:
        """One optimizer step; returns the summed token loss over `normalizer`."""
        host_t0 = time.perf_counter()
        step = self._begin(inputs_BS, labels_BS, segments_BS)
        self._embed_forward(step)
        for k, use in enumerate(self.uses):  # the layers forward, the head, the layers backward
            self._run_use(step, k, use, normalizer)
        self._embed_backward(step)
        total_norm, loss = self._read_norm_and_loss(step)
        max_norm = self.config.optim.max_grad_norm
        clip = min(1.0, max_norm / (total_norm + 1e-6)) if max_norm > 0 else 1.0
        skip = not math.isfinite(total_norm)  # a NaN/inf gradient: leave weights and moments as they are
        if self.resident and not skip:
            self._update_resident_units(clip)
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)
        if self.delay_from is not None:  # a delayed update ran behind this whole step: the next step streams its result
            step.stats["optim_wait_s"] += self._land_delayed_update()
        step_s = time.perf_counter() - host_t0
        if skip:
            self.skipped_steps += 1
            warnings.warn(f"step {len(self.history)}: gradient norm is {total_norm}; update skipped "
                          f"({self.skipped_steps} skipped so far)", stacklevel=2)
        else:
            delayed = self.delay_from is not None and self.optimizer.step_count >= self.delay_from
            if delayed:  # this step's gradients wait a step on the host; the next step writes the other copy
                self.store.hand_over_grads()
            self.optimizer.submit(clip, step.grad_ready, self.lr, delayed)
        self._record_step(step, host_t0, step_s, total_norm, skip)
        if self.draws is not None:
            self.draws.step += 1
        return loss

    def _land_delayed_update(self) -> float:
        """update_delay: wait for the update submitted a step ago (the seconds waited: the optimizer's exposed time)
        and, when it was delayed, make the weights it wrote the ones the next step streams (an exact one, of the
        warm-up, landed in place before this step streamed them)."""
        t0 = time.perf_counter()
        self.optimizer.flush()
        if self.store.ahead:
            self.store.advance_weights()
        return time.perf_counter() - t0

    def _begin(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
               segments_BS: torch.Tensor | None) -> StepState:
        """The step's state: its counters, and each micro-batch's tokens, labels and context on the compute stream."""
        s, dev, mb = self.streams, self.device, self.config.micro_batch
        s.begin_step()
        stats = {"h2d_bytes": 0, "d2h_bytes": 0, "optim_wait_s": 0.0}
        self.acts.stats = stats
        with s.use("compute"):
            tokens = [inputs_BS[i:i + mb].to(dev, non_blocking=True) for i in range(0, inputs_BS.shape[0], mb)]
            labels = [labels_BS[i:i + mb].to(dev, non_blocking=True) for i in range(0, labels_BS.shape[0], mb)]
            contexts = self.program.contexts(segments_BS, len(tokens))
            aux = self.program.aux_loss(tokens, self.ranks.world)
        return StepState(stats=stats, tokens=tokens, labels=labels, contexts=contexts,
                         embed_params=bind(self.embed, self.embed_buf, requires_grad=False),
                         grad_ready=[None] * len(self.units), aux=aux)

    def _embed_forward(self, step: StepState) -> None:
        """The embedding's weights and the first use's start loading, then the embedding's forward."""
        s = self.streams
        embed_ready = None if 0 in self.resident else self._load(step, self.embed, self.embed_buf, self.embed_free)
        self._prefetch(step, 0)
        with s.use("compute"):
            s.wait("compute", embed_ready)
            s.wait("compute", self.embed_free)  # embed_grad was the D2H source in fp32 runs
            start = s.record("compute")
            self.acts.put(0, [self.program.embed(step.embed_params, t, c) for t, c in zip(step.tokens, step.contexts,
                                                                                           strict=True)])
            self.embed_grad.zero_()
            step.grad_sumsq = torch.zeros((), dtype=torch.float32, device=self.device)
            step.loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
            s.span("compute", 0, "fwd", start, s.record("compute"))

    def _run_use(self, step: StepState, k: int, use: Use, normalizer: int) -> None:
        """Use k on the compute stream once its weights are in, while use k+1's weights load into the other slot."""
        s = self.streams
        ahead = use.slot is not None and len(self.weight_slots) > 1
        if ahead:  # prefetch the next use's weights into the other slot while this one computes
            self._prefetch(step, k + 1)
        unit = self.units[use.unit]
        with s.use("compute"):
            if k in step.weights_ready:
                before = s.record("compute")
                s.wait("compute", step.weights_ready[k])
                after = s.record("compute")
                step.stall_events.append((before, after))
            start = s.record("compute")
            weights = self.resident[use.unit].weights if use.slot is None else self.weight_slots[use.slot]
            if use.phase in ("fwd", "refwd"):
                self._forward(step, unit, weights, regenerate=use.phase == "refwd")
            elif use.phase == "head":
                self._head(step, unit, weights, normalizer)
            else:
                self._backward(step, unit, weights)
            if use.phase in ("head", "bwd") and use.slot is not None:  # streamed ones fill alternating grad slots
                step.grad_slot = 1 - step.grad_slot
            end = s.record("compute")
            s.span("compute", use.unit, use.phase, start, end)
            if use.slot is not None:
                self.slot_free[use.slot] = end
        if not ahead:  # resident: queue its compute first, since _load may wait for the host optimizer; one slot:
            self._prefetch(step, k + 1)  # the next load waits for this use (slot_free)

    def _read_norm_and_loss(self, step: StepState) -> tuple[float, float]:
        """The global gradient norm and the summed loss: the step's one synchronisation. The read must run on the
        compute stream: the default stream does not wait for the side streams, so reading there could take the sum
        before the last backward and the embedding's gradient were added to it."""
        with self.streams.use("compute"):
            norm_sq_and_loss = torch.stack([step.grad_sumsq, step.loss_sum])
            self.ranks.sum_norm_and_loss(norm_sq_and_loss)  # each rank's shards of the norm, its micro-batches' loss
            norm_sq, loss = norm_sq_and_loss.tolist()
        return math.sqrt(norm_sq), loss

    def _update_resident_units(self, clip: float) -> None:
        """AdamW of each resident unit on the compute stream, before the next step's forward reads it."""
        s = self.streams
        with s.use("compute"):
            for index, r in self.resident.items():
                start = s.record("compute")
                torch_adamw_unit(self.resident_adamw, self.units[index], r.weights, r.grad, r.master, r.moments,
                                 clip, self.config.optim.weight_decay, None, self.resident_scratch, self.lr)
                s.span("compute", index, "opt", start, s.record("compute"))

    # ---- transfers -------------------------------------------------------------------------------
    def _prefetch(self, step: StepState, k: int) -> None:
        """Start loading use k's weights into its slot, if it needs a load."""
        if k < len(self.uses) and self.uses[k].load:
            use = self.uses[k]
            step.weights_ready[k] = self._load(step, self.units[use.unit], self.weight_slots[use.slot],
                                               self.slot_free[use.slot])

    def _load(self, step: StepState, unit: Unit, dst: torch.Tensor, after) -> object:
        """Stream unit's weights into dst on the H2D stream once `after` (last reader of dst) is done (and, unless the
        pending update is a delayed one that writes the next step's copy, once the host optimizer has updated them)."""
        if not self.store.ahead:
            step.stats["optim_wait_s"] += self.optimizer.wait(unit.index)
        s = self.streams
        s.wait("h2d", after)
        start = s.record("h2d")
        with s.use("h2d"):
            dst[:unit.numel].copy_(self.store.tile(self.store.weights, unit), non_blocking=True)
        end = s.record("h2d")
        s.span("h2d", unit.index, "load", start, end)
        step.stats["h2d_bytes"] += unit.numel * self.weight_elem_bytes
        return end

    def _offload(self, step: StepState, unit: Unit, src: torch.Tensor, grad_slot: int | None) -> object:
        """Copy unit's gradient from src to the host tile on the D2H stream; returns its done event."""
        s = self.streams
        ready = s.record("compute")
        s.wait("d2h", ready)
        start = s.record("d2h")
        dst = self.store.tile(self.store.grads, unit)[slice(*self.ranks.shard(unit.numel))]  # this rank's shard
        with s.use("d2h"):
            dst.copy_(src[:dst.numel()], non_blocking=True)
        end = s.record("d2h")
        s.span("d2h", unit.index, "offload", start, end)
        step.stats["d2h_bytes"] += dst.numel() * src.element_size()
        step.grad_ready[unit.index] = end
        if grad_slot is not None:
            self.grad_slot_free[grad_slot] = end
        return end

    # ---- the uses --------------------------------------------------------------------------------
    def _forward(self, step: StepState, unit: Unit, weights: torch.Tensor, regenerate: bool = False) -> None:
        """Layer u reads activations u-1 and writes activations u. regenerate: a recomputed input's second forward
        in backward ('refwd'), whose input stays on the GPU for that layer's own backward."""
        layer = unit.index
        if self.training_forward and not regenerate:  # the recompute's graph: its inputs as the recompute's
            params = bind(unit, weights, requires_grad=True)
            with torch.enable_grad():
                outputs = [_detached(self.program.layer(unit, params, x.detach().requires_grad_(), step.contexts[m]))
                           for m, x in enumerate(self.acts.gpu[layer - 1])]
        else:
            params = bind(unit, weights, requires_grad=False)
            with torch.no_grad():  # a regenerated input's second forward replays its first's routing
                outputs = [self.program.layer(unit, params, x, step.contexts[m], step.aux.routing(layer, m))
                           for m, x in enumerate(self.acts.gpu[layer - 1])]
        self.acts.put(layer, step.aux.forward(outputs, count=not regenerate, layer=layer))
        if not regenerate:
            self.acts.consumed(layer - 1)

    def _accumulate(self, grad_acc: torch.Tensor, unit: Unit, names: list[str], grads) -> None:
        views = bind(unit, grad_acc, requires_grad=False)
        torch._foreach_add_([views[n] for n in names], list(grads))

    def _grad_buffer(self, unit: Unit, grad_slot: int) -> torch.Tensor:
        """The zeroed fp32 buffer this use accumulates its gradient in: the unit's own when resident, else
        gradient slot `grad_slot` once its last gradient has left for the host."""
        if unit.index in self.resident:
            return self.resident[unit.index].grad.zero_()
        self.streams.wait("compute", self.grad_slot_free[grad_slot])
        return self.grad_slots[grad_slot][:unit.numel].zero_()

    def _head(self, step: StepState, unit: Unit, weights: torch.Tensor, normalizer: int) -> None:
        """The final norm, the chunked loss and their backward, micro-batch by micro-batch."""
        grad_acc = self._grad_buffer(unit, step.grad_slot)
        params = bind(unit, weights, requires_grad=True)
        head_w = self.program.head_weight_name
        tied = head_w not in params
        own = list(params)  # the unit's own; a tied head's matrix is the embedding's
        if tied:
            params[head_w] = step.embed_params[self.program.embed_weight_name].detach().requires_grad_()
        hidden = self.acts.take(self.model.num_layers)
        self.acts.prefetch(self.model.num_layers - 1)  # the first backward layer's input
        for m, h in enumerate(hidden):
            h = h.detach().requires_grad_()
            with torch.enable_grad():
                loss = self.program.head_loss(params, h, step.labels[m], normalizer)
                dh, *grads = torch.autograd.grad(loss, [h, *params.values()])
            step.output_grads.append(dh)
            step.loss_sum += loss.detach()
            step.aux.add_loss(step.loss_sum, m)
            self._accumulate(grad_acc, unit, own, grads[:len(own)])
            if tied:
                bind(self.embed, self.embed_grad, requires_grad=False)[self.program.embed_weight_name].add_(grads[-1])
            hidden[m] = None
        self._finish_grads(step, unit, grad_acc, step.grad_slot)

    def _backward(self, step: StepState, unit: Unit, weights: torch.Tensor) -> None:
        """A layer recomputed from its saved input and backpropagated, micro-batch by micro-batch."""
        grad_acc = self._grad_buffer(unit, step.grad_slot)
        params = bind(unit, weights, requires_grad=True)
        names, tensors = list(params), list(params.values())
        inputs = self.acts.take(unit.index - 1)  # this layer's inputs; its outputs were consumed already
        self.acts.prefetch(unit.index - 2)  # the next layer's, streaming in while this backward runs
        for m, x in enumerate(inputs):
            x = x.detach().requires_grad_()
            # the forward's routing replayed: a gradient of the routing the loss saw (the forward's own graph, under
            # forward_graph=training, routes as the forward did)
            routing = step.aux.routing(unit.index, m, last=True)
            with torch.enable_grad():
                y = self.program.layer(unit, params, x, step.contexts[m], None if self.training_forward else routing)
                grads = step.aux.grads(y, [x, *tensors], step.output_grads[m], m)
            step.output_grads[m] = grads[0]
            self._accumulate(grad_acc, unit, names, grads[1:])
            inputs[m] = None
        self._finish_grads(step, unit, grad_acc, step.grad_slot)

    def _finish_grads(self, step: StepState, unit: Unit, grad_acc: torch.Tensor, grad_slot: int) -> None:
        grad_acc = self._summed(unit, grad_acc)
        step.grad_sumsq += torch.linalg.vector_norm(grad_acc).square()
        if unit.index in self.resident:  # stays on the GPU: updated there once the norm is known
            return
        src = grad_acc
        if self.grad_staging is not None:
            src = self.grad_staging[grad_slot][:grad_acc.numel()]
            src.copy_(grad_acc)
        self._offload(step, unit, src, grad_slot)

    def _summed(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        """The gradient this rank counts in the norm and offloads: all of `grad` in one process; over several ranks,
        its shard of the sum across them (a resident unit's is summed whole: every rank updates it alike)."""
        return self.ranks.sum_gradient(grad, replicated=unit.index in self.resident)

    def _embed_backward(self, step: StepState) -> None:
        s = self.streams
        with s.use("compute"):
            start = s.record("compute")
            grads = bind(self.embed, self.embed_grad, requires_grad=False)
            for t, dy, c in zip(step.tokens, step.output_grads, step.contexts, strict=True):
                self.program.embed_backward(grads, step.embed_params, t, dy, c, s.cuda)
            step.output_grads = []
            grad = self._summed(self.embed, self.embed_grad)
            step.grad_sumsq += torch.linalg.vector_norm(grad).square()
            if 0 not in self.resident:  # a resident one stays on the GPU: updated there once the norm is known
                src = grad
                if self.grad_staging is not None:  # the embedding weights are not needed again this step: stage
                    src = self.embed_buf[:grad.numel()].copy_(grad)  # in place
                self.embed_free = self._offload(step, self.embed, src, None)
            s.span("compute", 0, "bwd", start, s.record("compute"))

    @torch.no_grad()
    def evaluate(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: int,
                 segments_BS: torch.Tensor | None = None) -> float:
        """The summed token loss over `normalizer`, without gradients or an update. Occasional (held-out loss), so
        simple: after every pending host update (a delayed one too: the weights with every gradient so far applied,
        as an export has them), on the compute stream, each streamed unit's weights are copied to
        a temporary GPU buffer in turn (resident units are read where they live) and every micro-batch passes it."""
        self.optimizer.flush()
        self.program.train(False)  # no dropout or jitter in a held-out loss
        try:
            return self._evaluate(inputs_BS, labels_BS, normalizer, segments_BS)
        finally:
            self.program.train(True)

    @torch.no_grad()
    def _evaluate(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, normalizer: int,
                  segments_BS: torch.Tensor | None) -> float:
        s, dev, mb, units = self.streams, self.device, self.config.micro_batch, self.units
        with s.use("compute"):
            def weights(unit):
                if unit.index in self.resident:
                    return self.resident[unit.index].weights
                return self.store.tile(self.store.latest_weights, unit).to(dev)

            contexts = self.program.contexts(segments_BS, -(-inputs_BS.shape[0] // mb))
            embed = bind(self.embed, weights(self.embed), requires_grad=False)
            xs = [self.program.embed(embed, inputs_BS[i:i + mb].to(dev), contexts[i // mb])
                  for i in range(0, inputs_BS.shape[0], mb)]
            for unit in units[1:-1]:
                params = bind(unit, weights(unit), requires_grad=False)
                xs = [self.program.layer(unit, params, x, contexts[m]) for m, x in enumerate(xs)]
                xs = [self.program.hidden(x) for x in xs]  # the held-out loss is the cross-entropy alone
            head = units[-1]
            params = bind(head, weights(head), requires_grad=False)
            params.setdefault(self.program.head_weight_name, embed[self.program.embed_weight_name])
            total = sum(self.program.head_loss(params, x, labels_BS[m * mb:(m + 1) * mb].to(dev), normalizer)
                        for m, x in enumerate(xs))
            return float(total)

    def load_resident_from_host(self) -> None:
        """Refresh the resident units' GPU state from their host tiles (after new weights or a resumed state)."""
        with self.streams.use("compute"):
            for index, r in self.resident.items():
                r.load_from_host(self.store, self.units[index])
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)

    def sync_resident_to_host(self) -> None:
        """Write the resident units' state back to their host tiles (for reading or saving the model)."""
        with self.streams.use("compute"):  # after the updates queued there; blocking copies wait for them
            for index, r in self.resident.items():
                r.sync_to_host(self.store, self.units[index])

    # ---- measurement -------------------------------------------------------------------------------
    def _record_step(self, step: StepState, host_t0: float, step_s: float, grad_norm: float, skipped: bool) -> None:
        s = self.streams
        timeline = s.resolve_timeline()
        host_end = host_t0 + step_s
        spans = self._late_optim_spans + self.optimizer.take_spans()
        for unit, a, b in spans:
            if b >= host_t0 - 1.0 and a <= host_end:
                timeline.append({"stream": "optim", "unit": unit, "phase": "opt",
                                 "start_ms": (a - host_t0) * 1e3, "end_ms": (b - host_t0) * 1e3})
        self._late_optim_spans = [sp for sp in spans if sp[2] > host_end]
        compute_busy_ms = sum(t["end_ms"] - t["start_ms"] for t in timeline if t["stream"] == "compute")
        stall_ms = sum(b_ms - a_ms for a_ms, b_ms in
                       ((s.origin.elapsed_time(a), s.origin.elapsed_time(b)) for a, b in step.stall_events))
        self.timeline = timeline
        self.history.append({
            "step_s": step_s,
            "h2d_bytes": step.stats["h2d_bytes"],
            "d2h_bytes": step.stats["d2h_bytes"],
            "compute_busy_s": compute_busy_ms / 1e3,
            "gpu_idle_s": max(step_s - compute_busy_ms / 1e3, 0.0),
            "compute_wait_h2d_s": stall_ms / 1e3,
            "optim_wait_s": step.stats["optim_wait_s"],
            "grad_norm": grad_norm,
            "skipped": skipped,
        })


def _detached(y):
    """A layer's output (a tensor, or a mixture's tuple of them) cut from the autograd graph its forward made."""
    return tuple(t.detach() for t in y) if isinstance(y, tuple) else y.detach()
