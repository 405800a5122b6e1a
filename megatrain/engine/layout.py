"""Flat per-unit tile layout of the model's parameters.

A *unit* is what streams to the GPU as one piece: the embedding, each decoder layer, and the head
(final norm + LM head; with tied embeddings the head streams only its norm and borrows the
embedding already on the GPU). Within a unit, parameters are laid out weight-decayed matrices first,
then norms and biases, so the optimizer sees two flat regions per unit; each starts on a multiple of
SLOT_ALIGN elements, the few elements before it left as zero padding.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from megatrain.models.shape import ModelShape
from megatrain.optim.groups import decays

ALIGN = 128  # elements; keeps every unit's tile start 256-byte aligned in bf16
# elements: every tensor starts 16-byte aligned in every tile, the int8 moments' 1-byte elements too. Kernels that
# load 16 bytes at a time need it: torch._grouped_mm refused Kimi-Linear's experts 8 bytes off, after a 4-element A_log
SLOT_ALIGN = 16


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

    @property
    def gaps(self) -> list[tuple[int, int]]:
        """[start, end) of the padding before each tensor that does not follow the previous one back to back."""
        ends = [0] + [slot.offset + slot.numel for slot in self.params[:-1]]
        return [(end, slot.offset) for end, slot in zip(ends, self.params, strict=True) if slot.offset > end]


def _unit_params(prefix: str, named_shapes: list[tuple[str, tuple[int, ...]]]):
    """(slots with decayed matrices first, unit numel, decayed numel)."""
    ordered = [p for p in named_shapes if decays(*p)] + [p for p in named_shapes if not decays(*p)]
    slots, off, decay = [], 0, 0
    for local, shape in ordered:
        off = -(-off // SLOT_ALIGN) * SLOT_ALIGN
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


def layout_digest(units: list[Unit]) -> str:
    """A short hash of where every tensor lies in the flat tiles: a saved state records it (megatrain.engine.state),
    and only a store laid out alike reads it back."""
    layout = [[u.kind, u.offset, u.numel, u.decay_numel, [[s.name, s.shape, s.offset, s.decays] for s in u.params]]
              for u in units]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]


def packed(units: list[Unit]) -> bool:
    """Whether every tile holds its tensors back to back, as every tile did before SLOT_ALIGN (states saved then
    record no layout digest)."""
    return not any(u.gaps for u in units)
