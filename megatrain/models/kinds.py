"""The two kinds of model, each by what only it has: its module, and its checkpoints' check, read and write. A shape
names its kind (ModelShape.kind); megatrain.models.checkpoint and megatrain.models.build_model reach the kind's own
code through kind_of, so a generic shape never reaches the hand-written translation, nor the other way round.

    handwritten   megatrain.models.handwritten: our Transformer; config.json translated to ModelConfig and tensors to
                  and from our names by its family's row (handwritten/families.py)
    generic       megatrain.models.generic: transformers' own causal LM (GenericCausalLM); its checkpoints read and
                  written by transformers itself

transformers is imported only where a generic model is built, read or written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from megatrain.models.generic import weights as generic
from megatrain.models.generic.module import GenericCausalLM
from megatrain.models.handwritten import hf as handwritten
from megatrain.models.handwritten.transformer import Transformer
from megatrain.models.safetensors_files import Stored
from megatrain.models.shape import ModelShape


@dataclass(frozen=True)
class ModelKind:
    """What one kind of model brings.

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
    """

    build_module: Callable[[ModelShape, bool, int], nn.Module]
    check_weights: Callable[[ModelShape, Path, Stored], None]
    read_weights: Callable[[ModelShape, Path], Iterator[tuple[str, torch.Tensor]]]
    write_weights: Callable[[Mapping[str, torch.Tensor], ModelShape, Path, int, torch.dtype], None]


KINDS = {
    "handwritten": ModelKind(Transformer, handwritten.check_weights, handwritten.read_weights,
                             handwritten.save_hf_checkpoint),
    "generic": ModelKind(GenericCausalLM, generic.check_weights, generic.read_weights, generic.write_weights),
}


def kind_of(shape: ModelShape) -> ModelKind:
    """The kind a shape is of, by the name it gives (ModelShape.kind)."""
    return KINDS[shape.kind]
