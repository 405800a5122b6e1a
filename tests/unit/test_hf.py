"""HF checkpoint load/save vs transformers' own model of every family and RoPE scaling. CPU only, seconds:
pytest tests/unit/test_hf.py"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import KINDS, ORIGINAL, family_config  # noqa: E402

from megatrain.models import Transformer, model_shape  # noqa: E402
from megatrain.models.checkpoint import open_checkpoint, save_checkpoint  # noqa: E402
from megatrain.models.handwritten.hf import config_from_hf, config_to_hf, save_hf_checkpoint  # noqa: E402
from megatrain.models.init import init_module  # noqa: E402
from megatrain.models.rope import RopeScaling  # noqa: E402
from megatrain.models.safetensors_files import INDEX_FILE, SINGLE_FILE  # noqa: E402

VOCAB, SEQ = 128, 32


def load_checkpoint(path, dtype=None):
    """(shape, every weight by our names) of a checkpoint folder, through the one road (megatrain.models.checkpoint)."""
    checkpoint = open_checkpoint(path)
    return checkpoint.shape, {name: t if dtype is None else t.to(dtype) for name, t in checkpoint.weights()}
SMALL_SHARD_BYTES = 20_000  # the 32 KiB embedding alone exceeds it: many shards

# Published config.json files (transformers 4.x layout) of two registered sizes.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def hf_model(kind: str, tied: bool, seed: int = 0, layers: int = 3):
    """A tiny random fp32 transformers model of `kind` (families.KINDS) whose norms and biases are random too (no
    identity maps)."""
    config = family_config(kind, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=layers, tie_word_embeddings=tied,
                           max_position_embeddings=4 * SEQ, rms_norm_eps=1e-5)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    return model.eval()


def assert_same_logits(hf, ours, vocab_size: int, seq: int = SEQ) -> None:
    tokens = torch.randint(0, vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(input_ids=tokens).logits - ours(tokens)).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("kind,tied,sharded", [
    ("qwen2", False, False), ("qwen2", True, True), ("llama", False, True), ("llama", True, False),
    *[(kind, False, False) for kind in KINDS[2:]]])
def test_load_transformers_checkpoint(tmp_path, kind, tied, sharded):
    """Logits at 4x the original context of the scaled kinds (and past every sliding window) equal transformers'."""
    hf = hf_model(kind, tied)
    hf.save_pretrained(tmp_path, max_shard_size=SMALL_SHARD_BYTES if sharded else "1GB")
    assert (tmp_path / (INDEX_FILE if sharded else SINGLE_FILE)).exists()

    cfg, state = load_checkpoint(tmp_path)
    assert cfg.family == hf.config.model_type and cfg.tie_embeddings == tied
    assert ("lm_head.weight" in state) == (not tied)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state, strict=True)
    assert_same_logits(hf, ours, VOCAB, seq=4 * ORIGINAL)


@pytest.mark.parametrize("name,max_shard_bytes", [
    ("tiny", 5 * 2**30), ("tiny", SMALL_SHARD_BYTES), ("tiny-tied", SMALL_SHARD_BYTES),
    *[(kind, 5 * 2**30) for kind in KINDS]])
def test_transformers_loads_our_checkpoint(tmp_path, name, max_shard_bytes):
    """Our export of a registry shape or of each family's config loads in transformers as the same architecture,
    every parameter and the logits the same."""
    cfg = config_from_hf(hf_model(name, tied=False).config.to_dict()) if name in KINDS else model_shape(name)
    ours = Transformer(cfg).eval()
    init_module(ours, seed=3)
    files = save_hf_checkpoint(ours, cfg, tmp_path, max_shard_bytes=max_shard_bytes)
    if len(files) > 1:
        assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert set(index["weight_map"]) == {("" if n == "lm_head.weight" else "model.") + n for n in ours.state_dict()}
    else:
        assert [f.name for f in files] == [SINGLE_FILE] and not (tmp_path / INDEX_FILE).exists()

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert hf.config.model_type == cfg.family and config_from_hf(hf.config.to_dict()) == cfg
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params()
    assert_same_logits(hf, ours, cfg.vocab_size, seq=4 * ORIGINAL)


@pytest.mark.parametrize("kind", KINDS)
def test_an_export_of_a_checkpoint_keeps_its_config_whole(tmp_path, kind):
    """Token ids, generation and tokenizer settings and keys we never read come back as the source had them (they
    came back as transformers' defaults: Llama's bos/eos 1/2, Qwen3's None); only the dtype is the export's, under
    the key the source names it by (torch_dtype was added beside transformers 5's dtype)."""
    model = hf_model(kind, tied=False)
    model.config.update({"bos_token_id": 100, "eos_token_id": [101, 102], "pad_token_id": 103, "megatrain_test": 1})
    model.save_pretrained(tmp_path / "source")
    source = json.loads((tmp_path / "source" / "config.json").read_text())
    assert source["dtype"] == "float32" and "torch_dtype" not in source
    checkpoint = open_checkpoint(tmp_path / "source")
    unnamed = {k: v for k, v in source.items() if k != "dtype"}
    # transformers 5's config, transformers 4's, and one naming no dtype (given both)
    for named, keys in ((source, ["dtype"]), ({**unnamed, "torch_dtype": "float32"}, ["torch_dtype"]),
                        (unnamed, ["dtype", "torch_dtype"])):
        save_checkpoint(dict(checkpoint.weights()), checkpoint.shape, tmp_path / "export", max_shard_bytes=2**30,
                        dtype=torch.bfloat16, source_config=named)
        exported = json.loads((tmp_path / "export" / "config.json").read_text())
        assert exported == {**named, **dict.fromkeys(keys, "bfloat16")}
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (100, [101, 102], 103)


