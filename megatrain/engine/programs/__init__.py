"""The programs the schedule streams a model through, one per kind of model (ModelShape.kind), behind one interface.

A program is what the schedule (megatrain.engine.schedule) calls to compute: the stream, the slots, the activations'
places and the optimizer are the schedule's and the same for every kind. `handwritten` runs our own layers
(megatrain.models.handwritten) through one layer template; `generic` runs transformers' own modules
(megatrain.models.generic) as stateless templates, with their preamble's state and any state crossing layers. A new
kind of model is a new program here, named by its row in megatrain.models.kinds.KINDS (imported only when built).
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from megatrain.engine.layout import Unit
from megatrain.models.kinds import kind_of


class Program(Protocol):
    """What the schedule asks of a model's program.

    `contexts` once per step: what each micro-batch's layers need besides their input; `embed` and `embed_backward`
    for the embedding unit, `layer` for a decoder layer (forward and, with gradients on, its recompute, given what
    the step kept of its forward to replay: AuxLoss.routing; `hidden` its output as the next layer's input),
    `head_loss` for the head; `aux_loss` once per step: what the step adds to the cross-entropy and keeps of the
    layers' forwards (AuxLoss); `buffers` the model's untrained weights a checkpoint holds (loaded, exported and saved
    beside the streamed ones); `train` the mode dropout follows; `draws` the seeds it reseeds from (None: it draws
    nothing)."""

    head_weight_name: str  # the head unit's matrix; a tied head borrows the embedding's
    embed_weight_name: str
    draws: object | None

    @property
    def compiled(self) -> bool: ...

    @property
    def mlp_chunk_tokens(self) -> int: ...

    def train(self, mode: bool) -> None: ...

    def contexts(self, segments_BS: torch.Tensor | None, micro_batches: int) -> list: ...

    def embed(self, params: dict, tokens_BS: torch.Tensor, context) -> torch.Tensor: ...

    def embed_backward(self, grads: dict, params: dict, tokens_BS: torch.Tensor, dy_BSH: torch.Tensor, context,
                       cuda: bool) -> None: ...

    def layer(self, unit: Unit, params: dict, x_BSH: torch.Tensor, context, routing=None): ...

    def hidden(self, y): ...

    def aux_loss(self, tokens: list[torch.Tensor], world: int) -> AuxLoss: ...

    def head_loss(self, params: dict, h_BSH: torch.Tensor, labels_BS: torch.Tensor,
                  normalizer: int) -> torch.Tensor: ...

    def buffers(self) -> dict[str, torch.Tensor]: ...


class AuxLoss:
    """What a step adds to its cross-entropy and keeps of its layers' forwards, as the schedule asks its program
    (Program.aux_loss): nothing here, the generic program's and a dense hand-written model's; a hand-written MoE keeps
    each layer's routing to replay in its recompute (megatrain.engine.programs.handwritten.Routing) and adds its router
    load-balancing loss (LoadBalancing). Every call runs on the compute stream, where the schedule makes it."""

    def forward(self, outputs: list, count: bool, layer: int) -> list:
        """The micro-batches' outputs of layer `layer`'s forward (Program.layer's) as the next layer's inputs; count:
        whether to count what they carry (not in a regenerated input's second forward)."""
        return outputs

    def routing(self, layer: int, m: int, last: bool = False):
        """What layer `layer`'s forward of micro-batch m left for its recompute to replay (Program.layer's
        `routing`): nothing here; last: the layer's backward, after which it is dropped."""
        return None

    def add_loss(self, loss_sum: torch.Tensor, m: int) -> None:
        """Add micro-batch m's auxiliary loss to the step's summed loss (in place), once every layer's forward ran."""

    def grads(self, y, inputs: list[torch.Tensor], output_grad: torch.Tensor, m: int) -> tuple:
        """The gradients for `inputs` of micro-batch m's recomputed layer output y (Program.layer's, gradients on)
        for the gradient output_grad into its hidden states, the auxiliary loss's included."""
        # a parameter a micro-batch leaves unused (an expert of a list no token reached) gets zeros
        return torch.autograd.grad(y, inputs, output_grad, allow_unused=True, materialize_grads=True)


def build_program(config, device: torch.device) -> Program:
    """The program of config.model (an EngineConfig's), as its kind names it (megatrain.models.kinds)."""
    return named(kind_of(config.model).program)(config, device)


def named(where: str):
    """The attribute a kind names as "module:attribute", its module imported now."""
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)
