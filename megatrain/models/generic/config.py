"""The shape of a transformers decoder trained through its own modules: a checkpoint's config.json, and every count
the planners, the pre-flight and the FLOP formula read, derived from the module's own parameter names and shapes.

GenericConfig answers the questions ModelConfig answers (num_params, active_params, layer_params, ...), so a case,
a record, the memory plan and the FLOP formula take either. Its counts come from the model built on the meta device
(megatrain.models.generic.skeleton, cached per config): nothing is guessed from a family's name. A mixture of experts
counts its routed experts (parameters under an `experts` module, the first dimension the expert) at k/E in the
parameters a token uses; shared experts, routers and everything else count whole.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatrain.models.draws import random_settings
from megatrain.models.masks import FULL, SLIDING, attended_pairs
from megatrain.models.shape import HeadSizes, UnitShapes

if TYPE_CHECKING:  # annotations only: the skeleton (which builds the model, with transformers) says the layout
    from megatrain.models.generic.skeleton import Layout

# the config keys transformers' families name a count with (the first their config has)
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "n_activated_experts", "num_activated_experts",
              "top_k_experts")
LAYERS_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
CHUNKED, LINEAR = "chunked_attention", "linear_attention"
ATTENTION_TYPES = (FULL, SLIDING, CHUNKED)  # layer types whose attention takes document masks


@dataclass(frozen=True)
class GenericConfig(HeadSizes):
    """A transformers decoder-only causal LM, by its config.json (canonical JSON, so the shape is hashable and a
    record keeps it). Built without memory; `layout` builds the model on the meta device once per config.

    Attributes:
        hf_json: the config.json dict as sorted JSON.
    """

    hf_json: str

    @staticmethod
    def from_hf(hf: Mapping) -> GenericConfig:
        """The shape of a config.json dict; what the generic path cannot stream is refused (ValueError) when its
        model is first built (check)."""
        return GenericConfig(json.dumps(dict(hf), sort_keys=True))

    @property
    def hf(self) -> dict:
        return json.loads(self.hf_json)

    def check(self) -> GenericConfig:
        """Build the meta-device model and run its forward preamble once: a ValueError names why the generic path
        cannot stream it (megatrain.models.generic.skeleton). Returns self."""
        layout(self.hf_json)
        key = next((k for k in TOP_K_KEYS if self.hf.get(k) is not None), None)
        # more than a layer has fails in transformers' top-k at step 1; none trains no expert, and 0 reads as "all"
        if self.is_moe and key is not None and not 1 <= self.hf[key] <= self.num_experts:
            raise ValueError(f"config.json {key}={self.hf[key]} must be from 1 to the experts a layer has "
                             f"({self.num_experts}): the experts each token is routed to")
        return self

    @property
    def layout(self) -> Layout:
        return layout(self.hf_json)

    # ---- what the config says ----------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return self.hf["model_type"]

    @property
    def num_layers(self) -> int:
        key = _first(self.hf, LAYERS_KEYS)
        return int(self.hf[key]) if key in self.hf else len(self.layout.units) - 2

    @property
    def vocab_size(self) -> int:
        return self.layout.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.layout.hidden_size

    @property
    def crossing_numel_per_token(self) -> int:
        return self.layout.crossing_numel_per_token

    replayed_bytes_per_token = 0  # transformers' modules take no routing to replay (megatrain.engine.programs)

    @property
    def num_heads(self) -> int:
        return int(self.hf.get(_first(self.hf, HEADS_KEYS)) or 1)

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        hf = self.hf
        # MLA's query-key width is its qk_head_dim (its head_dim is the rotary part alone)
        return int(hf.get("qk_head_dim") or hf.get("head_dim") or self.hidden_size // self.num_heads)

    def layer_head_dim(self, layer: int) -> int:
        """Layer `layer`'s head width: transformers' per-layer config's where its config class sets layers apart
        (Gemma 4's full layers take global_head_dim), else head_dim."""
        dims = _layer_head_dims(self.hf_json)
        return dims[layer] if len(dims) == self.num_layers and dims[layer] else self.head_dim

    @property
    def intermediate_size(self) -> int:
        return int(self.hf.get("intermediate_size") or 4 * self.hidden_size)

    @property
    def max_seq_len(self) -> int:
        return int(self.hf.get("max_position_embeddings") or 2**20)

    @property
    def tie_embeddings(self) -> bool:
        return self.layout.head_weight_name not in dict(self.layout.units[-1].shapes)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's attention as the config names it ('full_attention', 'sliding_attention',
        'chunked_attention', 'linear_attention', ...) and its model runs it: transformers' config class's, which fills
        in a pattern where config.json lists none (Gemma's 5:1) and may change a listed one (Gemma 4 makes its last
        layer full: a cut of Gemma-4-31B to 4 layers has one full layer); every layer sliding where a window is set
        without types."""
        hf = self.hf
        if built := _built_layer_types(self.hf_json):
            return built
        if hf.get("layer_types"):
            return tuple(hf["layer_types"])
        slides = hf.get("sliding_window") and hf.get("use_sliding_window", True)
        return (SLIDING if slides else FULL,) * self.num_layers

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer]

    @property
    def sliding_window(self) -> int:
        return int(self.hf.get("sliding_window") or 0) if SLIDING in self.layer_types else 0

    def attended_pairs(self, layer: int, seq: int) -> float:
        """(query, key) pairs layer `layer` scores in one sequence: causal, within its window or chunk; 0 where its
        attention is linear or of a type not counted here (hardware FLOPs count the matmuls alone there)."""
        kind = self.layer_type(layer)
        if kind == FULL:
            return attended_pairs(seq)
        if kind == SLIDING:
            return attended_pairs(seq, self.sliding_window)
        if kind == CHUNKED and self.hf.get("attention_chunk_size"):
            chunk = min(seq, int(self.hf["attention_chunk_size"]))
            return (seq // chunk) * attended_pairs(chunk) + attended_pairs(seq % chunk)
        return 0.0

    # ---- experts ------------------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return any(self.layout.routed)

    @property
    def num_experts(self) -> int:
        """Routed experts of a mixture-of-experts layer (the most of any layer; 0 for a dense model)."""
        return max(self.layout.experts)

    @property
    def num_experts_per_tok(self) -> int:
        hf = self.hf
        return int(next((hf[k] for k in TOP_K_KEYS if hf.get(k)), self.num_experts))

    @property
    def moe_intermediate_size(self) -> int:
        return int(self.hf.get("moe_intermediate_size") or self.intermediate_size)

    @property
    def random_settings(self) -> dict[str, float]:
        """config.json's dropout and jitter settings above 0 (megatrain.models.draws): transformers' modules apply
        them in train mode."""
        return random_settings(self.hf)

    # ---- accounting: from the module's parameter names and shapes ----------------------------------------------
    def unit_shapes(self) -> tuple[UnitShapes, ...]:
        """The units in forward order: the embedding (with whatever else the forward preamble owns), each decoder
        layer, the head (the final norm and the LM head, none of its own when tied)."""
        return self.layout.units

    def _layer_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        return [dict(u.shapes) for u in self.layout.units[1:-1]]

    def _active_fraction(self) -> float:
        return min(1.0, self.num_experts_per_tok / self.num_experts) if self.is_moe else 1.0

    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (what a streaming or sharding system holds of one at a time)."""
        return max(_numel(shapes) for shapes in self._layer_shapes())

    def embedding_params(self) -> int:
        return _numel(dict(self.layout.units[0].shapes))

    def head_params(self) -> int:
        return _numel(dict(self.layout.units[-1].shapes))

    def num_params(self) -> int:
        """Every parameter (tied embeddings once), every expert included: what the training state holds."""
        return sum(_numel(dict(u.shapes)) for u in self.layout.units)

    def unrouted_params(self) -> int:
        """Per token, the routed experts' parameters it is not routed to: (E - k) / E of them."""
        routed = sum(math.prod(shape) for layer, names in zip(self._layer_shapes(), self.layout.routed, strict=True)
                     for name, shape in layer.items() if name in names)
        return round(routed * (1 - self._active_fraction()))

    def active_params(self) -> int:
        """The parameters one token uses (the records' 6NT): routed experts at k/E, everything else whole."""
        return self.num_params() - self.unrouted_params()

    def param_numels(self) -> list[int]:
        return [math.prod(shape) for u in self.layout.units for _, shape in u.shapes]

    def layer_matmul_params(self) -> float:
        """The matrices of a decoder layer a token multiplies through, the mean over the layers (their sum over
        num_layers): tensors of 2 or more dimensions, routed experts at k/E; norms, biases and vectors do none."""
        fraction = self._active_fraction()
        total = sum(math.prod(shape) * (fraction if name in names else 1.0)
                    for layer, names in zip(self._layer_shapes(), self.layout.routed, strict=True)
                    for name, shape in layer.items() if len(shape) >= 2 and not name.endswith("bias"))
        return total / self.num_layers

    def head_matmul_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def matmul_params(self) -> float:
        return self.num_layers * self.layer_matmul_params() + self.head_matmul_params()

    def with_layers(self, num_layers: int) -> GenericConfig:
        """The model at another depth: num_hidden_layers and every per-layer list of the config (layer_types,
        mlp_only_layers, ...) cut, or repeated from its start."""
        hf, old = self.hf, self.num_layers
        for key, value in hf.items():
            if isinstance(value, list) and len(value) == old and key not in ("architectures",):
                hf[key] = [value[n % old] for n in range(num_layers)]
        if (key := _first(hf, LAYERS_KEYS)) not in hf:
            raise ValueError(f"{self.family}'s config sets its depth by none of {', '.join(LAYERS_KEYS)}: num_layers "
                             "cannot change it")
        hf[key] = num_layers
        # a count of the last layers that reuse an earlier layer's keys and values (Gemma 3n and 4's
        # num_kv_shared_layers) keeps its share of the depth, and at least one producing layer of each attention type
        # before it: Gemma-4-E4B's last 18 of 42 layers become the last 5 of 12, not 18 of 12
        if (shared := hf.get("num_kv_shared_layers")) and num_layers != old:
            types = hf.get("layer_types") or []
            producers = 1 + max((n for n, kind in enumerate(types) if kind not in types[:n]), default=0)
            hf["num_kv_shared_layers"] = max(0, min(round(shared * num_layers / old), num_layers - producers))
        return GenericConfig.from_hf(hf)

    def to_dict(self) -> dict:
        return {"hf_json": self.hf_json}

    # ---- what it refuses, and its kind (megatrain.models.kinds: its module and its checkpoints) -------------------
    kind = "generic"

    def packing_refusal(self) -> str | None:
        """Why packed rows cannot train this model (its layers other than attention would carry state from one document
        into the next), or None."""
        if kinds := sorted(set(self.layer_types) - set(ATTENTION_TYPES)):
            return f"{self.family}'s {', '.join(kinds)} layers would carry state from one packed document into the " \
                "next: train it with --no-pack"
        return None


