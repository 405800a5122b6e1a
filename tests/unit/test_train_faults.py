"""`python -m megatrain train` loses nothing: one run per --out and one process at a time, checkpoints verified by
checksum with a fallback, SIGTERM, divergence, torn metrics, bad or full disks (a tmpfs, where mounting is allowed),
kill -9 at named points (MEGATRAIN_FAULT). CPU, about a minute; the ones marked subprocess spawn python -m megatrain:
pytest tests/unit/test_train_faults.py"""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

transformers = pytest.importorskip("transformers")

from train_helpers import (  # noqa: E402
    ROOT,
    at_step,
    chat_tokenizer,
    fill,
    hf_model,
    interrupt_at_step,
    metrics,
    pretokenized,
    run_train,
    tmpfs,
    train_args,
)

from megatrain.cli import main  # noqa: E402
from megatrain.train.data import Rows  # noqa: E402
from megatrain.train.rundir import RunDir  # noqa: E402

SAVES = ["--save-every", "2", "--keep", "3"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A tiny model, 10 rows of data (batch 4: steps cross epochs), and its uninterrupted run of 8 steps."""
    root = tmp_path_factory.mktemp("straight")
    init, data = hf_model("qwen2", root / "init"), pretokenized(root / "data.jsonl", rows=10)
    assert run_train(init, data, root / "run", steps=8, extra=SAVES) == 0
    return init, data, [m["loss"] for m in metrics(root / "run")], root / "run"


def _resume(out, *extra):
    return main(["train", "--resume", str(out), *extra])


def _losses_once_each(out, steps=8):
    lines = metrics(out)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    return [m["loss"] for m in lines]


def _entries(path):
    return sorted(p.name for p in path.iterdir())


def _error(capsys) -> str:
    """The one error line of the last command (the log lines before it aside)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def _exported_step(out):
    return json.loads((out / "hf" / "megatrain_export.json").read_text())["step"]


def test_a_new_run_is_refused_a_directory_holding_another_and_overwrite_discards_it(straight, tmp_path, capsys):
    init, data, _, done = straight
    out = tmp_path / "run"
    shutil.copytree(done, out)
    first = json.loads((out / "run.json").read_text())["run_id"]
    assert run_train(init, data, out, steps=2, extra=SAVES) == 2
    assert f"--resume {out}" in _error(capsys) and len(metrics(out)) == 8
    assert run_train(init, data, out, steps=2, extra=[*SAVES, "--overwrite"]) == 0
    assert [m["step"] for m in metrics(out)] == [1, 2] and _exported_step(out) == 2
    assert _entries(out / "checkpoints") == ["step-2"], "the old run's steps 4-8 went, not the new run's step 2"
    assert json.loads((out / "run.json").read_text())["run_id"] != first
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("not a run\n")
    assert run_train(init, data, mine, steps=2, extra=["--overwrite"]) == 2
    assert "todo.txt" in _error(capsys) and (mine / "todo.txt").exists()


def test_overwrite_refuses_a_run_that_recorded_nothing_of_what_it_wrote_and_resume_continues_it(straight, tmp_path,
                                                                                                 capsys):
    """A run of a megatrain from before the manifest: its files cannot be told from the user's, so --overwrite
    deletes none of them and says what to do."""
    init, data, _, done = straight
    out = tmp_path / "run"
    shutil.copytree(done, out)
    (out / ".megatrain-written").unlink()
    before = _entries(out)
    for extra in ([], ["--overwrite"]):
        assert run_train(init, data, out, steps=2, extra=[*SAVES, *extra]) == 2
        assert _error(capsys) == f"error: --out {out} holds a run that recorded nothing of what it wrote " \
            f"({out / '.megatrain-written'} is missing: a run of a megatrain from before it, or one put together by " \
            f"hand), so its files cannot be told from yours: --resume {out} continues it; to discard it, delete it " \
            "yourself, or choose another --out"
        assert _entries(out) == before and len(metrics(out)) == 8
    assert _resume(out, "--steps", "9") == 0 and len(metrics(out)) == 9


@pytest.mark.parametrize("mine", ["checkpoints/notes.txt", "checkpoints/step-8.bak", "hf/README.md"])
def test_overwrite_deletes_no_file_put_into_the_runs_checkpoints_or_export(straight, tmp_path, capsys, mine):
    init, data, _, done = straight
    out = tmp_path / "run"
    shutil.copytree(done, out)
    (out / mine).write_text("a model card, say")
    assert run_train(init, data, out, steps=2, extra=[*SAVES, "--overwrite"]) == 2
    assert _error(capsys) == f"error: --overwrite {out}: {out / mine} is no file a run writes there (put there " \
        "since), and discarding the run would delete it: move it out first"
    assert (out / mine).read_text() == "a model card, say" and len(metrics(out)) == 8


def test_sigterm_saves_like_ctrl_c_and_the_previous_handler_comes_back(straight, tmp_path):
    init, data, losses, _ = straight
    out = tmp_path / "run"
    received = []
    previous = signal.signal(signal.SIGTERM, lambda *_: received.append(1))
    try:
        with pytest.MonkeyPatch.context() as mp:
            interrupt_at_step(mp, 3, signal.SIGTERM)
            assert run_train(init, data, out, steps=8, extra=SAVES) == 143
        os.kill(os.getpid(), signal.SIGTERM)
        assert received == [1], "train put back the handler it found"
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert _entries(out / "checkpoints") == ["step-2", "step-3"]
    assert _resume(out) == 0 and _losses_once_each(out) == losses


def test_sighup_a_closed_terminal_saves_like_sigterm_and_the_previous_handler_comes_back(straight, tmp_path,
                                                                                      capsys):
    init, data, losses, _ = straight
    out = tmp_path / "run"
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with pytest.MonkeyPatch.context() as mp:
            interrupt_at_step(mp, 3, signal.SIGHUP)
            assert run_train(init, data, out, steps=8, extra=SAVES) == 129
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, "train put back the handler it found"
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert f"interrupted (SIGHUP) at step 3: checkpoint at step 3 in {out / 'checkpoints'}" in capsys.readouterr().err
    assert _entries(out / "checkpoints") == ["step-2", "step-3"]
    assert _resume(out) == 0 and _losses_once_each(out) == losses


def test_a_delayed_update_run_stopped_by_sigterm_across_its_warm_up_resumes_bitwise(straight, tmp_path):
    """update_delay=1 after 2 exact updates: SIGTERM during step 3 (just past the change-over) saves both weight
    copies and the pending update applied; the resumed run's losses are the uninterrupted delayed run's."""
    init, data, exact, _ = straight
    delayed = [*SAVES, "--option", "update_delay=1", "--option", "update_delay_warmup=2"]
    assert run_train(init, data, tmp_path / "straight", steps=8, extra=delayed) == 0
    losses = _losses_once_each(tmp_path / "straight")
    assert losses[:3] == exact[:3] and losses[3] != exact[3], "exact until the first delayed update lands"
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        interrupt_at_step(mp, 3, signal.SIGTERM)
        assert run_train(init, data, out, steps=8, extra=delayed) == 143
    assert _resume(out) == 0 and _losses_once_each(out) == losses


def _interrupted_at_6(init, data, out):
    """A run of 8 steps stopped after step 6: checkpoints at steps 2, 4 and 6, metrics of steps 1-6."""
    with pytest.MonkeyPatch.context() as mp:
        interrupt_at_step(mp, 6)
        assert run_train(init, data, out, steps=8, extra=SAVES) == 130


def test_a_damaged_checkpoint_is_refused_by_name_and_the_fallback_resumes_from_the_one_before(straight, tmp_path,
                                                                                               capsys):
    init, data, losses, _ = straight
    out = tmp_path / "run"
    _interrupted_at_6(init, data, out)
    (out / "checkpoints" / "step-6" / "state.json").unlink()
    assert _resume(out) == 2
    assert "step-6/state.json is missing" in _error(capsys)
    with (out / "checkpoints" / "step-4" / "tiles.bin").open("r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    assert _resume(out, "--resume-fallback") == 0
    err = capsys.readouterr().err
    assert "resuming from step-2 (--resume-fallback)" in err and "step-4/tiles.bin does not match" in err
    assert _losses_once_each(out) == losses and _entries(out / "checkpoints") == ["step-4", "step-6", "step-8"]


@pytest.mark.parametrize("key, value", [
    ("step", "8"), ("step", 7), ("step", True), ("total_steps", [8]), ("data_rows_consumed", "32"), ("torch_rng", "x"),
    ("torch_rng", [1, 2, 3]), ("torch_rng", [999] * 5056), ("run_id", 5), ("files", []), ("files", {"tiles.bin": "x"}),
    ("files", {"../../run.json": {"bytes": 1, "sha256": ["0"]}}),
])
def test_a_trainer_json_of_valid_json_and_wrong_types_is_refused_naming_the_key(straight, tmp_path, capsys, key,
                                                                               value):
    out = tmp_path / "run"
    shutil.copytree(straight[3], out)
    meta = out / "checkpoints" / "step-8" / "trainer.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), key: value}))
    assert _resume(out, "--steps", "9") == 2
    assert f"step-8/trainer.json: {key} must be " in _error(capsys)


@pytest.mark.parametrize("name", ["run.json", "train.log", "metrics.jsonl", "memory.json",
                                  "checkpoints/step-8/trainer.json", "hf", "tensorboard"])
def test_a_folder_where_the_run_keeps_a_file_or_a_file_for_a_folder_is_refused_naming_it(straight, tmp_path, capsys,
                                                                                         name):
    out = tmp_path / "run"
    shutil.copytree(straight[3], out)
    if (out / name).is_dir():
        shutil.rmtree(out / name)
        (out / name).write_text("")
    elif (out / name).exists():
        (out / name).unlink()
        (out / name).mkdir()
    else:  # a run that reports to TensorBoard made it a folder
        (out / name).write_text("")
    assert _resume(out, "--steps", "9", *(["--report-to", "tensorboard"] if name == "tensorboard" else [])) == 2
    assert f"{out / name} " in _error(capsys)


def test_metrics_lose_a_torn_line_and_the_steps_after_the_resumed_checkpoint(straight, tmp_path):
    init, data, losses, _ = straight
    out = tmp_path / "run"
    _interrupted_at_6(init, data, out)
    shutil.rmtree(out / "checkpoints" / "step-6")  # the last checkpoint is step 4's, the metrics go to step 6
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "lo')  # killed mid-write
    assert _resume(out) == 0 and _losses_once_each(out) == losses


def test_resume_takes_the_recorded_data_position(straight, tmp_path, monkeypatch):
    init, data, _, _ = straight
    out = tmp_path / "run"
    assert run_train(init, data, out, steps=2, extra=SAVES) == 0
    meta_file = out / "checkpoints" / "step-2" / "trainer.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "data_rows_consumed": 7}))  # say, rows skipped as unusable
    firsts, batch = [], Rows.batch
    monkeypatch.setattr(Rows, "batch", lambda self, first, count: firsts.append(first) or batch(self, first, count))
    assert _resume(out, "--steps", "4") == 0
    assert firsts == [7, 11]


def test_a_resume_refuses_data_that_changed_since_the_run_started(straight, tmp_path, capsys):
    init, data, _, _ = straight
    mine = tmp_path / "data.jsonl"
    shutil.copy(data, mine)
    out = tmp_path / "run"
    assert run_train(init, mine, out, steps=2, extra=SAVES) == 0
    original, stat = mine.read_bytes(), mine.stat()
    lines = original.splitlines(keepends=True)
    mine.write_bytes(lines[1] + lines[0] + b"".join(lines[2:]))  # other rows at the recorded position, same size
    assert _resume(out, "--steps", "3") == 2
    assert f"the data changed: {mine} holds other bytes than when the run started (the same number)" in _error(capsys)
    mine.write_bytes(original)
    assert _resume(out, "--steps", "3") == 2
    assert "was modified since the run started (its size and sampled blocks are the same" in _error(capsys)
    os.utime(mine, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _resume(out, "--steps", "3") == 0


def test_a_resume_without_run_json_refuses_data_changed_since_the_run_started(straight, tmp_path, capsys):
    init, data, _, _ = straight
    mine, out, copied = tmp_path / "data.jsonl", tmp_path / "run", tmp_path / "copied"
    shutil.copy(data, mine)
    assert run_train(init, mine, out, steps=2, extra=SAVES) == 0
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    (out / "run.json").unlink()
    shutil.copytree(out / "checkpoints", copied / "checkpoints")  # a run's checkpoints alone, elsewhere
    original, stat = mine.read_bytes(), mine.stat()
    lines = original.splitlines(keepends=True)
    mine.write_bytes(lines[1] + lines[0] + b"".join(lines[2:]))
    for run in (out, copied):  # each checkpoint records what the run trained on
        assert _resume(run, "--steps", "3") == 2
        assert f"the data changed: {mine} holds other bytes than when the run started" in _error(capsys)
    meta_file = copied / "checkpoints" / "step-2" / "trainer.json"
    older = {k: v for k, v in json.loads(meta_file.read_text()).items() if not k.endswith("_files")}
    meta_file.write_text(json.dumps(older))  # as an older megatrain wrote it, and no run.json beside it
    assert _resume(copied, "--steps", "3") == 2
    assert "records what the run's data was (run.json deleted, and a checkpoint of an older megatrain)" in \
        _error(capsys)
    mine.write_bytes(original)
    os.utime(mine, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _resume(out, "--steps", "3") == 0
    assert json.loads((out / "run.json").read_text())["run_id"] == run_id  # written again, under the run's id


def test_a_resume_refuses_a_tokenizer_changed_since_the_run_started(tmp_path, capsys):
    tok, data, out = tmp_path / "tok", tmp_path / "text.jsonl", tmp_path / "run"
    chat_tokenizer(tok)
    data.write_text("".join(json.dumps({"text": " ".join(f"w{i + j}" for j in range(6))}) + "\n" for i in range(8)))
    assert main(["train", "--model", "tiny", "--tokenizer", str(tok), "--data", str(data), "--seq", "8", "--batch",
                 "2", "--steps", "1", "--out", str(out)]) == 0
    config = tok / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "eos_token": "<|im_end|>"}))  # every row's EOS
    assert _resume(out, "--steps", "2") == 2
    assert f"the tokenizer changed: {config.resolve()} holds" in _error(capsys)


def test_a_resume_refuses_a_checkpoint_of_another_run_and_an_edited_record_of_its_data(straight, tmp_path, capsys):
    init, data, _, _ = straight
    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        assert run_train(init, data, out, steps=2, extra=SAVES) == 0
    shutil.rmtree(b / "checkpoints")
    shutil.copytree(a / "checkpoints", b / "checkpoints")  # the same data: only the run ids tell them apart
    assert _resume(b, "--steps", "3") == 2
    run_a = json.loads((a / "run.json").read_text())["run_id"]
    assert f"step-2 is a checkpoint of run {run_a}, and {b / 'run.json'} is of run " in _error(capsys)
    meta_file = a / "checkpoints" / "step-2" / "trainer.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "data_files": {name: 5 for name in meta["data_files"]}}))
    assert _resume(a, "--steps", "3") == 2
    assert _error(capsys) == f"error: {meta_file}: data_files is not what a run records (file names to their size, " \
        "modification time and hash): it was edited; restore it, or start a new run in another --out"


def test_a_named_chat_template_is_fingerprinted_and_exported(tmp_path, capsys):
    tok, data, out = tmp_path / "tok", tmp_path / "chat.jsonl", tmp_path / "run"
    chat_tokenizer(tok)
    named = tok / "additional_chat_templates" / "default.jinja"  # where transformers reads a template named default
    named.parent.mkdir()
    (tok / "chat_template.jinja").rename(named)
    turns = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4 w5"}]
    data.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(4)))
    assert main(["train", "--model", "tiny", "--tokenizer", str(tok), "--data", str(data), "--seq", "8", "--batch",
                 "2", "--steps", "1", "--out", str(out)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(out / "hf", local_files_only=True)
    assert exported.chat_template == named.read_text()
    named.write_text(named.read_text().replace("<|im_end|>\n", "<|im_end|>"))
    assert _resume(out, "--steps", "2") == 2
    assert f"the tokenizer changed: {named.resolve()} holds" in _error(capsys)


def test_a_resume_refuses_an_init_from_config_changed_since_the_run_started(straight, tmp_path, capsys):
    init, data, out = tmp_path / "init", straight[1], tmp_path / "run"
    shutil.copytree(straight[0], init)
    assert run_train(init, data, out, steps=1) == 0
    config = init / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rms_norm_eps": 0.5}))  # the weights' shapes stand
    assert _resume(out, "--steps", "2") == 2
    assert f"--init-from's config changed: {config.resolve()} holds" in _error(capsys)


def test_a_run_started_with_relative_paths_resumes_from_anywhere(straight, tmp_path, monkeypatch):
    init, data, _, _ = straight
    shutil.copytree(init, tmp_path / "init")
    shutil.copy(data, tmp_path / "data.jsonl")
    monkeypatch.chdir(tmp_path)
    assert run_train("init", "data.jsonl", "run", steps=2, extra=SAVES) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _resume(tmp_path / "run", "--steps", "3") == 0
    (tmp_path / "run").rename(tmp_path / "moved")
    assert _resume(tmp_path / "moved", "--steps", "4") == 0 and len(metrics(tmp_path / "moved")) == 4


def test_a_resume_with_nothing_to_train_or_into_another_out_is_refused(straight, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(straight[3], out)
    assert _resume(out) == 2 and "pass --steps N with N above 8" in _error(capsys)
    assert _resume(out, "--steps", "6") == 2 and "nothing to train" in _error(capsys)
    assert _resume(out, "--steps", "10", "--out", str(tmp_path / "other")) == 2
    assert "drop --out" in _error(capsys) and not (tmp_path / "other").exists()


@pytest.mark.filterwarnings("ignore:.*update skipped:UserWarning")
def test_a_diverging_run_stops_with_its_last_finite_checkpoint_and_no_export(straight, tmp_path, capsys):
    init, data, _, _ = straight
    out = tmp_path / "run"
    assert run_train(init, data, out, steps=30, extra=["--lr", "1e3", "--save-every", "1", "--keep", "1"]) == 1
    assert "diverged: the loss or gradient norm was not finite for 3 steps" in capsys.readouterr().err
    lines = metrics(out)
    assert not (out / "hf").exists() and len(lines) < 30
    assert not any(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in lines[-3:])
    (kept,) = _entries(out / "checkpoints")
    last = lines[int(kept.removeprefix("step-")) - 1]
    assert math.isfinite(last["loss"]) and math.isfinite(last["grad_norm"])
    on = tmp_path / "on"
    assert run_train(init, data, on, steps=12, extra=["--lr", "1e3", "--max-nonfinite-steps", "0"]) == 1
    assert len(metrics(on)) == 12 and not (on / "hf").exists(), "never stopped, and its end kept nowhere"


@pytest.mark.filterwarnings("ignore:.*update skipped:UserWarning")
def test_a_run_ending_on_a_non_finite_step_keeps_its_last_good_checkpoint_and_export(straight, tmp_path, capsys):
    out = tmp_path / "nf"
    shutil.copytree(straight[3], out)  # 8 good steps, exported
    assert _resume(out, "--steps", "10", "--lr", "1e30", "--keep", "1") == 1
    assert "not finite for 1 step in a row (to step 10); stopped without saving" in capsys.readouterr().err
    assert not math.isfinite(metrics(out)[-1]["loss"]), "the last step was not finite"
    assert _entries(out / "checkpoints") == ["step-4", "step-6", "step-8"] and _exported_step(out) == 8


def test_an_init_from_inside_out_is_refused_before_anything_is_deleted(straight, tmp_path, capsys):
    _, data, _, done = straight
    out = tmp_path / "run"
    shutil.copytree(done, out)
    assert run_train(out / "hf", data, out, steps=2, extra=["--overwrite"]) == 2
    assert "is inside --out" in _error(capsys) and _exported_step(out) == 8


def test_files_no_export_writes_stay_in_hf_across_exports(straight, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(straight[3], out)
    (out / "hf" / "README.md").write_text("# my model\n")
    (out / "hf" / "eval").mkdir()
    (out / "hf" / "eval" / "scores.json").write_text("{}")
    assert _resume(out, "--steps", "9") == 0 and _exported_step(out) == 9
    assert (out / "hf" / "README.md").read_text() == "# my model\n" and (out / "hf" / "eval" / "scores.json").exists()


def test_an_out_that_cannot_hold_a_run_is_refused_in_one_line(straight, tmp_path, capsys):
    init, data, _, _ = straight
    (tmp_path / "file").write_text("")
    assert run_train(init, data, tmp_path / "file", steps=1) == 2 and "is a file" in _error(capsys)
    assert run_train(init, data, "/proc/megatrain-run", steps=1) == 2
    line = _error(capsys)
    assert "cannot write there" in line and "GiB" not in line
    with tmpfs(tmp_path / "ro", "size=1m", read_only=True) as ro:
        assert run_train(init, data, ro / "run", steps=1) == 2 and "Read-only file system" in _error(capsys)


def test_a_full_disk_mid_run_ends_in_one_line_and_the_run_resumes(straight, tmp_path, capsys):
    init, data, losses, _ = straight
    with tmpfs(tmp_path / "disk", "size=8m") as disk:
        out, filler = disk / "run", disk / "filler"
        with pytest.MonkeyPatch.context() as mp:
            at_step(mp, 3, lambda: fill(filler))
            assert run_train(init, data, out, steps=8, extra=SAVES) == 2
        line = _error(capsys)
        assert "disk full writing" in line and "step-2, is intact" in line
        assert _entries(out / "checkpoints") == ["step-2"], "the partial checkpoint is deleted"
        filler.unlink()
        assert _resume(out) == 0 and _losses_once_each(out) == losses


def _fill_under(path) -> None:
    """Every write to the open file at path fails as on a full disk (/dev/full in its place, its descriptor kept)."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                full = os.open("/dev/full", os.O_WRONLY)
                os.dup2(full, fd)
                os.close(full)


def test_a_full_disk_at_the_train_log_ends_in_one_line_and_the_run_resumes(straight, tmp_path, capsys):
    init, data, losses, _ = straight
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        at_step(mp, 3, lambda: _fill_under(out / "train.log"))  # its metrics line fits, its log line not
        assert run_train(init, data, out, steps=8, extra=SAVES) == 2
    assert _error(capsys) == f"error: disk full writing {out / 'train.log'}: the last complete checkpoint, " \
        f"{out / 'checkpoints' / 'step-2'}, is intact; free space, then --resume {out}"
    claim = RunDir._claim

    def claimed_then_full(run, *args):  # full from the resume's first line (a link at its claim is refused)
        claim(run, *args)
        (out / "train.log").rename(tmp_path / "train.log")
        (out / "train.log").symlink_to("/dev/full")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RunDir, "_claim", claimed_then_full)
        assert _resume(out) == 2 and "disk full writing" in _error(capsys)
    (out / "train.log").unlink()
    assert _resume(out) == 0 and _losses_once_each(out) == losses


@pytest.mark.parametrize("saves", [True, False])
def test_a_full_disk_during_the_export_ends_in_one_line(straight, tmp_path, capsys, saves):
    init, data, _, done = straight
    size = lambda d: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())  # noqa: E731
    room = (size(done / "checkpoints" / "step-8") if saves else 0) + size(done / "hf") // 2
    with tmpfs(tmp_path / "disk", "size=8m") as disk:
        out = disk / "run"
        with pytest.MonkeyPatch.context() as mp:  # room for the last step's metrics and checkpoint, not the export
            at_step(mp, 2, lambda: fill(disk / "filler", leave_bytes=room))
            assert run_train(init, data, out, steps=2, extra=[] if saves else ["--no-save"]) == 2
        line = _error(capsys)
        assert f"disk full writing {out / 'hf'} at step 2" in line
        if not saves:
            assert "no checkpoint to resume from (none saved yet, or --no-save)" in line
            return
        assert "step-2, is intact" in line and not (out / "hf").exists()
        (disk / "filler").unlink()
        assert _resume(out) == 0 and _exported_step(out) == 2


def _killed(args, fault):
    """`python -m megatrain train ARGS` killed with SIGKILL at the point MEGATRAIN_FAULT names."""
    env = {**os.environ, "MEGATRAIN_FAULT": fault, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "megatrain", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


@pytest.mark.subprocess
def test_kill_9_between_a_checkpoint_written_and_swapped_in_loses_nothing(straight, tmp_path):
    init, data, losses, _ = straight
    out = tmp_path / "run"
    _killed(train_args(init, data, out, steps=8, extra=SAVES), "written-step-4")
    assert _entries(out / "checkpoints") == [".step-4.tmp", "step-2"]
    assert _resume(out) == 0 and _losses_once_each(out) == losses
    assert _entries(out / "checkpoints") == ["step-4", "step-6", "step-8"]


@pytest.mark.subprocess
@pytest.mark.parametrize("fault, leftovers, resumed", [("written-hf", [".hf.tmp", "hf"], 0),
                                                       ("swap-hf", [".hf.old", ".hf.tmp"], 2)])
def test_kill_9_mid_export_leaves_the_old_export_or_the_new_one(straight, tmp_path, fault, leftovers, resumed):
    out = tmp_path / "run"
    shutil.copytree(straight[3], out)
    _killed(["train", "--resume", str(out), "--steps", "10"], fault)
    assert [name for name in _entries(out) if "hf" in name] == leftovers
    # Written, not swapped: the old export stands, and the resume exports step 10. Mid-swap: the new one was
    # complete, so it is swapped in, and there is nothing left to do.
    assert _resume(out, "--steps", "10") == resumed
    assert [name for name in _entries(out) if "hf" in name] == ["hf"] and _exported_step(out) == 10
    transformers.AutoModelForCausalLM.from_pretrained(out / "hf")


@pytest.mark.subprocess
def test_a_second_process_on_the_same_out_is_refused_and_sigterm_saves(straight, tmp_path, capsys):
    init, data, _, _ = straight
    out = tmp_path / "run"
    with (tmp_path / "stderr").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "megatrain", *train_args(init, data, out, steps=10**5)],
                                cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run_train(init, data, out, steps=2) == 2
        assert f"--out {out} is in use by another train process" in _error(capsys)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        proc.kill()
    reached = metrics(out)[-1]["step"]
    assert "interrupted (SIGTERM)" in (tmp_path / "stderr").read_text()
    assert _entries(out / "checkpoints") == [f"step-{reached}"]
    assert _resume(out, "--steps", str(reached + 1)) == 0, "the lock died with its process"
