"""Which parameters get weight decay: matrices (ndim >= 2) do; norms, biases (the experts' 2-D ones too) and attention
sinks do not. Shared by every system."""

from __future__ import annotations

import torch

from megatrain.optim.config import OptimConfig


def decays(name: str, shape) -> bool:
    """The one weight-decay rule: matrices (2 or more dims) decay, biases (GPT-OSS's experts' [E, n] ones too) do
    not; norms and sinks are 1-D."""
    return len(shape) >= 2 and not name.endswith("bias")


def adamw_param_groups(named_params, optim: OptimConfig, shape_of=lambda p: p.shape) -> list[dict]:
    """Decay / no-decay groups of (name, parameter) pairs; `shape_of` gives a parameter's full shape (ZeRO-3
    partitions are 1-D stubs)."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    return [
        {"params": [p for n, p in named if decays(n, shape_of(p))], "weight_decay": optim.weight_decay},
        {"params": [p for n, p in named if not decays(n, shape_of(p))], "weight_decay": 0.0},
    ]


def adamw_hyperparameters(optim: OptimConfig) -> dict:
    """torch.optim.AdamW's keyword arguments for our hyperparameters (the weight decay is each group's)."""
    return {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), "eps": optim.eps}


def torch_adamw(named_params, optim: OptimConfig, fused: bool = True) -> torch.optim.AdamW:
    """The reference optimizer: torch.optim.AdamW with our hyperparameters and decay groups."""
    return torch.optim.AdamW(adamw_param_groups(named_params, optim), **adamw_hyperparameters(optim), fused=fused)
