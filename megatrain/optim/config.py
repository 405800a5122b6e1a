"""The optimizer's settings: AdamW with global-norm clipping, identical for every system."""

from __future__ import annotations

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
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm}")
        if self.moments not in MOMENTS:
            raise ValueError(f"moments must be one of {', '.join(MOMENTS)}, got {self.moments!r}")
