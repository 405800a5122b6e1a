"""Model shape: one dataclass, its named tensor shapes (every parameter count derives from them), and validation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from megatrain.models.handwritten.families import FAMILIES, MOE_FAMILIES, NONE, ROWS
from megatrain.models.masks import FULL, LAYER_TYPES, SLIDING, attended_pairs
from megatrain.models.rope import RopeScaling
from megatrain.models.shape import HeadSizes, UnitShapes


@dataclass(frozen=True)
class ModelConfig(HeadSizes):
    """Shape of a Llama/Qwen2/Qwen3/Mistral-style decoder, or of a Qwen3-MoE/GPT-OSS mixture of experts.

    Attributes:
        family: the Hugging Face model_type the shape loads from and exports to (a row of handwritten.families).
        vocab_size: tokens in the embedding table.
        hidden_size: residual stream width H.
        intermediate_size: SwiGLU inner width I.
        num_layers: decoder layers L.
        num_heads: query heads; head_dim = H / num_heads unless head_dim is given.
        num_kv_heads: key/value heads (GQA); must divide num_heads.
        head_dim: per-head width; 0 means hidden_size // num_heads.
        qkv_bias: bias on q/k/v projections (Qwen2 always; Llama and Qwen3 with attention_bias).
        o_bias: bias on the attention output projection (Llama and Qwen3 with attention_bias).
        mlp_bias: biases on the SwiGLU projections (Llama's mlp_bias).
        qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3).
        tie_embeddings: the LM head reuses the input embedding matrix.
        rope_theta: RoPE base frequency.
        rope_scaling: the checkpoint's RoPE scaling (models.rope), None for plain RoPE.
        rms_norm_eps: RMSNorm epsilon.
        max_seq_len: the config's max_position_embeddings: the context the shape is published for (dynamic RoPE
            scales beyond it).
        sliding_window: window of sliding-attention layers in tokens; 0 when no layer slides.
        layer_types: per layer 'full_attention' or 'sliding_attention'; empty means every layer full.
        num_experts: experts of each layer's mixture of experts (every layer's MLP is one); 0 for a dense model.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: each expert's SwiGLU inner width (intermediate_size stays the config's dense width).
        norm_topk_prob: the top-k routing weights are renormalised to sum to 1 (GPT-OSS always: its softmax is over
            the top-k logits).
        moe_bias: the router and the experts' projections have biases (GPT-OSS).
        attention_sinks: a learned logit per head joins each query's softmax and takes its share of the weight, with
            no value (GPT-OSS).
        swiglu_limit: GPT-OSS's clamped SwiGLU, (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g) with
            g = clamp(gate, max=l); 0 for the plain silu(gate) * up.
        swiglu_alpha: the alpha of that SwiGLU.
        router_aux_loss_coef: weight of the router's load-balancing loss (transformers' load_balancing_loss_func) in
            the training loss; 0 when the config does not ask for it (output_router_logits false).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    qkv_bias: bool = False
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_seq_len: int = 32768
    family: str = ""
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_bias: bool = False
    attention_sinks: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    router_aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # read back from a record or run.json
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if not self.family:  # shapes written before families were named: what their flags say
            object.__setattr__(self, "family", "qwen2" if self.qkv_bias else "llama")
        self._check_family()
        self._check_attention_layers()
        self._check_experts()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}; "
                    "change num_heads or set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} (grouped-query attention)"
            )

    def _check_family(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"model family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}")
        # what the family's modeling code builds (its row): a shape that no checkpoint of the family can hold is refused
        row = ROWS[self.family]
        o_bias = {None: dict(o_bias=False), True: dict(o_bias=True), False: {}}[row.attention_bias]
        rules = dict(qkv_bias=True if row.qkv_bias else self.o_bias, **o_bias, qk_norm=row.qk_norm,
                     moe_bias=row.moe_bias, attention_sinks=row.attention_sinks)
        rules.update({} if row.mlp_bias else dict(mlp_bias=False))
        rules.update({} if row.experts else dict(num_experts=0))
        rules.update({} if row.clamped_swiglu else dict(swiglu_limit=0.0))
        rules.update(dict(norm_topk_prob=True) if row.top_k_softmax else {})
        wrong = {k: getattr(self, k) for k, v in rules.items() if getattr(self, k) != v}
        if wrong:
            raise ValueError(f"a {self.family} model cannot have {wrong} (its architecture fixes {rules})")

    def _check_attention_layers(self) -> None:
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: no sliding layers), got {self.sliding_window}")
        if unknown := sorted(set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}")
        if (SLIDING in self.layer_types) != (self.sliding_window > 0):
            raise ValueError(f"sliding_window={self.sliding_window} with layer_types {sorted(set(self.layer_types))}: "
                             "sliding layers need a window > 0, and a window needs sliding layers")
        if ROWS[self.family].windows == NONE and self.sliding_window:
            raise ValueError(f"{self.family} models have no sliding-window attention")

    def _check_experts(self) -> None:
        if self.family not in MOE_FAMILIES:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"a {self.family} model routes each token to 1..num_experts experts; got "
                             f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}")
        if ROWS[self.family].clamped_swiglu and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit={self.swiglu_limit}: {self.family}'s clamped SwiGLU needs a limit > 0")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(f"router_aux_loss_coef must be a finite number >= 0, got {self.router_aux_loss_coef}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    crossing_numel_per_token = 0  # only the hidden state passes from a layer to the next

    @property
    def replayed_bytes_per_token(self) -> int:
        """Bytes a token's routing takes over a step where the engine keeps it for the recompute: K int64 experts in
        every layer (megatrain.engine.programs.handwritten.Routing); none for a dense model."""
        return self.num_layers * self.num_experts_per_tok * 8 if self.is_moe else 0

    @property
    def router_stats(self) -> bool:
        """Whether each layer reports its routing for the load-balancing loss."""
        return self.is_moe and self.router_aux_loss_coef > 0

    @property
    def random_settings(self) -> dict[str, float]:
        """None: the hand-written model has no dropout (a config.json that sets one trains through transformers'
        modules, megatrain.models.handwritten.hf.config_from_hf)."""
        return {}

    def layer_type(self, layer: int) -> str:
        """The attention of decoder layer `layer` (0-based): 'full_attention' or 'sliding_attention'."""
        return self.layer_types[layer] if self.layer_types else FULL

    def attended_pairs(self, layer: int, seq: int) -> float:
        """(query, key) pairs decoder layer `layer` scores in one sequence (megatrain.models.masks.attended_pairs)."""
        return attended_pairs(seq, self.sliding_window if self.layer_type(layer) != FULL else 0)

    # ---- accounting: every count derives from the named tensor shapes below ---------------------------------
    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter of one decoder layer: its name in megatrain.models.DecoderLayer (in that module's order)
        and its shape ([out, in] for a projection)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
        if self.attention_sinks:  # the attention's own parameter: before its submodules'
            shapes["self_attn.sinks"] = (self.num_heads,)
        projections = [("self_attn.q_proj", q, h, self.qkv_bias), ("self_attn.k_proj", kv, h, self.qkv_bias),
                       ("self_attn.v_proj", kv, h, self.qkv_bias), ("self_attn.o_proj", h, q, self.o_bias)]
        for name, out, inp, bias in projections:
            shapes[f"{name}.weight"] = (out, inp)
            if bias:
                shapes[f"{name}.bias"] = (out,)
        if self.qk_norm:
            shapes.update({"self_attn.q_norm.weight": (self.head_dim,), "self_attn.k_norm.weight": (self.head_dim,)})
        shapes["post_attention_layernorm.weight"] = (h,)
        if self.is_moe:
            return {**shapes, **self.moe_shapes()}
        for name, out, inp in (("mlp.gate_proj", i, h), ("mlp.up_proj", i, h), ("mlp.down_proj", h, i)):
            shapes[f"{name}.weight"] = (out, inp)
            if self.mlp_bias:
                shapes[f"{name}.bias"] = (out,)
        return shapes

    def moe_shapes(self) -> dict[str, tuple[int, ...]]:
        """A layer's router and experts (handwritten.moe.MoE): each expert's gate and up rows stacked ([E, 2I,
        H], gate first) and its down projection ([E, H, I]), so one expert's weights are one contiguous slice."""
        e, h, i = self.num_experts, self.hidden_size, self.moe_intermediate_size
        shapes = {"mlp.router.weight": (e, h), **({"mlp.router.bias": (e,)} if self.moe_bias else {}),
                  "mlp.experts.gate_up_proj": (e, 2 * i, h), "mlp.experts.down_proj": (e, h, i)}
        if self.moe_bias:
            shapes.update({"mlp.experts.gate_up_proj_bias": (e, 2 * i), "mlp.experts.down_proj_bias": (e, h)})
        return shapes

    def expert_params(self) -> int:
        """Parameters of one expert of one layer (its projections and their biases)."""
        if not self.is_moe:
            return 0
        h, i = self.hidden_size, self.moe_intermediate_size
        return 3 * i * h + (2 * i + h if self.moe_bias else 0)

    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"embed_tokens.weight": (self.vocab_size, self.hidden_size)}

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """The final norm and the LM head matrix (none of its own when tied: it is the embedding's)."""
        lm_head = {} if self.tie_embeddings else {"lm_head.weight": (self.vocab_size, self.hidden_size)}
        return {"norm.weight": (self.hidden_size,), **lm_head}

    def unit_shapes(self) -> tuple[UnitShapes, ...]:
        """The streamed units in forward order: the embedding, each decoder layer, the head (megatrain.models.
        Transformer's names)."""
        layer = tuple(self.layer_shapes().items())
        return (UnitShapes("embed", "", tuple(self.embedding_shapes().items())),
                *(UnitShapes("layer", f"layers.{n}.", layer) for n in range(self.num_layers)),
                UnitShapes("head", "", tuple(self.head_shapes().items())))

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter of the model by its name in megatrain.models.Transformer (tied embeddings once)."""
        layers = {f"layers.{n}.{name}": shape for n in range(self.num_layers)
                  for name, shape in self.layer_shapes().items()}
        return {**self.embedding_shapes(), **layers, **self.head_shapes()}

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        return _numel(self.layer_shapes())

    def embedding_params(self) -> int:
        return _numel(self.embedding_shapes())

    def head_params(self) -> int:
        """Final norm plus the LM head matrix (0 extra when tied)."""
        return _numel(self.head_shapes())

    def num_params(self) -> int:
        """Total parameters (tied embeddings counted once), every expert included: what the training state holds.
        What a token computes with is active_params and matmul_params."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    def unrouted_params(self) -> int:
        """Per token, the parameters of the experts it is not routed to (0 for a dense model)."""
        return self.num_layers * (self.num_experts - self.num_experts_per_tok) * self.expert_params()

    def active_params(self) -> int:
        """The parameters one token uses: all but the experts it is not routed to (num_params for a dense model;
        GPT-OSS-120B: 5.1B of 117B). The records' TFLOPS count 6 x active_params x tokens."""
        return self.num_params() - self.unrouted_params()

    def param_numels(self) -> list[int]:
        """Element counts of every parameter tensor of the model (tied embeddings once)."""
        return [math.prod(shape) for shape in self.param_shapes().values()]

    def layer_matmul_params(self) -> int:
        """The matrices of one decoder layer a token multiplies through: attention, the dense MLP or the router and
        the num_experts_per_tok experts it is routed to (norms, biases and sinks do no matmul)."""
        if not self.is_moe:
            return sum(math.prod(shape) for shape in self.layer_shapes().values() if len(shape) == 2)
        attention = sum(math.prod(shape) for name, shape in self.layer_shapes().items()
                        if name.startswith("self_attn.") and len(shape) == 2)
        return attention + self.num_experts * self.hidden_size + \
            self.num_experts_per_tok * 3 * self.moe_intermediate_size * self.hidden_size

    def head_matmul_params(self) -> int:
        """The LM head's matrix (the embedding's when tied)."""
        return self.vocab_size * self.hidden_size

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: the layers' matrices and the LM head. The untied input
        embedding is a lookup and does none."""
        return self.num_layers * self.layer_matmul_params() + self.head_matmul_params()

    def with_layers(self, num_layers: int) -> ModelConfig:
        """The shape at another depth; a per-layer attention pattern is cut, or repeated from its start."""
        types = tuple(self.layer_types[n % len(self.layer_types)] for n in range(num_layers)) \
            if self.layer_types else ()
        sliding = self.sliding_window if SLIDING in types else 0
        return replace(self, num_layers=num_layers, layer_types=types, sliding_window=sliding)

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- what it refuses, and its kind (megatrain.models.kinds: its module and its checkpoints) -------------------
    kind = "handwritten"

    def check(self) -> ModelConfig:
        """Every setting was checked as the shape was made: nothing to build. Returns self."""
        return self

    def packing_refusal(self) -> str | None:
        """None: the attention keeps packed documents apart (document masks, positions restarting per document)."""
        return None


def _numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())
