"""A resume loads a checkpoint in a format that can run code (pickles) only if this user wrote it here, else only
with --trust-checkpoint; formats that cannot run code need no key. CPU, seconds (the DeepSpeed and FSDP ones spawn a
process each, about a minute): pytest tests/unit/test_trust.py"""

import dataclasses
import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from train_helpers import (  # noqa: E402
    fill,
    hf_model,
    pretokenized,
    python_process,
    run_train,
    tmpfs,
    train_any,
)

import megatrain  # noqa: E402
from megatrain import checked_files, systems  # noqa: E402
from megatrain.cli import main  # noqa: E402
from megatrain.systems import native  # noqa: E402
from megatrain.train import trust  # noqa: E402


class PicklingSystem(native.NativeSystem):
    """native's state loaded as DeepSpeed loads its own: unpickled (weights_only=False), through open_checked."""

    def load_state(self, in_dir):
        with checked_files.open_checked(Path(in_dir) / "native_state.pt") as f:
            state = torch.load(f, map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped_steps = state["skipped_steps"]


# registered under this name, its .pt files are pickles
PICKLING = dataclasses.replace(native.SPEC, factory=PicklingSystem, pickled=("*.pt",))


class Payload:
    """A pickle that runs code when it loads: it makes the file `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mknod, (self.marker,)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("trust")
    return hf_model("qwen2", root / "init"), pretokenized(root / "data.jsonl", rows=8)


@pytest.fixture
def pickling(monkeypatch):
    monkeypatch.setitem(systems.SYSTEMS, "pickling", systems.Registered(f"{__name__}:PICKLING"))


def _another_user(monkeypatch, tmp_path):
    """This process as a user of another key (a copy of the run directory on another account or machine)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "elsewhere"))


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    return line


def test_a_pickle_checkpoint_written_here_resumes_and_from_elsewhere_needs_trust_checkpoint(files, tmp_path, pickling,
                                                                                          monkeypatch, capsys):
    init, data = files
    out = tmp_path / "run"
    assert run_train(init, data, out, system="pickling", steps=2) == 0
    meta = json.loads((out / "checkpoints" / "step-2" / "trainer.json").read_text())
    assert trust.SIGNATURE in meta and oct(trust.key_path().stat().st_mode & 0o777) == "0o600"
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 0, "written by this user here: no flag needed"
    _another_user(monkeypatch, tmp_path)
    assert main(["train", "--resume", str(out), "--steps", "4"]) == 2
    line = _error(capsys)
    assert "step-3/native_state.pt is a pickle" in line and "--trust-checkpoint" in line
    assert len(trust.key_path().read_bytes()) == 32, "the key of the checkpoints it would sign, made in its pre-flight"
    assert main(["train", "--resume", str(out), "--steps", "4", "--trust-checkpoint"]) == 0


def test_a_checkpoint_cannot_grant_itself_trust_checkpoint(files, tmp_path, pickling, monkeypatch, capsys):
    init, data = files
    out = tmp_path / "run"
    assert run_train(init, data, out, system="pickling", steps=2) == 0
    _another_user(monkeypatch, tmp_path)  # a checkpoint from elsewhere, its settings written by whoever made it
    meta = out / "checkpoints" / "step-2" / "trainer.json"
    forged = json.loads(meta.read_text())
    forged["train_config"].update(trust_checkpoint=True, resume_fallback=True)
    meta.write_text(json.dumps(forged))
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    assert "step-2/native_state.pt is a pickle" in _error(capsys)


def test_a_checkpoint_whose_trainer_json_names_another_system_is_refused_naming_it(files, tmp_path, capsys):
    init, data = files
    out = tmp_path / "run"
    assert run_train(init, data, out, steps=2) == 0
    meta = out / "checkpoints" / "step-2" / "trainer.json"
    forged = json.loads(meta.read_text())
    forged["train_config"]["system"] = "native"  # not a pickle format: no signature to break
    meta.write_text(json.dumps(forged))
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    assert _error(capsys) == f"error: {meta.parent} holds no native state (no native_state.pt; it holds state.json, " \
        "tiles.bin): another system saved it; its trainer.json names --system native (edited, or copied from another " \
        "run)"


def test_a_pickle_swapped_in_with_its_checksum_recomputed_is_refused(files, tmp_path, pickling, capsys):
    init, data = files
    out = tmp_path / "run"
    assert run_train(init, data, out, system="pickling", steps=2) == 0
    step = out / "checkpoints" / "step-2"
    evil = step / "native_state.pt"
    evil.write_bytes(evil.read_bytes() + b"\0")  # anything: the checksums are plain sha256 anyone can recompute
    meta = json.loads((step / "trainer.json").read_text())
    meta["files"]["native_state.pt"] = {"bytes": evil.stat().st_size,
                                        "sha256": [hashlib.sha256(evil.read_bytes()).hexdigest()]}
    (step / "trainer.json").write_text(json.dumps(meta))
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    assert "its signature is not this user's key's" in _error(capsys)