def _first(hf: Mapping, keys: tuple[str, ...]) -> str:
    """The first of `keys` the config has (the first of all where it has none)."""
    return next((k for k in keys if k in hf), keys[0])


def _numel(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


@functools.lru_cache(maxsize=64)
def _built_layer_types(hf_json: str) -> tuple[str, ...]:
    """The layer types transformers' config class sets (config.json's, or a pattern where it lists none: Gemma 3
    and 4 by their sliding-window pattern), or () where it sets none."""
    from megatrain.models.generic.skeleton import transformers_config

    try:
        config = transformers_config(GenericConfig(hf_json))
    except ValueError:  # a config transformers refuses: refused, with why, where the model is built
        return ()
    return tuple(getattr(config, "layer_types", None) or ())


@functools.lru_cache(maxsize=64)
def _layer_head_dims(hf_json: str) -> tuple[int, ...]:
    """Each layer's head_dim (None where its config has none) where transformers' config class sets layers apart (a
    heterogeneous config's per-layer configs), or () where it does not."""
    from megatrain.models.generic.skeleton import transformers_config

    try:
        config = transformers_config(GenericConfig(hf_json))
    except ValueError:  # a config transformers refuses: refused, with why, where the model is built
        return ()
    if not getattr(config, "is_heterogeneous", False):
        return ()
    return tuple(getattr(layer, "head_dim", None) for layer in config.per_layer_config)


@functools.lru_cache(maxsize=16)
def layout(hf_json: str) -> Layout:
    """The Layout of a config, from its model on the meta device (megatrain.models.generic.skeleton)."""
    from megatrain.models.generic.skeleton import Skeleton

    return Skeleton(GenericConfig(hf_json)).layout()
