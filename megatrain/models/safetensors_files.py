"""The safetensors files of a Hugging Face checkpoint folder, of either kind of model: found (one file, or an index
and its shards), their headers read and held to each other, their tensors read by key, and shards written.

A damaged file (truncated, empty, a header that is not JSON or claims more bytes than the file has) and an index that
does not match its shards are refused by file name (ValueError) before any tensor is read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names, for tensors read as headers only
_STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                  "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                  "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}



class StoredTensor(NamedTuple):
    """A tensor of a checkpoint as its file's header states it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str


Stored = dict[str, StoredTensor]  # every tensor of a checkpoint's files, by key


def read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON ({exc})") from None
    except OSError as exc:  # a folder, a file this user cannot read
        raise ValueError(f"{file} cannot be read ({exc.strerror})") from None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, the single file first as transformers looks for it."""
    if (path / SINGLE_FILE).exists():
        if not (path / SINGLE_FILE).is_file():
            raise ValueError(f"{SINGLE_FILE} is not a file (a folder, a FIFO): the weights are a safetensors "
                             "file")
        return [path / SINGLE_FILE]
    if (path / INDEX_FILE).exists():
        files = [path / f for f in sorted(set(_weight_map(path).values()))]
        if missing := [f.name for f in files if not f.is_file()]:
            raise ValueError(f"{path / INDEX_FILE} names shard {missing[0]}, which is not in {path}"
                             + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
        return files
    raise ValueError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors checkpoints are read")


def _weight_map(path: Path) -> dict[str, str]:
    index = read_json(path / INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{path / INDEX_FILE} has no weight_map of tensor names to shard files")
    return weight_map


def _open(file: Path, stack: contextlib.ExitStack):
    try:
        return stack.enter_context(safe_open(file, framework="pt", device="cpu"))
    except SafetensorError as exc:  # truncated, empty, a header of another size or not JSON
        raise ValueError(f"{file.name} is not a readable safetensors file ({exc}): download or export it "
                         "again") from None


def stored_tensors(path: Path) -> Stored:
    """Every tensor of the checkpoint in folder `path`, from its files' headers alone; a damaged file, a key in two
    files, and an index naming a tensor its shard lacks (or a shard holding one it does not name) refused by file and
    key."""
    stored: Stored = {}
    with contextlib.ExitStack() as stack:
        for file in weight_files(path):
            handle = _open(file, stack)
            for key in handle.keys():
                if key in stored:
                    raise ValueError(f"tensor {key!r} is in both {stored[key].file} and {file.name}")
                view = handle.get_slice(key)
                stored[key] = StoredTensor(tuple(view.get_shape()), _STORED_DTYPES.get(view.get_dtype(), torch.uint8),
                                           file.name)
    if not (path / SINGLE_FILE).exists():
        weight_map = _weight_map(path)
        for key, file in sorted(weight_map.items()):
            if key not in stored or stored[key].file != file:
                raise ValueError(f"{INDEX_FILE} places tensor {key!r} in {file}, which does not hold it")
        if unnamed := sorted(set(stored) - set(weight_map)):
            raise ValueError(f"{stored[unnamed[0]].file} holds tensor {unnamed[0]!r}, which {INDEX_FILE} does not "
                             "name")
    return stored


class Tensors:
    """The tensors of a checkpoint folder by key, each file opened once (inside `stack`), counting the keys read; with
    meta=True, meta tensors of the stored shapes and dtypes (a check that reads no data)."""

    def __init__(self, path: Path, stored: Stored, stack: contextlib.ExitStack | None = None, meta: bool = False):
        self.stored, self.meta, self.read_keys = stored, meta, set()
        self.files = {} if meta else {file.name: _open(file, stack) for file in weight_files(path)}
        self.where = SINGLE_FILE if (path / SINGLE_FILE).exists() else f"the shards {INDEX_FILE} names"

    def __contains__(self, key: str) -> bool:
        return key in self.stored

    def __call__(self, key: str) -> torch.Tensor:
        if key not in self.stored:
            raise ValueError(f"{self.where} lack{'s' * (self.where == SINGLE_FILE)} tensor {key!r}")
        self.read_keys.add(key)
        shape, dtype, file = self.stored[key]
        return torch.empty(shape, dtype=dtype, device="meta") if self.meta else self.files[file].get_tensor(key)


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split of names (in order) into shards of at most max_shard_bytes; a bigger tensor gets its own."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, nbytes in sizes.items():
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """The files of a checkpoint of `count` shards, as transformers names them."""
    return [SINGLE_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file; an I/O failure (a full disk) raised as the OSError it is, not as a SafetensorError."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as exc:
        found = re.search(r"\(os error (\d+)\)", str(exc))
        if found is None:
            raise
        raise OSError(int(found[1]), os.strerror(int(found[1])), str(path)) from None
