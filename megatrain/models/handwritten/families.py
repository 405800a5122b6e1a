"""The hand-written families: one row per Hugging Face model_type, what its transformers config class and modeling
file build. ModelConfig holds a shape to its row (a shape no checkpoint of the family can hold is refused), and the
config translation (hf.py) reads and writes config.json by it.

A new family our modules can build (the decoder of megatrain.models.handwritten.transformer with its options) is a
row here, plus its checkpoint layout in hf.py where its tensor names differ from ours; a family they cannot build needs
no row: it trains through transformers' own modules (megatrain.models.generic) by its config.json alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NONE, SUFFIX, ALL, ALTERNATE = "none", "suffix", "all", "alternate"  # which layers slide (Family.windows)


@dataclass(frozen=True)
class Family:
    """What one hand-written family's checkpoints hold.

    Attributes:
        architecture: its *ForCausalLM class (written into an export's config.json).
        defaults: transformers' defaults for the keys a config.json may leave out.
        qkv_bias: q, k and v projections always biased (Qwen2); else biased exactly where o_proj is.
        attention_bias: the default of the family's attention_bias key (o_proj's bias, and q, k, v's with it); None
            where the family has no such key (no bias on o_proj: attention_bias=true is refused); True where every
            release has the biases (attention_bias=false is refused).
        mlp_bias: the family reads mlp_bias (its SwiGLU may have biases); else mlp_bias=true is refused.
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        windows: which layers slide: NONE (a sliding layer is refused), SUFFIX (the layers from max_window_layers on,
            when use_sliding_window), ALL (every layer, when sliding_window), ALTERNATE (even layers, by default).
        experts: every layer's MLP is a mixture of experts.
        moe_bias: the router and the experts' projections have biases (GPT-OSS).
        attention_sinks: a learned logit per head joins each query's softmax (GPT-OSS).
        clamped_swiglu: the experts' SwiGLU is clamped at a limit (GPT-OSS's swiglu_limit).
        top_k_softmax: the routing softmax is over the top-k logits, so the routed weights always sum to 1 (GPT-OSS:
            norm_topk_prob fixed true).
    """

    architecture: str
    defaults: dict = field(default_factory=dict)
    qkv_bias: bool = False
    attention_bias: bool | None = False
    mlp_bias: bool = False
    qk_norm: bool = False
    windows: str = NONE
    experts: bool = False
    moe_bias: bool = False
    attention_sinks: bool = False
    clamped_swiglu: bool = False
    top_k_softmax: bool = False


ROWS: dict[str, Family] = {
    "qwen2": Family("Qwen2ForCausalLM", dict(max_position_embeddings=32768, max_window_layers=28), qkv_bias=True,
                    attention_bias=None, windows=SUFFIX),
    "llama": Family("LlamaForCausalLM", dict(max_position_embeddings=2048), mlp_bias=True),
    "qwen3": Family("Qwen3ForCausalLM", dict(max_position_embeddings=32768, max_window_layers=28, head_dim=128),
                    qk_norm=True, windows=SUFFIX),
    "mistral": Family("MistralForCausalLM", dict(max_position_embeddings=131072, num_key_value_heads=8,
                                                 sliding_window=4096), attention_bias=None, windows=ALL),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", dict(max_position_embeddings=32768, num_key_value_heads=4,
                                                    norm_topk_prob=False), qk_norm=True, experts=True),
    "gpt_oss": Family("GptOssForCausalLM", dict(
        max_position_embeddings=131072, num_key_value_heads=8, head_dim=64, sliding_window=128, num_experts_per_tok=4,
        swiglu_limit=7.0, swiglu_alpha=1.702, rms_norm_eps=1e-5,
        rope=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                  original_max_position_embeddings=4096, rope_theta=150000.0)),
        attention_bias=True, windows=ALTERNATE, experts=True, moe_bias=True, attention_sinks=True, clamped_swiglu=True,
        top_k_softmax=True),
}
FAMILIES = tuple(ROWS)
MOE_FAMILIES = tuple(name for name, row in ROWS.items() if row.experts)