def test_save_from_plain_dict_in_bf16_round_trips(tmp_path):
    cfg = model_shape("tiny")
    model = Transformer(cfg)
    init_module(model, seed=5)
    # Host tiles: views into one flat buffer, as the streaming engine keeps them.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    host_tiles, offset = {}, 0
    for name, p in model.named_parameters():
        host_tiles[name] = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
    save_hf_checkpoint(host_tiles, cfg, tmp_path, max_shard_bytes=SMALL_SHARD_BYTES, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"

    loaded_cfg, state = load_checkpoint(tmp_path)
    assert loaded_cfg == cfg
    assert state.keys() == host_tiles.keys()
    for name, tensor in state.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, host_tiles[name].to(torch.bfloat16)), name
    _, state32 = load_checkpoint(tmp_path, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in state32.values())


def test_saving_over_an_old_checkpoint_leaves_no_stale_weights(tmp_path):
    cfg = model_shape("tiny")
    for seed, max_shard_bytes in [(0, SMALL_SHARD_BYTES), (1, 5 * 2**30), (2, SMALL_SHARD_BYTES)]:
        model = Transformer(cfg)
        init_module(model, seed=seed)
        save_hf_checkpoint(model, cfg, tmp_path, max_shard_bytes=max_shard_bytes)
        sharded = max_shard_bytes == SMALL_SHARD_BYTES
        assert (tmp_path / SINGLE_FILE).exists() != sharded and (tmp_path / INDEX_FILE).exists() == sharded
        _, state = load_checkpoint(tmp_path)
        assert all(torch.equal(state[n], p) for n, p in model.state_dict().items())


def test_save_rejects_state_dict_that_does_not_match_config(tmp_path):
    cfg = model_shape("tiny")
    state = Transformer(cfg).state_dict()
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        save_hf_checkpoint({k: v for k, v in state.items() if k != "lm_head.weight"}, cfg, tmp_path)
    state["norm.weight"] = torch.ones(cfg.hidden_size + 1)
    with pytest.raises(ValueError, match="norm.weight has shape"):
        save_hf_checkpoint(state, cfg, tmp_path)


def test_tied_checkpoint_that_stores_the_head_and_untied_one_without_it(tmp_path):
    cfg = model_shape("tiny-tied")
    model = Transformer(cfg)
    init_module(model, seed=0)
    save_hf_checkpoint(model, cfg, tmp_path)
    # A tied checkpoint that also stores lm_head.weight: the head is ignored, as transformers does.
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / SINGLE_FILE)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / SINGLE_FILE, metadata={"format": "pt"})
    _, state = load_checkpoint(tmp_path)
    assert "lm_head.weight" not in state

    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.safetensors lacks tensor 'lm_head.weight'"):
        load_checkpoint(tmp_path)


LLAMA31_8B = LLAMA3_8B | {"max_position_embeddings": 131072, "rope_scaling": {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    "rope_type": "llama3"}}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


@pytest.mark.parametrize("hf_config,name", [(QWEN25_05B, "qwen2.5-0.5b"), (LLAMA3_8B, "llama3-8b"),
                                            (LLAMA31_8B, "llama3.1-8b"), (QWEN3_8B, "qwen3-8b"),
                                            (MISTRAL_7B_V01, "mistral-7b-v0.1"), (GPT_OSS_20B, "gpt-oss-20b"),
                                            (QWEN3_30B_A3B, "qwen3-30b-a3b")])
def test_published_configs_map_to_registry(hf_config, name):
    assert config_from_hf(hf_config) == model_shape(name)


@pytest.mark.parametrize("name", ["tiny", "tiny-tied", "qwen2.5-7b", "llama3-70b", "llama3.1-8b", "llama3.2-1b",
                                  "qwen3-8b", "mistral-7b-v0.1", "mistral-7b-v0.3", "gpt-oss-120b",
                                  "qwen3-235b-a22b", "tiny-moe", "tiny-gpt-oss"])
def test_config_round_trips_through_transformers(name):
    cfg = model_shape(name)
    hf = transformers.AutoConfig.for_model(**config_to_hf(cfg, torch.bfloat16))
    assert hf.dtype == torch.bfloat16
    assert config_from_hf(hf.to_dict()) == cfg


