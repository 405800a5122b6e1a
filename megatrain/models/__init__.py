"""One model definition for every system: shapes, registry, modules, init, loss, HF checkpoints."""

from megatrain.models.config import ModelConfig
from megatrain.models.registry import MODELS, get_model_config
from megatrain.models.rope import rotary_tables
from megatrain.models.transformer import DecoderLayer, RMSNorm, Transformer

__all__ = ["MODELS", "DecoderLayer", "ModelConfig", "RMSNorm", "Transformer", "get_model_config", "rotary_tables"]
