"""The protocol every training system implements, and the name -> system registry.

A system is built from a CaseConfig, runs one optimizer step per `step(inputs, labels)` call over
the whole batch (micro-batches and gradient accumulation inside), and reports its own settings and
metrics for the record. Every system trains the same megatrain.models.Transformer with the same
init, loss normalisation (valid tokens of the whole step), AdamW groups and global-norm clipping.
Systems are named here and imported only when built, so the engine never imports a baseline.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from megatrain.config import CaseConfig

SYSTEMS = {
    "native": "baselines.native:NativeSystem",
    "megatrain": "megatrain.engine.trainer:StreamingSystem",
    "deepspeed": "baselines.deepspeed_zero3:DeepSpeedSystem",
    "fsdp": "baselines.fsdp_offload:FSDPSystem",
}


class TrainSystem(Protocol):
    skipped_steps: int  # steps whose global gradient norm was not finite: the update was skipped
    last_grad_norm: float  # the global gradient norm of the last step, before clipping

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        """One optimizer step over the batch; returns the step's mean token loss. segments_BS (packed rows: the
        document of each token) keeps attention and positions within documents; megatrain and native take it."""

    def system_config(self) -> dict:
        """The exact settings this system ran with (stored in the record)."""

    def metrics(self) -> dict:
        """System-specific measurements for the record (bytes moved, pinned bytes, ...)."""

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Current weights as fp32 CPU tensors under our module names (parity tests)."""

    def evaluate(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                 segments_BS: torch.Tensor | None = None) -> float:
        """The mean token loss of the batch, without gradients or an update (held-out data)."""

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following updates (a schedule)."""

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace every weight, one (name, tensor) at a time (a Hugging Face checkpoint, before training)."""

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """The current weights by name, without copying the model (a Hugging Face export copies shard by shard)."""

    def save_state(self, out_dir: Path) -> None:
        """Write the full training state (weights, optimizer state, step counts) into out_dir."""

    def load_state(self, in_dir: Path) -> None:
        """Continue from a save_state directory: the next step is as if training had never stopped."""

    def close(self) -> None:
        """Release GPU memory, pinned memory, threads and process groups."""


def build_system(case: CaseConfig) -> TrainSystem:
    if case.system not in SYSTEMS:
        raise ValueError(f"unknown system {case.system!r}; choose one of: {', '.join(SYSTEMS)}")
    module, name = SYSTEMS[case.system].split(":")
    return getattr(importlib.import_module(module), name)(case)
