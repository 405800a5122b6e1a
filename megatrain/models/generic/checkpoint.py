"""A checkpoint's model, the hand-written one or transformers' own (shape_from_hf), and its weights in and out.

A generic model's checkpoints are read and written by transformers itself: whatever layout a family publishes (experts
one by one or fused, renamed keys) is transformers' conversion to and from its modules, not ours.

Reading loads the checkpoint with from_pretrained on the host (its safetensors only, in its stored dtype) and hands
over its weights one at a time: the host holds that copy of the model beside the training state while it loads.
Writing is save_pretrained of the same class, from the weights by name, with the config.json it was read from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from megatrain.models.generic.config import GenericConfig
from megatrain.models.generic.skeleton import build_causal_lm, transformers_config
from megatrain.models.handwritten.config import FAMILIES, ModelConfig
from megatrain.models.handwritten.hf import (
    REQUIRED_KEYS,
    check_config_values,
    check_hf_checkpoint,
    config_from_hf,
    iter_hf_tensors,
    named_weights,
    persistent_buffers,
    read_hf_config,
    save_hf_checkpoint,
    weight_files,
)


def iter_generic_weights(path: str | Path, cfg: GenericConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and persistent buffer of the checkpoint in directory `path`, as transformers
    loads it (from_pretrained on the host, safetensors only)."""
    from transformers import AutoModelForCausalLM

    with _quiet():
        model = AutoModelForCausalLM.from_pretrained(path, config=transformers_config(cfg), dtype="auto",
                                                     use_safetensors=True)
    weights = named_weights(model)
    del model
    for name in list(weights):  # each released once the caller has copied it
        yield name, weights.pop(name)


@torch.no_grad()
def save_generic_checkpoint(weights: Mapping[str, torch.Tensor], cfg: GenericConfig, out_dir: str | Path,
                            max_shard_bytes: int, dtype: torch.dtype) -> None:
    """Write `weights` (every parameter and persistent buffer by name) as the family's own checkpoint: transformers'
    save_pretrained of the same class, the config.json `cfg` was read from; the parameters in `dtype`, the buffers in
    their own."""
    model = build_causal_lm(cfg, "meta")
    buffers = persistent_buffers(model)
    expected = named_weights(model)
    if missing := sorted(set(expected) - set(weights)):
        raise ValueError(f"weights missing for the export: {missing[:8]}")
    state = {name: weights[name].detach().to("cpu", None if name in buffers else dtype) for name in expected}
    model.config.dtype = dtype
    with _quiet():
        model.save_pretrained(out_dir, state_dict=state, max_shard_size=max_shard_bytes, safe_serialization=True)


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars off (a train run logs its own lines), as they were after."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def check_checkpoint(path: str | Path, generic: bool = False) -> tuple[ModelConfig | GenericConfig, dict]:
    """(the model of the checkpoint in directory `path` (shape_from_hf), the config.json it was read from): the
    config read and translated once, and the weight files found (for the hand-written model, every weight it reads
    found in the files' headers with the shape the config implies: check_hf_checkpoint), without reading a tensor; a
    ValueError, starting with the path, names what is missing, damaged or unsupported."""
    hf = read_hf_config(path)
    try:
        cfg = shape_from_hf(hf, generic)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if isinstance(cfg, ModelConfig):
        return check_hf_checkpoint(path, hf), hf
    weight_files(Path(path))
    return cfg, hf


def shape_from_hf(hf: Mapping, generic: bool = False) -> ModelConfig | GenericConfig:
    """The model a config.json trains as: our hand-written one where it implements every setting (the fast path),
    else transformers' own modules streamed (megatrain.models.generic; with generic, always); a ValueError says why
    neither can. A hand-written family's config whose values are damaged (check_config_values) is refused, not
    handed to transformers' modules."""
    if hf.get("model_type") in FAMILIES:
        check_config_values(hf)
        # a hand-written family's config without a shape key is damaged, not a request for transformers' defaults
        if missing := [key for key in REQUIRED_KEYS if key not in hf]:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
    if not generic:
        try:
            return config_from_hf(hf)
        except ValueError:
            pass
    return GenericConfig.from_hf(hf).check()


def iter_weights(path: str | Path, shape: ModelConfig | GenericConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of the checkpoint in `path`, by the names of `shape`'s model."""
    return iter_hf_tensors(path, cfg=shape) if isinstance(shape, ModelConfig) else iter_generic_weights(path, shape)


def save_weights(weights: Mapping[str, torch.Tensor], shape: ModelConfig | GenericConfig, out_dir: str | Path,
                 max_shard_bytes: int, dtype: torch.dtype, source_config: Mapping | None = None) -> None:
    """`weights` (by the names of `shape`'s model) written as the family's own Hugging Face checkpoint; the
    hand-written model's config.json starts from source_config (the checkpoint's trained from), if any, and a generic
    model's is the config.json it was read from."""
    if isinstance(shape, ModelConfig):
        save_hf_checkpoint(weights, shape, out_dir, max_shard_bytes=max_shard_bytes, dtype=dtype,
                           source_config=source_config)
    else:
        save_generic_checkpoint(weights, shape, out_dir, max_shard_bytes, dtype)
