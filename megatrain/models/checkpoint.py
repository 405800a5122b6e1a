"""The one road from a Hugging Face checkpoint folder to a model and its weights, and back: `train --init-from`, the
Python API (`Engine(dir)`, `Trainer`), `bench` and every export take it, for either kind of model.

    checkpoint = open_checkpoint("./Qwen2.5-0.5B")   # config.json read and checked, its model chosen, files checked
    system.load_weights(checkpoint.weights())         # (name, tensor) one at a time, by the model's names
    save_checkpoint(system.export_weights(), checkpoint.shape, out_dir, ..., source_config=checkpoint.config)

The model a config.json trains as (shape_from_config): the hand-written one of its family where ours implements every
setting (megatrain.models.handwritten: the fast path), else transformers' own modules (megatrain.models.generic).
Before a tensor is read, a folder is refused in one line naming the file and the key or field (ValueError, the
folder's path first): a config.json that is not one or holds a damaged value (a count that is not a positive
integer, a number that is not finite), a damaged safetensors file or index, and the tensors its model would not find
there (missing, extra, of another shape, not floating point; for a generic model, what transformers' renaming hides
from the headers is refused as the weights are read, from transformers' own loading report).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.models.generic.config import LAYERS_KEYS
from megatrain.models.kinds import KINDS, claim, kind_of
from megatrain.models.safetensors_files import read_json, stored_tensors
from megatrain.models.shape import ModelShape
from megatrain.user_files import within

CONFIG_FILE = "config.json"
REMOTE_CODE = "auto_map"  # config.json's map of its classes to Python files of the checkpoint's own
DTYPE_KEYS = ("dtype", "torch_dtype")  # a config.json's name of its weights' dtype: transformers 5's, and before
# the config.json keys read as counts (>= 1 where given), counts that may be 0, and numbers: another type or range is
# refused by name, whichever kind of model would read it
_COUNT_KEYS = (*dict.fromkeys(k for kind in KINDS for k in kind.required_keys), "num_key_value_heads",
               "max_position_embeddings", "original_max_position_embeddings")
_SIZE_KEYS = ("head_dim", "sliding_window", "max_window_layers", "num_experts", "num_local_experts",
              "num_experts_per_tok", "moe_intermediate_size")
_NUMBER_KEYS = ("rope_theta", "rms_norm_eps", "router_aux_loss_coef", "swiglu_limit", "swiglu_alpha",
                "partial_rotary_factor")
# The most layers a config may name: far above any published decoder's. A deeper one is damaged, and the model's
# per-layer structures (its shapes, transformers' modules on the meta device) would grow for minutes and gigabytes
# before the memory pre-flight could weigh it.
MAX_LAYERS = 1024


@dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face checkpoint folder, checked (open_checkpoint).

    Attributes:
        path: the folder.
        shape: the model it holds.
        config: its config.json as read, without auto_map (an export of the model starts from it).
        notes: what a run says of it before it starts (the custom code it does not run).
    """

    path: Path
    shape: ModelShape
    config: dict
    notes: tuple[str, ...] = ()

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight, by the model's names, read one at a time (what a system's load_weights
        takes); what the headers could not show wrong is refused as it is read."""
        return kind_of(self.shape).read_weights(self.shape, self.path)


def open_checkpoint(path: str | Path, generic: bool = False) -> Checkpoint:
    """The checkpoint in folder `path`: its config.json read and checked once, the model it trains as
    (shape_from_config; with generic, transformers' own modules always), and its files held to that model without
    reading a tensor. ValueError, starting with the path, naming what is missing, damaged or unsupported."""
    path = Path(path)
    for entry in path.iterdir() if path.is_dir() else ():  # read, and config.json and the weights carried into an
        within(path, entry)  # export: none of it from outside the folder named
    config = read_config(path)
    # the checkpoint's own Python code (transformers runs it only with trust_remote_code): never run here, the model
    # trains as transformers' own class of its model_type (from_pretrained's choice without trust_remote_code), and
    # an export whose config.json kept auto_map would load into that code, not the architecture trained
    notes = (f"note: {path / CONFIG_FILE} names code of its own (auto_map), which megatrain never runs: it trains as "
             f"transformers' own {config.get('model_type')!r} model, as from_pretrained loads it without "
             "trust_remote_code, and the export's config.json has no auto_map",) if REMOTE_CODE in config else ()
    config = {k: v for k, v in config.items() if k != REMOTE_CODE}
    try:
        shape = shape_from_config(config, generic)
        kind_of(shape).check_weights(shape, path, stored_tensors(path))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return Checkpoint(path, shape, config, notes)


def config_shape(path: Path) -> tuple[ModelShape, str]:
    """(the model, the sha256 of the file) of a config.json file, or of a checkpoint folder's config.json (its weights
    neither read nor needed): a model to benchmark by its shape alone. ValueError naming the file and what is wrong."""
    file = path / CONFIG_FILE if path.is_dir() else path
    config = read_config(path) if path.is_dir() else read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{file} is not a JSON object")
    try:
        shape = shape_from_config(config)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None
    return shape, hashlib.sha256(file.read_bytes()).hexdigest()


def read_config(path: Path) -> dict:
    """The config.json of a checkpoint folder; ValueError naming the folder when it or the file is missing or not a
    JSON object."""
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path} has no {CONFIG_FILE}: not a Hugging Face checkpoint directory")
    config = read_json(path / CONFIG_FILE)
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG_FILE} is not a JSON object")
    return config


def shape_from_config(config: Mapping, generic: bool = False) -> ModelShape:
    """The model a config.json trains as: our hand-written one where it implements every setting (the fast path),
    else transformers' own modules streamed (with generic, always); a ValueError says why neither can. A damaged
    value (check_config_values) is refused whichever model would read it, and a hand-written family's config without
    a shape key is damaged, not a request for transformers' defaults."""
    check_config_values(config)
    return claim(config, generic)


