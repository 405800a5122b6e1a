"""What `train` runs: every flag, readable from a TOML file (--config) whose keys are the flags' names with
underscores; flags given on the command line override the file. EngineSettings are those of the Engine train's loop
drives (megatrain.train.engine), which a program's Engine takes by the same names; TrainConfig adds training's own."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.flags import CaseFlags, add_flags, file_values, flag, given
from megatrain.models.checkpoint import Checkpoint, open_checkpoint
from megatrain.models.handwritten.families import FAMILIES
from megatrain.models.registry import model_shape
from megatrain.optim.config import OptimConfig
from megatrain.options import check_field_types
from megatrain.run_config import DEVICES, DTYPES, PRECISIONS, share
from megatrain.systems import SYSTEMS, parse_options, system_spec
from megatrain.train import trust
from megatrain.train.data import data_files
from megatrain.train.lr import SCHEDULES
from megatrain.train.report_to import check_report_to

PATH_SETTINGS = ("init_from", "tokenizer", "data", "eval_data", "out", "resume")
# how this command treats the directory and its checkpoint: not the run's settings, never taken from a checkpoint's
PER_INVOCATION = ("overwrite", "resume_fallback", "trust_checkpoint")
# the settings a resumed run keeps, each shaping its data, model or saved state; the others may change: the optimizer's
# and the length from the resumed step on, the device, micro-batch, compile and the system's options only in rounding
RESUME_FIXES = ("system", "init_from", "generic", "model", "tokenizer", "data", "data_split", "train_on_prompt",
                "ignore_column", "shuffle", "pack", "seq", "batch", "seed", "dtype", "precision", "moments")


@dataclass
class EngineSettings(CaseFlags):
    """The settings of one training system over a model (megatrain.Engine's, by train's flags and rules): the shared
    case settings (megatrain.flags.CaseFlags) with training's defaults, the model and AdamW's betas and eps. train's
    own settings (TrainConfig) hold these beneath theirs."""

    # --system offers the trainers only
    system: str = flag("megatrain", help=" | ".join(s for s in SYSTEMS if system_spec(s).trains)
                       + " (default {default})")
    seq: int = 2048
    batch: int = 8
    lr: float = 1e-5
    init_from: str | None = flag(None, metavar="DIR",
                                 help="local Hugging Face checkpoint folder (safetensors): a hand-written family "
                                 f"({', '.join(FAMILIES)}) or any other transformers decoder, through transformers' "
                                 "own modules")
    model: str | None = flag(None, help="registry shape trained from scratch (python -m megatrain models)")
    generic: bool = flag(False, help="train --init-from through transformers' own modules even where a hand-written "
                                     "model of its family exists")
    adam_betas: tuple[float, float] = flag((OptimConfig.beta1, OptimConfig.beta2), metavar=("B1", "B2"))
    adam_eps: float = flag(OptimConfig.eps)

    def __post_init__(self) -> None:
        check_field_types(self, "train setting")  # a TOML file's values reach here untyped
        if self.system not in SYSTEMS:
            raise ValueError(f"--system must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        if not system_spec(self.system).trains:
            raise ValueError(f"--system {self.system} is a benchmark peer (bench and suites), not a trainer: train "
                             f"with {', '.join(s for s in SYSTEMS if system_spec(s).trains)}")
        if (self.init_from is None) == (self.model is None):
            raise ValueError("give one of --init-from DIR (a Hugging Face checkpoint) or --model NAME (from scratch)")
        if self.model is not None:
            model_shape(self.model)
            if self.generic:
                raise ValueError(f"--generic trains an --init-from checkpoint through transformers' own modules; "
                                 f"--model {self.model} is a registry shape, which trains as registered: drop "
                                 "--generic")
        if self.dtype not in DTYPES or self.precision not in PRECISIONS or self.device not in DEVICES:
            raise ValueError(f"--dtype must be one of {DTYPES}, --precision one of {PRECISIONS} and --device one of "
                             f"{DEVICES}")
        for holds, name, value, must in self._ranges():
            if not holds:
                raise ValueError(f"{name} must be {must}, got {value}")
        parse_options(self.system, self.option)  # a wrong option is refused before the data is read
        self.adam_betas = tuple(self.adam_betas)

    def _ranges(self) -> list[tuple[bool, str, object, str]]:
        """(holds, flag, value, what it must be) of every numeric setting; NaN fails every comparison."""
        finite = math.isfinite
        return [
            (finite(self.lr) and self.lr > 0, "--lr", self.lr, "a finite number > 0"),
            (finite(self.weight_decay) and self.weight_decay >= 0, "--weight-decay", self.weight_decay,
             "a finite number >= 0"),
            (all(0 <= b < 1 for b in self.adam_betas), "--adam-betas", " ".join(map(str, self.adam_betas)),
             "two numbers in [0, 1)"),
            (finite(self.adam_eps) and self.adam_eps > 0, "--adam-eps", self.adam_eps, "a finite number > 0"),
            (finite(self.max_grad_norm) and self.max_grad_norm >= 0, "--max-grad-norm", self.max_grad_norm,
             "a finite number >= 0 (0 disables clipping)"),
            (self.seq >= 1, "--seq", self.seq, ">= 1"),
            (self.batch >= 1, "--batch", self.batch, ">= 1"),
            (self.micro_batch == 0 or _holds(share, self.batch, self.micro_batch), "--micro-batch",
             self.micro_batch, f"a divisor of --batch ({self.batch}), or 0 for the whole batch"),
            (0 <= self.seed < 2**32, "--seed", self.seed, "in [0, 2**32)"),  # seeds torch.Generator per epoch
        ]

    def optim(self) -> OptimConfig:
        return super().optim(beta1=self.adam_betas[0], beta2=self.adam_betas[1], eps=self.adam_eps)


@dataclass
class TrainConfig(EngineSettings):
    """What `train` runs: the engine's settings (EngineSettings) and training's own."""

    data: list[str] = flag(factory=list, metavar="FILE", help=".jsonl/.txt file or folder; or a Hugging Face dataset: "
                           "a save_to_disk folder, parquet/arrow/json files, a hub name with --data-split; repeatable")
    data_split: str | None = flag(None, metavar="SPLIT", help="the split of a --data dataset that has several, or of "
                                  "a hub dataset")
    tokenizer: str | None = flag(None, metavar="DIR", help="local tokenizer directory (default: --init-from's)")
    train_on_prompt: bool = flag(False, help="loss on chat prompts too")
    ignore_column: list[str] = flag(factory=list, metavar="NAME", help="a key of the data's lines (and turns) to drop: "
                                    "one no format reads is refused otherwise; repeatable")
    shuffle: bool = flag(True, help="keep file order")
    pack: bool = flag(True, help="one example per row, padded (default: documents packed, attention kept within each)")
    steps: int | None = flag(None, help="optimizer steps from the run's start")
    epochs: float | None = flag(None, help="passes over the data, instead of --steps")
    lr_schedule: str = flag("cosine", choices=SCHEDULES, help="after warmup (default {default})")
    warmup_steps: int = flag(0)
    min_lr: float = flag(0.0, help="the schedule's final learning rate (default 0)")
    out: str = flag("runs/train", metavar="DIR", help="metrics.jsonl, checkpoints/, hf/ (default {default})")
    export_dtype: str | None = flag(None, choices=DTYPES, help="the dtype of hf/'s weights (default: the --init-from "
                                    "checkpoint's, else --dtype)")
    save_every: int = flag(0, metavar="N", help="checkpoint every N steps (and always at the end)")
    save: bool = flag(True, help="no training-state checkpoints, not even at the end (the Hugging Face export stays)")
    keep: int = flag(2, metavar="K", help="checkpoints kept (default {default})")
    resume: str | None = flag(None, metavar="DIR", help="continue the run in DIR (its latest complete checkpoint)")
    resume_fallback: bool = flag(False, help="resume from the checkpoint before when the latest fails its checksums "
                                             "(deleting it)")
    trust_checkpoint: bool = flag(False, help="resume although the checkpoint holds pickles (DeepSpeed's, FSDP's: "
                                  "loading them runs code) that another user or machine wrote")
    overwrite: bool = flag(False, help="discard the run already in --out and start a new one (default: refuse)")
    max_nonfinite_steps: int = flag(3, metavar="K", help="stop (exit 1, no export) after K steps in a row with a "
                                    "non-finite loss or gradient norm (default {default}, 0: never)")
    log_every: int = flag(1, metavar="N", help="plain progress line every N steps (default {default})")
    eval_data: list[str] = flag(factory=list, metavar="FILE", help="held-out data, as --data")
    eval_split: str | None = flag(None, metavar="SPLIT", help="the split of an --eval-data dataset, as --data-split")
    eval_every: int = flag(0, metavar="N", help="held-out loss every N steps (and at the end)")
    report_to: list[str] = flag(factory=list, metavar="NAME", help="also send metrics.jsonl's lines to tensorboard "
                                "(OUT/tensorboard), wandb or mlflow, repeatable; each its own extra (default none)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.data:
            raise ValueError("--data FILE is required (JSONL or .txt, repeatable, a folder, or a Hugging Face dataset)")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give one of --steps N or --epochs E")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if self.export_dtype not in (None, *DTYPES):
            raise ValueError(f"--export-dtype must be one of {DTYPES}, got {self.export_dtype!r}")
        for holds, name, value, must in self._train_ranges():
            if not holds:
                raise ValueError(f"{name} must be {must}, got {value}")
        if self.resume and self.overwrite:
            raise ValueError("--resume DIR continues the run in DIR and --overwrite discards it: give one")
        if not self.save and self.save_every:
            raise ValueError("--no-save (no training-state checkpoints) and --save-every N contradict each other")
        if bool(self.eval_every) != bool(self.eval_data):
            raise ValueError("--eval-data FILE and --eval-every N (>= 1) go together")
        if self.eval_split is not None and not self.eval_data:
            raise ValueError(f"--eval-split {self.eval_split} names a split of --eval-data, which is not given")

    def _train_ranges(self) -> list[tuple[bool, str, object, str]]:
        """(holds, flag, value, what it must be) of training's own numeric settings."""
        finite = math.isfinite
        return [
            (finite(self.min_lr) and 0 <= self.min_lr <= self.lr, "--min-lr", self.min_lr,
             f"a number from 0 to --lr ({self.lr:g})"),
            (self.steps is None or self.steps >= 1, "--steps", self.steps, ">= 1"),
            (self.epochs is None or (finite(self.epochs) and self.epochs > 0), "--epochs", self.epochs,
             "a finite number > 0"),
            (self.warmup_steps >= 0, "--warmup-steps", self.warmup_steps, ">= 0"),
            (self.save_every >= 0, "--save-every", self.save_every, ">= 0 (0: only at the end)"),
            (self.keep >= 1, "--keep", self.keep, ">= 1"),
            (self.log_every >= 1, "--log-every", self.log_every, ">= 1"),
            (self.eval_every >= 0, "--eval-every", self.eval_every, ">= 0"),
            (self.max_nonfinite_steps >= 0, "--max-nonfinite-steps", self.max_nonfinite_steps, ">= 0 (0: never stop)"),
        ]


