"""Bytes per parameter of each tensor of the training state, by precision and dtype: the one rule behind the engine's
memory plan and host store, every system's pre-flight estimate, the size of a checkpoint and the host optimizer's
memory traffic."""

from __future__ import annotations

FP32_BYTES = 4
QBLOCK = 128  # int8 moments: elements per quantisation block, each with one fp32 absmax (divides the tile alignment)
# bytes per parameter of one AdamW moment as kept (megatrain.optim.compact), its int8 blocks' absmax included
MOMENT_BYTES = {"fp32": FP32_BYTES, "bf16": 2, "int8": 1 + FP32_BYTES / QBLOCK}


def state_bytes_per_param(param_bytes: int, precision: str, moment_bytes: float = FP32_BYTES,
                          update_delay: int = 0) -> dict[str, float]:
    """Bytes per parameter of each training-state tensor.

    Args:
        param_bytes: bytes per element of the weights as kept (2 bf16, 4 fp32); the gradients are in the same dtype.
        precision: 'mixed' keeps an fp32 master copy of weights narrower than fp32; 'bf16' updates the bf16 weights
            in fp32 and rounds them back, with no master.
        moment_bytes: each of AdamW's two moments (MOMENT_BYTES by format; torch's AdamW keeps them in the parameter
            dtype instead).
        update_delay: 1 when each update applies the previous step's gradient (the engine's option): the weights
            the next step streams and the gradient pending are second copies beside the streamed weights and the
            gradients the step writes.

    Returns:
        {weights, grads, exp_avg, exp_avg_sq[, master][, weights_next, grads_pending]}: bytes per parameter of each.
    """
    per = {"weights": param_bytes, "grads": param_bytes, "exp_avg": moment_bytes, "exp_avg_sq": moment_bytes}
    if precision == "mixed" and param_bytes < FP32_BYTES:
        per["master"] = FP32_BYTES
    if update_delay:
        per.update(weights_next=param_bytes, grads_pending=param_bytes)
    return per


def checkpoint_bytes_per_param(per: dict[str, float]) -> float:
    """What a checkpoint keeps of a state_bytes_per_param layout: everything but the gradients, which every step
    overwrites (a pending one included: a checkpoint is written once it is applied)."""
    return sum(per.values()) - per["grads"] - per.get("grads_pending", 0)


def adamw_traffic_bytes_per_param(per: dict[str, float]) -> float:
    """Host memory bytes one-pass AdamW reads and writes per parameter of a state_bytes_per_param layout: the gradient
    read; the master read and written and the streamed copy written, or (no master) the weights read and written;
    both moments read and written. 28 in mixed precision with fp32 moments, 22 in bf16. With the update delayed and no
    master the weights are first copied to the next step's (+2 x the weights)."""
    weights = 2 * per["master"] + per["weights"] if "master" in per else 2 * per["weights"]
    if "weights_next" in per and "master" not in per:
        weights += 2 * per["weights"]
    return per["grads"] + weights + 2 * (per["exp_avg"] + per["exp_avg_sq"])
