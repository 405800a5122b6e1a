"""The engine's program for a hand-written model (megatrain.models.handwritten): its layer template called with the
rotary tables and each attention type's mask, the embedding lookup, the chunked head."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatrain.engine.layout import Unit
from megatrain.engine.templates import HeadTemplate, LayerTemplate, add_rows
from megatrain.models import DecoderLayer, Transformer, rotary_tables
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
                                      mlp_chunk_tokens=config.options.mlp_chunk_tokens)
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

    def layer(self, unit: Unit, params: dict, x_BSH: torch.Tensor, context):
        """Decoder-layer unit `unit`'s output (with the load-balancing loss, also its routing: DecoderLayer)."""
        cos, sin, masks = context
        return self.template(params, x_BSH, cos, sin, masks[self.model.layer_type(unit.index - 1)])

    def head_loss(self, params: dict, h_BSH: torch.Tensor, labels_BS: torch.Tensor, normalizer: int) -> torch.Tensor:
        return self.head.loss(params["norm.weight"], params[self.head_weight_name], h_BSH, labels_BS, normalizer)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The model's weights that are not trained but a checkpoint holds, by name, where they live: none here."""
        return {}


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
