"""Model shape: one dataclass, the exact parameter count, and validation."""

from __future__ import annotations

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

    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        return attn + 3 * h * i + 2 * h

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """Final norm plus the LM head matrix (0 extra when tied)."""
        return self.hidden_size + (0 if self.tie_embeddings else self.vocab_size * self.hidden_size)

    def num_params(self) -> int:
        """Exact parameter count (tied embeddings counted once)."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    def param_numels(self) -> list[int]:
        """Element counts of every parameter tensor of the model (tied embeddings once)."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        layer = [h * q, h * kv, h * kv, q * h] + [h * i] * 3 + [h, h]
        if self.qkv_bias:
            layer += [q, kv, kv]
        head = [h] + ([] if self.tie_embeddings else [self.vocab_size * h])
        return [self.vocab_size * h] + layer * self.num_layers + head

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (layers' matrices and the LM head)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * self.q_size + 2 * h * self.kv_size + self.q_size * h + 3 * h * i
        return self.num_layers * per_layer + self.vocab_size * h

    def with_layers(self, num_layers: int) -> ModelConfig:
        return replace(self, num_layers=num_layers)

    def to_dict(self) -> dict:
        return asdict(self)
