"""The kinds of model, in one table (KINDS, in the order they claim a config.json): how each claims a config, what only
it has (its module, and its checkpoints' check, read and write), and what the layers above ask of it by name, never by
the model's class: its engine program and what DeepSpeed ZeRO-3 gathers whole and compiles. A shape names its kind
(ModelShape.kind); kind_of finds its row.

    handwritten   megatrain.models.handwritten: our Transformer, for the families of handwritten/families.py;
                  config.json translated to ModelConfig and tensors to and from our names by its family's row
    generic       megatrain.models.generic: transformers' own causal LM (GenericCausalLM), for any other decoder;
                  its checkpoints read and written by transformers itself

A new kind is its package and one row here. transformers is imported only where a generic model is built, read or
written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megatrain.models.generic import weights as generic
from megatrain.models.generic.config import GenericConfig
from megatrain.models.generic.module import GenericCausalLM
from megatrain.models.handwritten import hf as handwritten
from megatrain.models.handwritten.config import ModelConfig
from megatrain.models.handwritten.families import FAMILIES
from megatrain.models.handwritten.moe import MoE
from megatrain.models.handwritten.transformer import DecoderLayer, Transformer
from megatrain.models.safetensors_files import Stored
from megatrain.models.shape import ModelShape


@dataclass(frozen=True)
class ModelKind:
    """What one kind of model brings.

    name: the kind a shape names (ModelShape.kind).
    shape: its shape's class; a record's shape (to_dict) is of the first kind whose fields hold its every key.
    families: the config.json model_types its modules are written for (empty: any decoder the kinds before leave).
    required_keys: config.json keys a config of one of its families has unless damaged (refused whichever kind would
        train it, not read as transformers' defaults).
    claim(config): the shape of a config.json this kind trains; ValueError where it cannot (the next kind is tried;
        the last kind's error says why none can).
    build_module(shape, activation_checkpointing, mlp_chunk_tokens): the module a system that owns one trains, on
        the current default device.
    check_weights(shape, path, stored): the checkpoint in folder `path`, whose files hold `stored` (from their
        headers), held to the model before a tensor is read; ValueError naming what is missing, extra, of another
        shape or not floating point, as far as the kind can tell from the headers.
    read_weights(shape, path): (name, tensor) of every weight of the checkpoint in folder `path`, by the model's
        names, one at a time; what check_weights could not see is refused as it is read.
    write_weights(weights, shape, out_dir, max_shard_bytes, dtype): the weights (by the model's names) written as the
        family's own checkpoint, a config.json of the shape included (an export's is its source's:
        megatrain.models.checkpoint.save_checkpoint).
    program: "module:attribute" of the engine program that streams it (megatrain.engine.programs), imported only
        when the engine builds one, as SYSTEMS names systems.
    zero3_leaves(module, compiled): the module classes DeepSpeed ZeRO-3 gathers whole in their own hook
        (set_z3_leaf_modules) rather than hooking their submodules.
    compile_layers: "module:attribute" of the function that runs every decoder layer of its module through compiled
        stateless templates, as the engine does, and returns them (DeepSpeed's compile).
    profiled: whether the performance model's ingredients profile its layers (megatrain.perf_model).
    """

    name: str
    shape: type
    families: tuple[str, ...]
    required_keys: tuple[str, ...]
    claim: Callable[[Mapping], ModelShape]
    build_module: Callable[[ModelShape, bool, int], nn.Module]
    check_weights: Callable[[ModelShape, Path, Stored], None]
    read_weights: Callable[[ModelShape, Path], Iterator[tuple[str, torch.Tensor]]]
    write_weights: Callable[[Mapping[str, torch.Tensor], ModelShape, Path, int, torch.dtype], None]
    program: str
    zero3_leaves: Callable[[nn.Module, bool], list[type]]
    compile_layers: str
    profiled: bool


def _handwritten_leaves(model: Transformer, compiled: bool) -> list[type]:
    """A compiled layer's hooks must stay outside the compiled call (Dynamo cannot trace them, and the partitioned
    stubs are empty); and what DeepSpeed tells its MoE users: the block's experts are read by its own forward, not
    by a submodule call ZeRO-3 could hook."""
    return [DecoderLayer] if compiled else [MoE] if model.cfg.is_moe else []


def _generic_leaves(model: GenericCausalLM, compiled: bool) -> list[type]:
    """A compiled layer's hooks outside the compiled call; transformers' own experts modules read their own
    parameters, as ZeRO-3's hooks expect."""
    return sorted({type(layer) for layer in model.layers}, key=str) if compiled else []


# The kinds, in the order they claim a config.json: the hand-written modules where they implement every setting (the
# fast path), else transformers' own (any decoder)
KINDS = (
    ModelKind("handwritten", ModelConfig, FAMILIES, handwritten.REQUIRED_KEYS, handwritten.config_from_hf, Transformer,
              handwritten.check_weights, handwritten.read_weights, handwritten.save_hf_checkpoint,
              "megatrain.engine.programs.handwritten:HandWrittenProgram", _handwritten_leaves,
              "megatrain.engine.programs.handwritten:compile_module_layers", True),
    ModelKind("generic", GenericConfig, (), (), lambda config: GenericConfig.from_hf(config).check(), GenericCausalLM,
              generic.check_weights, generic.read_weights, generic.write_weights,
              "megatrain.engine.programs.generic:GenericProgram", _generic_leaves,
              "megatrain.engine.programs.generic:compile_module_layers", False),
)


def kind_of(shape: ModelShape) -> ModelKind:
    """The kind a shape is of, by the name it gives (ModelShape.kind); KeyError naming the kinds there are."""
    for kind in KINDS:
        if kind.name == shape.kind:
            return kind
    raise KeyError(f"no model kind {shape.kind!r}: the kinds are {', '.join(k.name for k in KINDS)}")


def claim(config: Mapping, generic: bool = False) -> ModelShape:
    """The shape of config.json `config` of the first kind that trains it (KINDS, in order); with generic, the last
    kind's (transformers' own modules) always. ValueError from the last kind: why none can. A config of a kind's
    family without one of its required keys is damaged, refused whichever kind would train it."""
    family = config.get("model_type")
    for kind in KINDS:
        if family in kind.families and (missing := [k for k in kind.required_keys if k not in config]):
            raise ValueError(f"config.json lacks {', '.join(missing)}")
    kinds = KINDS[-1:] if generic else KINDS
    for kind in kinds[:-1]:
        try:
            return kind.claim(config)
        except ValueError:
            pass
    return kinds[-1].claim(config)


def shape_from_dict(d: dict) -> ModelShape:
    """A model shape read back from a record or a case (ModelShape.to_dict): of the first kind whose shape's fields
    hold its every key."""
    kind = next((k for k in KINDS if set(d) <= {f.name for f in dataclasses.fields(k.shape)}), KINDS[0])
    return kind.shape(**d)
