"""Checkpoint directories: OUT/checkpoints/step-N/, written under a temporary name and renamed when complete
(a crash mid-save leaves the previous checkpoint as the latest), the last K kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatrain.config import CaseConfig
from megatrain.memory import GIB

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
