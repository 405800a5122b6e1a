"""Named model sizes with their published shapes.

Each shape follows its release's config.json (Qwen2.5, Qwen3, Meta-Llama-3, Llama-3.1/3.2 with their llama3
RoPE scaling, Mistral-7B v0.1 with its 4096-token sliding window and v0.3 without; the mixtures of experts
GPT-OSS-20B/-120B, the paper's 120B, and Qwen3-30B-A3B/-235B-A22B). `dense-120b` is our own documented ~120B dense
shape (Qwen2.5-72B's vocabulary and head size, widened and deepened), the dense stand-in the suites used for the
paper's GPT-OSS-120B before the mixtures of experts ran. `tiny*` are for CPU tests and smoke runs.
"""

from __future__ import annotations

from megatrain.models.generic import GenericConfig
from megatrain.models.handwritten.config import ModelConfig
from megatrain.models.handwritten.hf import config_to_hf
from megatrain.models.masks import SLIDING
from megatrain.models.rope import RopeScaling
from megatrain.models.shape import ModelShape

_QWEN = dict(qkv_bias=True, rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=32768)
_LLAMA3 = dict(family="llama", qkv_bias=False, rms_norm_eps=1e-5, rope_theta=500_000.0, max_seq_len=8192,
               vocab_size=128256)


def _llama31(factor: float) -> dict:
    """Llama 3.1/3.2: 3's shape with the llama3 RoPE scaling to 128k."""
    return {**_LLAMA3, "max_seq_len": 131072, "rope_scaling": RopeScaling(
        "llama3", factor, original_max_positions=8192, low_freq_factor=1.0, high_freq_factor=4.0)}


_QWEN3 = dict(family="qwen3", qk_norm=True, head_dim=128, vocab_size=151936, num_kv_heads=8, rms_norm_eps=1e-6,
              rope_theta=1_000_000.0, max_seq_len=40960)
_QWEN3_MOE = dict(family="qwen3_moe", qk_norm=True, head_dim=128, vocab_size=151936, num_kv_heads=4, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, max_seq_len=40960, num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, tie_embeddings=False)
# GPT-OSS: 2880 wide, 64 query heads of 64, 8 KV heads, sinks, even layers a 128-token window, YaRN x32 of 4096
_GPT_OSS = dict(family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_heads=64,
                num_kv_heads=8, head_dim=64, qkv_bias=True, o_bias=True, rms_norm_eps=1e-5, rope_theta=150000.0,
                max_seq_len=131072, sliding_window=128, moe_intermediate_size=2880, num_experts_per_tok=4,
                norm_topk_prob=True, moe_bias=True, attention_sinks=True, swiglu_limit=7.0, swiglu_alpha=1.702,
                tie_embeddings=False, rope_scaling=RopeScaling("yarn", 32.0, original_max_positions=4096,
                                                               truncate=False))


def _alternating(num_layers: int) -> tuple[str, ...]:
    return tuple(SLIDING if n % 2 == 0 else "full_attention" for n in range(num_layers))


_MISTRAL = dict(family="mistral", hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                num_kv_heads=8, rms_norm_eps=1e-5, max_seq_len=32768, tie_embeddings=False)

MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3,
                        num_heads=4, num_kv_heads=2, qkv_bias=True, tie_embeddings=False, max_seq_len=2048),
    "tiny-tied": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=2,
                             num_heads=4, num_kv_heads=4, qkv_bias=False, tie_embeddings=True, max_seq_len=2048),
    # the families' additions at the tiny size: Qwen3 (q/k norms, a head wider than hidden/heads, YaRN past 64
    # positions) and alternating sliding-window layers (a 64-token window)
    "tiny-qwen3": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                              num_kv_heads=2, head_dim=24, family="qwen3", qk_norm=True, max_seq_len=2048,
                              rope_scaling=RopeScaling("yarn", 4.0, original_max_positions=64)),
    "tiny-sliding": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                                num_kv_heads=2, qkv_bias=True, max_seq_len=2048, sliding_window=64,
                                layer_types=(SLIDING, "full_attention", SLIDING)),
    # mixtures of experts at the tiny size: Qwen3-MoE's softmax-then-top-k; GPT-OSS's sinks and biases, with the
    # router's load-balancing loss in training
    "tiny-moe": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                            num_kv_heads=2, family="qwen3_moe", qk_norm=True, max_seq_len=2048, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32),
    "tiny-gpt-oss": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=4, num_heads=4,
                                num_kv_heads=2, head_dim=16, family="gpt_oss", qkv_bias=True, o_bias=True,
                                max_seq_len=2048, sliding_window=64, layer_types=_alternating(4), num_experts=8,
                                num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, moe_bias=True,
                                attention_sinks=True, swiglu_limit=7.0, swiglu_alpha=1.702, router_aux_loss_coef=0.1),
    # ~0.1B: big enough to exercise the GPU paths, small enough for a quick check.
    "small": ModelConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                         num_heads=12, num_kv_heads=4, qkv_bias=True, tie_embeddings=False),
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                                num_heads=14, num_kv_heads=2, tie_embeddings=True, **_QWEN),
    "qwen2.5-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                                num_heads=12, num_kv_heads=2, tie_embeddings=True, **_QWEN),
    "qwen2.5-3b": ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
                              num_heads=16, num_kv_heads=2, tie_embeddings=True, **_QWEN),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                              num_heads=28, num_kv_heads=4, tie_embeddings=False, **_QWEN),
    "qwen2.5-14b": ModelConfig(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_layers=48,
                               num_heads=40, num_kv_heads=8, tie_embeddings=False, **_QWEN),
    "qwen2.5-32b": ModelConfig(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                               num_heads=40, num_kv_heads=8, tie_embeddings=False, **_QWEN),
    "qwen2.5-72b": ModelConfig(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_layers=80,
                               num_heads=64, num_kv_heads=8, tie_embeddings=False, **_QWEN),
    "llama3-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32,
                             num_heads=32, num_kv_heads=8, tie_embeddings=False, **_LLAMA3),
    "llama3-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_layers=80,
                              num_heads=64, num_kv_heads=8, tie_embeddings=False, **_LLAMA3),
    "llama3.1-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                               tie_embeddings=False, **_llama31(8.0)),
    "llama3.1-70b": ModelConfig(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                                num_kv_heads=8, tie_embeddings=False, **_llama31(8.0)),
    "llama3.2-1b": ModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                               head_dim=64, tie_embeddings=True, **_llama31(32.0)),
    "llama3.2-3b": ModelConfig(hidden_size=3072, intermediate_size=8192, num_layers=28, num_heads=24, num_kv_heads=8,
                               head_dim=128, tie_embeddings=True, **_llama31(32.0)),
    "qwen3-0.6b": ModelConfig(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                              tie_embeddings=True, **_QWEN3),
    "qwen3-8b": ModelConfig(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                            tie_embeddings=False, **_QWEN3),
    "qwen3-14b": ModelConfig(hidden_size=5120, intermediate_size=17408, num_layers=40, num_heads=40,
                             tie_embeddings=False, **_QWEN3),
    "qwen3-32b": ModelConfig(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
                             tie_embeddings=False, **_QWEN3),
    "mistral-7b-v0.1": ModelConfig(vocab_size=32000, rope_theta=10000.0, sliding_window=4096,
                                   layer_types=(SLIDING,) * 32, **_MISTRAL),
    "mistral-7b-v0.3": ModelConfig(vocab_size=32768, rope_theta=1_000_000.0, **_MISTRAL),
    "qwen3-30b-a3b": ModelConfig(hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                                 moe_intermediate_size=768, **_QWEN3_MOE),
    "qwen3-235b-a22b": ModelConfig(hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
                                   moe_intermediate_size=1536, **_QWEN3_MOE),
    "gpt-oss-20b": ModelConfig(num_layers=24, num_experts=32, layer_types=_alternating(24), **_GPT_OSS),
    "gpt-oss-120b": ModelConfig(num_layers=36, num_experts=128, layer_types=_alternating(36), **_GPT_OSS),
    # 12288 wide, 76 layers, 96 query heads of 128, 8 KV heads, 32768 SwiGLU: 120.4B parameters.
    "dense-120b": ModelConfig(vocab_size=152064, hidden_size=12288, intermediate_size=32768, num_layers=76,
                              num_heads=96, num_kv_heads=8, tie_embeddings=False, **_QWEN),
}


