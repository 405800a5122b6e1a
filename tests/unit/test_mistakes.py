"""Every mistake a user can make in what `train`, `suite` and `bench` read is one line and exit 2, naming the file, flag
or line, and an input mistake is found before the run directory is claimed. CPU, about half a minute:
pytest tests/unit/test_mistakes.py"""

import contextlib
import json
import os
import shutil
import signal
import threading

import pytest

pytest.importorskip("transformers")

from train_helpers import at_step, hf_model, make_read_only, one_error, pretokenized, run_train, unmount  # noqa: E402

import megatrain.train.engine as engine  # noqa: E402
from megatrain.cli import main  # noqa: E402
from megatrain.models.handwritten.hf import INDEX_FILE, SINGLE_FILE  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Hugging Face model and pre-tokenized data, and a run of 2 steps checkpointed at each."""
    root = tmp_path_factory.mktemp("mistakes")
    init, data = hf_model("qwen2", root / "init"), pretokenized(root / "data.jsonl", rows=8)
    assert run_train(init, data, root / "run", steps=2, extra=["--save-every", "1"]) == 0
    return init, data, root / "run"


def _truncated(d):
    weights = d / SINGLE_FILE
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])


def _header_flipped(d):
    weights = d / SINGLE_FILE
    raw = bytearray(weights.read_bytes())
    raw[8:20] = b"not a header"
    weights.write_bytes(bytes(raw))


def _sharded(d, weight_map):
    (d / SINGLE_FILE).rename(d / "model-00001-of-00002.safetensors")
    (d / INDEX_FILE).write_text(json.dumps(weight_map))


def _config(d, **changes):
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("damage, says", [
    (_truncated, "model.safetensors is not a readable safetensors file"),
    (lambda d: (d / SINGLE_FILE).write_bytes(b""), "model.safetensors is not a readable safetensors file"),
    (_header_flipped, "model.safetensors is not a readable safetensors file"),
    (lambda d: _sharded(d, {"metadata": {}}), f"{INDEX_FILE} has no weight_map"),
    (lambda d: _sharded(d, {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}),
     "names shard model-00002-of-00002.safetensors, which is not in"),
    (lambda d: _config(d, vocab_size="128"), 'config.json vocab_size="128" must be an integer'),
    (lambda d: _config(d, hidden_size=32), "embed_tokens.weight has shape (128, 64), the config implies (128, 32)"),
    (lambda d: _config(d, rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
     "rope_theta must be a finite number > 0, got nan"),
    (lambda d: (d / "tokenizer.json").write_text("not a tokenizer"), "tokenizer.json is not a tokenizer"),
])
def test_a_damaged_init_from_is_refused_in_one_line_before_out_is_claimed(files, tmp_path, capsys, damage, says):
    init, data, _ = files
    bad = tmp_path / "init"
    shutil.copytree(init, bad)
    damage(bad)
    assert run_train(bad, data, tmp_path / "run", steps=1) == 2
    line = one_error(capsys)
    assert says in line and str(bad) in line
    assert not (tmp_path / "run").exists(), "nothing claimed: the corrected command needs no --overwrite"


@contextlib.contextmanager
def _released(fifo):
    """A reader of fifo gets its end of file instead of blocking forever (so a test of code that reads it fails
    rather than hangs): a writer opens it the moment a reader has, and closes it."""
    stop = threading.Event()

    def writer():
        while not stop.wait(0.05):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader yet
                pass

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_data_folders_read_regular_files_only(files, tmp_path, capsys):
    init, data, _ = files
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(data, folder / "a.jsonl")
    os.mkfifo(folder / "fifo.jsonl")  # read, it would block forever
    (folder / "dir.jsonl").mkdir()
    (folder / "loop.jsonl").symlink_to(folder / "loop.jsonl")
    with pytest.warns(UserWarning) as said, _released(folder / "fifo.jsonl"):
        assert run_train(init, folder, tmp_path / "run", steps=1) == 0
    skipped = {str(w.message).split("skipped ")[1].split(",")[0] for w in said}
    assert skipped == {"dir.jsonl", "fifo.jsonl", "loop.jsonl"}
    for named in ("fifo.jsonl", "loop.jsonl"):
        assert run_train(init, folder / named, tmp_path / named, steps=1) == 2
        assert f"--data {folder / named} is not a regular file" in one_error(capsys)


def test_a_config_file_resume_that_is_not_a_path_is_refused(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("resume = 5\n")
    assert main(["train", "--config", str(tmp_path / "run.toml")]) == 2
    assert "train setting resume=5: expected a string" in one_error(capsys)


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def test_a_copy_beside_the_checkpoints_is_not_one(files, tmp_path):
    out = _copy(files[2], tmp_path)
    shutil.copytree(out / "checkpoints" / "step-2", out / "checkpoints" / "step-2.bak")
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 0
    assert (out / "checkpoints" / "step-2.bak").is_dir(), "someone's copy: left alone"


@pytest.mark.parametrize("text", ['{"step": 2, "total_ste', "[]", "{}"])
def test_an_unreadable_trainer_json_names_itself_and_the_fallback_passes_it(files, tmp_path, capsys, text):
    out = _copy(files[2], tmp_path)
    (out / "checkpoints" / "step-2" / "trainer.json").write_text(text)
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    line = one_error(capsys)
    assert f"{out / 'checkpoints' / 'step-2' / 'trainer.json'} " in line and "--resume-fallback" in line
    assert main(["train", "--resume", str(out), "--steps", "3", "--resume-fallback"]) == 0
    assert "resuming from step-1 (--resume-fallback): step-2 deleted" in capsys.readouterr().err


@pytest.mark.parametrize("where, text, says", [
    ("metrics.jsonl", "garbage\n", "metrics.jsonl:3 is not a metrics line a run writes ('garbage')"),
    ("metrics.jsonl", '{"loss": 1}\n', "metrics.jsonl:3 is not a metrics line"),
    ("hf/megatrain_export.json", "garbage", "megatrain_export.json is not what an export writes"),
    ("hf/megatrain_export.json", "[2]", "megatrain_export.json is not what an export writes"),
])
def test_a_damaged_file_of_the_run_names_itself(files, tmp_path, capsys, where, text, says):
    out = _copy(files[2], tmp_path)
    with (out / where).open("a" if where == "metrics.jsonl" else "w") as f:
        f.write(text)
    # metrics are read on every resume, the export's step on one with nothing left to train
    assert main(["train", "--resume", str(out), *(["--steps", "3"] if where == "metrics.jsonl" else [])]) == 2
    assert says in one_error(capsys)


def test_ctrl_c_before_the_first_step_says_so_and_the_same_command_runs_again(files, tmp_path, capsys, monkeypatch):
    init, data, _ = files
    out = tmp_path / "run"
    build = engine.build_system  # the Engine train's loop opens builds the system
    with monkeypatch.context() as mp:  # Ctrl-C while the system builds: before train's handlers stand
        mp.setattr(engine, "build_system", lambda case: (_ for _ in ()).throw(KeyboardInterrupt))
        try:
            code = run_train(init, data, out, steps=2)
        except KeyboardInterrupt:  # escaped main, as a 30-line traceback
            code = None
        assert code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted (Ctrl-C)"

    def built(case):  # Ctrl-C while the weights load: after the handlers stand, before step 1
        system = build(case)
        load = system.load_weights
        system.load_weights = lambda named: (load(named), os.kill(os.getpid(), signal.SIGINT))
        return system

    with monkeypatch.context() as mp:
        mp.setattr(engine, "build_system", built)
        assert run_train(init, data, out, steps=2) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "interrupted (SIGINT) at step 0: nothing trained, no checkpoint: run the same command again"
    assert run_train(init, data, out, steps=2) == 0, "a run that trained no step holds nothing --overwrite must discard"


def test_a_checkpoints_folder_made_read_only_mid_run_ends_in_one_line(files, tmp_path, capsys, monkeypatch):
    init, data, _ = files
    out = tmp_path / "run"
    at_step(monkeypatch, 2, lambda: make_read_only(out / "checkpoints"))
    try:
        assert run_train(init, data, out, steps=3, extra=["--save-every", "1"]) == 2
    finally:
        unmount(out / "checkpoints")
    line = one_error(capsys)
    assert f"cannot write (Read-only file system) {out / 'checkpoints'} at step 2" in line
    assert "checkpoints/step-1, is intact; make it writable, then --resume" in line


SUITE = """description = "mistakes"
hardware = "cpu-ci"
[defaults]
systems = "native"
models = "tiny"
device = "cpu"
steps = 1
"""


@pytest.mark.parametrize("text, says", [
    ('description = "x"\ncases = 5\n', "cases = 5 must be [[cases]] tables"),
    ('description = "x"\ncases = [1]\n', "cases entry 0 is not a table"),
    ('description = "x"\ndefaults = 3\n[[cases]]\nsystems = "native"\n', "defaults = 3 must be a table"),
    ('timeout_s = "soon"\n', 'timeout_s = "soon" must be a number of seconds'),
    (SUITE + '[[cases]]\nlabel = "{nope}"\n', "label '{nope}' cannot be filled"),
    (SUITE + "[[cases]]\nlabel = 5\n", "label=5: expected a string"),
    (SUITE + '[[cases]]\nbatch = "two"\n', "case setting batch='two': expected an integer"),
    (SUITE + '[[cases]]\nladder = "batch"\nbatch = [1, "a"]\n', "case setting batch='a': expected an integer"),
    (SUITE + "[[cases]]\noptim = 5\n", "optim=5: expected a table"),
])
def test_a_suite_file_mistake_is_one_line_naming_the_file(tmp_path, capsys, text, says):
    (tmp_path / "s.toml").write_text(text)
    assert main(["suite", str(tmp_path / "s.toml"), "--out-dir", str(tmp_path / "out"), "--dry-run"]) == 2
    line = one_error(capsys)
    assert line.startswith(f"error: {tmp_path / 's.toml'}: ") and says in line


def test_a_second_suite_runner_on_one_out_dir_is_refused(tmp_path, capsys):
    from megatrain.bench.suite import sole_runner

    (tmp_path / "s.toml").write_text(SUITE + '[[cases]]\nname = "a"\n')
    with sole_runner(tmp_path / "out"):  # another runner's, alive
        assert main(["suite", str(tmp_path / "s.toml"), "--out-dir", str(tmp_path / "out")]) == 2
    assert f"--out-dir {tmp_path / 'out'} is in use by another suite runner" in one_error(capsys)
    with sole_runner(tmp_path / "out"):
        pass  # the kernel dropped the first lock with its descriptor: this one takes it


BENCH = ["bench", "--system", "native", "--model", "tiny", "--batch", "2", "--seq", "8", "--steps", "1",
         "--warmup", "0", "--device", "cpu"]


def test_bench_refuses_an_out_it_cannot_append_to_before_running(tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr("megatrain.bench.case.run_case", lambda *a, **k: ran.append(1))
    assert main([*BENCH, "--out", "/proc/megatrain/records.jsonl"]) == 2
    assert "--out /proc/megatrain/records.jsonl: cannot write there" in one_error(capsys)
    assert main([*BENCH, "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a folder" in one_error(capsys)
    assert ran == [] and list(tmp_path.iterdir()) == []
