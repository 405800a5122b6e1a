"""The two rules for the files of a directory a user named (train's --out, --init-from and --tokenizer, suite's
--out-dir, report's --out and the workspace's docs/, Engine.save's and Engine.export's path), kept here once and
followed wherever this program reads, writes or deletes there:

- No symbolic link is followed out of the directory the user named. A file read from it (a checkpoint's files, its
  config and tokenizer files, which an export carries and publishes) is refused where a link leads out of it:
  `merges.txt` linked to the user's checkpoint key would be copied into the export. A link inside it is followed, as
  is one of a Hugging Face cache snapshot into its repository's blobs/ (the cache's own layout). An entry this program
  writes, appends to or deletes is never a link at all, nor a FIFO or a device: it makes none, so one there is someone
  else's, writing through a link writes wherever it leads, and opening a FIFO waits without end.
- Nothing this program did not write is deleted or written over. A directory it writes into keeps a manifest
  (MANIFEST: the relative paths it wrote there, one a line), and only what the manifest lists is ever deleted or
  replaced; anything else in the way is refused by name, before anything there changes.

And what this program writes there is writable by this user alone, whatever the umask (private): under umask 000 a
run's run.json, metrics and export were world-writable, so another user could rewrite what a resume reads or an export
publishes.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

MANIFEST = ".megatrain-written"
MANIFEST_FILES = (MANIFEST, f"{MANIFEST}.tmp")  # the manifest, and the new one written aside


def within(d: Path, path: Path) -> Path:
    """`path`, a file in directory d, resolved to where it leads; ValueError naming it where a symbolic link leads out
    of d (or, for a Hugging Face cache snapshot `<repo>/snapshots/<rev>`, out of d and `<repo>/blobs`)."""
    root, target = d.resolve(), path.resolve()
    roots = [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]
    if not any(target.is_relative_to(r) for r in roots):
        raise ValueError(f"{path} links to {target}, outside {d}: a link is never followed out of the directory "
                         "named (what it leads to could be published in an export); put the file itself there")
    return target


def plain_entry(path: Path, what: str) -> None:
    """Refuse (ValueError) an entry this program writes, appends to, reads back or deletes that is a symbolic link, or
    no file or folder (a FIFO, a socket, a device): it makes none, through a link it would write wherever the link
    leads, and opening a FIFO waits for a writer or reader without end. `what` says which of its entries path is."""
    if path.is_symlink():
        raise ValueError(f"{path}, {what}, is a link (to {os.readlink(path)}), which this program never makes: "
                         "writing through it would write (or delete) where it leads; put the file or folder itself "
                         "there, or move the link out")
    if path.exists() and not path.is_file() and not path.is_dir():
        raise ValueError(f"{path}, {what}, is no file or folder (a FIFO, a socket or a device), which this program "
                         "never makes: opening it would wait without end, or write to a device; move it out")


def written(d: Path) -> set[str]:
    """The relative paths d's manifest lists (none where it has none), each inside d: a line naming a place outside
    (an absolute path, a '..') was never written by this program, and is not taken as written."""
    path = d / MANIFEST
    if path.is_symlink() or not path.is_file():
        return set()
    lines = path.read_text(errors="replace").splitlines()
    return {line for line in lines if line and not Path(line).is_absolute() and ".." not in Path(line).parts}


def record(d: Path, names: Iterable[str]) -> None:
    """d's manifest made to list `names`, written aside and renamed in (a kill leaves the old list or the new)."""
    tmp = d / MANIFEST_FILES[1]
    tmp.unlink(missing_ok=True)
    tmp.write_text("".join(f"{name}\n" for name in sorted(set(names))))
    os.replace(tmp, d / MANIFEST)


