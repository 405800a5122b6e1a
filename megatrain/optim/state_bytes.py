"""Bytes per parameter of each tensor of the training state, by precision and dtype: the one rule behind the engine's
memory plan and host store, every system's pre-flight estimate and the size of a checkpoint."""

from __future__ import annotations

FP32_BYTES = 4


def state_bytes_per_param(param_bytes: int, precision: str, moment_bytes: int = FP32_BYTES) -> dict[str, int]:
    """Bytes per parameter of each training-state tensor.

    Args:
        param_bytes: bytes per element of the weights as kept (2 bf16, 4 fp32); the gradients are in the same dtype.
        precision: 'mixed' keeps an fp32 master copy of weights narrower than fp32; 'bf16' updates the bf16 weights
            in fp32 and rounds them back, with no master.
        moment_bytes: AdamW's two moments, fp32 (torch's AdamW keeps them in the parameter dtype instead).

    Returns:
        {weights, grads, exp_avg, exp_avg_sq[, master]}: bytes per parameter of each.
    """
    per = {"weights": param_bytes, "grads": param_bytes, "exp_avg": moment_bytes, "exp_avg_sq": moment_bytes}
    if precision == "mixed" and param_bytes < FP32_BYTES:
        per["master"] = FP32_BYTES
    return per


def checkpoint_bytes_per_param(per: dict[str, int]) -> int:
    """What a checkpoint keeps of a state_bytes_per_param layout: everything but the gradients, which every step
    overwrites."""
    return sum(per.values()) - per["grads"]
