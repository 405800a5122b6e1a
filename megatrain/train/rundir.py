"""A run directory (`train --out DIR`): one process at a time (a lock), one run (its identity in run.json), and
directories swapped in whole with renames, so a kill at any point leaves the old or the new one complete."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import megatrain.user_files as user_files
from megatrain.train.report_to import TENSORBOARD_DIR
from megatrain.train.runlog import LOG_FILE

RUN_FILE, LOCK_FILE, TRASH = "run.json", ".train.lock", ".discarded"
# what a run writes before its first step (its settings, its log, the dashboards' folders): a run stopped there left
# nothing of it to keep
BEFORE_FIRST_STEP = {RUN_FILE, f".{RUN_FILE}.tmp", LOG_FILE, TENSORBOARD_DIR, "wandb"}
# What a run writes into DIR, which a new run lists in DIR's manifest (megatrain.user_files) as it claims it empty:
# a run deletes (a stopped one's, with --overwrite any) only a directory that holds nothing else.
RUN_ENTRIES = BEFORE_FIRST_STEP | {LOCK_FILE, TRASH, "metrics.jsonl", ".metrics.jsonl.tmp", "memory.json",
                                   "checkpoints", "hf", ".hf.tmp", ".hf.old"}
# this process's own: its lock, and the manifest of what runs wrote here (megatrain.user_files)
OWN = (LOCK_FILE, *user_files.MANIFEST_FILES)
# the entries a run reads, writes into or appends to as files, and as folders
RUN_FILES = (RUN_FILE, LOG_FILE, "metrics.jsonl", "memory.json")
RUN_FOLDERS = ("checkpoints", "hf", TENSORBOARD_DIR, "wandb")


def fault(point: str) -> None:
    """Test hook: MEGATRAIN_FAULT=point kills this process there with SIGKILL (no handler runs), and
    MEGATRAIN_FAULT=stop-point stops it (SIGSTOP: alive, answering no one). Points: written-NAME (the new NAME
    complete aside, nothing renamed) and swap-NAME (the old NAME moved aside, the new one not yet renamed in), NAME
    being step-N or hf; rank-R-step-N (under torchrun, rank R once it trained step N)."""
    asked = os.environ.get("MEGATRAIN_FAULT")
    if asked in (point, f"stop-{point}"):
        os.kill(os.getpid(), signal.SIGKILL if asked == point else signal.SIGSTOP)


def aside(final: Path, kind: str) -> Path:
    """Where `final` is written before it is swapped in (kind 'tmp') or moved while it is replaced ('old')."""
    return final.parent / f".{final.name}.{kind}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def written_aside(final: Path):
    """Yields a fresh directory, aside(final, 'tmp'), to write `final` into; once the block ends it is swapped in
    with renames only, or deleted if the block raised (a full disk, say), the old `final` standing. A kill leaves
    the old final complete, or the new one, or both aside with the new one complete: recover_dir rolls forward."""
    tmp, old = aside(final, "tmp"), aside(final, "old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for path in [*tmp.rglob("*"), tmp]:  # on disk before any rename, so that a power cut loses nothing either
        _fsync(path)
    fault(f"written-{final.name}")
    if final.exists():
        final.rename(old)
    fault(f"swap-{final.name}")
    tmp.rename(final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_dir(path: Path) -> None:
    """Delete a directory so that a kill midway leaves no part of it under its name."""
    path.rename(aside(path, "old"))
    shutil.rmtree(aside(path, "old"))


def recover_dir(final: Path) -> None:
    """Finish what a kill interrupted around `final`: a swap whose old copy was moved aside had its new copy
    complete, so it is renamed in; any other leftover copy is incomplete or superseded, and deleted."""
    tmp, old = aside(final, "tmp"), aside(final, "old")
    if old.exists() and tmp.exists() and not final.exists():
        tmp.rename(final)
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


def _made(path: Path) -> bool:
    """mkdir -p that says whether it made the directory (of two processes starting at once, one did)."""
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        return False
    return True


class RunDir:
    """DIR for one train process: locked (flock, released when the process ends however it ends), and owned by one
    run: a new run needs DIR empty (or --overwrite, which discards the run in it), --resume continues the run in it."""

    def __init__(self, out: Path, resume: bool, overwrite: bool):
        self.out, self.started = out, False
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is a file: choose a directory")
        user_files.plain_entry(out / LOCK_FILE, f"the lock of --out {out}")  # opening it would make its target
        try:
            self.created = _made(out)
            self.lock = (out / LOCK_FILE).open("a")
        except OSError as exc:
            raise ValueError(f"--out {out}: cannot write there ({exc.strerror}): choose a writable directory") from None
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lock.close()
            raise ValueError(f"--out {out} is in use by another train process: wait for it to end, or choose "
                             "another --out") from None
        try:
            self._claim(resume, overwrite)
        except (ValueError, OSError) as exc:
            self.close()
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"--out {out}: cannot write there ({exc.strerror}): free space, or choose a writable "
                             "directory") from None

    def _claim(self, resume: bool, overwrite: bool) -> None:
        """Take DIR for this run: a new run's empty (its manifest made, megatrain.user_files), or emptied of what a
        run wrote there (one stopped before its first step, or with --overwrite), or a resumed one's."""
        out = self.out
        entries = sorted(p for p in out.iterdir() if p.name not in OWN)
        for entry in (p for p in entries if p.name in RUN_ENTRIES):  # written, appended to, deleted: never a link
            user_files.plain_entry(entry, f"an entry of the run in --out {out}")
        if resume:
            if wrong := next((name for name in (*RUN_FILES, *RUN_FOLDERS) if (out / name).exists()
                              and (out / name).is_dir() != (name in RUN_FOLDERS)), None):
                kind, other = ("folder", "file") if wrong in RUN_FOLDERS else ("file", "folder")
                raise ValueError(f"--resume {out}: {out / wrong} is a {other} where the run keeps a {kind}: move it "
                                 "out of the run's directory, then resume")
            return
        if not entries:
            user_files.record(out, RUN_ENTRIES)  # what a run writes here, none of it here before this one
            return
        if not (out / user_files.MANIFEST).exists() and (out / RUN_FILE).is_file() and (out / "checkpoints").is_dir():
            manifest = out / user_files.MANIFEST
            raise ValueError(f"--out {out} holds a run that recorded nothing of what it wrote ({manifest} is missing: "
                             "a run of a megatrain from before it, or one put together by hand), so its files cannot "
                             f"be told from yours: --resume {out} continues it; to discard it, delete it yourself, or "
                             "choose another --out")
        if strangers := user_files.strangers(out, user_files.written(out) | set(OWN)):
            raise ValueError(f"--out {out} holds {', '.join(strangers[:3])}, which no train run recorded writing "
                             f"there ({out / user_files.MANIFEST}): a run deletes only what one wrote; choose another "
                             "--out, or move them out")
        if {p.name for p in entries} <= BEFORE_FIRST_STEP:
            for entry in entries:  # a run that stopped before its first step: nothing of it to keep
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            return
        if not overwrite:
            raise ValueError(f"--out {out} holds another run: pass --resume {out} to continue it, --overwrite to "
                             "discard it, or another --out")
        trash = out / TRASH
        trash.mkdir(exist_ok=True)
        for entry in sorted(entries, key=lambda p: p.name != "checkpoints"):  # first: a kill midway leaves no resume
            if entry != trash:
                entry.rename(trash / entry.name)
        shutil.rmtree(trash)

    def recorded(self) -> dict:
        """run.json as the run's start wrote it ({} before a run started here, or from before run.json existed)."""
        path = self.out / RUN_FILE
        if not path.exists():
            return {}
        try:
            record = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}): the run's identity is lost; start a new run in "
                             "another --out") from None
        if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
            raise ValueError(f"{path} holds no run_id: start a new run in another --out")
        return record

    def start(self, settings: dict, run_id: str | None = None, **facts) -> str:
        """The run's id: recorded in run.json by a new run (with its creation time, settings and `facts`), read on
        resume; a resumed run whose run.json is gone writes it again under run_id, its checkpoint's."""
        path = self.out / RUN_FILE
        if not path.exists():  # a new run, or a resumed one whose run.json is gone
            text = json.dumps(settings, sort_keys=True)
            record = {"run_id": run_id or uuid.uuid4().hex, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "settings_sha256": hashlib.sha256(text.encode()).hexdigest(), "settings": settings, **facts}
            tmp = aside(path, "tmp")
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            os.replace(tmp, path)
        self.started = True
        return self.recorded()["run_id"]

    def close(self) -> None:
        """Release the lock; a directory this process created for a run that never started is removed."""
        if self.created and not self.started:
            shutil.rmtree(self.out, ignore_errors=True)
        self.lock.close()
