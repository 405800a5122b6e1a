"""What train, report and the Engine read, write and delete in the directories a user names (megatrain.user_files): no
link followed out of them, nothing deleted or written over that this program did not write; and the one-line
refusals of trust round 4 (issue 73). CPU, seconds each (train runs of 2 steps of a tiny model):
pytest tests/unit/test_user_files.py"""

import errno
import json
import os
import shutil
import signal
import subprocess

import pytest

pytest.importorskip("transformers")

from train_helpers import chat_tokenizer, hf_model, metrics, one_error, pretokenized, run_train  # noqa: E402

import megatrain  # noqa: E402
from megatrain.cli import main  # noqa: E402
from megatrain.models.checkpoint import shape_from_config  # noqa: E402
from megatrain.train import fingerprint  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(a tiny Qwen2 checkpoint with its tokenizer, pre-tokenized data, a finished 2-step run of them)."""
    root = tmp_path_factory.mktemp("user_files")
    init = hf_model("qwen2", root / "init")
    chat_tokenizer(init)
    data = pretokenized(root / "data.jsonl", rows=8)
    assert run_train(init, data, root / "done", steps=2) == 0
    return init, data, root / "done"


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    return out


def test_an_export_copies_no_tokenizer_file_whose_link_leads_out_of_its_directory(files, tmp_path, capsys):
    init, data, _ = files
    secret = tmp_path / "checkpoint.key"
    secret.write_text("the user's signing key")
    ck = tmp_path / "ck"
    shutil.copytree(init, ck)
    says = f"links to {secret}, outside {ck}: a link is never followed out of the directory named (what it leads " \
        "to could be published in an export); put the file itself there"
    for name in ("merges.txt", "vocab.json", "generation_config.json"):
        (ck / name).unlink(missing_ok=True)
        (ck / name).symlink_to(secret)
        assert run_train(ck, data, tmp_path / "out", steps=2) == 2
        assert one_error(capsys) == f"error: --init-from {ck / name} {says}"
        assert not (tmp_path / "out").exists(), "refused before --out was claimed"
        assert run_train(init, data, tmp_path / "out", steps=2, extra=["--tokenizer", str(ck)]) == 2
        assert one_error(capsys) == f"error: {ck / name} {says}", "a --tokenizer folder's alike"
        (ck / name).unlink()
    # a Hugging Face cache snapshot: every file a link into its repository's blobs/; and a link inside the folder
    repo = tmp_path / "models--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for n, path in enumerate(sorted(p for p in init.iterdir() if p.is_file())):
        shutil.copy(path, repo / "blobs" / f"blob{n}")
        (snapshot / path.name).symlink_to(f"../../blobs/blob{n}")
    (snapshot / "sub").mkdir()
    (snapshot / "sub" / "merges.txt").write_text("#version: 0.2\n")
    (snapshot / "merges.txt").symlink_to("sub/merges.txt")
    assert run_train(snapshot, data, tmp_path / "out", steps=2) == 0
    hf = tmp_path / "out" / "hf"
    assert (hf / "merges.txt").read_text() == "#version: 0.2\n" and not (hf / "merges.txt").is_symlink()
    assert (hf / "tokenizer.json").read_bytes() == (init / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("name", ["train.log", "metrics.jsonl"])
def test_a_resume_appends_through_no_link(files, tmp_path, capsys, name):
    out = _copy(files[2], tmp_path)
    mine = tmp_path / "bashrc"
    mine.write_text("export PATH=...\n")
    (out / name).unlink()
    (out / name).symlink_to(mine)
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    assert f"error: {out / name}, an entry of the run in --out {out}, is a link (to {mine})" in one_error(capsys)
    assert mine.read_text() == "export PATH=...\n" and [p.name for p in (out / "checkpoints").iterdir()] == ["step-2"]


def test_overwrite_moves_nothing_into_a_discarded_link(files, tmp_path, capsys):
    init, data, done = files
    out = _copy(done, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / ".discarded").symlink_to(elsewhere)
    assert run_train(init, data, out, steps=2, extra=["--overwrite"]) == 2
    assert f"{out / '.discarded'}, an entry of the run in --out {out}, is a link" in one_error(capsys)
    assert not any(elsewhere.iterdir()) and (out / "checkpoints" / "step-2").is_dir()


def test_a_resume_whose_export_folder_became_a_link_is_refused_before_training(files, tmp_path, capsys):
    out = _copy(files[2], tmp_path)
    moved = tmp_path / "published" / "hf"
    moved.parent.mkdir()
    (out / "hf").rename(moved)
    (out / "hf").symlink_to(moved)
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    assert f"error: {out / 'hf'}, an entry of the run in --out {out}, is a link (to {moved})" in one_error(capsys)
    assert len(metrics(out)) == 2 and json.loads((moved / "megatrain_export.json").read_text())["step"] == 2


@pytest.mark.parametrize("mine", ["tensorboard/", "wandb/", "train.log", "run.json"])
def test_a_new_run_deletes_nothing_no_run_wrote_with_or_without_overwrite(files, tmp_path, capsys, mine):
    init, data, _ = files
    out = tmp_path / "project"
    entry = out / mine.rstrip("/")
    if mine.endswith("/"):
        entry.mkdir(parents=True)
        (entry / "events").write_text("mine")
    else:
        out.mkdir()
        entry.write_text('{"mine": true}')
    for extra in ([], ["--overwrite"]):
        assert run_train(init, data, out, steps=2, extra=extra) == 2
        assert f"--out {out} holds {entry.name}, which no train run recorded writing there" in one_error(capsys)
        assert entry.exists() and ((entry / "events").exists() if mine.endswith("/") else entry.read_text())


def test_a_config_deeper_than_any_model_is_refused_before_anything_grows(files, tmp_path, capsys):
    init, data, _ = files
    ck = tmp_path / "ck"
    shutil.copytree(init, ck)
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**9}))
    assert run_train(ck, data, tmp_path / "out", steps=2) == 2  # the weights' check built 10**9 layers' shapes
    assert one_error(capsys) == f"error: --init-from {ck}: config.json num_hidden_layers=1000000000 is deeper than " \
        "any model this program builds (at most 1024 layers): the config is damaged"
    gemma3 = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 10**6}
    with pytest.raises(ValueError, match="num_hidden_layers=1000000 is deeper than any model"):
        shape_from_config(gemma3)  # transformers' modules on the meta device, built layer by layer


def test_engine_save_deletes_nothing_its_record_does_not_list(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "code.py").write_text("mine")
    (project / "engine_state.json").write_text(json.dumps({"files": {}}))  # a stray record names nothing of it
    with megatrain.Engine("tiny", seq=8, batch=2, lr=1e-3, device="cpu", dtype="float32", log=lambda _: None) as e:
        with pytest.raises(ValueError, match=f"holds {project / 'code.py'}, which its engine_state.json does not list: "
                                             "Engine.save did not write it"):
            e.save(project)
        e.save(tmp_path / "state")
        (tmp_path / "state" / "notes.txt").write_text("mine")
        with pytest.raises(ValueError, match="notes.txt, which its engine_state.json does not list"):
            e.save(tmp_path / "state")
        (tmp_path / "state" / "notes.txt").unlink()
        e.save(tmp_path / "state")  # its own, replaced
    assert (project / "code.py").read_text() == "mine"


def _writable_by_others(d):
    return [p.relative_to(d).as_posix() or "." for p in [d, *d.rglob("*")] if p.stat().st_mode & 0o022]


def test_what_train_the_engine_and_report_write_is_writable_by_this_user_alone_whatever_the_umask(files, tmp_path):
    from megatrain import user_files

    init, data, _ = files
    old = os.umask(0)
    try:
        assert run_train(init, data, tmp_path / "run", steps=2) == 0
        with megatrain.Engine(init, seq=8, batch=2, lr=1e-3, device="cpu", dtype="float32", log=lambda _: None) as e:
            e.save(tmp_path / "state")
            e.export(tmp_path / "hf")
        with user_files.replacing(tmp_path / "report", "report") as stage:
            (stage / "index.html").write_text("page")
        assert os.umask(0) == 0, "the caller's umask put back"
    finally:
        os.umask(old)
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "trainer.json").exists()
    for d in ("run", "state", "hf", "report"):  # run.json, metrics, train.log, checkpoints, the export alike
        assert _writable_by_others(tmp_path / d) == [], d


def test_a_second_report_into_one_folder_at_once_is_refused_and_the_first_is_whole(tmp_path):
    from megatrain import user_files

    d = tmp_path / "report"
    with user_files.replacing(d, "report") as stage:
        (stage / "index.html").write_text("first")
        with pytest.raises(ValueError, match=f"report: {d} is being written by another process: wait for it to end"):
            with user_files.replacing(d, "report") as second:
                (second / "index.html").write_text("second")
    assert (d / "index.html").read_text() == "first"
    with user_files.replacing(d, "report") as stage:  # the lock went with the first
        (stage / "index.html").write_text("third")
    assert sorted(p.name for p in d.iterdir()) == [user_files.MANIFEST, "index.html"]


def test_sigterm_during_the_final_export_exits_143_once_the_export_is_whole(files, tmp_path, monkeypatch, capsys):
    import megatrain.train.engine as engine  # the Engine train's loop opens writes the export

    init, data, _ = files
    export = engine.export_checkpoint

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        export(*args, **kwargs)

    monkeypatch.setattr(engine, "export_checkpoint", signalled)
    out = tmp_path / "run"
    assert run_train(init, data, out, steps=2) == 143
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted (SIGTERM) during the export, which was finished: " \
        f"2 steps; Hugging Face checkpoint in {out / 'hf'}"
    assert json.loads((out / "hf" / "megatrain_export.json").read_text())["step"] == 2


def test_the_touch_a_resume_advises_restores_the_modification_time_exactly(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    os.utime(data, ns=(1733233333123456789, 1733233333123456789))  # a float has ~16 of these 19 digits
    was = fingerprint.fingerprints([data])
    os.utime(data, ns=(1733233334000000000, 1733233334000000000))
    said = fingerprint.changed(was, fingerprint.fingerprints([data]))
    command = said.split("`")[1]
    assert command == "touch -d @1733233333.123456789", said
    subprocess.run([*command.split(), str(data)], check=True)
    assert fingerprint.changed(was, fingerprint.fingerprints([data])) is None


def test_a_suite_out_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    file = tmp_path / "afile"
    file.write_text("")
    assert main(["suite", "smoke", "--out-dir", str(file)]) == 2
    assert one_error(capsys) == f"error: --out-dir {file} is a file: choose a directory"
    assert main(["suite", "smoke", "--out-dir", str(file / "x")]) == 2
    assert one_error(capsys) == f"error: --out-dir {file / 'x'}: cannot make that directory (Not a directory): " \
        "choose another"


def test_a_resume_deletes_no_checkpoint_that_is_a_link(files, tmp_path, capsys):
    out = _copy(files[2], tmp_path)
    moved = tmp_path / "bigger-disk" / "step-2"
    moved.parent.mkdir()
    (out / "checkpoints" / "step-2").rename(moved)
    (out / "checkpoints" / "step-2").symlink_to(moved)  # the run's --keep deletes its old checkpoints
    assert main(["train", "--resume", str(out), "--steps", "4", "--save-every", "1", "--keep", "1"]) == 2
    assert f"error: {out / 'checkpoints' / 'step-2'}, a checkpoint of the run, is a link" in one_error(capsys)
    assert (moved / "trainer.json").is_file()


def test_no_file_of_a_checkpoint_is_read_through_a_link_out_of_its_folder(files, tmp_path, capsys):
    init, data, _ = files
    ck = tmp_path / "ck"
    shutil.copytree(init, ck)
    config = json.loads((ck / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hub_token": "hf_the_users_own"}))
    (ck / "config.json").unlink()
    (ck / "config.json").symlink_to(tmp_path / "config.json")  # its keys are carried into the export's config
    assert run_train(ck, data, tmp_path / "out", steps=2) == 2
    assert one_error(capsys).startswith(f"error: --init-from {ck / 'config.json'} links to {tmp_path / 'config.json'}")
    assert not (tmp_path / "out").exists()


def test_a_lock_that_is_a_link_makes_no_file_where_it_leads(files, tmp_path, capsys):
    init, data, _ = files
    out = tmp_path / "run"
    out.mkdir()
    (out / ".train.lock").symlink_to(tmp_path / "made-outside")
    assert run_train(init, data, out, steps=2) == 2
    assert f"{out / '.train.lock'}, the lock of --out {out}, is a link" in one_error(capsys)
    assert not (tmp_path / "made-outside").exists()


def test_a_disk_full_as_a_run_claims_its_folder_is_one_line(files, tmp_path, monkeypatch, capsys):
    from megatrain import user_files

    def full(d, names):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(d / user_files.MANIFEST))

    monkeypatch.setattr(user_files, "record", full)
    init, data, _ = files
    assert run_train(init, data, tmp_path / "run", steps=2) == 2
    assert one_error(capsys) == f"error: --out {tmp_path / 'run'}: cannot write there (No space left on device): " \
        "free space, or choose a writable directory"


def test_a_manifest_line_naming_a_place_outside_its_folder_is_never_deleted(tmp_path):
    from megatrain import user_files

    (tmp_path / "victim.txt").write_text("mine")
    d = tmp_path / "report"
    d.mkdir()
    (d / user_files.MANIFEST).write_text(f"../victim.txt\n{tmp_path / 'victim.txt'}\nold.png\n")
    (d / "old.png").write_bytes(b"an earlier report's")
    with user_files.replacing(d, "report") as stage:
        (stage / "index.html").write_text("page")
    assert (tmp_path / "victim.txt").read_text() == "mine" and not (d / "old.png").exists()
    assert (d / user_files.MANIFEST).read_text() == "index.html\n"


def test_engine_export_replaces_no_checkpoint_an_export_did_not_write(files, tmp_path):
    init = files[0]
    project = tmp_path / "project"
    shutil.copytree(init, project)  # a user's own checkpoint: its config.json and weights
    with megatrain.Engine(init, seq=8, batch=2, lr=1e-3, device="cpu", dtype="float32", log=lambda _: None) as e:
        with pytest.raises(ValueError, match="holds chat_template.jinja, which no export wrote there \\(it has no "
                                             "megatrain_export.json\\)"):
            e.export(project)
        e.export(tmp_path / "hf")
        e.export(tmp_path / "hf")  # its own, replaced
    assert (project / "model.safetensors").read_bytes() == (init / "model.safetensors").read_bytes()


def test_a_suite_appends_no_record_through_a_link(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "records.jsonl").symlink_to(notes)
    assert main(["suite", "smoke", "--out-dir", str(tmp_path / "results"), "--only", "no case"]) == 2
    assert f"records.jsonl, which the suite writes in --out-dir {tmp_path / 'results'}, is a link" in one_error(capsys)
    assert notes.read_text() == "mine\n"


def test_a_tokenizer_file_that_is_no_file_is_refused_before_the_run_not_at_its_export(files, tmp_path, capsys):
    init, data, _ = files
    ck = tmp_path / "ck"
    shutil.copytree(init, ck)
    os.mkfifo(ck / "merges.txt")  # the export's copy raised SpecialFileError after the training
    (ck / "vocab.json").mkdir()  # and IsADirectoryError
    for name in ("vocab.json", "merges.txt"):
        assert run_train(ck, data, tmp_path / "out", steps=2) == 2
        assert one_error(capsys) == f"error: {ck / name} is not a file (an export copies it from there): put the " \
            "file there, or remove it"
        (ck / name).rmdir() if (ck / name).is_dir() else (ck / name).unlink()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("entry", [".train.lock", "run.json", "metrics.jsonl", "train.log", "memory.json",
                                   "checkpoints/step-2/trainer.json"])
def test_an_entry_of_the_run_that_is_a_fifo_is_refused_where_opening_it_waited_without_end(files, tmp_path, capsys,
                                                                                        entry):
    init, data, done = files
    out = _copy(done, tmp_path)
    (out / entry).unlink()
    os.mkfifo(out / entry)

    def hung(*_):
        raise TimeoutError(f"the resume waited on the FIFO {entry}")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    error = one_error(capsys)
    assert error.startswith(f"error: {out / entry}, ") and "is no file or folder (a FIFO, a socket or a device)" \
        in error


def test_engine_load_refuses_a_state_record_that_is_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "engine_state.json")
    with megatrain.Engine("tiny", seq=8, batch=2, lr=1e-3, device="cpu", dtype="float32", log=lambda _: None) as e:
        with pytest.raises(ValueError, match="engine_state.json, the record of Engine.save's state, is no file or "
                                             "folder"):
            e.load(tmp_path)


def test_a_data_folder_trains_no_file_through_a_link_out_of_it(files, tmp_path, capsys):
    init, data, _ = files
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").symlink_to(data)  # the user's file elsewhere: trained into the weights an export publishes
    assert run_train(init, folder, tmp_path / "out", steps=2) == 2
    assert one_error(capsys) == f"error: --data {folder / 'a.jsonl'} links to {data}, outside {folder}: a link is " \
        "never followed out of the directory named (what it leads to could be published in an export); put the file " \
        "itself there"
    assert not (tmp_path / "out").exists()
    (folder / "a.jsonl").unlink()
    shutil.copy(data, folder / "rows.jsonl")
    (folder / "a.jsonl").symlink_to("rows.jsonl")  # a link inside the folder
    assert run_train(init, folder, tmp_path / "out", steps=2) == 0


def test_a_suite_writes_its_traces_in_a_relative_out_dir_not_beside_the_checkout(tmp_path, monkeypatch):
    from megatrain.bench.suite import CASE_CWD

    (tmp_path / "one.toml").write_text('description = "one case"\nhardware = "cpu-ci"\ntimeout_s = 120\n[defaults]\n'
                                       'models = "tiny"\ndevice = "cpu"\ndtype = "float32"\nsteps = 2\nwarmup = 1\n'
                                       'seq = 16\n[[cases]]\nname = "one"\nsystems = ["megatrain"]\nbatch = 2\n')
    out = f"results-{os.getpid()}"  # relative: to the current directory, where the case runs elsewhere (CASE_CWD)
    monkeypatch.chdir(tmp_path)
    try:
        assert main(["suite", str(tmp_path / "one.toml"), "--out-dir", out, "--any-hardware"]) == 0
    finally:
        leaked = (CASE_CWD / out).exists()
        shutil.rmtree(CASE_CWD / out, ignore_errors=True)
    assert not leaked, "the case's trace went beside the checkout, outside --out-dir"
    assert len(list((tmp_path / out / "traces").glob("*.json"))) == 1


def test_a_report_of_records_that_are_a_fifo_is_one_line_where_it_waited_without_end(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    os.mkfifo(tmp_path / "results" / "records.jsonl")

    def hung(*_):
        raise TimeoutError("the report waited on the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        assert main(["report", str(tmp_path / "results"), "--out", str(tmp_path / "report")]) == 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert one_error(capsys) == f"error: {tmp_path / 'results' / 'records.jsonl'} is no file (a FIFO, a socket or a " \
        "device), whose reading would wait without end: it should be the records' JSONL file"
