"""The band a bf16 loss curve is judged in: native's own spread around native's curve, one rule for the GPU suite's
curve check (tests/gpu/test_engine_gpu.py), its spread study (scripts/curve_spread.py) and the walk's GPU column
(megatrain.checks.walk.curve).

A step is within 3 spreads + 1% of native's loss + LOSS_FLOOR. One pair of native runs samples its noise once a step
and passes through 0 by chance, so each unlearnt step's spread is raised to the largest share of its loss any unlearnt
step's spread was (share_floor). A repeated batch learnt by heart (native's loss under MEMORISED) has losses whose
bf16 logits carry no relative precision, and there native's own runs wander apart as much at one step as at another
(a rounding flips the sign of Adam's near-zero update: Gemma-4-E4B's native with its gradient sums in another order
rose to 0.82 at a learnt step where the first stayed at 1e-3, H200), so each learnt step takes the largest spread
among them (band_excess)."""

from __future__ import annotations

import torch

LOSS_FLOOR = 1e-4
LOSS_SHARE = 0.01
MEMORISED = 1e-2  # a loss below this: the batch is learnt by heart


def share_floor(spread: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each unlearnt step's spread raised to the largest share of its loss that any unlearnt step's spread was."""
    unlearnt = ref >= MEMORISED
    if not unlearnt.any():
        return spread
    share = (spread[unlearnt] / ref[unlearnt].abs()).max()
    return torch.where(unlearnt, torch.maximum(spread, share * ref.abs()), spread)


def band_excess(ours: torch.Tensor, ref: torch.Tensor, spread: torch.Tensor,
                learnt: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(each step's spread, each learnt step's raised to the largest among them; the largest amount |ours - ref|
    exceeds the band by, inf where a loss of ours is not finite): the band is 3 spreads + 1% of the loss +
    LOSS_FLOOR."""
    if learnt.any():
        spread = torch.where(learnt, spread.clamp_min(spread[learnt].max()), spread)
    if not torch.isfinite(ours).all():
        return spread, float("inf")
    return spread, ((ours - ref).abs() - (3 * spread + LOSS_SHARE * ref.abs() + LOSS_FLOOR)).max().item()
