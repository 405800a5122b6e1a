"""What a train run leaves for its user beside metrics.jsonl: OUT/train.log (the terminal's lines, a resume's
appended), lines written above the progress bar, and --report-to: TensorBoard's event files under --out (read back
with TensorBoard's own reader), W&B and MLflow through stand-ins of their modules (their calls recorded). CPU,
seconds: pytest tests/unit/test_train_outputs.py"""

import json
import shutil
import sys
from types import SimpleNamespace

import pytest
import torch
from tqdm import tqdm
from train_helpers import hf_model, interrupt_at_step, metrics, pretokenized, run_train

from megatrain.cli import main
from megatrain.train.runlog import LOG_FILE, RunLog


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A tiny checkpoint, training data and held-out data, shared by the runs here."""
    root = tmp_path_factory.mktemp("case")
    return SimpleNamespace(init=hf_model("qwen2", root / "init"), data=pretokenized(root / "data.jsonl", rows=12),
                           held_out=pretokenized(root / "eval.jsonl", rows=4, seed=2))


def test_train_log_holds_every_line_the_terminal_showed_and_a_resume_appends(tmp_path, case, capsys):
    out = tmp_path / "run"
    assert run_train(case.init, case.data, out, steps=2, extra=["--eval-data", str(case.held_out), "--eval-every",
                                                                "1"]) == 0
    said = capsys.readouterr().err.splitlines()
    assert (out / LOG_FILE).read_text().splitlines() == said
    assert any("held-out loss" in line for line in said) and said[-1].startswith("done: 2 steps")
    assert main(["train", "--resume", str(out)]) == 2  # nothing to train: refused, the refusal logged too
    resumed = capsys.readouterr().err.splitlines()
    assert resumed[-1].startswith("error: nothing to train")
    assert (out / LOG_FILE).read_text().splitlines() == [*said, *resumed]


def test_the_export_keeps_the_source_checkpoints_dtype_and_says_so(tmp_path, case, capsys):
    """An fp32 checkpoint trained at --dtype bfloat16 (fp32 masters) is exported in fp32: in bf16 (what the export
    wrote) a norm's updates at lr 1e-5 round away, so the export held the untrained norms. --export-dtype asks
    otherwise."""
    from safetensors.torch import load_file

    norm = "model.norm.weight"
    start = load_file(case.init / "model.safetensors")[norm]
    bf16 = ["--dtype", "bfloat16", "--lr", "1e-5", "--min-lr", "0", "--warmup-steps", "0", "--lr-schedule", "constant"]
    for asked, dtype, said in (([], torch.float32, "float32 weights: the --init-from checkpoint's dtype"),
                               (["--export-dtype", "bfloat16"], torch.bfloat16, "bfloat16 weights: --export-dtype")):
        out = tmp_path / str(dtype)
        assert run_train(case.init, case.data, out, steps=2, extra=[*bf16, *asked]) == 0
        trained = load_file(out / "hf" / "model.safetensors")[norm]
        assert trained.dtype == dtype and json.loads((out / "hf" / "config.json").read_text())["dtype"] == str(
            dtype).removeprefix("torch.")
        assert f"({said})" in capsys.readouterr().err.splitlines()[-1]
        moved = trained.float() != start
        assert bool(moved.all()) if dtype == torch.float32 else not bool(moved.any()), "updates of ~2e-5 round away"


def test_a_line_said_while_the_bar_runs_is_written_above_it(capsys):
    bar = tqdm(total=3, file=sys.stderr, ncols=60)
    bar.update(1)
    log = RunLog(lambda line: print(line, file=sys.stderr))
    log.bar = bar
    log("step 1/3: held-out loss 4.2")
    log.step("step 1/3: loss 4.3")  # the bar shows the steps: not said
    bar.close()
    err = capsys.readouterr().err
    assert "\rstep 1/3: held-out loss 4.2\n" in err  # the bar cleared first, the line on a line of its own
    assert "loss 4.3" not in err


def test_tensorboard_holds_every_steps_loss_once_across_a_resume(tmp_path, case, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    extra = ["--report-to", "tensorboard", "--save-every", "2", "--eval-data", str(case.held_out), "--eval-every", "2"]
    with monkeypatch.context() as mp:
        interrupt_at_step(mp, 3)
        assert run_train(case.init, case.data, out, steps=5, extra=extra) == 130
    shutil.rmtree(out / "checkpoints" / "step-3")  # as a kill before step 3's checkpoint: the resume trains it again
    assert main(["train", "--resume", str(out)]) == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    lines = metrics(out)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "host_peak_gib", "eval_loss"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        expected = [(m["step"], pytest.approx(m[key], rel=1e-6)) for m in lines if key in m]
        assert logged == expected, key
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]


class _Recorder:
    """A stand-in for the wandb or mlflow module: every call, by name, with its arguments."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return self  # wandb.init's run: its log and finish come back here too

        return call

    def named(self, name):
        return [(args, kwargs) for n, args, kwargs in self.calls if n == name]


def test_wandb_and_mlflow_get_every_line_at_its_step_and_the_runs_end(tmp_path, case, monkeypatch, capsys):
    wandb, mlflow = _Recorder(), _Recorder()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    out = tmp_path / "run"
    extra = ["--report-to", "wandb", "--report-to", "mlflow", "--eval-data", str(case.held_out), "--eval-every", "2"]
    assert run_train(case.init, case.data, out, steps=2, extra=extra) == 0
    run_id = (out / "run.json").read_text().split('"run_id": "')[1].split('"')[0]
    lines = [{k: v for k, v in m.items() if k != "step"} for m in metrics(out)]
    steps = [m["step"] for m in metrics(out)]
    (_, init), = wandb.named("init")
    assert init["id"] == run_id and init["resume"] == "allow" and init["dir"] == str(out)
    assert init["config"]["steps"] == 2 and init["project"] == "megatrain"
    assert [(args[0], kwargs["step"]) for args, kwargs in wandb.named("log")] == list(zip(lines, steps, strict=True))
    assert wandb.named("finish") == [((), {"exit_code": 0})]
    (_, start), = mlflow.named("start_run")
    assert start["tags"]["megatrain.run_id"] == run_id
    assert mlflow.named("log_params")[0][0][0]["steps"] == "2"
    assert [(args[0], kwargs["step"]) for args, kwargs in mlflow.named("log_metrics")] == \
        list(zip(lines, steps, strict=True))
    assert mlflow.named("end_run") == [((), {"status": "FINISHED"})]


def test_a_missing_report_to_package_is_one_line_naming_its_extra(tmp_path, case, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails, as where it is not installed
    assert run_train(case.init, case.data, tmp_path / "run", steps=1, extra=["--report-to", "wandb"]) == 2
    assert capsys.readouterr().err.strip() == "error: --report-to wandb needs the wandb package: pip install " \
        "'megatrain[wandb]'"
    assert run_train(case.init, case.data, tmp_path / "run", steps=1, extra=["--report-to", "comet"]) == 2
    assert "--report-to must be one of tensorboard, wandb, mlflow, none, got 'comet'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
