"""Shared by the CPU and GPU engine tests: train a case for some steps in this process."""

from __future__ import annotations

import torch

from baselines.protocol import build_system
from megatrain.config import CaseConfig
from megatrain.data import make_batches


def train(system: str, steps: int = 10, **kw) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """(per-step losses, final fp32 parameters by name, the system's metrics) of `steps` steps of a case."""
    case = CaseConfig(system=system, steps=steps, **kw)
    trainer = build_system(case)
    data = make_batches(case, case.model_config().vocab_size)
    try:
        losses = [trainer.step(*data.batch_at(i)) for i in range(steps)]
        params = trainer.named_parameters_fp32()
        metrics = trainer.metrics()
    finally:
        trainer.close()
    return losses, params, metrics
