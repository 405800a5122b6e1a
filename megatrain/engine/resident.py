"""Resident units (options resident_embedding, resident_layers): their weights, fp32 gradient and AdamW state live on
the GPU and are updated there (by the schedule, on its compute stream); the host optimizer skips them. Their host
tiles are written only when the model is read or saved, and read when weights or a state are loaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.engine.layout import Unit
from megatrain.engine.store import HostStore
from megatrain.optim.compact import Moments


@dataclass
class ResidentUnit:
    weights: torch.Tensor  # compute dtype (the embedding's: its streaming buffer)
    grad: torch.Tensor  # fp32 accumulator (the embedding's: its streaming one)
    master: torch.Tensor | None  # fp32, mixed precision with bf16 weights only
    moments: Moments  # in the store's format

    @staticmethod
    def from_host(store: HostStore, unit: Unit, device: torch.device, weights: torch.Tensor | None = None,
                  grad: torch.Tensor | None = None) -> ResidentUnit:
        """The unit's state moved to `device`: its weights (into `weights` when given), an fp32 gradient buffer
        (`grad` when given), the fp32 master (mixed precision) and moments (in their format)."""
        if weights is None:
            weights = torch.empty(unit.numel, dtype=store.compute_dtype, device=device)
            grad = torch.empty(unit.numel, dtype=torch.float32, device=device)
        weights.copy_(store.tile(store.weights, unit))
        return ResidentUnit(
            weights=weights, grad=grad,
            master=store.tile(store.master, unit).to(device, copy=True) if store.master is not None else None,
            moments=store.moment_tiles(unit).to(device))

    def load_from_host(self, store: HostStore, unit: Unit) -> None:
        """Refresh the GPU state from the unit's host tiles."""
        self.weights.copy_(store.tile(store.weights, unit))
        if self.master is not None:
            self.master.copy_(store.tile(store.master, unit))
        self.moments.copy_(store.moment_tiles(unit))

    def sync_to_host(self, store: HostStore, unit: Unit) -> None:
        """Write the GPU state back to the unit's host tiles."""
        store.tile(store.weights, unit).copy_(self.weights)
        if self.master is not None:
            store.tile(store.master, unit).copy_(self.master)
        store.moment_tiles(unit).copy_(self.moments)
