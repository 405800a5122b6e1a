"""The settings every system shares, declared once: one step's work (batch, micro-batch, sequence length), its numbers
(compute dtype, precision, AdamW), where it runs (device), how it starts (seed) and whether its layers compile. A
benchmark or training case (megatrain.config.CaseConfig) and the streaming engine's own settings
(megatrain.engine.config.EngineConfig) are RunConfigs; the flags that make a case (megatrain.flags.CaseFlags) take
their defaults from here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megatrain.optim.config import OptimConfig

DTYPES = ("float32", "bfloat16")
PRECISIONS = ("mixed", "bf16")
DEVICES = ("cpu", "cuda")


def share(batch: int, micro_batch: int, world: int = 1) -> int:
    """Rows of a global batch of `batch` that each of `world` ranks trains: whole micro-batches, as many as the
    others (every system splits it so; one process is one rank). The one home of the rule that the micro-batch
    divides the batch: a RunConfig, train's flags and the ranks ask it."""
    if micro_batch < 1 or batch % (world * micro_batch):
        if world == 1:
            raise ValueError(f"micro_batch={micro_batch} must divide batch={batch}")
        raise ValueError(f"--batch {batch} must be a multiple of the {world} ranks x --micro-batch {micro_batch}: "
                         "each rank trains whole micro-batches, as many as the others")
    return batch // world


@dataclass(frozen=True)
class RunConfig:
    """The settings every system shares.

    Attributes:
        batch: sequences per optimizer step.
        micro_batch: sequences per forward/backward pass; divides batch (gradients accumulate over the rest). 0 =
            batch.
        seq: tokens per sequence.
        dtype: compute dtype ('bfloat16' on GPU, 'float32' for exact CPU parity).
        precision: 'mixed' (fp32 master weights) or 'bf16' (bf16 weights, fp32 Adam moments).
        device: 'cpu' or 'cuda'.
        seed: seeds the weights (and a benchmark's synthetic data).
        optim: AdamW and global-norm clipping.
        compile: run each decoder layer through torch.compile, in every system (the same kernels for all; a
            comparison gives every system the same setting).
    """

    batch: int = 2
    micro_batch: int = 0
    seq: int = 64
    dtype: str = "float32"
    precision: str = "mixed"
    device: str = "cpu"
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)
    compile: bool = False

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.micro_batch == 0:
            object.__setattr__(self, "micro_batch", self.batch)
        share(self.batch, self.micro_batch)
        if self.seq < 1:
            raise ValueError(f"seq must be >= 1, got {self.seq}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    def run_settings(self) -> dict:
        """These shared settings by name: what a RunConfig of another kind is made of (a case's engine config)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RunConfig)}

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype."""
        return getattr(torch, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the compute dtype: every case, engine and estimate counts by this."""
        return self.torch_dtype.itemsize
