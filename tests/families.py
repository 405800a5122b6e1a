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
