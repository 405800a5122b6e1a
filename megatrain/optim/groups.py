"""Which parameters get weight decay: matrices (ndim >= 2) do, norms and biases do not. Shared by every system."""

from __future__ import annotations

import torch

from megatrain.config import OptimConfig


def decays(param: torch.Tensor) -> bool:
    return param.ndim >= 2


def adamw_param_groups(params, optim: OptimConfig) -> list[dict]:
    params = [p for p in params if p.requires_grad]
    return [
        {"params": [p for p in params if decays(p)], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
    ]


def torch_adamw(params, optim: OptimConfig, fused: bool = True) -> torch.optim.AdamW:
    """The reference optimizer: torch.optim.AdamW with our hyperparameters and decay groups."""
    return torch.optim.AdamW(adamw_param_groups(params, optim), lr=optim.lr, betas=(optim.beta1, optim.beta2),
                             eps=optim.eps, fused=fused)