def strangers(d: Path, listed: set[str]) -> list[str]:
    """The entries under d (relative paths, sorted) this program did not write there: neither among `listed` nor
    inside or above one of them, and every link (it makes none). A folder it did not write is named, not its files."""
    found = []
    for top, dirs, files in os.walk(d):
        above = []  # the folders to look into: those holding a listed entry
        for name in sorted([*dirs, *files]):
            rel = (Path(top) / name).relative_to(d).as_posix()
            link = (d / rel).is_symlink()
            if not link and any(rel == n or rel.startswith(f"{n}/") for n in listed):
                continue  # its, whole
            if not link and any(n.startswith(f"{rel}/") for n in listed):
                above.append(name)
            else:
                found.append(rel)
        dirs[:] = above
    return sorted(found)


def make_dir(d: Path, what: str) -> None:
    """mkdir -p d, `what` (a flag, or words) naming it in a ValueError where it is a file or cannot be made."""
    if d.exists() and not d.is_dir():
        raise ValueError(f"{what} {d} is a file: choose a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on its way, a place this user cannot write
        raise ValueError(f"{what} {d}: cannot make that directory ({exc.strerror}): choose another") from None


@contextmanager
def private():
    """The files and folders made in the block are writable by this user alone (the umask takes group and others'
    write away, as it stood before for the rest); the umask is put back after. Also a decorator."""
    old = os.umask(0o022)
    os.umask(old | 0o022)
    try:
        yield
    finally:
        os.umask(old)


@contextmanager
def locked(d: Path, busy: str):
    """d (a directory) held by this process alone for the block: a second process writing there meanwhile is refused
    (ValueError, `busy` its words) rather than mixing its files with the first's. The lock is on the directory itself
    (flock): it adds no file there, and goes with its process however that ends."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(busy) from None
        yield
    finally:
        os.close(fd)


@contextmanager
def replacing(d: Path, what: str):
    """Yields a fresh folder in which to write the files `what` (the command, naming d) puts in directory d; once the
    block ends they are copied into d, the files d's manifest listed and not written again are deleted, and the
    manifest lists the new ones. A file in the way that the manifest does not list (or a link) is refused by name
    before anything in d changes; a d that is a file or cannot be made is refused first, and so is a d another process
    is writing (locked)."""
    with private():
        make_dir(d, f"{what}'s folder")
        busy = f"{what}: {d} is being written by another process: wait for it to end, or choose another directory"
        with locked(d, busy), tempfile.TemporaryDirectory(prefix="megatrain-") as stage:
            yield Path(stage)
            _copy_in(Path(stage), d, what)


def _copy_in(stage: Path, d: Path, what: str) -> None:
    """replacing's end: the files under stage copied into d over those its manifest lists, which are replaced."""
    ours = written(d)
    new = sorted(Path(top, f).relative_to(stage).as_posix() for top, _, files in os.walk(stage) for f in files)
    if in_way := [n for n in new if _in_the_way(d, n, ours)]:
        raise ValueError(f"{what}: {d / in_way[0]} was not written by this program ({d / MANIFEST} does not list "
                         "it), and writing there would replace it: move it, or choose another directory")
    try:
        record(d, ours | set(new))  # first: a kill midway leaves nothing of its unlisted
        for name in new:
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(stage / name, d / name)
        for name in sorted(ours - set(new)):
            if not (d / name).is_symlink() and (d / name).is_file():
                (d / name).unlink()
        record(d, new)
    except OSError as exc:  # a full disk, a directory made read-only
        raise ValueError(f"{what}: cannot write in {d} ({exc.strerror}): free space there, or make it "
                         "writable") from None


def _in_the_way(d: Path, name: str, ours: set[str]) -> bool:
    """Whether writing d/name would write over what this program did not write there, or through a link."""
    folders = [d / p for p in Path(name).parents if p != Path(".")]
    if any(f.is_symlink() or f.exists() and not f.is_dir() for f in folders):
        return True
    path = d / name
    return os.path.lexists(path) and (name not in ours or path.is_symlink() or not path.is_file())
