"""The engine's training state on disk, streamed: each host tile is written and read in place, chunk by
chunk, so saving or resuming needs no second copy of anything in memory.

A state directory holds tiles.bin (the tiles back to back, raw) and state.json (their names, dtypes and
sizes, the digest of where each tensor lies in them, and the AdamW step counts), and for a generic model with
buffers its checkpoint holds (a router's score correction) buffers.safetensors. Gradients are not state: every step
overwrites them.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatrain.engine.layout import Unit, layout_digest, packed
from megatrain.engine.store import HostStore

CHUNK_BYTES = 64 * 2**20
TILES_FILE, STATE_FILE, BUFFERS_FILE = "tiles.bin", "state.json", "buffers.safetensors"


def state_tiles(store: HostStore) -> dict[str, torch.Tensor]:
    tiles = {"weights": store.weights, "master": store.master, **store.moments.tensors(),
             "weights_next": store.weights_next}  # update_delay: the next step's, with the pending update applied
    return {name: t for name, t in tiles.items() if t is not None}


def manifest(tiles: dict[str, torch.Tensor]) -> list[dict]:
    return [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "numel": t.numel()} for n, t in tiles.items()]


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


def write_tiles(path: Path, tiles: dict[str, torch.Tensor]) -> list[dict]:
    with path.open("wb") as f:
        for t in tiles.values():
            raw = _raw(t)
            for a in range(0, len(raw), CHUNK_BYTES):
                f.write(raw[a:a + CHUNK_BYTES])
    return manifest(tiles)


def _tile(entry: dict | None) -> str:
    return f"{entry['name']} ({entry['dtype']} x {entry['numel']})" if entry else "none"


def read_tiles(path: Path, tiles: dict[str, torch.Tensor], saved: list[dict]) -> None:
    mine = manifest(tiles)
    differ = [(a, b) for a, b in itertools.zip_longest(saved, mine) if a != b]
    if differ:  # one line: the first difference and the count, not both manifests
        (first_saved, first_mine), tiles_n = differ[0], max(len(saved), len(mine))
        raise ValueError(f"{path.parent} holds another model, dtype or precision than this engine: {len(differ)} of "
                         f"{tiles_n} tiles differ, the first saved as {_tile(first_saved)}, here {_tile(first_mine)}")
    with path.open("rb") as f:
        for t in tiles.values():
            raw = _raw(t)
            for a in range(0, len(raw), CHUNK_BYTES):
                b = min(a + CHUNK_BYTES, len(raw))
                if f.readinto(raw[a:b]) != b - a:
                    raise ValueError(f"{path} is shorter than its state.json says: a partial write")


def check_layout(in_dir: Path, units: list[Unit], saved: str | None) -> None:
    """Refuse a state laid out otherwise than `units` (saved: its state.json's layout digest; None in a state saved
    before they recorded one, whose tiles held their tensors back to back)."""
    mine = layout_digest(units)
    if saved is None and not packed(units):
        raise ValueError(f"{in_dir} was saved with each tile's tensors back to back, and this engine starts some of "
                         f"this model's 16-byte aligned (layout {mine}): resume it with the MegaTrain that saved it, "
                         "or train on from its exported weights (--init-from)")
    if saved is not None and saved != mine:
        raise ValueError(f"{in_dir} holds tiles laid out otherwise (layout {saved}) than this engine lays out its "
                         f"model (layout {mine}): resume it with the model and the MegaTrain that saved it")


def steps_to_json(steps: dict) -> list:
    """FlatAdamW step counts ({(unit, offset): tensor}) as JSON."""
    return [[list(key), float(t)] for key, t in steps.items()]


def steps_from_json(items: list, device: torch.device) -> dict:
    return {tuple(key): torch.tensor(value, dtype=torch.float32, device=device) for key, value in items}


def save_engine_state(out_dir: Path, store: HostStore, counters: dict,
                      buffers: dict[str, torch.Tensor] | None = None) -> None:
    """The store's tiles, the counters and the model's buffers (a generic model's, megatrain.engine.programs.generic;
    none for the hand-written model) into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = write_tiles(out_dir / TILES_FILE, state_tiles(store))
    meta = {"tiles": manifest, "layout": layout_digest(store.units), **counters}
    (out_dir / STATE_FILE).write_text(json.dumps(meta) + "\n")
    if buffers:
        save_file({n: b.detach().cpu().contiguous() for n, b in buffers.items()}, out_dir / BUFFERS_FILE)


def load_engine_state(in_dir: Path, store: HostStore, buffers: dict[str, torch.Tensor] | None = None) -> dict:
    """Fill the store's tiles (and the model's buffers) from in_dir; returns the counters saved beside them."""
    meta = json.loads((in_dir / STATE_FILE).read_text())
    check_layout(in_dir, store.units, meta.pop("layout", None))
    read_tiles(in_dir / TILES_FILE, state_tiles(store), meta.pop("tiles"))
    if buffers:
        saved = load_file(in_dir / BUFFERS_FILE)
        if set(saved) != set(buffers):
            raise ValueError(f"{in_dir} holds the buffers of another model: {sorted(set(saved) ^ set(buffers))[:4]}")
        for name, b in buffers.items():
            b.copy_(saved[name])
    return meta
