"""What a data file holds, cheaply: its size, modification time and a hash of sampled blocks. A run records them for
its data when it starts; a resume refuses files that changed since, which would otherwise train other rows at the
recorded data position without a word."""

from __future__ import annotations

import hashlib
from pathlib import Path

from megatrain.train.datasets import HFData

SAMPLED_BLOCKS = 16  # evenly spaced, the first and last included; a smaller file is hashed whole
BLOCK_BYTES = 2**16


def fingerprint(path: Path) -> dict:
    """{bytes, mtime_ns, sampled_sha256} of the file at path."""
    st = path.stat()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if st.st_size <= SAMPLED_BLOCKS * BLOCK_BYTES:
            digest.update(f.read())
        else:
            for i in range(SAMPLED_BLOCKS):
                f.seek((st.st_size - BLOCK_BYTES) * i // (SAMPLED_BLOCKS - 1))
                digest.update(f.read(BLOCK_BYTES))
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sampled_sha256": digest.hexdigest()}


def fingerprints(files: list[Path | HFData]) -> dict[str, dict]:
    """Each file's fingerprint by its resolved path: a local Hugging Face dataset's every file (of its folder, or the
    one file); a hub dataset's none (its name and split are settings a resume may not change, and it is read where
    the hub is reached: what it holds there is the hub's)."""
    paths = []
    for f in files:
        if not isinstance(f, HFData):
            paths.append(f)
        elif not f.hub:
            root = Path(f.name)
            paths += sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    return {str(p.resolve()): fingerprint(p) for p in paths}


def fingerprints_record(recorded) -> bool:
    """Whether `recorded` is what fingerprints() returns (a record read back from a file anyone may have edited)."""
    return isinstance(recorded, dict) and all(
        isinstance(print_, dict) and set(print_) == {"bytes", "mtime_ns", "sampled_sha256"}
        for print_ in recorded.values())


def changed(recorded: dict[str, dict], now: dict[str, dict]) -> str | None:
    """How the files fingerprinted as `now` differ from those `recorded`, in words (the first difference), or None."""
    for name in sorted(set(recorded) | set(now)):
        if name not in now:
            return f"{name} is no longer among them"
        if name not in recorded:
            return f"{name} was not among them"
        was, is_ = recorded[name], now[name]
        if was["bytes"] != is_["bytes"]:
            return f"{name} holds {is_['bytes']} bytes, {was['bytes']} when the run started"
        if was["sampled_sha256"] != is_["sampled_sha256"]:
            return f"{name} holds other bytes than when the run started (the same number)"
        if was["mtime_ns"] != is_["mtime_ns"]:
            seconds, ns = divmod(was["mtime_ns"], 10**9)  # exactly: a float holds ~16 of its 19 digits
            return (f"{name} was modified since the run started (its size and sampled blocks are the same: if its "
                    f"content is, `touch -d @{seconds}.{ns:09d}` it back)")
    return None
