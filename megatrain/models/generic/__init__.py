"""transformers' own decoders, trained through their own modules: the generic path beside the hand-written models."""

from megatrain.models.generic.config import GenericConfig

__all__ = ["GenericConfig"]
