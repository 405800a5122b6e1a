"""The engine's program for a hand-written model (megatrain.models.handwritten): its layer template called with the
rotary tables and each attention type's mask, the embedding lookup, the chunked head, and a mixture of experts' router
load-balancing loss (LoadBalancing)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatrain.engine.layout import Unit
from megatrain.engine.programs import AuxLoss
from megatrain.engine.templates import HeadTemplate, LayerTemplate, add_rows
from megatrain.models import DecoderLayer, Transformer, rotary_tables
from megatrain.models.handwritten.config import ModelConfig
from megatrain.models.handwritten.moe import load_balancing_grad, load_balancing_loss
from megatrain.models.masks import rope_and_masks


class HandWrittenProgram:
    """The hand-written model (megatrain.models.Transformer) as the schedule runs it: the embedding lookup, one layer
    template called with the rotary tables and its attention type's mask, the chunked head. What the schedule asks of
    it is megatrain.engine.programs.Program's; megatrain.engine.programs.generic is the other program."""

    head_weight_name = "lm_head.weight"  # the head unit's matrix; a tied head borrows the embedding's
    embed_weight_name = "embed_tokens.weight"

    def __init__(self, config, device: torch.device):
        model = config.model
        self.model, self.device, self.micro_batch = model, device, config.micro_batch
        self.template = LayerTemplate(model, compile_layer=config.compile,
                                      mlp_chunk_tokens=config.options.mlp_chunk_tokens, routing=True)
        self.head = HeadTemplate(model)
        self.cos, self.sin = rotary_tables(model, config.seq, device, config.torch_dtype)

    draws = None  # the hand-written model draws nothing (no dropout): nothing to reseed

    @property
    def compiled(self) -> bool:
        return self.template.compiled

    @property
    def mlp_chunk_tokens(self) -> int:
        return self.template.module.mlp.chunk_tokens

    def train(self, mode: bool) -> None:
        """Nothing to switch: the hand-written model computes alike in train and eval mode."""

    def contexts(self, segments_BS: torch.Tensor | None, micro_batches: int) -> list[tuple]:
        """(cos, sin, {layer type: mask}) of each micro-batch: the shared tables and the model's masks, or for packed
        rows per-document positions and document masks (models.masks.rope_and_masks); on the compute stream."""
        model, mb = self.model, self.micro_batch

        def rope(segments):
            return rope_and_masks(self.cos, self.sin, segments, self.device, model.sliding_window, model.layer_types)

        if segments_BS is None:
            return [rope(None)] * micro_batches
        return [rope(segments_BS[i:i + mb].to(self.device)) for i in range(0, segments_BS.shape[0], mb)]

    def embed(self, params: dict, tokens_BS: torch.Tensor, context) -> torch.Tensor:
        return F.embedding(tokens_BS, params[self.embed_weight_name])

    def embed_backward(self, grads: dict, params: dict, tokens_BS: torch.Tensor, dy_BSH: torch.Tensor, context,
                       cuda: bool) -> None:
        """Add the embedding's gradient for output gradient dy_BSH into `grads` (fp32 views of the unit)."""
        add_rows(grads[self.embed_weight_name], tokens_BS.flatten(), dy_BSH.flatten(0, 1), cuda)

    def layer(self, unit: Unit, params: dict, x_BSH: torch.Tensor, context, routing=None):
        """Decoder-layer unit `unit`'s output; a mixture of experts' with its routing last (with the load-balancing
        loss, its counts before it: DecoderLayer), `routing` a forward's replayed (LayerTemplate)."""
        cos, sin, masks = context
        return self.template(params, x_BSH, cos, sin, masks[self.model.layer_type(unit.index - 1)], routing)

    def hidden(self, y):
        """A layer's output as the next layer's input: its hidden states, without the routing a mixture of experts'
        layer reports beside them."""
        return y[0] if self.model.is_moe else y

    def aux_loss(self, tokens: list[torch.Tensor], world: int) -> AuxLoss:
        """What the step keeps beside the layers (on the compute stream): a mixture of experts' routing, to replay in
        recompute, and its load-balancing loss where the model has one; nothing for a dense model."""
        if self.model.router_stats:
            return LoadBalancing(self.model, tokens, world, self.device)
        return Routing() if self.model.is_moe else AuxLoss()

    def head_loss(self, params: dict, h_BSH: torch.Tensor, labels_BS: torch.Tensor, normalizer: int) -> torch.Tensor:
        return self.head.loss(params["norm.weight"], params[self.head_weight_name], h_BSH, labels_BS, normalizer)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's weights that are not trained but a checkpoint holds, by name, where they live: none here."""
        return {}


