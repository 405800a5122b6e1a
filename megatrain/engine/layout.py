"""Flat per-unit tile layout of the model's parameters.

A *unit* is what streams to the GPU as one piece: the embedding, each decoder layer, and the head
(final norm + LM head; with tied embeddings the head streams only its norm and borrows the
embedding already on the GPU). Within a unit, parameters are laid out contiguously, weight-decayed
matrices first, then norms and biases, so the optimizer sees two flat regions per unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.models.shape import ModelShape
from megatrain.optim.groups import decays

ALIGN = 128  # elements; keeps every unit's tile start 256-byte aligned in bf16


@dataclass(frozen=True)
class ParamSlot:
    name: str  # full module name, e.g. 'layers.3.mlp.up_proj.weight'
    local: str  # name inside the unit's template, e.g. 'mlp.up_proj.weight'
    shape: tuple[int, ...]
    offset: int  # within the unit tile
    decays: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Unit:
    index: int
    kind: str  # 'embed' | 'layer' | 'head'
    params: tuple[ParamSlot, ...]
    offset: int  # of the tile within the store's flat tensors
    numel: int
    decay_numel: int  # the first decay_numel elements take weight decay

    def view(self, flat_unit: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
        return flat_unit[slot.offset:slot.offset + slot.numel].view(slot.shape)


def _unit_params(prefix: str, named_shapes: list[tuple[str, tuple[int, ...]]]):
    """(slots with decayed matrices first, unit numel, decayed numel)."""
    ordered = [p for p in named_shapes if decays(*p)] + [p for p in named_shapes if not decays(*p)]
    slots, off, decay = [], 0, 0
    for local, shape in ordered:
        slot = ParamSlot(prefix + local, local, shape, off, decays(local, shape))
        slots.append(slot)
        off += slot.numel
        if slot.decays:
            decay = off
    return tuple(slots), off, decay


def build_units(cfg: ModelShape) -> list[Unit]:
    """Units in forward order: embed, layers 0..L-1, head (the model's named shapes: cfg.unit_shapes)."""
    units, offset = [], 0
    for index, spec in enumerate(cfg.unit_shapes()):
        params, numel, decay = _unit_params(spec.prefix, list(spec.shapes))
        units.append(Unit(index, spec.kind, params, offset, numel, decay))
        offset += -(-numel // ALIGN) * ALIGN
    return units


def total_numel(units: list[Unit]) -> int:
    last = units[-1]
    return last.offset + -(-last.numel // ALIGN) * ALIGN