def _holds(rule, *args) -> bool:
    """Whether a rule (a function raising ValueError where its arguments break it) holds for `args`."""
    try:
        rule(*args)
    except ValueError:
        return False
    return True


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """--config, then every setting's flag, each None when not given: the file's value, else TrainConfig's default,
    applies."""
    p.add_argument("--config", default=None, help="TOML file of these settings (keys: flag names with underscores)")
    add_flags(p, TrainConfig)


def resumed_config(run_dir: Path, fallback: bool = False) -> dict:
    """The settings a run in run_dir was started with, from its latest complete checkpoint (with fallback, the latest
    whose trainer.json reads: the resume itself deletes those that do not)."""
    from megatrain.checked_files import read_meta
    from megatrain.train.checkpoint import complete

    found = complete(run_dir / "checkpoints")
    if not found:
        raise ValueError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    for d in reversed(found):
        try:
            settings = read_meta(d)["train_config"]
        except ValueError as exc:
            if not fallback:
                raise ValueError(f"{exc}: checkpoint {d} is damaged; --resume-fallback resumes from the one before") \
                    from None
            if d == found[0]:
                raise ValueError(f"no checkpoint under {run_dir / 'checkpoints'} has a readable trainer.json ({exc}, "
                                 "and every later one)") from None
            continue
        if not isinstance(settings, dict):
            raise ValueError(f"{d / 'trainer.json'}: train_config is not an object")
        return settings


