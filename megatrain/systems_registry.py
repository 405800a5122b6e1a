"""The protocol every training system implements, and the one registry of systems.

A system is built from a CaseConfig, runs one optimizer step per `step(inputs, labels)` call over
the whole batch (micro-batches and gradient accumulation inside), and reports its own settings and
metrics for the record. Every system trains the same megatrain.models.Transformer with the same
init, loss normalisation (valid tokens of the whole step), AdamW groups and global-norm clipping.

Everything the harness knows about a system before building it is its SystemSpec, declared in the system's own
file; SYSTEMS names where each spec lives and imports it only when asked, so the engine never imports a baseline.
Adding a system is its file (the system class and its SPEC) and one line in SYSTEMS, which also says how reports name
and draw it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from megatrain.memory import Budget
from megatrain.options import CommonOptions


class Case(Protocol):
    """A case as the registry hands it on: megatrain.config.CaseConfig, which sits above the registry (it asks the
    registry for its system and typed options), so the registry names it by what it reads and imports it not."""

    system: str
    options: dict


@dataclass(frozen=True)
class Registered:
    """A system's line in the registry: where its SystemSpec lives ("module:attribute", imported only when asked
    for) and how the reports show it: its name in sentences, its colour (a hue of its own; a label's variants are
    shades of it) and its marker in figures. A system registered without them is drawn grey under its key."""

    spec: str
    name: str | None = None
    color: str | None = None
    marker: str | None = None


# The one registry of systems, in the order reports list them (MegaTrain first)
SYSTEMS = {
    "megatrain": Registered("megatrain.systems.megatrain:SPEC", "MegaTrain", "#d7301f", "o"),
    "paper": Registered("megatrain.systems.paper_code:SPEC", "the paper's code", "#b5478f", "X"),
    "native": Registered("megatrain.systems.native:SPEC", "plain PyTorch", "#8e82b8", "D"),
    "deepspeed": Registered("megatrain.systems.deepspeed_zero3:SPEC", "DeepSpeed ZeRO-3 offload", "#5b83b0", "s"),
    "fsdp": Registered("megatrain.systems.fsdp_offload:SPEC", "FSDP2 offload", "#6aa583", "^"),
    "torchao": Registered("megatrain.systems.torchao_offload:SPEC", "torchao CPU-offload optimizer", "#b89b5e", "P"),
}


@dataclass(frozen=True)
class SystemSpec:
    """One training system, as the harness sees it before building it.

    Attributes:
        factory: builds the system for a case (its class).
        options: its typed options (a CommonOptions dataclass): `--option KEY=VALUE`, a suite's `options`.
        plan_memory: (case, limits) -> the pre-flight plan of the case against `limits`: {host_bytes, gpu_bytes,
            fits, reason, source}, host_bytes with the process overhead (on CPU, everything; gpu_bytes 0 there),
            reason naming the budget exceeded (None when it fits); for a case the system cannot run whatever the
            memory (a device or launch it does not support), {fits: False, reason} alone, as for a missing package.
        checkpoint_bytes: case -> bytes of one save_state checkpoint (the weights and the optimizer state).
        package: the package it needs beyond torch, also the name of its pip extra; None when it needs none.
        missing: case -> what else this environment lacks to run the case (the system's own code, a package an
            option needs), or None. A case skipped for a missing package or for this is run again when its suite
            resumes: installing what it lacked changes nothing the records measured.
        trains: False for a benchmark peer only (bench and suites), which `train` refuses: it has no evaluation,
            export or resume.
        pickled: glob patterns (relative to a save_state directory) of the files load_state unpickles, which can run
            code: a resume loads them only from a checkpoint this user wrote here (megatrain.train.trust).
        state_files: glob patterns (the same way) of files every save_state of it writes: a state that lacks one
            (another system's) is refused by name before load_state reads it (megatrain.train.checkpoint).
    """

    factory: Callable[[Case], TrainSystem]
    options: type[CommonOptions]
    plan_memory: Callable[[Case, Budget], dict]
    checkpoint_bytes: Callable[[Case], int]
    package: str | None = None
    missing: Callable[[Case], str | None] | None = None
    trains: bool = True
    pickled: tuple[str, ...] = ()
    state_files: tuple[str, ...] = ()


def system_spec(system: str) -> SystemSpec:
    """The spec of `system`, importing its module (a baseline's only when asked for); ValueError for an unknown name."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose one of: {', '.join(SYSTEMS)}")
    module, name = SYSTEMS[system].spec.split(":")
    return getattr(importlib.import_module(module), name)


def parse_options(system: str, given: dict) -> CommonOptions:
    """The system's options from a {key: value} mapping (JSON/TOML values); ValueError names what to change.

    A key the system does not have (a typo, or another system's option) and a value of the wrong type are refused
    with the system's valid keys (the CLI's exit 2)."""
    cls = system_spec(system).options
    valid = _option_keys(system)
    unknown = [k for k in given if k not in valid]
    if unknown:
        owners = sorted(s for s in SYSTEMS if unknown[0] in _option_keys(s))
        whose = f" (an option of {', '.join(owners)})" if owners else ""
        raise ValueError(f"{system} has no option {unknown[0]!r}{whose}; its options: {', '.join(valid)}")
    try:
        return cls(**given)
    except ValueError as exc:
        raise ValueError(f"{system}: {exc}") from None


class TrainSystem(Protocol):
    skipped_steps: int  # steps whose global gradient norm was not finite: the update was skipped
    last_grad_norm: float  # the global gradient norm of the last step, before clipping

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        """One optimizer step over the batch; returns the step's mean token loss. segments_BS (packed rows: the
        document of each token) keeps attention and positions within documents; megatrain and native take it."""

    def system_config(self) -> dict:
        """The exact settings this system ran with (stored in the record)."""

    def metrics(self, warmup_steps: int = 0) -> dict:
        """System-specific measurements for the record (bytes moved, pinned bytes, ...); per-step figures are medians
        over the steps after the first warmup_steps (the caller's to say: the engine knows no benchmark)."""

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
        """The current weights by name, without copying the model where it can (a Hugging Face export copies shard by
        shard). Under torchrun every rank calls it (a sharded system gathers each weight) and rank 0's mapping holds
        them."""

    def save_state(self, out_dir: Path | None) -> None:
        """Write the full training state (weights, optimizer state, step counts) into out_dir. Under torchrun every
        rank calls it, rank 0 with out_dir and the others with None."""

    def load_state(self, in_dir: Path) -> None:
        """Continue from a save_state directory: the next step is as if training had never stopped (under torchrun
        every rank calls it)."""

    def close(self) -> None:
        """Release GPU memory, pinned memory, threads and process groups."""


def _option_keys(system: str) -> list[str]:
    return [f.name for f in dataclasses.fields(system_spec(system).options)]


def build_system(case: Case) -> TrainSystem:
    """The case's system, built (the packages only building needs, such as DeepSpeed, are imported now)."""
    return system_spec(case.system).factory(case)