def check_config_values(config: Mapping) -> None:
    """The config.json keys read as counts positive integers (sizes that may be 0: head_dim, windows, experts; a list
    of them, one per layer), those read as numbers numbers, and its RoPE base and norm epsilon finite and > 0, where
    given; ValueError naming the first that is not."""
    for keys, kind, what, least in ((_COUNT_KEYS, int, "an integer >= 1", 1), (_SIZE_KEYS, int, "an integer >= 0", 0),
                                    (_NUMBER_KEYS, int | float, "a number", -math.inf)):
        for key in keys:
            value = config.get(key)
            values = value if isinstance(value, list) else [value]  # a list: one per layer (Gemma 3n's widths)
            if value is not None and not all(isinstance(v, kind) and not isinstance(v, bool) and v >= least
                                             for v in values):
                raise ValueError(f"{CONFIG_FILE} {key}={json.dumps(value)} must be {what}")
    for key in LAYERS_KEYS:
        if isinstance(config.get(key), int) and config[key] > MAX_LAYERS:
            raise ValueError(f"{CONFIG_FILE} {key}={config[key]} is deeper than any model this program builds (at most "
                             f"{MAX_LAYERS} layers): the config is damaged")
    params = config.get("rope_parameters")
    theta = params.get("rope_theta") if isinstance(params, Mapping) else None
    for key, value in (("rope_theta", config.get("rope_theta") if theta is None else theta),
                       ("rms_norm_eps", config.get("rms_norm_eps"))):
        if isinstance(value, int | float) and not isinstance(value, bool) and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{key} must be a finite number > 0, got {value}")


def save_checkpoint(weights: Mapping[str, torch.Tensor], shape: ModelShape, out_dir: str | Path, max_shard_bytes: int,
                    dtype: torch.dtype, source_config: Mapping | None = None) -> None:
    """`weights` (by the names of `shape`'s model) written into out_dir as the family's own Hugging Face checkpoint,
    which transformers' from_pretrained loads: config.json (exported_config of source_config, the config.json of the
    checkpoint the model was read from, where there is one; else the kind's) and safetensors shards of at most
    max_shard_bytes, the weights in `dtype`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind_of(shape).write_weights(weights, shape, out_dir, max_shard_bytes, dtype)
    if source_config is not None:
        assert shape_from_config(source_config, kind_of(shape) is KINDS[-1]) == shape, "the source's model"
        (out_dir / CONFIG_FILE).write_text(json.dumps(exported_config(source_config, dtype), indent=2) + "\n")


def exported_config(source: Mapping, dtype: torch.dtype) -> dict:
    """The config.json of an export of a model trained from the checkpoint whose config.json is `source`: the source
    whole (its token ids, generation and tokenizer settings, use_cache, keys we do not read), not a kind's rendering
    of it (transformers' own turned use_cache false), without a quantization_config (the export's experts are plain
    tensors), and its dtype key naming the weights' dtype: `dtype` (transformers 5), `torch_dtype` (before), both
    where it has neither."""
    config = {k: v for k, v in source.items() if k != "quantization_config"}
    keys = [k for k in DTYPE_KEYS if k in config] or DTYPE_KEYS
    config.update(dict.fromkeys(keys, str(dtype).removeprefix("torch.")))
    return config


def stored_dtype(config: Mapping) -> torch.dtype | None:
    """The dtype a config.json says its checkpoint's weights are stored in (None: it names none, or not a floating
    dtype torch has)."""
    name = next((config[k] for k in DTYPE_KEYS if isinstance(config.get(k), str)), None)
    dtype = getattr(torch, name, None) if name else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
