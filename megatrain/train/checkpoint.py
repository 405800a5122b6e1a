"""Checkpoint directories: OUT/checkpoints/step-N/, written under a temporary name and renamed when complete
(a crash mid-save leaves the previous checkpoint as the latest), the last K kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

META_FILE = "trainer.json"  # written last: its presence marks a complete checkpoint


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def save(root: Path, step: int, write_state, meta: dict, keep: int) -> Path:
    """write_state(dir) writes the system's state; meta (step, data position, RNG, config) goes beside it."""
    final = step_dir(root, step)
    tmp = root / f".step-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_state(tmp)
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in complete(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def complete(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not root.exists():
        return []
    done = [d for d in root.glob("step-*") if (d / META_FILE).exists()]
    return sorted(done, key=lambda d: int(d.name.removeprefix("step-")))


def latest(root: Path) -> Path | None:
    found = complete(root)
    return found[-1] if found else None
