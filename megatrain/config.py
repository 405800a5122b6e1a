"""One benchmark/training case: which system trains which model on what work."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

from megatrain.models import registry
from megatrain.models.kinds import shape_from_dict
from megatrain.models.shape import ModelShape
from megatrain.optim.config import OptimConfig
from megatrain.options import CommonOptions
from megatrain.run_config import RunConfig
from megatrain.systems_registry import parse_options, system_spec

# a record's config block in the key order records always had: the shared settings (RunConfig's) among the case's own
RECORD_ORDER = ("system", "model", "model_shape", "num_layers", "batch", "micro_batch", "seq", "steps", "warmup",
                "dtype", "precision", "device", "seed", "data", "tokenizer", "repeat_batch", "compile", "optim",
                "options", "ranks")


@dataclass(frozen=True)
class CaseConfig(RunConfig):
    """One training case: which system trains which model on what work: the settings every system shares
    (megatrain.run_config.RunConfig: batch the global batch, seed the weights' and the synthetic data's), and the
    case's own.

    Attributes:
        system: a name in megatrain.systems_registry.SYSTEMS.
        model: registry name (megatrain.models.registry.MODELS), or a label when model_shape is given.
        model_shape: the model's shape when it is not a registry one (a Hugging Face checkpoint's config).
        num_layers: override the registered depth (depth-scaling sweeps); None keeps it.
        steps: optimizer steps run; the first `warmup` are not timed.
        data: 'synthetic', or a path to .jsonl / .txt (needs tokenizer).
        tokenizer: local Hugging Face tokenizer directory (tokenizer.json) for text data.
        repeat_batch: train on the same batch every step (convergence checks).
        options: system-specific settings, recorded as given; parsed and checked as `opts` (the system's SystemSpec).
        ranks: processes (one a GPU) that train the case together, each its share of the global batch: torchrun's
            world size (`torchrun --nproc-per-node N -m megatrain bench`); 1 is one process without torchrun.
    """

    system: str = "native"
    model: str = "tiny"
    model_shape: ModelShape | None = None
    num_layers: int | None = None
    steps: int = 5
    warmup: int = 1
    data: str = "synthetic"
    tokenizer: str | None = None
    repeat_batch: bool = False
    options: dict = field(default_factory=dict)
    ranks: int = 1

    def __post_init__(self) -> None:
        system_spec(self.system)  # refuses an unknown system, naming the known ones
        self.shape()  # validates the model name and depth
        super().__post_init__()  # the shared settings: batch, micro-batch, seq, dtype, precision, device
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={self.steps} warmup={self.warmup}")
        if "compile" in self.options:
            raise ValueError("compile is a case setting for every system, not an option: use --compile "
                             "(in a suite: compile = true)")
        parse_options(self.system, self.options)  # refuses unknown keys and bad values
        if self.optim.moments != "fp32" and self.system != "megatrain":
            raise ValueError(f"--moments {self.optim.moments} is the megatrain engine's: {self.system} keeps fp32 "
                             "moments; use --moments fp32")
        if self.data != "synthetic" and not self.tokenizer:
            raise ValueError("text data needs --tokenizer DIR (a local Hugging Face tokenizer directory)")

    def shape(self) -> ModelShape:
        """The shape of the model the case trains: model_shape (a checkpoint's) or the registry's `model`, at
        num_layers where that is given."""
        if self.model_shape is not None:
            return self.model_shape if self.num_layers is None else self.model_shape.with_layers(self.num_layers)
        return registry.model_shape(self.model, self.num_layers)

    @functools.cached_property
    def opts(self) -> CommonOptions:
        """The system's typed options (its SystemSpec.options)."""
        return parse_options(self.system, self.options)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq

    @property
    def timed_steps(self) -> int:
        return self.steps - self.warmup if self.steps > self.warmup else self.steps

    def to_dict(self) -> dict:
        fields = asdict(self)
        d = {key: fields.pop(key) for key in RECORD_ORDER}
        d.update(fields)
        if d["model_shape"] is None:  # registry models: the dict (and the case ids hashed from it) as before
            del d["model_shape"]
        if d["ranks"] == 1:  # one process: likewise
            del d["ranks"]
        return d

    @staticmethod
    def from_dict(d: dict) -> CaseConfig:
        d = dict(d)
        d["optim"] = OptimConfig(**d.get("optim", {}))
        if d.get("model_shape") is not None:
            d["model_shape"] = shape_from_dict(d["model_shape"])
        return CaseConfig(**d)
