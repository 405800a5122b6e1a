"""The optimizer's settings: AdamW with global-norm clipping, identical for every system."""

from __future__ import annotations

import math
from dataclasses import dataclass

# How AdamW keeps its two moments (megatrain.optim.compact says each format and its cost): fp32 (exact, the default),
# bf16 with stochastic rounding, or int8 in blocks of QBLOCK with a fp32 absmax each.
MOMENTS = ("fp32", "bf16", "int8")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping, identical for every system."""

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0  # 0 disables clipping
    moments: str = "fp32"  # MOMENTS

    def __post_init__(self) -> None:
        for holds, name, value, must in (
                (_finite(self.lr) and self.lr > 0, "lr", self.lr, "a finite number > 0"),
                (all(_finite(b) and 0 <= b < 1 for b in (self.beta1, self.beta2)), "betas",
                 f"{self.beta1!r}, {self.beta2!r}", "two numbers in [0, 1)"),
                (_finite(self.eps) and self.eps > 0, "eps", self.eps, "a finite number > 0"),
                (_finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", self.weight_decay,
                 "a finite number >= 0"),
                (_finite(self.max_grad_norm) and self.max_grad_norm >= 0, "max_grad_norm", self.max_grad_norm,
                 "a finite number >= 0 (0 disables clipping)")):
            if not holds:  # NaN fails every comparison; a NaN learning rate trains nothing but NaN
                raise ValueError(f"{name} must be {must}, got {value!r}")
        if self.moments not in MOMENTS:
            raise ValueError(f"moments must be one of {', '.join(MOMENTS)}, got {self.moments!r}")


def _finite(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_lr(lr: float) -> None:
    """A learning rate set between steps (a caller's schedule, which may reach 0): ValueError unless finite and >= 0."""
    if not (_finite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
