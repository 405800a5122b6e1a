"""One model definition for every system: shapes, registry, modules, init, loss, HF checkpoints; and transformers' own
decoders beside it (megatrain.models.generic)."""

from torch import nn

from megatrain.models.generic import GenericConfig
from megatrain.models.handwritten.config import ModelConfig
from megatrain.models.handwritten.transformer import DecoderLayer, RMSNorm, Transformer
from megatrain.models.registry import MODELS, get_model_config
from megatrain.models.rope import rotary_tables


def build_model(cfg: ModelConfig | GenericConfig, activation_checkpointing: bool = False,
                mlp_chunk_tokens: int = 0) -> nn.Module:
    """The module a system that owns one trains, on the current default device: our Transformer for a hand-written
    shape, transformers' own causal LM (megatrain.models.generic.module.GenericCausalLM) for a generic one; both take
    forward(tokens, labels, normalizer, segments, aux_weight) and keep their decoder layers in `layers`."""
    if isinstance(cfg, ModelConfig):
        return Transformer(cfg, activation_checkpointing=activation_checkpointing, mlp_chunk_tokens=mlp_chunk_tokens)
    from megatrain.models.generic.module import GenericCausalLM

    return GenericCausalLM(cfg, activation_checkpointing=activation_checkpointing, mlp_chunk_tokens=mlp_chunk_tokens)


__all__ = ["MODELS", "DecoderLayer", "GenericConfig", "ModelConfig", "RMSNorm", "Transformer", "build_model",
           "get_model_config", "rotary_tables"]