def _resolved(values: dict) -> dict:
    """values with --out, --resume and every path setting that names an existing file or folder made absolute: a run
    stores its settings, and resumes from any working directory. A value of the wrong type stays for TrainConfig to
    refuse."""
    def absolute(key: str, value):
        path = Path(value).expanduser() if isinstance(value, str) else None
        return str(path.resolve()) if path is not None and (key in ("out", "resume") or path.exists()) else value

    return {k: ([absolute(k, p) for p in v] if isinstance(v, list) else absolute(k, v)) if k in PATH_SETTINGS else v
            for k, v in values.items()}


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's settings from train's flags (a parser add_train_arguments made): train_config of those given."""
    return train_config(given(TrainConfig, args), args.config)


def train_config(values: dict, config_file: str | None = None) -> TrainConfig:
    """The run's settings: the config file's, `values` (by setting name) over them, and on resume the run's own
    beneath both (refusing a change to what the run trains, RESUME_FIXES); paths absolute."""
    values = _resolved({**file_values(TrainConfig, config_file), **values})
    if values.get("resume"):
        if not isinstance(values["resume"], str):
            raise ValueError(f"train setting resume={values['resume']!r}: expected a string (the run's directory)")
        values = _over_resumed(values, values["resume"], values.get("resume_fallback") is True)
    try:
        return TrainConfig(**values)
    except TypeError as exc:  # a key of a checkpoint's settings this version does not have
        raise ValueError(f"bad train setting: {exc}") from None


def _over_resumed(asked: dict, run_dir: str, fallback: bool) -> dict:
    resumed = _resolved(resumed_config(Path(run_dir), fallback))  # paths stored relative (an older run): as from here
    # a checkpoint's trainer.json, signed or not, never grants --trust-checkpoint (or deletes with --resume-fallback)
    resumed = {k: v for k, v in resumed.items() if k not in PER_INVOCATION}
    changed = [f"{k} {resumed.get(k)!r} -> {asked[k]!r}" for k in RESUME_FIXES
               if k in asked and asked[k] != resumed.get(k)]
    if changed:
        raise ValueError(f"--resume {run_dir}: {', '.join(changed)}: a resumed run keeps the settings of its data, "
                         "model and saved state; resume without these, or start a new run in another --out")
    values = {**resumed, "out": run_dir, **asked}
    if ("steps" in asked) != ("epochs" in asked):  # one length given replaces the run's, whichever it had
        values.update(steps=asked.get("steps"), epochs=asked.get("epochs"))
    return values


def check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device on this machine; use --device cpu")


def check_available(cfg: TrainConfig) -> Checkpoint | None:
    """What cfg's values alone cannot tell, checked before anything is read or built: the CUDA device, the
    --init-from checkpoint, the data files, the --report-to packages and the checkpoint key of a system whose
    checkpoints are pickles (made now where the run will sign one), here. Returns --init-from's checkpoint (its
    model and config.json), read once here (None without it)."""
    check_device(cfg.device)
    if system_spec(cfg.system).pickled and (cfg.save or cfg.resume and not cfg.trust_checkpoint):
        trust.check_key(create=cfg.save)  # not at the first save, after the training
    source = None
    if cfg.init_from:
        try:
            source = open_checkpoint(cfg.init_from, cfg.generic)
        except ValueError as exc:
            raise ValueError(f"--init-from {exc}") from None
    data_files(cfg.data, "--data", cfg.data_split)
    if cfg.eval_data:
        data_files(cfg.eval_data, "--eval-data", cfg.eval_split)
    check_report_to(cfg.report_to)
    return source
