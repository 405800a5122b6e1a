"""The Hugging Face export of a trained model, train's hf/ and Engine.export's alike: the weights in the dtype asked
(else the source checkpoint's, else the compute dtype), the source's config.json, the tokenizer's files, and a record
of who exported it, written aside and swapped in whole."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

import megatrain.user_files as user_files
from megatrain.config import CaseConfig
from megatrain.models.checkpoint import save_checkpoint, stored_dtype
from megatrain.models.safetensors_files import INDEX_FILE
from megatrain.tokenizer import CHAT_TEMPLATES_DIR, TOKEN_FILES, token_files
from megatrain.train.rundir import written_aside

GENERATION_FILE = "generation_config.json"  # an export copies it from the tokenizer's directory, beside token_files
TOKENIZER_FILES = (*TOKEN_FILES, GENERATION_FILE)  # what an export copies from the tokenizer's directory (and
# the named chat templates of its CHAT_TEMPLATES_DIR)
EXPORT_SHARD_BYTES = 2**29  # the most a Hugging Face export holds in memory beyond training's own state
EXPORT_FILE = "megatrain_export.json"  # in hf/: the step exported and the run, beside the Hugging Face files


def export_dtype(asked: str | None, source_config: dict | None, case: CaseConfig) -> tuple[torch.dtype, str]:
    """(the export's weights' dtype, a note saying which and whence): `asked` (--export-dtype), else the dtype of the
    checkpoint trained from (an fp32 checkpoint trained at --dtype bfloat16 keeps its fp32 master's updates, where
    bf16 weights round away those below 2^-8 of a weight: a norm's at lr 1e-5), else the compute dtype (--dtype)."""
    stored = stored_dtype(source_config) if source_config is not None else None
    dtype, whence = (getattr(torch, asked), "--export-dtype") if asked is not None else \
        (stored, "the --init-from checkpoint's dtype") if stored is not None else (case.torch_dtype, "--dtype")
    return dtype, f"{str(dtype).removeprefix('torch.')} weights: {whence}"


def export_checkpoint(weights, case: CaseConfig, hf_dir: Path, tokenizer_dir: str | None, provenance: dict,
                      dtype: torch.dtype, source_config: dict | None = None) -> None:
    """The weights (a system's export_weights) in `dtype` as a Hugging Face checkpoint with the tokenizer files,
    written aside and swapped in whole; its config.json the source's (source_config, the checkpoint's trained from),
    if any."""
    with written_aside(hf_dir) as tmp:
        save_checkpoint(weights, case.shape(), tmp, max_shard_bytes=EXPORT_SHARD_BYTES,
                        dtype=dtype, source_config=source_config)
        for name, source in tokenizer_copies(tokenizer_dir).items():
            (tmp / name).parent.mkdir(exist_ok=True)
            shutil.copy(source, tmp / name)
        (tmp / EXPORT_FILE).write_text(json.dumps(provenance) + "\n")
        _keep_others(hf_dir, tmp)


def tokenizer_copies(tokenizer_dir: str | None) -> dict[str, Path]:
    """The tokenizer files (TOKENIZER_FILES) an export copies from tokenizer_dir, by name, each where it leads: one
    whose link leads out of the directory is refused (megatrain.user_files.within), for the export publishes it, and
    so is one that is not a file (a folder, a named pipe), which the export could not copy."""
    if not tokenizer_dir:
        return {}
    d = Path(tokenizer_dir)
    named = [name for name in token_files(d) if name.startswith(CHAT_TEMPLATES_DIR + "/")]
    copies = {name: user_files.within(d, d / name) for name in [*TOKENIZER_FILES, *named] if (d / name).exists()}
    if odd := next((name for name, path in copies.items() if not path.is_file()), None):
        raise ValueError(f"{d / odd} is not a file (an export copies it from there): put the file there, or remove it")
    return copies


def _keep_others(old: Path, new: Path) -> None:
    """Carry into the new export, as hard links, what no export writes that someone put in the old one (a README, a
    model card): the swap would delete it."""
    for entry in sorted(old.iterdir()) if old.is_dir() else ():
        if not exported_name(entry.name) and not (new / entry.name).exists():
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=os.link)
            else:
                os.link(entry, new / entry.name, follow_symlinks=False)


def not_exported(folder: Path) -> list[str]:
    """The files of `folder` an export would replace that no export wrote: those of an export's names, in a folder
    without the EXPORT_FILE every export writes (a user's own checkpoint, say)."""
    if not folder.is_dir() or (folder / EXPORT_FILE).is_file():
        return []
    return sorted(p.name for p in folder.iterdir() if exported_name(p.name))


def exported_name(name: str) -> bool:
    """Whether an export writes (or replaces) the file `name` of its folder."""
    return name in {"config.json", INDEX_FILE, EXPORT_FILE, *TOKENIZER_FILES, CHAT_TEMPLATES_DIR} or \
        name.endswith(".safetensors")
