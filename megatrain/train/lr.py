"""Learning-rate schedules: linear warmup, then constant, or a cosine or linear decay towards min_lr, which it reaches
one step after the last (transformers' get_cosine_schedule_with_warmup and get_linear_schedule_with_warmup): the last
update still moves the weights."""

from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_at(step: int, total_steps: int, lr: float, schedule: str, warmup_steps: int, min_lr: float) -> float:
    """The learning rate of update `step` (0-based) of `total_steps`. The warmup rises to lr at its last step, one step
    before transformers' (whose first update, at lr 0, moves nothing); the decay is transformers' from there."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min((step - warmup_steps) / max(1, total_steps - warmup_steps), 1.0)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr - (lr - min_lr) * progress
    raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def schedule_notes(cfg, total_steps: int, resumed_total_steps: int | None = None) -> list[str]:
    """One line each on what the schedule of a run of `total_steps` (cfg: a TrainConfig) does that its flags do not
    say: a warmup as long as the run, and on resume from a run of `resumed_total_steps`, a decay re-stretched."""
    notes = []
    if cfg.warmup_steps >= total_steps:
        top = lr_at(total_steps - 1, total_steps, cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr)
        notes.append(f"note: --warmup-steps {cfg.warmup_steps} is not shorter than the run's {total_steps} steps: the "
                     f"learning rate only rises, to {top:.3g} at the last step (--lr {cfg.lr:g}); the "
                     f"{cfg.lr_schedule} schedule after the warmup never starts")
    if resumed_total_steps not in (None, total_steps) and cfg.lr_schedule != "constant":
        notes.append(f"note: the run's length changes from {resumed_total_steps} to {total_steps} steps: the "
                     f"{cfg.lr_schedule} decay to --min-lr is stretched over the new length, so from the resumed step "
                     "on the learning rate leaves the curve the run followed")
    return notes
