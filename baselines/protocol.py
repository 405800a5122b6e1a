"""The case protocol every system implements, and the name -> system registry.

A system is built from a CaseConfig, runs one optimizer step per `step(inputs, labels)` call over
the whole batch (micro-batches and gradient accumulation inside), and reports its own settings and
metrics for the record. Every system trains the same megatrain.models.Transformer with the same
init, loss normalisation (valid tokens of the whole step), AdamW groups and global-norm clipping.
"""

from __future__ import annotations

import contextlib
import importlib
import math
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

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor) -> float:
        """One optimizer step over the batch; returns the step's mean token loss."""

    def system_config(self) -> dict:
        """The exact settings this system ran with (stored in the record)."""

    def metrics(self) -> dict:
        """System-specific measurements for the record (bytes moved, pinned bytes, ...)."""

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        """Current weights as fp32 CPU tensors under our module names (parity tests)."""

    def close(self) -> None:
        """Release GPU memory, pinned memory, threads and process groups."""


def build_system(case: CaseConfig) -> TrainSystem:
    if case.system not in SYSTEMS:
        raise ValueError(f"unknown system {case.system!r}; choose one of: {', '.join(SYSTEMS)}")
    module, name = SYSTEMS[case.system].split(":")
    return getattr(importlib.import_module(module), name)(case)


def compute_dtype(case: CaseConfig) -> torch.dtype:
    return getattr(torch, case.dtype)


def accumulate_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, case: CaseConfig,
                        device: torch.device, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                        autocast=contextlib.nullcontext) -> tuple[float, bool]:
    """One optimizer step of a module-owning system: micro-batches accumulate gradients of the summed
    token loss over the step's valid tokens, then global-norm clipping and AdamW. A non-finite global
    norm skips the update (weights and AdamW state untouched, as AMP's overflow skip).
    Returns (the mean loss, whether the update was applied)."""
    normalizer = valid_tokens(labels_BS)
    total = torch.zeros((), device=device)
    mb = case.micro_batch
    for start in range(0, inputs_BS.shape[0], mb):
        x = inputs_BS[start:start + mb].to(device, non_blocking=True)
        y = labels_BS[start:start + mb].to(device, non_blocking=True)
        with autocast():
            loss = model(x, y, normalizer)
        loss.backward()
        total += loss.detach().float()
    # with clipping off, max_norm=inf only measures the norm (the coefficient clamps to exactly 1)
    max_norm = case.optim.max_grad_norm if case.optim.max_grad_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    stepped = bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total), stepped


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer in place (per block, as torchtitan does): the same Inductor graphs of a layer's
    forward and recompute+backward that the engine's compiled template runs. Whole-model compile is not what any
    system here does."""
    for layer in model.layers:
        layer.compile(dynamic=False)


COMPILED_LAYERS = "torch.compile(dynamic=False) of each decoder layer"


def valid_tokens(labels_BS: torch.Tensor) -> int:
    """The loss normaliser of a step: labels that are not IGNORE_INDEX (at least 1)."""
    from megatrain.models.loss import IGNORE_INDEX

    return max(int((labels_BS != IGNORE_INDEX).sum()), 1)