# Models trained through transformers' own modules (megatrain.models.generic), by their config.json: tiny ones, the
# twins of two hand-written shapes (the two paths compared on one model), and published shapes of families only that
# path trains (their config.json files as released: Gemma-3-27B's text config, Qwen3-Next-80B-A3B, DeepSeek-V2-Lite).
_TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=False)
_GEMMA4_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]
_GEMMA4_LARGE = dict(model_type="gemma4_text", vocab_size=262144, head_dim=256, global_head_dim=512,
                     attention_k_eq_v=True, hidden_size_per_layer_input=0, num_kv_shared_layers=0, sliding_window=1024,
                     final_logit_softcapping=30.0, use_bidirectional_attention="vision",
                     hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, max_position_embeddings=262144,
                     tie_word_embeddings=True, rope_parameters={
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
HF_CONFIGS: dict[str, dict] = {
    # the generic path's three kinds at the tiny size (the GPU suite's): dense with sliding layers and softcapped
    # logits, MLA with shared and routed experts after a dense layer, linear and full attention over experts
    "tiny-hf-gemma3": dict(_TINY_HF, model_type="gemma3_text", sliding_window=64, query_pre_attn_scalar=16,
                           final_logit_softcapping=30.0, tie_word_embeddings=True,
                           layer_types=["sliding_attention", "full_attention"] * 2),
    "tiny-hf-deepseek-v3": dict(_TINY_HF, model_type="deepseek_v3", num_key_value_heads=4, head_dim=8,  # its rope's
                                moe_intermediate_size=32,
                                first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                                topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                qk_nope_head_dim=8, v_head_dim=16),
    "tiny-hf-qwen3-next": dict(_TINY_HF, model_type="qwen3_next", num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=4,
                               linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                               layer_types=["linear_attention", "full_attention"] * 2),
    # state crossing layers (Gemma 4): per-layer inputs of 8 a layer, and the last two layers reusing the keys and
    # values of the first two (one sliding, one full); initialised at 0.1, as the CPU tests' (tests/families.py), where
    # the tiny model does not amplify rounding as it does at 0.02. Over experts beside the MLP: -moe
    "tiny-hf-gemma4": dict(_TINY_HF, model_type="gemma4_text", global_head_dim=16, sliding_window=64,
                           hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=2,
                           layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.1,
                           tie_word_embeddings=True),
    "tiny-hf-gemma4-moe": dict(_TINY_HF, model_type="gemma4_text", global_head_dim=16, sliding_window=64,
                               hidden_size_per_layer_input=8, vocab_size_per_layer_input=256, num_kv_shared_layers=2,
                               layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.1,
                               tie_word_embeddings=True, enable_moe_block=True, num_experts=4, top_k_experts=2,
                               moe_intermediate_size=32),
    # Gemma 4's large checkpoints' switches at the tiny size (the CPU tests' gemma4_26b_a4b, tests/families.py): no
    # per-layer inputs, no shared KV, keys equal to values on the full layers with their own head width (32) and KV
    # heads (1), softcapped logits, experts beside the MLP
    "tiny-hf-gemma4-26b-a4b": dict(_TINY_HF, model_type="gemma4_text", sliding_window=64,
                                   layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.1,
                                   hidden_size_per_layer_input=0, num_kv_shared_layers=0, global_head_dim=32,
                                   attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=30.0,
                                   use_bidirectional_attention="vision", tie_word_embeddings=True,
                                   enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
    "llama3.1-8b-hf": config_to_hf(MODELS["llama3.1-8b"]),
    "qwen3-8b-hf": config_to_hf(MODELS["qwen3-8b"]),
    "gemma-3-27b": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=5376, intermediate_size=21504,
                        num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                        query_pre_attn_scalar=168, sliding_window=1024, max_position_embeddings=131072,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True),
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
                               num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
                               linear_num_value_heads=32, linear_value_head_dim=128, num_experts=512,
                               num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               norm_topk_prob=True, full_attention_interval=4, partial_rotary_factor=0.25,
                               rope_theta=10_000_000.0, max_position_embeddings=262144, tie_word_embeddings=False),
    # the generic path with dropout (trained in train mode, megatrain.models.draws): Seed-OSS's class defaults
    "tiny-hf-seed-oss": dict(_TINY_HF, model_type="seed_oss", attention_bias=True, attention_dropout=0.1,
                             residual_dropout=0.1),
    "tiny-hf-seed-oss-no-dropout": dict(_TINY_HF, model_type="seed_oss", attention_bias=True, attention_dropout=0.0,
                                        residual_dropout=0.0),
    # ByteDance's Seed-OSS-36B as its config.json publishes it: attention and residual dropout 0.1
    "seed-oss-36b": dict(model_type="seed_oss", vocab_size=155136, hidden_size=5120, intermediate_size=27648,
                         num_hidden_layers=64, num_attention_heads=80, num_key_value_heads=8, head_dim=128,
                         attention_bias=True, attention_out_bias=False, mlp_bias=False, attention_dropout=0.1,
                         residual_dropout=0.1, rms_norm_eps=1e-6, rope_theta=10000000.0,
                         max_position_embeddings=524288, tie_word_embeddings=False),
    # Gemma-4-E4B's text decoder at its published widths: 42 layers of 2560, 8 query heads and 2 KV heads of 256 on
    # its sliding layers (512 on its full ones), a 10240 GELU MLP, 5 sliding layers (512-token window) to 1 full,
    # per-layer inputs of 256 from their own 262k table, the last 18 layers reusing earlier layers' keys and values;
    # what the release's config.json sets beyond these is left at transformers' Gemma4TextConfig defaults. Cut to
    # fewer layers, the shared layers keep their share (GenericConfig.with_layers): 5 of 12
    "gemma-4-e4b": dict(model_type="gemma4_text", vocab_size=262144, hidden_size=2560, intermediate_size=10240,
                        num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                        global_head_dim=512, hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                        sliding_window=512, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
                        num_kv_shared_layers=18, rms_norm_eps=1e-6, max_position_embeddings=131072,
                        tie_word_embeddings=True),
    # Gemma 4's large checkpoints (google/gemma-4-31B and google/gemma-4-26B-A4B; their -it twins share the text
    # config) as transformers' convert_gemma4_weights.py sets them, the rest at Gemma4TextConfig's defaults as their
    # config.json has them: a 262k tied vocabulary, sliding heads of 256 and full ones of 512, 5 sliding layers
    # (1024-token window) to 1 full, no per-layer inputs and no shared KV, keys equal to values on the full layers
    # (their own KV heads), logits softcapped at 30. 31B: 60 dense layers of 5376; 26B-A4B: 30 layers of 2816, each
    # a 2112 GELU MLP beside 128 experts of 704 (top 8). A cut's last layer is full (transformers' config makes it so)
    "gemma-4-31b": dict(_GEMMA4_LARGE, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
                        layer_types=_GEMMA4_LAYERS * 10),
    "gemma-4-26b-a4b": dict(_GEMMA4_LARGE, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                            num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                            layer_types=_GEMMA4_LAYERS * 5, enable_moe_block=True, num_experts=128, top_k_experts=8,
                            moe_intermediate_size=704),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                             first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
                             norm_topk_prob=False, max_position_embeddings=163840, tie_word_embeddings=False),
}


def model_shape(name: str, num_layers: int | None = None) -> ModelShape:
    """The registered shape `name` (MODELS, or HF_CONFIGS through transformers' own modules), optionally with another
    depth (depth-scaling sweeps)."""
    if name not in MODELS and name not in HF_CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join([*MODELS, *HF_CONFIGS])}")
    cfg = MODELS[name] if name in MODELS else GenericConfig.from_hf(HF_CONFIGS[name])
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        cfg = cfg.with_layers(num_layers)
    return cfg
