"""A saved state's record of its files, and the opener a loader unpickles them through: below both the systems, whose
load_state opens every pickle with open_checked, and train and the Python API, which write the record (checksums, in a
checkpoint's trainer.json or Engine.save's own file), check it (read_meta, mismatch) and hold a load to it
(checked_loads). A system that imported this from train would point an arrow up (tests/unit/test_boundaries.py)."""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

import megatrain.user_files as user_files

META_FILE = "trainer.json"  # written last: its presence marks a complete checkpoint
HASH_BLOCK_BYTES = 2**28  # files are hashed in blocks, in parallel threads: tens of GiB in seconds, not minutes
READ_BYTES = 2**22
META_KEYS = ("step", "total_steps", "data_rows_consumed", "torch_rng", "train_config")  # what a resume reads


def step_of(d: Path) -> int:
    """The step a checkpoint's directory names (step-N)."""
    return int(d.name.removeprefix("step-"))


def read_meta(d: Path) -> dict:
    """The trainer.json of checkpoint d; ValueError naming it when it is not what a checkpoint writes."""
    path = d / META_FILE
    user_files.plain_entry(path, "the record of a checkpoint")
    try:
        meta = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise ValueError(f"{path} cannot be read ({exc.strerror})") from None
    if not isinstance(meta, dict) or (missing := [k for k in META_KEYS if k not in meta]):
        raise ValueError(f"{path} lacks {', '.join(missing) if isinstance(meta, dict) else 'an object'}")
    rng_bytes = torch.get_rng_state().numel()
    files = files_problem(meta["files"]) if "files" in meta else None  # none: an older megatrain's, verify says
    for key, holds, must in (
            ("step", _count(meta["step"]) and meta["step"] == step_of(d),
             f"{step_of(d)}, the step its directory names"),
            ("total_steps", _count(meta["total_steps"]) and meta["total_steps"] >= 1, "a whole number >= 1"),
            ("data_rows_consumed", _count(meta["data_rows_consumed"]), "a whole number >= 0"),
            ("torch_rng", isinstance(meta["torch_rng"], list) and len(meta["torch_rng"]) == rng_bytes
             and all(_count(b) and b < 256 for b in meta["torch_rng"]), f"a list of {rng_bytes} bytes (0-255)"),
            ("train_config", isinstance(meta["train_config"], dict), "an object"),
            ("run_id", isinstance(meta.get("run_id", ""), str), "a string"),
            ("files", files is None, files)):
        if not holds:
            raise ValueError(f"{path}: {key} must be {must}, got {json.dumps(meta.get(key))[:60]}")
    return meta


def _count(value) -> bool:
    """A whole number >= 0 (JSON's true is none)."""
    return type(value) is int and value >= 0


def files_problem(files) -> str | None:
    """What in a record's `files` (checksums' output) is not what checksums writes, or None."""
    if not isinstance(files, dict):
        return "an object of file names"
    for name, want in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"an object of names inside the checkpoint ({name!r} is not)"
        if not (isinstance(want, dict) and set(want) == {"bytes", "sha256"} and _count(want["bytes"])
                and isinstance(want["sha256"], list) and all(isinstance(h, str) for h in want["sha256"])):
            return f"an object of {{bytes, sha256}} per file (that of {name!r} is not)"
    return None


def _block_sha256(fd: int, offset: int) -> str:
    digest = hashlib.sha256()
    end = offset + HASH_BLOCK_BYTES
    while offset < end and (chunk := os.pread(fd, min(end - offset, READ_BYTES), offset)):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _checksums(fds: dict[str, int]) -> dict[str, dict]:
    """{name: {"bytes", "sha256": [one per HASH_BLOCK_BYTES block]}} of the open files `fds`, read with pread (their
    offsets stay where they were), the blocks hashed in parallel threads."""
    sizes = {name: os.fstat(fd).st_size for name, fd in fds.items()}
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib lets go of the GIL on large buffers
        blocks = {name: [pool.submit(_block_sha256, fds[name], at) for at in range(0, max(size, 1), HASH_BLOCK_BYTES)]
                  for name, size in sizes.items()}
        return {name: {"bytes": sizes[name], "sha256": [b.result() for b in blocks[name]]} for name in fds}


def checksums(d: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256": [one per HASH_BLOCK_BYTES block]}} of the files `names` under d."""
    with ExitStack() as stack:
        return _checksums({name: stack.enter_context((d / name).open("rb")).fileno() for name in names})


def mismatch(d: Path, files: dict[str, dict]) -> str | None:
    """Which of the files under d (checksums' output) is missing, of another size or not matching its checksum, in
    words, or None."""
    for name, want in files.items():
        if not (d / name).is_file():
            return f"{d / name} is missing"
        if (d / name).stat().st_size != want["bytes"]:
            return f"{d / name} has {(d / name).stat().st_size} bytes, {want['bytes']} were written"
    found = checksums(d, list(files))
    bad = [name for name, want in files.items() if found[name]["sha256"] != want["sha256"]]
    return f"{d / bad[0]} does not match its checksum" if bad else None



# (checkpoint, its record's checksums, --trust-checkpoint) of the state a system is loading (checked_loads)
_loading: tuple[Path, dict[str, dict], bool] | None = None


@contextmanager
def checked_loads(d: Path, files: dict[str, dict], trusted: bool):
    """While a system loads its state from checkpoint d: `files` are the checksums of its record as it was checked
    (and its signature verified), which every pickle the system opens through open_checked must match."""
    global _loading
    _loading = (d, files, trusted)
    try:
        yield
    finally:
        _loading = None


def open_checked(path: str | os.PathLike) -> BinaryIO:
    """A file of the checkpoint being loaded (checked_loads) opened for a loader that unpickles it, which reads it
    through this handle alone: the bytes read through it match the file's checksum in the checked record, so what
    unpickles is what was checked and signed, whatever takes the file's name meanwhile; and unless --trust-checkpoint
    no other user can write them in place while it is open. ValueError naming the file otherwise."""
    assert _loading is not None, "a checkpoint's pickles are opened inside checked_loads"
    d, files, trusted = _loading
    name = Path(os.path.relpath(os.path.abspath(path), os.path.abspath(d))).as_posix()
    if name not in files:
        raise ValueError(f"{path} is not among the files {d / META_FILE} lists (and signs): a file put there since; "
                         "delete it")
    f = open(path, "rb")  # the caller closes it
    try:
        st = os.fstat(f.fileno())
        if not trusted and (st.st_uid != os.getuid() or st.st_mode & 0o022):
            raise ValueError(f"{path} is a pickle another user can write (owner uid {st.st_uid}, mode "
                             f"{st.st_mode & 0o777:o}), so what loads might not be what was checked: make it yours and "
                             "chmod go-w it, or pass --trust-checkpoint if you trust whoever can write it")
        if _checksums({name: f.fileno()})[name] != files[name]:
            raise ValueError(f"{path} changed after the checkpoint's checksums were checked (replaced or written "
                             "while it loaded): nothing of it was loaded; resume again")
    except BaseException:
        f.close()
        raise
    return f

