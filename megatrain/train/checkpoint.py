"""Checkpoint directories: OUT/checkpoints/step-N/ holds the system's own files and trainer.json (the step, data
position, RNG, settings and a sha256 of every file), written last. A checkpoint is written under a temporary name
and swapped in whole (rundir.replace_dir), so trainer.json marks a complete one; its checksums are verified on
resume. Only the last K are kept."""

from __future__ import annotations

import json
import re
import shutil
import time
from fnmatch import fnmatch
from pathlib import Path

import megatrain.user_files as user_files
from megatrain.checked_files import META_FILE, checksums, mismatch, read_meta, step_of
from megatrain.config import CaseConfig
from megatrain.memory import GIB
from megatrain.train import trust
from megatrain.train.rundir import recover_dir, remove_dir, written_aside

STEP_NAME = re.compile(r"step-(\d+)")  # a checkpoint's directory; another name (a copy, step-8.bak) is not one


def not_checkpoints(root: Path) -> list[Path]:
    """The entries of root (a run's checkpoints/) that are no checkpoint of the run nor one being swapped (a user's
    notes, a copy step-8.bak): --overwrite, which discards the run's checkpoints, would delete them."""
    ours = re.compile(rf"{STEP_NAME.pattern}|\.{STEP_NAME.pattern}\.(tmp|old)")
    return sorted(p for p in root.iterdir() if not ours.fullmatch(p.name)) if root.is_dir() and not root.is_symlink() \
        else []


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def save(root: Path, step: int, write_state, meta: dict, keep: int, pickled: tuple[str, ...] = ()) -> Path:
    """write_state(dir) writes the system's state; meta (step, data position, RNG, config) goes beside it as
    seal() records it. The new checkpoint is complete before the oldest of this run's beyond `keep` is deleted."""
    final = step_dir(root, step)
    with written_aside(final) as tmp:
        write_state(tmp)
        seal(tmp, meta, pickled, META_FILE)
    older = [d for d in complete(root) if d != final]
    assert all(step_of(d) < step for d in older), "a resume removes the checkpoints after its own"
    for d in older[:max(len(older) - (keep - 1), 0)]:
        remove_dir(d)
    return final


def complete(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.exists():
        return []
    return sorted((d for d in root.glob("step-*") if STEP_NAME.fullmatch(d.name) and (d / META_FILE).exists()),
                  key=step_of)


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



def check_system(d: Path, files: dict[str, dict], system: str, fix: str) -> None:
    """Refuse (ValueError, ending with `fix`) to load the state in d, whose record lists `files`, into `system` when
    it lacks a file every save of that system writes (SystemSpec.state_files): another system's state, which its
    loader would fail on or misread."""
    from megatrain.systems import system_spec

    missing = next((p for p in system_spec(system).state_files if not any(fnmatch(name, p) for name in files)), None)
    if missing is not None:
        raise ValueError(f"{d} holds no {system} state (no {missing}; it holds {', '.join(sorted(files)[:3])}"
                         f"{', ...' if len(files) > 3 else ''}): another system saved it; {fix}")



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
