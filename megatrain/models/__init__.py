"""The model layer: two kinds of model behind one shape (megatrain.models.shape.ModelShape), and one road from a
checkpoint folder to a model and back (megatrain.models.checkpoint).

    handwritten/  our own modules for the families in handwritten/families.py (one row per model_type): the fast path
    generic/      transformers' own modules, streamed, for every other decoder
    registry.py   named shapes of both kinds (python -m megatrain models)
"""

from torch import nn

from megatrain.models.generic import GenericConfig
from megatrain.models.handwritten.config import ModelConfig
from megatrain.models.handwritten.transformer import DecoderLayer, RMSNorm, Transformer
from megatrain.models.kinds import kind_of
from megatrain.models.registry import MODELS, model_shape
from megatrain.models.rope import rotary_tables
from megatrain.models.shape import ModelShape


def build_model(shape: ModelShape, activation_checkpointing: bool = False, mlp_chunk_tokens: int = 0) -> nn.Module:
    """The module a system that owns one trains, on the current default device: our Transformer for a hand-written
    shape, transformers' own causal LM (megatrain.models.generic.module.GenericCausalLM) for a generic one; both take
    forward(tokens, labels, normalizer, segments, aux_weight) and keep their decoder layers in `layers`."""
    return kind_of(shape).build_module(shape, activation_checkpointing, mlp_chunk_tokens)


__all__ = ["MODELS", "DecoderLayer", "GenericConfig", "ModelConfig", "ModelShape", "RMSNorm", "Transformer",
           "build_model", "model_shape", "rotary_tables"]
