"""The shape of a model, of either kind: what the layers above the models read of it (ModelShape), and the units a
streaming or sharding system holds (UnitShapes).

Two kinds implement ModelShape: the hand-written models (megatrain.models.handwritten.config.ModelConfig: our own
modules for the families in megatrain.models.handwritten.families) and transformers' own modules
(megatrain.models.generic.config.GenericConfig: every other decoder). A case, the engine, the memory plan, the FLOP
formula and the records take a ModelShape and never ask which kind they hold; what only one kind has (its config
translation, its checkpoint layout, its modules, its engine program, what DeepSpeed gathers whole) is its kind's row
in megatrain.models.kinds, which code above the models reads by the shape's kind name, never by a class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class UnitShapes:
    """One streamed unit of a model (megatrain.engine.layout): its kind ('embed', 'layer', 'head'), the prefix of its
    parameters' full names, and (name inside its template, shape) of each parameter in the module's order."""

    kind: str
    prefix: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]


class ModelShape(Protocol):
    """A model's shape: its sizes, its attention per layer, its experts, and every parameter count (each derived from
    the named tensor shapes of its units), for any kind of model."""

    @property
    def kind(self) -> str:
        """Which kind of model it is, 'handwritten' or 'generic': its row in megatrain.models.kinds.KINDS."""

    # ---- what its config says ----------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        """The Hugging Face model_type (config.json's) the model loads from and exports to."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def crossing_numel_per_token(self) -> int:
        """Elements a token's state that crosses decoder layers holds over a step, besides the hidden state (per-layer
        inputs, keys and values shared with later layers)."""

    @property
    def replayed_bytes_per_token(self) -> int:
        """Bytes of a token's routing the engine keeps over a step for its recompute to replay (a hand-written
        mixture of experts' chosen experts in every layer), 0 where nothing is replayed."""

    @property
    def intermediate_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def q_size(self) -> int: ...

    @property
    def kv_size(self) -> int: ...

    def layer_head_dim(self, layer: int) -> int:
        """Decoder layer `layer`'s attention head width (head_dim, where a config gives some layers their own)."""

    @property
    def max_seq_len(self) -> int:
        """The context the shape is published for (config.json's max_position_embeddings)."""

    @property
    def tie_embeddings(self) -> bool: ...

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's attention as the config names it ('full_attention', 'sliding_attention', ...)."""

    @property
    def sliding_window(self) -> int: ...

    def layer_type(self, layer: int) -> str: ...

    def attended_pairs(self, layer: int, seq: int) -> float:
        """(query, key) pairs decoder layer `layer` scores in one sequence of `seq` tokens."""

    # ---- experts -------------------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def num_experts_per_tok(self) -> int: ...

    @property
    def moe_intermediate_size(self) -> int: ...

    # ---- training ------------------------------------------------------------------------------------------------
    @property
    def random_settings(self) -> dict[str, float]:
        """The config's settings that make training draw random numbers (dropout, jitter; megatrain.models.draws),
        by config.json key: empty for a model whose training is deterministic."""

    # ---- accounting ----------------------------------------------------------------------------------------------
    def unit_shapes(self) -> tuple[UnitShapes, ...]:
        """The streamed units in forward order: the embedding, each decoder layer, the head."""

    def num_params(self) -> int:
        """Every parameter (tied embeddings once), every expert included: what the training state holds."""

    def active_params(self) -> int:
        """The parameters one token uses (the records' 6NT)."""

    def unrouted_params(self) -> int: ...

    def embedding_params(self) -> int: ...

    def layer_params(self) -> int:
        """Parameters of a decoder layer (the largest, where they differ)."""

    def head_params(self) -> int: ...

    def param_numels(self) -> list[int]: ...

    def layer_matmul_params(self) -> float: ...

    def head_matmul_params(self) -> int: ...

    def matmul_params(self) -> float: ...

    # ---- other shapes of it, and what it refuses ----------------------------------------------------------------
    def with_layers(self, num_layers: int) -> ModelShape:
        """The model at another depth."""

    def to_dict(self) -> dict:
        """The shape as a record keeps it (megatrain.models.kinds.shape_from_dict reads it back)."""

    def check(self) -> ModelShape:
        """What building the model alone tells, refused now (ValueError saying why); returns self."""

    def packing_refusal(self) -> str | None:
        """Why packed rows (several documents a row) cannot train this model, or None."""


class HeadSizes:
    """The attention's projection widths from a shape's heads, one definition for both kinds of model (ModelConfig
    and GenericConfig inherit it): a query's num_heads x head_dim, a key's or value's num_kv_heads x head_dim."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_head_dim(self, layer: int) -> int:
        return self.head_dim