def test_transformers_4_layouts_read_as_5():
    """4.x's rope_scaling with `type`, and a top-level original_max_position_embeddings, mean what 5.x reads."""
    yarn4 = QWEN25_05B | {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert config_from_hf(yarn4).rope_scaling == RopeScaling("yarn", 4.0, original_max_positions=32768)
    top = LLAMA31_8B | {"original_max_position_embeddings": 4096}
    assert config_from_hf(top).rope_scaling.original_max_positions == 4096
    sliding = QWEN25_05B | {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    cfg = config_from_hf(sliding)
    assert cfg.sliding_window == 4096 and [cfg.layer_type(n) for n in (19, 20)] == ["full_attention",
                                                                                     "sliding_attention"]
    assert config_from_hf(QWEN25_05B | {"sliding_window": 4096}).sliding_window == 0  # not used: not sliding


@pytest.mark.parametrize("change,message", [
    ({"model_type": "gemma"}, "model_type 'gemma' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6, "beta_fast": 8}},
     r"\['beta_fast'\] are not used by rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6}},
      "layer_types": ["full_attention"] * 2}, "per-layer rope_parameters"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, r"layer_types \['chunked_attention'\]"),
    ({"mlp_bias": True}, "mlp_bias=true is not part of qwen2"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "needs a factor"),
])
def test_unsupported_configs_are_refused_by_name(change, message):
    hf = transformers.Qwen2Config(num_hidden_layers=2).to_dict() | change
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


@pytest.mark.parametrize("config,change,message", [
    (transformers.LlamaConfig, {"layer_types": ["sliding_attention"] * 2, "sliding_window": 4}, "no sliding-window"),
    (transformers.MistralConfig, {"layer_types": ["full_attention", "sliding_attention"]}, "as Ministral"),
    (transformers.MistralConfig, {"attention_bias": True}, "attention_bias=true is not part of mistral"),
    (transformers.Qwen3Config, {"use_sliding_window": True, "sliding_window": None,
                                "layer_types": ["sliding_attention"] * 2}, "has no sliding_window"),
])
def test_unsupported_family_settings_are_refused(config, change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(config(num_hidden_layers=2).to_dict() | change)


@pytest.mark.parametrize("config,change,message", [
    (QWEN3_30B_A3B, {"mlp_only_layers": [3]}, "dense MLP layers among the experts"),
    (QWEN3_30B_A3B, {"decoder_sparse_step": 2}, "dense MLP layers among the experts"),
    (QWEN3_30B_A3B, {"use_sliding_window": True, "sliding_window": 4096}, "qwen3_moe with use_sliding_window"),
    (QWEN3_30B_A3B, {"num_experts": 0}, "load it as model_type qwen3"),
    (QWEN3_30B_A3B, {"num_experts_per_tok": 129}, "routes each token to 1..num_experts"),
    (GPT_OSS_20B, {"attention_bias": False}, "gpt_oss with attention_bias=false"),
    (GPT_OSS_20B, {"quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes' is not supported"),
])
def test_unsupported_expert_settings_are_refused(config, change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(config | change)


def test_the_load_balancing_loss_is_on_only_where_the_config_asks():
    assert config_from_hf(GPT_OSS_20B).router_aux_loss_coef == 0.0
    assert config_from_hf(GPT_OSS_20B | {"output_router_logits": True}).router_aux_loss_coef == 0.9


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_loads_as_transformers_dequantizes_it(tmp_path):
    """The published layout: each layer's experts as MXFP4 blocks and scales. Our load equals transformers' model
    holding transformers' own dequantization of the same blocks."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_model("gpt-oss", tied=False)
    hf.save_pretrained(tmp_path / "bf16")
    tensors = load_file(tmp_path / "bf16" / SINGLE_FILE)
    gen = torch.Generator().manual_seed(4)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inp, out = tensors.pop(key).shape  # stored [E, in, out]: MXFP4 rows are the outputs
        blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8, generator=gen)
        scales = torch.randint(120, 124, (experts, out, inp // 32), dtype=torch.uint8, generator=gen)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        hf.get_parameter(key).data.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    (tmp_path / "mxfp4").mkdir()
    save_file(tensors, tmp_path / "mxfp4" / SINGLE_FILE, metadata={"format": "pt"})
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(config))

    cfg, state = load_checkpoint(tmp_path / "mxfp4", dtype=torch.float32)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(state, strict=True)
    assert_same_logits(hf, ours, VOCAB)


def test_a_checkpoint_tensor_the_model_does_not_have_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("qwen3-moe", tied=False).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / SINGLE_FILE)
    tensors["model.layers.0.mlp.experts.4.up_proj.weight"] = torch.zeros(32, 64)  # a fifth expert
    save_file(tensors, tmp_path / SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensors this model does not have: \['model.layers.0.mlp.experts.4"):
        load_checkpoint(tmp_path)


def test_a_shape_its_family_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="a qwen2 model cannot have {'qkv_bias': False}"):
        model_shape("tiny").__class__(**{**model_shape("tiny").to_dict(), "qkv_bias": False, "family": "qwen2"})
    with pytest.raises(ValueError, match="model family 'gpt2' is not supported"):
        model_shape("tiny").__class__(**{**model_shape("tiny").to_dict(), "family": "gpt2"})
