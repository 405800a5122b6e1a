"""Tiny transformers configs of every model family and RoPE scaling we train, for the CPU and GPU parity tests.

Each kind is the smallest config that exercises what its family or scaling adds: sliding windows of 5 tokens and
original contexts of 8 positions, so 16- and 32-token sequences run past both.
"""

import transformers

KINDS = ("qwen2", "llama", "llama3.1", "llama-bias-linear", "llama-dynamic", "qwen2-yarn", "qwen2-sliding", "qwen3",
         "qwen3-yarn-sliding", "mistral", "qwen3-moe", "gpt-oss", "qwen3-moe-aux")
MOE_KINDS = ("qwen3-moe", "gpt-oss", "qwen3-moe-aux")
AUX_COEF = 0.3
EXPERTS, TOP_K = 4, 2
WINDOW, ORIGINAL = 5, 8


def family_config(kind: str, **shape) -> transformers.PretrainedConfig:
    """The transformers config of `kind` at `shape` (vocab_size, hidden_size, ... as transformers names them)."""
    theta = {"rope_theta": 10000.0}
    if kind == "qwen2":
        return transformers.Qwen2Config(**shape, rope_parameters={"rope_type": "default", **theta})
    if kind == "llama":
        return transformers.LlamaConfig(**shape, rope_parameters={"rope_type": "default", **theta})
    if kind == "llama3.1":
        return transformers.LlamaConfig(**shape, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": ORIGINAL, **theta})
    if kind == "llama-bias-linear":
        return transformers.LlamaConfig(**shape, attention_bias=True, mlp_bias=True,
                                        rope_parameters={"rope_type": "linear", "factor": 2.0, **theta})
    if kind == "llama-dynamic":  # max_position_embeddings below the sequence: the base is rescaled
        return transformers.LlamaConfig(**{**shape, "max_position_embeddings": ORIGINAL},
                                        rope_parameters={"rope_type": "dynamic", "factor": 2.0, **theta})
    if kind == "qwen2-yarn":
        return transformers.Qwen2Config(**shape, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, **theta})
    if kind == "qwen2-sliding":  # the layers from max_window_layers on slide
        return transformers.Qwen2Config(**shape, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                        rope_parameters={"rope_type": "default", **theta})
    if kind == "qwen3":
        return transformers.Qwen3Config(**shape, head_dim=24, rope_parameters={"rope_type": "default", **theta})
    if kind == "qwen3-yarn-sliding":  # alternating layers, YaRN without truncation (GPT-OSS's form)
        layers = shape["num_hidden_layers"]
        return transformers.Qwen3Config(
            **shape, head_dim=16, use_sliding_window=True, sliding_window=WINDOW, attention_bias=True,
            layer_types=["sliding_attention" if n % 2 == 0 else "full_attention" for n in range(layers)],
            rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                             "truncate": False, **theta})
    if kind == "mistral":
        return transformers.MistralConfig(**shape, sliding_window=WINDOW,
                                          rope_parameters={"rope_type": "default", **theta})
    if kind == "qwen3-moe":  # softmax over every expert, then the top-k unnormalised
        return transformers.Qwen3MoeConfig(**shape, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                           moe_intermediate_size=32, norm_topk_prob=False,
                                           rope_parameters={"rope_type": "default", **theta})
    if kind == "qwen3-moe-aux":  # the router's load-balancing loss in training, renormalised top-k
        return transformers.Qwen3MoeConfig(**shape, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                           moe_intermediate_size=32, norm_topk_prob=True, output_router_logits=True,
                                           router_aux_loss_coef=AUX_COEF,
                                           rope_parameters={"rope_type": "default", **theta})
    if kind == "gpt-oss":  # sinks, alternating windows, YaRN, router and expert biases, the clamped SwiGLU
        return transformers.GptOssConfig(**shape, head_dim=16, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                         sliding_window=WINDOW, rope_parameters={
                                             "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": ORIGINAL,
                                             **theta})
    raise AssertionError(kind)


def _gemma4(kind: str, shape: dict) -> transformers.PretrainedConfig:
    """Gemma 4 at `shape` made 4 layers deep: per-layer inputs of 8 per layer, sliding and full layers, and the
    last two layers reusing the keys and values of the first two (each of its own attention type). Initialised wider
    than its default (0.02), at which the tiny model amplifies rounding so fast that transformers' own eager and sdpa
    attention leave 1e-5 apart within 10 steps (2e-4 there)."""
    settings = {"num_hidden_layers": 4, "head_dim": 16, "global_head_dim": 16, "sliding_window": WINDOW,
                "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": shape["vocab_size"],
                "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 2,
                "initializer_range": 0.1}
    settings = {**settings, **shape, "num_hidden_layers": 4}  # what the caller gives wins, but the depth
    if kind in ("gemma4_31b", "gemma4_26b_a4b"):
        # the large checkpoints' switches as published (transformers' convert_gemma4_weights.py), over the caller's
        # too: no per-layer inputs, no shared KV, keys equal to values on the full layers with their own head width
        # (32, the sliding layers' 16) and KV heads (1, theirs 2), softcapped logits, a tied head; 26B-A4B: experts
        # beside the MLP
        settings.update(hidden_size_per_layer_input=0, num_kv_shared_layers=0, global_head_dim=32,
                        attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=30.0,
                        use_bidirectional_attention="vision", tie_word_embeddings=True)
    if kind == "gemma4_unified":
        return transformers.Gemma4UnifiedTextConfig(**settings)
    moe = dict(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=TOP_K, moe_intermediate_size=32)
    return transformers.Gemma4TextConfig(**settings, **(moe if kind in ("gemma4_moe", "gemma4_26b_a4b") else {}))


