"""A module's weights by name, of either kind of model: what a checkpoint of it holds, and a checkpoint's tensors copied
into it one at a time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a checkpoint holds (a router's score correction), by name; rotary tables and the like are not."""
    saved = set(module.state_dict(keep_vars=True))
    return {name: b for name, b in module.named_buffers() if name in saved}


def named_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint of `module` holds: its parameters (tied ones once) and its persistent buffers, by name."""
    return {**dict(module.named_parameters()), **persistent_buffers(module)}


@torch.no_grad()
def copy_named_weights(targets: Mapping[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each (name, tensor) of `named` into targets[name], one at a time (a checkpoint never whole in memory).
    A name the targets lack, a shape that differs, or a target left without a tensor is refused by name."""
    seen = set()
    for name, tensor in named:
        if name not in targets:
            raise ValueError(f"weight {name!r} is not a parameter of this model")
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, this model's is {tuple(targets[name].shape)}")
        targets[name].copy_(tensor)
        seen.add(name)
    if missing := sorted(set(targets) - seen):
        raise ValueError(f"weights missing: {missing}")
