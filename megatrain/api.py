"""The Python API: `Trainer`, the `train` command as an object (the same settings, the same run, the same files in
its --out), and `Engine` (megatrain.train.engine), one training system driven a step at a time by another program's
loop, as train's own loop drives it.

    import megatrain

    result = megatrain.Trainer(init_from="Qwen2.5-0.5B", data="sft.jsonl", steps=100, batch=8, seq=1024,
                               device="cuda", dtype="bfloat16", out="runs/sft", report_to="tensorboard").train()
    result.losses[-1], result.export  # the last step's loss, the Hugging Face checkpoint

    with megatrain.Engine("Qwen2.5-0.5B", seq=1024, batch=8, lr=1e-5, device="cuda", dtype="bfloat16") as engine:
        for input_ids, labels in my_batches:  # [rows, tokens], right-padded, labels -100 where no loss
            loss = engine.step(input_ids, labels)
        engine.export("runs/mine/hf")
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, fields
from pathlib import Path

from megatrain.train import checkpoint
from megatrain.train.config import TrainConfig, train_config
from megatrain.train.engine import Engine
from megatrain.train.loop import train
from megatrain.train.rundir import RUN_FILE

__all__ = ["Engine", "TrainResult", "Trainer", "run"]


@dataclass(frozen=True)
class TrainResult:
    """What a train run left: exit_code as the CLI's (0 done, 1 diverged, 129/130/143 interrupted and saved); step, the
    last trained; losses, the training loss of steps 1..step; eval_losses, the held-out loss by step; checkpoint, its
    latest complete checkpoint (None: none saved); export, the Hugging Face checkpoint this run wrote (None unless
    it ended done)."""

    exit_code: int
    step: int
    losses: list[float]
    eval_losses: dict[int, float]
    checkpoint: Path | None
    export: Path | None
    out: Path
    run_id: str


class Trainer:
    """`python -m megatrain train` as an object. Settings are train's flags by their TOML names (`--init-from DIR` is
    init_from="DIR"), each value as the flag takes it; a list setting (data, eval_data, report_to, ...) also takes
    one value, a path setting a Path. `config` is a TOML file of settings, under those given here; resume="DIR"
    continues that run. A wrong setting raises ValueError saying what to change, before anything is read."""

    def __init__(self, config: str | os.PathLike | None = None, **settings):
        self.config = train_config(_flag_values(settings), None if config is None else os.fspath(config))

    def train(self, log=print) -> TrainResult:
        """Run (or resume) the training; every line it says goes to `log` (and OUT/train.log)."""
        return run(self.config, log)


def run(cfg: TrainConfig, log=print) -> TrainResult:
    """Train as cfg says, the CLI's path and Trainer's alike, and read back what the run left in cfg.out."""
    code = train(cfg, log)
    out, metrics = Path(cfg.out), Path(cfg.out) / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    losses = [m["loss"] for m in lines if "loss" in m]
    exported = out / "hf" if code == 0 and (out / "hf").is_dir() else None
    return TrainResult(code, len(losses), losses, {m["step"]: m["eval_loss"] for m in lines if "eval_loss" in m},
                       checkpoint.latest(out / "checkpoints"), exported, out,
                       json.loads((out / RUN_FILE).read_text())["run_id"])


def _flag_values(settings: dict) -> dict:
    """Keyword settings as the flags give them: one value of a list setting as a list, paths as strings."""
    hints = typing.get_type_hints(TrainConfig)
    lists = {f.name for f in fields(TrainConfig) if typing.get_origin(hints[f.name]) is list}
    values = {}
    for key, value in settings.items():
        if key in lists and isinstance(value, str | os.PathLike):
            value = [value]
        values[key] = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value] \
            if isinstance(value, list) else os.fspath(value) if isinstance(value, os.PathLike) else value
    return values
