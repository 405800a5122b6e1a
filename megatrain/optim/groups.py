"""Which parameters get weight decay: matrices (ndim >= 2) do, norms and biases do not. Shared by every system."""

from __future__ import annotations

import torch

from megatrain.optim.config import OptimConfig


def decays(shape) -> bool:
    """The one weight-decay rule: matrices (2 or more dims) decay; norms and biases do not."""
    return len(shape) >= 2


def adamw_param_groups(params, optim: OptimConfig, shape_of=lambda p: p.shape) -> list[dict]:
    """Decay / no-decay groups; `shape_of` gives a parameter's full shape (ZeRO-3 partitions are 1-D stubs)."""
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if decays(shape_of(p))], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if not decays(shape_of(p))], "weight_decay": 0.0},
    ]


def torch_adamw(params, optim: OptimConfig, fused: bool = True) -> torch.optim.AdamW:
    """The reference optimizer: torch.optim.AdamW with our hyperparameters and decay groups."""
    return torch.optim.AdamW(adamw_param_groups(params, optim), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                             eps=optim.eps, fused=fused)
