"""The flags of `bench`: the shared case flags (megatrain.flags.CaseFlags) and bench's own. The suite runner writes a
case back as these flags (`BenchFlags.of_case`, megatrain.flags.flag_argv) for the case's subprocess."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.flags import CaseFlags, flag
from megatrain.models.checkpoint import config_shape
from megatrain.models.registry import HF_CONFIGS, MODELS
from megatrain.models.shape import ModelShape


def model_file(model: str, base: Path = Path()) -> tuple[str, ModelShape] | None:
    """(label, shape) of a model named by a config.json or a checkpoint folder, its path relative to `base` unless
    absolute: its shape alone, labelled with the file's name and sha256 (so a case follows its contents, not where it
    lies); None for a registry name or no such path."""
    path = base / model
    if model in MODELS or model in HF_CONFIGS or not path.exists():
        return None
    shape, sha256 = config_shape(path)
    return f"{path.name}@sha256:{sha256}", shape


# the OptimConfig fields that are flags; betas and eps are not
OPTIM_FLAGS = ("lr", "weight_decay", "max_grad_norm", "moments")


@dataclass
class BenchFlags(CaseFlags):
    model: str = flag(CaseConfig.model, help="registry name (python -m megatrain models), or a config.json or a "
                      "checkpoint folder (its shape alone; the record names the file's sha256)")
    num_layers: int | None = flag(None, help="override the model's depth")
    steps: int = flag(CaseConfig.steps)
    warmup: int = flag(CaseConfig.warmup, help="leading steps not timed")
    data: str = flag(CaseConfig.data, help="'synthetic' or a .jsonl/.txt file")
    tokenizer: str | None = flag(None, help="local HF tokenizer dir for text data")
    repeat_batch: bool = flag(CaseConfig.repeat_batch, help="same batch every step")
    gemm_peak_tflops: float | None = flag(None, help="measured GEMM peak for MFU")
    out: str | None = flag(None, help="append the record to this JSONL file")
    ranks: int | None = flag(None, help="processes training the case together, torchrun's --nproc-per-node "
                             "(default: this launch's; 1 without torchrun)")
    json: bool = flag(False, help="print the record as one JSON line, stdout's last (the suite runner reads it)")

    def case(self) -> CaseConfig:
        """The case of these flags; a --model that is a config.json or a checkpoint folder (not a registry name) is
        the case's model_shape, labelled with its file's name and sha256."""
        label, shape = model_file(self.model) or (self.model, None)
        return self.make_case(label, model_shape=shape, num_layers=self.num_layers, steps=self.steps,
                              warmup=self.warmup, data=self.data, tokenizer=self.tokenizer,
                              repeat_batch=self.repeat_batch, ranks=self.ranks or distributed.launch_size()[0])

    @staticmethod
    def of_case(case: CaseConfig) -> BenchFlags:
        """The flags of `case`'s settings (what they cannot express, as optim betas and eps, is left out)."""
        names = {f.name for f in dataclasses.fields(BenchFlags)}
        values = {k: v for k, v in vars(case).items() if k in names}
        values["ranks"] = case.ranks if case.ranks > 1 else None  # one process: no flag, as before
        return BenchFlags(**values, option=case.options, **{k: getattr(case.optim, k) for k in OPTIM_FLAGS})
