"""What `train` runs: every flag, readable from a TOML file (--config) whose keys are the flags' names with
underscores; flags given on the command line override the file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from megatrain.bench.args import parse_option_flags
from megatrain.config import DTYPES, PRECISIONS
from megatrain.optim.config import OptimConfig
from megatrain.systems import SYSTEMS
from megatrain.train.lr import SCHEDULES


@dataclass
class TrainConfig:
    system: str = "megatrain"
    device: str = "cpu"
    dtype: str = "float32"
    precision: str = "mixed"
    compile: bool = False
    option: dict = field(default_factory=dict)
    init_from: str | None = None
    model: str | None = None
    data: list[str] = field(default_factory=list)
    tokenizer: str | None = None
    train_on_prompt: bool = False
    shuffle: bool = True
    pack: bool = True
    seq: int = 2048
    batch: int = 8
    micro_batch: int = 0
    steps: int | None = None
    epochs: float | None = None
    lr: float = 1e-5
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr: float = 0.0
    weight_decay: float = OptimConfig.weight_decay
    adam_betas: tuple[float, float] = (OptimConfig.beta1, OptimConfig.beta2)
    adam_eps: float = OptimConfig.eps
    max_grad_norm: float = OptimConfig.max_grad_norm
    seed: int = 0
    out: str = "runs/train"
    save: bool = True
    save_every: int = 0
    keep: int = 2
    resume: str | None = None
    log_every: int = 1
    eval_data: list[str] = field(default_factory=list)
    eval_every: int = 0

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"--system must be one of {', '.join(SYSTEMS)}, got {self.system!r}")
        if (self.init_from is None) == (self.model is None) and self.resume is None:
            raise ValueError("give one of --init-from DIR (a Hugging Face checkpoint) or --model NAME (from scratch)")
        if not self.data:
            raise ValueError("--data FILE is required (JSONL or .txt, repeatable, or a folder)")
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("give one of --steps N or --epochs E")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if self.dtype not in DTYPES or self.precision not in PRECISIONS:
            raise ValueError(f"--dtype must be one of {DTYPES} and --precision one of {PRECISIONS}")
        if self.keep < 1 or self.save_every < 0 or self.warmup_steps < 0 or self.log_every < 1:
            raise ValueError("--keep and --log-every must be >= 1, --save-every and --warmup-steps >= 0")
        if not self.save and self.save_every:
            raise ValueError("--no-save (no training-state checkpoints) and --save-every N contradict each other")
        if self.eval_every < 0 or bool(self.eval_every) != bool(self.eval_data):
            raise ValueError("--eval-data FILE and --eval-every N (>= 1) go together")
        self.adam_betas = tuple(self.adam_betas)

    def optim(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, beta1=self.adam_betas[0], beta2=self.adam_betas[1], eps=self.adam_eps,
                           weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag defaults to None (not given): the file's value, else TrainConfig's default, applies."""
    p.add_argument("--config", default=None, help="TOML file of these settings (keys: flag names with underscores)")
    p.add_argument("--system", help="megatrain (default) | native | deepspeed | fsdp")
    p.add_argument("--device", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=DTYPES)
    p.add_argument("--precision", choices=PRECISIONS)
    p.add_argument("--compile", action="store_true", default=None, help="torch.compile each decoder layer")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="system option (JSON value), as in bench")
    p.add_argument("--init-from", metavar="DIR", help="local Hugging Face checkpoint (Qwen2 or Llama, safetensors)")
    p.add_argument("--model", help="registry shape trained from scratch (python -m megatrain models)")
    p.add_argument("--data", action="append", metavar="FILE", help=".jsonl/.txt file or folder, repeatable")
    p.add_argument("--tokenizer", metavar="DIR", help="local tokenizer directory (default: --init-from's)")
    p.add_argument("--train-on-prompt", action="store_true", default=None, help="loss on chat prompts too")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", default=None, help="keep file order")
    p.add_argument("--no-pack", dest="pack", action="store_false", default=None,
                   help="one example per row, padded (default: documents packed, attention kept within each)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 2048)")
    p.add_argument("--batch", type=int, help="sequences per optimizer step (default 8)")
    p.add_argument("--micro-batch", type=int, help="sequences per forward/backward (default: --batch)")
    p.add_argument("--steps", type=int, help="optimizer steps from the run's start")
    p.add_argument("--epochs", type=float, help="passes over the data, instead of --steps")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-5)")
    p.add_argument("--lr-schedule", choices=SCHEDULES, help="after warmup (default cosine)")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--min-lr", type=float, help="the schedule's final learning rate (default 0)")
    p.add_argument("--weight-decay", type=float, help="on tensors of 2+ dimensions")
    p.add_argument("--adam-betas", type=float, nargs=2, metavar=("B1", "B2"))
    p.add_argument("--adam-eps", type=float)
    p.add_argument("--max-grad-norm", type=float, help="global-norm clipping, 0 disables")
    p.add_argument("--seed", type=int)
    p.add_argument("--out", metavar="DIR", help="metrics.jsonl, checkpoints/, hf/ (default runs/train)")
    p.add_argument("--save-every", type=int, metavar="N", help="checkpoint every N steps (and always at the end)")
    p.add_argument("--no-save", dest="save", action="store_false", default=None,
                   help="no training-state checkpoints, not even at the end (the Hugging Face export stays)")
    p.add_argument("--keep", type=int, metavar="K", help="checkpoints kept (default 2)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR (its latest complete checkpoint)")
    p.add_argument("--log-every", type=int, metavar="N", help="plain progress line every N steps (default 1)")
    p.add_argument("--eval-data", action="append", metavar="FILE", help="held-out data, as --data")
    p.add_argument("--eval-every", type=int, metavar="N", help="held-out loss every N steps (and at the end)")


def resumed_config(run_dir: Path) -> dict:
    """The settings a run in run_dir was started with, from its latest complete checkpoint."""
    from megatrain.train.checkpoint import META_FILE, latest

    found = latest(run_dir / "checkpoints")
    if found is None:
        raise ValueError(f"--resume {run_dir}: no complete checkpoint under {run_dir / 'checkpoints'}")
    return json.loads((found / META_FILE).read_text())["train_config"]


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values = {}
    if args.resume:  # the run's own settings, in the directory given, then the file's and the flags' over them
        values = {**resumed_config(Path(args.resume)), "out": args.resume}
    if args.config:
        try:
            file_values = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--config {args.config}: {exc}") from None
        values = {**values, **file_values}
        if isinstance(values.get("data"), str):
            values["data"] = [values["data"]]
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - names - {"resume"})
    if unknown:
        raise ValueError(f"--config {args.config}: unknown keys {unknown}; valid: {', '.join(sorted(names))}")
    for name in names:
        given = getattr(args, name, None)
        if given is not None:
            values[name] = parse_option_flags(given) if name == "option" else given
    if values.get("resume") and not values.get("out"):  # resume = "DIR" in a TOML file
        values["out"] = values["resume"]
    try:
        return TrainConfig(**values)
    except TypeError as exc:
        raise ValueError(f"bad train setting: {exc}") from None
