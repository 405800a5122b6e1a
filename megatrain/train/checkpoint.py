"""Checkpoint directories: OUT/checkpoints/step-N/ holds the system's own files and trainer.json (the step, data
position, RNG, settings and a sha256 of every file), written last. A checkpoint is written under a temporary name
and swapped in whole (rundir.replace_dir), so trainer.json marks a complete one; its checksums are verified on
resume. Only the last K are kept."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import BinaryIO

import torch

import megatrain.user_files as user_files
from megatrain.config import CaseConfig
from megatrain.memory import GIB
from megatrain.train import trust
from megatrain.train.rundir import recover_dir, remove_dir, written_aside

META_FILE = "trainer.json"  # written last: its presence marks a complete checkpoint
HASH_BLOCK_BYTES = 2**28  # files are hashed in blocks, in parallel threads: tens of GiB in seconds, not minutes
READ_BYTES = 2**22


META_KEYS = ("step", "total_steps", "data_rows_consumed", "torch_rng", "train_config")  # what a resume reads
STEP_NAME = re.compile(r"step-(\d+)")  # a checkpoint's directory; another name (a copy, step-8.bak) is not one


def not_checkpoints(root: Path) -> list[Path]:
    """The entries of root (a run's checkpoints/) that are no checkpoint of the run nor one being swapped (a user's
    notes, a copy step-8.bak): --overwrite, which discards the run's checkpoints, would delete them."""
    ours = re.compile(rf"{STEP_NAME.pattern}|\.{STEP_NAME.pattern}\.(tmp|old)")
    return sorted(p for p in root.iterdir() if not ours.fullmatch(p.name)) if root.is_dir() and not root.is_symlink() \
        else []


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def _step(d: Path) -> int:
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
            ("step", _count(meta["step"]) and meta["step"] == _step(d), f"{_step(d)}, the step its directory names"),
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


def save(root: Path, step: int, write_state, meta: dict, keep: int, pickled: tuple[str, ...] = ()) -> Path:
    """write_state(dir) writes the system's state; meta (step, data position, RNG, config) goes beside it as
    seal() records it. The new checkpoint is complete before the oldest of this run's beyond `keep` is deleted."""
    final = step_dir(root, step)
    with written_aside(final) as tmp:
        write_state(tmp)
        seal(tmp, meta, pickled, META_FILE)
    older = [d for d in complete(root) if d != final]
    assert all(_step(d) < step for d in older), "a resume removes the checkpoints after its own"
    for d in older[:max(len(older) - (keep - 1), 0)]:
        remove_dir(d)
    return final


def complete(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.exists():
        return []
    return sorted((d for d in root.glob("step-*") if STEP_NAME.fullmatch(d.name) and (d / META_FILE).exists()),
                  key=_step)


def latest(root: Path) -> Path | None:
    found = complete(root)
    return found[-1] if found else None


def recover(root: Path) -> None:
    """Finish or undo what a kill left under root: a checkpoint mid-swap is renamed in, partial ones deleted."""
    for name in {p.name[1:].rsplit(".", 1)[0] for p in root.glob(".step-*")}:
        recover_dir(root / name)


def seal(d: Path, meta: dict, pickled: tuple[str, ...], record_file: str) -> None:
    """Seal a state just written into d: its record, d/record_file, is meta with the checksums of every file under d,
    and where the state holds pickles (`pickled`: the system's glob patterns) this user's HMAC of both
    (megatrain.train.trust). Its callers write it writable by this user alone, whatever the umask
    (user_files.private): open_checked loads no pickle another user could change meanwhile, and no other user rewrites
    the raw tiles or the record a resume reads."""
    names = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    record = {**meta, "files": checksums(d, names)}
    (d / record_file).write_text(json.dumps(trust.signed(record) if pickled else record, indent=1) + "\n")


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


def verify(d: Path) -> str | None:
    """What is wrong with checkpoint d (its trainer.json unreadable, a file missing, of another size or not matching
    its checksum), or None."""
    try:
        files = read_meta(d).get("files")
    except ValueError as exc:
        return str(exc)
    if files is None:
        return f"{d / META_FILE} has no checksums (an older megatrain wrote it)"
    return mismatch(d, files)


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


def check_system(d: Path, files: dict[str, dict], system: str, fix: str) -> None:
    """Refuse (ValueError, ending with `fix`) to load the state in d, whose record lists `files`, into `system` when
    it lacks a file every save of that system writes (SystemSpec.state_files): another system's state, which its
    loader would fail on or misread."""
    from megatrain.systems import system_spec

    missing = next((p for p in system_spec(system).state_files if not any(fnmatch(name, p) for name in files)), None)
    if missing is not None:
        raise ValueError(f"{d} holds no {system} state (no {missing}; it holds {', '.join(sorted(files)[:3])}"
                         f"{', ...' if len(files) > 3 else ''}): another system saved it; {fix}")


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


def resume_point(root: Path, fallback: bool, log) -> tuple[Path, dict]:
    """The latest complete checkpoint under root whose files verify, and its trainer.json. One that fails is refused
    by name, or with fallback the one before is tried, and those that failed are deleted (their steps are trained
    again, so a later resume does not meet them). A checkpoint that is a link is refused (the run deletes old ones)."""
    for d in complete(root):
        user_files.plain_entry(d, "a checkpoint of the run")
    failed = []
    for d in reversed(complete(root)):
        t0 = time.perf_counter()
        problem = verify(d)
        seconds = time.perf_counter() - t0
        if seconds > 1 and problem is None:
            size = sum(f["bytes"] for f in read_meta(d)["files"].values())
            log(f"checked {d.name}'s {size / GIB:.1f} GiB against its checksums in {seconds:.0f} s")
        if problem is None:
            break
        if not fallback:
            raise ValueError(f"{problem}: checkpoint {d} is damaged; --resume-fallback resumes from the one before")
        failed.append((d, problem))
    else:
        raise ValueError(f"no complete checkpoint under {root} to resume from"
                         + (f" ({failed[-1][1]}, and every one before)" if failed else ""))
    for bad, _ in failed:
        remove_dir(bad)
    if failed:
        log(f"resuming from {d.name} (--resume-fallback): " + "; ".join(f"{bad.name} deleted, {problem}"
                                                                        for bad, problem in failed))
    return d, read_meta(d)


def state_bytes(case: CaseConfig) -> int:
    """Bytes of one checkpoint of `case`: the weights and AdamW state as its system writes them."""
    from megatrain.systems import system_spec

    return system_spec(case.system).checkpoint_bytes(case)


def check_disk(case: CaseConfig, out: Path, saves: int, keep: int, export_bytes: int) -> None:
    """Refuse a run whose checkpoints and export cannot fit the free space under `out`, before anything is built.
    At most keep + 1 checkpoints are on disk at once (a new one is complete before the oldest goes)."""
    existing = len(complete(out / "checkpoints"))
    new_checkpoints = min(keep + 1, existing + saves) - existing if saves else 0
    need = max(new_checkpoints, 0) * state_bytes(case) + export_bytes
    where = next(p for p in [out, *out.resolve().parents] if p.exists())
    free = shutil.disk_usage(where).free
    if need > free:
        raise ValueError(f"the run needs ~{need / GIB:.1f} GiB of disk under {out} ({max(new_checkpoints, 0)} "
                         f"checkpoint(s) of {state_bytes(case) / GIB:.1f} GiB, a {export_bytes / GIB:.1f} GiB export), "
                         f"{free / GIB:.1f} GiB free there: free space, choose another --out, --keep 1, or --no-save")