class Routing(AuxLoss):
    """A mixture of experts' routing over a step: the experts each token of each micro-batch went to in each layer's
    forward, replayed by that layer's recompute in backward (and by a regenerated input's second forward), so that
    the gradient is of the routing the loss saw (megatrain.models.handwritten.moe.route). Dropped as each layer's
    backward takes it; K int64 per token and layer (ModelConfig.replayed_bytes_per_token)."""

    def __init__(self):
        self.experts: dict[tuple[int, int], torch.Tensor] = {}

    def forward(self, outputs: list, count: bool, layer: int) -> list:
        """The hidden states of each micro-batch's (hidden states, ..., experts), their routing kept."""
        for m, out in enumerate(outputs):
            self.experts[layer, m] = out[-1]
        return [out[0] for out in outputs]

    def routing(self, layer: int, m: int, last: bool = False):
        return self.experts.pop((layer, m), None) if last else self.experts.get((layer, m))

    def grads(self, y, inputs: list[torch.Tensor], output_grad: torch.Tensor, m: int) -> tuple:
        return super().grads(y[0], inputs, output_grad, m)


class LoadBalancing(Routing):
    """A step's router load-balancing loss (megatrain.models.handwritten.moe.load_balancing_loss), which couples the
    layers: each micro-batch's tokens routed to each expert and router probability sums, added up over the layers in
    forward; its gradient into a layer's probability sums, known once every layer's forward has run, backpropagated
    beside the output gradient when the layer is recomputed in backward (with the forward's routing: Routing)."""

    def __init__(self, model: ModelConfig, tokens: list[torch.Tensor], world: int, device: torch.device):
        """tokens: the step's micro-batches on this rank; world: the ranks, whose sequences share the weight."""
        super().__init__()
        self.model, self.tokens, self.world = model, tokens, world
        self.routed, self.probsum = ([torch.zeros(model.num_experts, device=device) for _ in tokens] for _ in range(2))

    def forward(self, outputs: list, count: bool, layer: int) -> list:
        """The hidden states of each micro-batch's (hidden states, routed, probability sums, experts), its routing
        counted and kept."""
        if count:  # a regenerated input's routing was counted in its first forward
            for m, (_, routed, probsum, _) in enumerate(outputs):
                self.routed[m] += routed
                self.probsum[m] += probsum
        return super().forward(outputs, count, layer)

    def add_loss(self, loss_sum: torch.Tensor, m: int) -> None:
        loss_sum += self._weight(m) * load_balancing_loss(self.routed[m], self.probsum[m], self._rows(m))

    def grads(self, y, inputs: list[torch.Tensor], output_grad: torch.Tensor, m: int) -> tuple:
        """Its router's share of the load-balancing loss backpropagated beside the hidden states' gradient."""
        aux_grad = load_balancing_grad(self.routed[m], self._rows(m), self._weight(m))
        return torch.autograd.grad([y[0], y[2]], inputs, [output_grad, aux_grad])

    def _rows(self, m: int) -> int:
        """Micro-batch m's (layer, token) rows of the load-balancing loss."""
        return self.model.num_layers * self.tokens[m].numel()

    def _weight(self, m: int) -> float:
        """The load-balancing loss's weight for micro-batch m: the coefficient x its share of the step's sequences, all
        ranks' (as megatrain.systems.common.aux_weight)."""
        rows = sum(t.shape[0] for t in self.tokens) * self.world
        return self.model.router_aux_loss_coef * self.tokens[m].shape[0] / rows


def compile_module_layers(model: Transformer) -> list[LayerTemplate]:
    """Every decoder layer of `model` run through one compiled layer template with its own parameters (a system that
    owns the module compiles as the engine does: DeepSpeed ZeRO-3); returns the template."""
    template = LayerTemplate(model.cfg, compile_layer=True)
    for layer in model.layers:
        layer.forward = functools.partial(_forward_through, template, layer)
    return [template]


def _forward_through(template: LayerTemplate, layer: DecoderLayer, x_BSH: torch.Tensor, cos_SD: torch.Tensor,
                     sin_SD: torch.Tensor, mask_B1SS=None) -> torch.Tensor:
    """`layer`'s forward: the template with the layer's own (under ZeRO-3: gathered) parameters."""
    return template(dict(layer.named_parameters()), x_BSH, cos_SD, sin_SD, mask_B1SS)