# Families only the generic path trains (transformers' own modules, megatrain.models.generic), each at the tiny shape
# with what it adds: sliding and full layers with softcapped logits (gemma3, tied), experts (mixtral), fused projections
# (phi3), MLA with shared experts after a dense layer (deepseek_v3, glm4_moe without MLA), linear and full attention
# over experts (qwen3_next), chunked and full attention, one expert and a shared one (llama4), q/k norms after the
# projections (olmo2), embedding, residual, attention and logit multipliers (granite); state crossing layers: per-layer
# inputs and the last two layers reading the first two's keys and values (gemma4, over experts beside the MLP:
# gemma4_moe; gemma4_unified); Gemma 4's large checkpoints, none of that but keys equal to values on full layers of
# their own width (gemma4_31b, over experts beside the MLP: gemma4_26b_a4b).
GENERIC_KINDS = ("gemma3", "mixtral", "phi3", "deepseek_v3", "qwen3_next", "llama4", "glm4_moe", "olmo2", "granite",
                 "gemma4", "gemma4_moe", "gemma4_unified", "gemma4_31b", "gemma4_26b_a4b")
# configs whose training draws random numbers (dropout, jitter): every system against transformers in train mode
RANDOM_KINDS = ("seed_oss", "phi3-dropout", "qwen2-dropout", "mixtral-jitter")


def generic_config(kind: str, **shape) -> transformers.PretrainedConfig:
    """The transformers config of generic `kind` at `shape` (as family_config)."""
    moe = dict(moe_intermediate_size=32, num_experts_per_tok=TOP_K)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(**{**shape, "tie_word_embeddings": True}, head_dim=16,
                                             query_pre_attn_scalar=16, sliding_window=WINDOW,
                                             final_logit_softcapping=3.0,
                                             layer_types=["sliding_attention", "full_attention"])
    if kind == "mixtral":
        return transformers.MixtralConfig(**shape, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    if kind == "phi3":
        return transformers.Phi3Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(**{**shape, "num_key_value_heads": shape["num_attention_heads"]}, **moe,
                                             first_k_dense_replace=1, n_routed_experts=EXPERTS, n_group=1,
                                             topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16)
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(**shape, **moe, head_dim=16, num_experts=EXPERTS,
                                            shared_expert_intermediate_size=32, linear_num_value_heads=4,
                                            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                                            layer_types=["linear_attention", "full_attention"])
    if kind == "llama4":
        return transformers.Llama4TextConfig(**shape, head_dim=16, intermediate_size_mlp=96,
                                             num_local_experts=EXPERTS, num_experts_per_tok=1, attention_chunk_size=8,
                                             no_rope_layers=[1, 0])
    if kind == "glm4_moe":
        return transformers.Glm4MoeConfig(**shape, **moe, head_dim=16, first_k_dense_replace=1,
                                          n_routed_experts=EXPERTS, n_group=1, topk_group=1)
    if kind == "seed_oss":  # its class defaults: attention and residual dropout 0.1
        return transformers.SeedOssConfig(**shape, head_dim=16)
    if kind == "phi3-dropout":  # dropout of the embedding (the preamble's draw), the residuals and the attention
        return transformers.Phi3Config(**shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, embd_pdrop=0.1,
                                       resid_pdrop=0.1, attention_dropout=0.1)
    if kind == "qwen2-dropout":  # a hand-written family whose dropout only transformers' modules train
        return transformers.Qwen2Config(**shape, attention_dropout=0.2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "mixtral-jitter":  # the router's jitter noise on its inputs in training
        return transformers.MixtralConfig(**shape, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                          router_jitter_noise=0.1)
    if kind == "olmo2":
        return transformers.Olmo2Config(**shape, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    if kind == "granite":
        return transformers.GraniteConfig(**shape, embedding_multiplier=2.0, residual_multiplier=0.5,
                                          attention_multiplier=0.3, logits_scaling=0.5)
    if kind.startswith("gemma4"):
        return _gemma4(kind, shape)
    raise AssertionError(kind)
