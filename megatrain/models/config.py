"""Model shape: one dataclass, its named tensor shapes (every parameter count derives from them), and validation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a LLaMA/Qwen2-style decoder.

    Attributes:
        vocab_size: tokens in the embedding table.
        hidden_size: residual stream width H.
        intermediate_size: SwiGLU inner width I.
        num_layers: decoder layers L.
        num_heads: query heads; head_dim = H / num_heads unless head_dim is given.
        num_kv_heads: key/value heads (GQA); must divide num_heads.
        head_dim: per-head width; 0 means hidden_size // num_heads.
        qkv_bias: bias on q/k/v projections (Qwen2 has it, Llama does not).
        tie_embeddings: the LM head reuses the input embedding matrix.
        rope_theta: RoPE base frequency.
        rms_norm_eps: RMSNorm epsilon.
        max_seq_len: longest context the shape is published for (informational).
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- accounting: every count derives from the named tensor shapes below ---------------------------------
    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter of one decoder layer: its name in megatrain.models.DecoderLayer (in that module's order)
        and its shape ([out, in] for a projection)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        shapes: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,)}
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[f"self_attn.{proj}.weight"] = (out, h)
            if self.qkv_bias:
                shapes[f"self_attn.{proj}.bias"] = (out,)
        shapes["self_attn.o_proj.weight"] = (h, q)
        shapes["post_attention_layernorm.weight"] = (h,)
        shapes.update({"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)})
        return shapes

    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"embed_tokens.weight": (self.vocab_size, self.hidden_size)}

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        """The final norm and the LM head matrix (none of its own when tied: it is the embedding's)."""
        lm_head = {} if self.tie_embeddings else {"lm_head.weight": (self.vocab_size, self.hidden_size)}
        return {"norm.weight": (self.hidden_size,), **lm_head}

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
        """Total parameters (tied embeddings counted once): what the training state holds. What a token computes
        with is matmul_params."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    def param_numels(self) -> list[int]:
        """Element counts of every parameter tensor of the model (tied embeddings once)."""
        return [math.prod(shape) for shape in self.param_shapes().values()]

    def layer_matmul_params(self) -> int:
        """The matrices of one decoder layer: the parameters a token multiplies through (norms and biases do no
        matmul)."""
        return sum(math.prod(shape) for shape in self.layer_shapes().values() if len(shape) == 2)

    def head_matmul_params(self) -> int:
        """The LM head's matrix (the embedding's when tied)."""
        return self.vocab_size * self.hidden_size

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token: the layers' matrices and the LM head. The untied input
        embedding is a lookup and does none."""
        return self.num_layers * self.layer_matmul_params() + self.head_matmul_params()

    def with_layers(self, num_layers: int) -> ModelConfig:
        return replace(self, num_layers=num_layers)

    def to_dict(self) -> dict:
        return asdict(self)


def _numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())
