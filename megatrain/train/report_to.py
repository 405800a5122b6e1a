"""`train --report-to`: the lines of OUT/metrics.jsonl sent on to TensorBoard, Weights & Biases or MLflow (the names
Hugging Face's Trainer uses), each an optional extra. Every numeric field of a line is one scalar under its
metrics.jsonl name (loss, lr, grad_norm, tokens_per_s, tflops, eval_loss, host_peak_gib, gpu_peak_gib, ...) at its
step.

- tensorboard: event files in OUT/tensorboard/; a resumed run purges the steps it trains again.
- wandb: the run's id is megatrain's (run.json), so a resumed run continues its W&B run; its files go to OUT/wandb/;
  WANDB_PROJECT (default megatrain), WANDB_MODE=offline, WANDB_API_KEY and the rest as W&B reads them.
- mlflow: one MLflow run per invocation, tagged with megatrain's run id; MLFLOW_TRACKING_URI (default: MLflow's
  local store), MLFLOW_EXPERIMENT_NAME and MLFLOW_RUN_ID as MLflow reads them.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

# --report-to name -> (the module it imports, the pip extra that installs it)
REPORT_TO = {"tensorboard": ("torch.utils.tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow"), "none": (None, None)}
TENSORBOARD_DIR = "tensorboard"


def check_report_to(names: list[str]) -> None:
    """Each --report-to name is known and its package importable: ValueError with the extra to install."""
    for name in names:
        if name not in REPORT_TO:
            raise ValueError(f"--report-to must be one of {', '.join(REPORT_TO)}, got {name!r}")
        module, extra = REPORT_TO[name]
        if module is None:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            raise ValueError(f"--report-to {name} needs the {extra} package: pip install 'megatrain[{extra}]'") \
                from None


class Reporters:
    """The integrations of one train invocation: started once the run is (its id known), given every metrics line,
    closed with the run's exit code (None: it raised)."""

    def __init__(self, names: list[str], out: Path):
        self.names, self.out, self.sinks = [n for n in names if n != "none"], out, []

    def start(self, run_id: str, start_step: int, settings: dict) -> None:
        for name in self.names:  # one by one: those started before one that raises are closed all the same
            self.sinks.append(SINKS[name](self.out, run_id, start_step, settings))

    def log(self, line: dict) -> None:
        """One metrics.jsonl line: its numeric fields at its step."""
        values = {k: float(v) for k, v in line.items() if k != "step" and isinstance(v, int | float)}
        for sink in self.sinks:
            sink.log(values, line["step"])

    def close(self, code: int | None) -> None:
        for sink in self.sinks:
            sink.close(code)
        self.sinks = []


class TensorBoard:
    def __init__(self, out: Path, run_id: str, start_step: int, settings: dict):
        from torch.utils.tensorboard import SummaryWriter

        # events of steps after start_step, from the run before a resume, are hidden: those steps are trained again
        self.writer = SummaryWriter(str(out / TENSORBOARD_DIR), purge_step=start_step + 1 if start_step else None)
        if not start_step:
            self.writer.add_text("settings", _settings_text(settings))

    def log(self, values: dict, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self, code: int | None) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, run_id: str, start_step: int, settings: dict):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "megatrain"), id=run_id, resume="allow",
                              name=out.name, config=settings, dir=str(out))

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self, code: int | None) -> None:
        self.run.finish(exit_code=1 if code is None else code)


class MLflow:
    def __init__(self, out: Path, run_id: str, start_step: int, settings: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.start_run(run_name=out.name, tags={"megatrain.run_id": run_id, "megatrain.start_step": str(start_step)})
        mlflow.log_params({k: str(v) for k, v in settings.items()})

    def log(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self, code: int | None) -> None:
        self.mlflow.end_run(status="FINISHED" if code == 0 else "KILLED" if code in (129, 130, 143) else "FAILED")


SINKS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def _settings_text(settings: dict) -> str:
    return "\n".join(f"    {k} = {v!r}" for k, v in settings.items())  # indented: TensorBoard's markdown as code