def test_a_pickle_planted_beside_a_signed_checkpoint_is_refused(files, tmp_path, pickling, capsys):
    init, data = files
    out = tmp_path / "run"
    assert run_train(init, data, out, system="pickling", steps=2) == 0
    step = out / "checkpoints" / "step-2"
    (step / "extra.pt").write_bytes((step / "native_state.pt").read_bytes())  # in no checksum, so in no signature
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    assert "step-2/extra.pt is a pickle" in _error(capsys)


def _swapped_after_the_checks(monkeypatch, replace) -> None:
    """replace(checkpoint) once the next resume's checks (checksums, signature) have passed, before its load: the race
    of a file swapped in between."""
    check = trust.check_trusted

    def checked(d, *args):
        check(d, *args)
        replace(d)

    monkeypatch.setattr(trust, "check_trusted", checked)


def test_a_pickle_swapped_in_between_the_check_and_the_load_runs_no_code(files, tmp_path, pickling, monkeypatch,
                                                                          capsys):
    init, data = files
    out, marker = tmp_path / "run", tmp_path / "ran"
    assert run_train(init, data, out, system="pickling", steps=2) == 0

    def swap(d):
        (d / "evil").write_bytes(pickle.dumps(Payload(marker)))
        os.replace(d / "evil", d / "native_state.pt")

    _swapped_after_the_checks(monkeypatch, swap)
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 2
    assert "step-2/native_state.pt changed after the checkpoint's checksums were checked" in _error(capsys)
    assert not marker.exists(), "the swapped pickle ran"


def test_a_pickle_another_user_can_write_loads_only_with_trust_checkpoint(files, tmp_path, pickling, monkeypatch,
                                                                          capsys):
    init, data = files
    out = tmp_path / "run"
    old = os.umask(0o002)  # group-writable files: the run's own pickles are made writable by it alone
    try:
        assert run_train(init, data, out, system="pickling", steps=2) == 0
    finally:
        os.umask(old)
    pt = out / "checkpoints" / "step-2" / "native_state.pt"
    assert pt.stat().st_mode & 0o777 == 0o644
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 0
    pt = out / "checkpoints" / "step-3" / "native_state.pt"
    _swapped_after_the_checks(monkeypatch, lambda d: pt.chmod(0o664))  # another of its group could rewrite it
    assert main(["train", "--resume", str(out), "--steps", "4"]) == 2
    line = _error(capsys)
    assert f"step-3/native_state.pt is a pickle another user can write (owner uid {os.getuid()}, mode 664)" in line
    assert main(["train", "--resume", str(out), "--steps", "4", "--trust-checkpoint"]) == 0


def test_formats_that_cannot_run_code_resume_from_anyone_and_need_no_key(files, tmp_path, monkeypatch):
    init, data = files
    runs = {system: tmp_path / system for system in ("megatrain", "native")}
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "writer"))
    for system, out in runs.items():
        assert run_train(init, data, out, system=system, steps=2) == 0
    assert not trust.key_path().exists(), "raw tiles and weights_only=True need no signature"
    _another_user(monkeypatch, tmp_path)
    for out in runs.values():
        assert main(["train", "--resume", str(out), "--steps", "3"]) == 0
    assert not trust.key_path().exists()


def test_a_key_others_can_read_is_refused_before_training(files, tmp_path, pickling, monkeypatch, capsys):
    init, data = files
    _another_user(monkeypatch, tmp_path)
    trust.key_path().parent.mkdir(parents=True)
    trust.key_path().write_bytes(os.urandom(32))
    trust.key_path().chmod(0o644)
    assert run_train(init, data, tmp_path / "run", system="pickling", steps=1) == 2
    assert "chmod 600" in _error(capsys) and not (tmp_path / "run").exists(), "refused before the run, not at its save"


