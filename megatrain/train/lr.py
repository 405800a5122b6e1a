"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay to min_lr at the last step."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_at(step: int, total_steps: int, lr: float, schedule: str, warmup_steps: int, min_lr: float) -> float:
    """The learning rate of update `step` (0-based) of `total_steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps - 1)
    progress = min(progress, 1.0)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
