"""One model definition for every system: shapes, registry, modules, init, loss, HF checkpoints."""

from megatrain.models.config import ModelConfig
from megatrain.models.registry import MODELS, get_model_config
from megatrain.models.transformer import DecoderLayer, RMSNorm, Transformer, rotary_tables

__all__ = ["MODELS", "DecoderLayer", "ModelConfig", "RMSNorm", "Transformer", "get_model_config", "rotary_tables"]