def test_a_relative_xdg_config_home_is_ignored_as_the_xdg_spec_says(monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", "config")  # else each working directory would hold another key
    assert trust.key_path() == Path.home() / ".config" / "megatrain" / "checkpoint.key"


def test_an_empty_or_short_key_is_refused_and_never_signs_or_verifies(files, tmp_path, pickling, monkeypatch,
                                                                      capsys):
    init, data = files
    _another_user(monkeypatch, tmp_path)
    out = tmp_path / "run"
    assert run_train(init, data, out, system="pickling", steps=2) == 0
    step = out / "checkpoints" / "step-2"
    for key in (b"", os.urandom(16)):
        trust.key_path().write_bytes(key)  # mode 600 still: as a disk that filled while the key was written left it
        meta = json.loads((step / "trainer.json").read_text())
        (step / "trainer.json").write_text(json.dumps({**meta, trust.SIGNATURE: trust._digest(key, meta)}))
        assert main(["train", "--resume", str(out), "--steps", "3"]) == 2, "a signature anyone could forge"
        assert f"{trust.key_path()}, the key that proves a checkpoint was written here, holds {len(key)} bytes" \
            in _error(capsys)
        assert run_train(init, data, tmp_path / "new", system="pickling", steps=1) == 2
        assert f"holds {len(key)} bytes, not 32" in _error(capsys) and not (tmp_path / "new").exists()
        with pytest.raises(ValueError, match=f"holds {len(key)} bytes, not 32"):  # its save would sign
            megatrain.Engine("tiny", system="pickling", seq=8, batch=2)


def test_a_key_that_cannot_be_made_is_refused_before_training_naming_it(files, tmp_path, pickling, monkeypatch,
                                                                        capsys):
    init, data = files
    with tmpfs(tmp_path / "full", "size=4k") as full:  # one page: the filler takes it
        monkeypatch.setenv("XDG_CONFIG_HOME", str(full))
        (full / "megatrain").mkdir()
        fill(full / "filler")
        assert run_train(init, data, tmp_path / "run", system="pickling", steps=1) == 2
        line = _error(capsys)
        assert f"cannot make the checkpoint key {trust.key_path()} (No space left on device)" in line
        assert os.listdir(full / "megatrain") == [] and not (tmp_path / "run").exists(), "no key, no short key"
        (full / "filler").unlink()
        assert run_train(init, data, tmp_path / "run", system="pickling", steps=1) == 0
        assert len(trust.key_path().read_bytes()) == 32
    with tmpfs(tmp_path / "ro", "size=64k", read_only=True) as ro:
        monkeypatch.setenv("XDG_CONFIG_HOME", str(ro))
        assert run_train(init, data, tmp_path / "run2", system="pickling", steps=1) == 2
        assert f"cannot make the checkpoint key {trust.key_path()} (Read-only file system)" in _error(capsys)
        assert not (tmp_path / "run2").exists()


@pytest.mark.subprocess
@pytest.mark.parametrize("system, pickle_file", [("deepspeed", ".pt is a pickle"), ("fsdp", "fsdp/.metadata is a")])
def test_deepspeed_and_fsdp_checkpoints_from_elsewhere_are_refused_before_anything_loads(files, tmp_path, monkeypatch,
                                                                                        capsys, system, pickle_file):
    if system == "deepspeed":
        pytest.importorskip("deepspeed")
    init, data = files
    out = tmp_path / "run"
    assert train_any(system, init, data, out, steps=1) == 0
    _another_user(monkeypatch, tmp_path)
    assert main(["train", "--resume", str(out), "--steps", "2"]) == 2  # refused before the system is built
    assert pickle_file in _error(capsys)


SWAPPER = f"""
import os, pickle, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import pytest
from test_trust import Payload, _swapped_after_the_checks
from megatrain.cli import exit_process, main

out, pattern, marker, steps = sys.argv[1:]


def swap(d):
    (target,) = d.glob(pattern)
    (d / "evil").write_bytes(pickle.dumps(Payload(marker)))
    os.replace(d / "evil", target)


with pytest.MonkeyPatch.context() as mp:
    if pattern:
        _swapped_after_the_checks(mp, swap)
    exit_process(main(["train", "--resume", out, "--steps", steps]))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("system, pickle_file", [("deepspeed", "**/*model_states.pt"), ("fsdp", "fsdp/.metadata"),
                                                 ("fsdp", "fsdp/*.distcp")])
def test_deepspeed_and_fsdp_load_the_pickles_checked_not_ones_swapped_in_after_the_check(files, tmp_path, system,
                                                                                       pickle_file):
    if system == "deepspeed":
        pytest.importorskip("deepspeed")
    init, data = files
    out, marker = tmp_path / "run", tmp_path / "ran"
    assert train_any(system, init, data, out, steps=1) == 0
    resumed = python_process(SWAPPER, str(out), "", str(marker), "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]  # every file it loads opened through open_checked
    swapped = python_process(SWAPPER, str(out), pickle_file, str(marker), "3")
    assert not marker.exists(), "the swapped pickle ran"
    assert swapped.returncode == 2, swapped.stderr[-3000:]
    assert "changed after the checkpoint's checksums were checked" in swapped.stderr.splitlines()[-1]


RESEALED = f"""
import json, runpy, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from pathlib import Path
from megatrain import checked_files

d = Path(sys.argv[1]) / "checkpoints" / "step-1"
(d / "fsdp" / ".metadata").write_bytes((d / "fsdp" / ".metadata").read_bytes()[:100])  # another, cut short
meta = json.loads((d / "trainer.json").read_text())
meta["files"] = checked_files.checksums(d, list(meta["files"]))  # its checksums made again, as by whoever swapped it
(d / "trainer.json").write_text(json.dumps(meta))
sys.argv = ["megatrain", "train", "--resume", sys.argv[1], "--steps", "2", "--trust-checkpoint"]
runpy.run_module("megatrain", run_name="__main__")  # as python -m megatrain ends its process (its __main__)
"""


@pytest.mark.subprocess
def test_an_fsdp_metadata_file_dcp_cannot_read_is_one_line(files, tmp_path):
    init, data = files
    out = tmp_path / "run"
    assert train_any("fsdp", init, data, out, steps=1) == 0
    resumed = python_process(RESEALED, str(out))
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert resumed.stderr.splitlines()[-1].startswith(f"error: {out / 'checkpoints' / 'step-1' / 'fsdp'}: "
                                                      "torch.distributed.checkpoint cannot load it into this model "
                                                      "(AssertionError: metadata is None; global metadata read "
                                                      "failed: pickle data was truncated")
