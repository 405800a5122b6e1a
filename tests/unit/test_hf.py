"""HF checkpoint load/save vs transformers' own Qwen2/Llama. CPU only, seconds: pytest tests/unit/test_hf.py"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain.models import Transformer, get_model_config  # noqa: E402
from megatrain.models.hf import (  # noqa: E402
    INDEX_FILE,
    SINGLE_FILE,
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    load_into_model,
    save_hf_checkpoint,
)
from megatrain.models.init import init_module  # noqa: E402

VOCAB, SEQ = 128, 32
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


def hf_model(model_type: str, tied: bool, seed: int = 0):
    """A tiny random fp32 transformers model whose norms and biases are random too (no identity maps)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=tied, attn_implementation="eager")
    if model_type == "qwen2":
        config = transformers.Qwen2Config(num_hidden_layers=2, rms_norm_eps=1e-6,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=3, rms_norm_eps=1e-5,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5e5}, **common)
        model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise)
    return model.eval()


def assert_same_logits(hf, ours, vocab_size: int) -> None:
    tokens = torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(input_ids=tokens).logits - ours(tokens)).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("model_type,tied,sharded", [
    ("qwen2", False, False), ("qwen2", True, True), ("llama", False, True), ("llama", True, False)])
def test_load_transformers_checkpoint(tmp_path, model_type, tied, sharded):
    hf = hf_model(model_type, tied)
    hf.save_pretrained(tmp_path, max_shard_size=SMALL_SHARD_BYTES if sharded else "1GB")
    assert (tmp_path / (INDEX_FILE if sharded else SINGLE_FILE)).exists()

    cfg, state = load_hf_checkpoint(tmp_path)
    assert cfg.tie_embeddings == tied and cfg.qkv_bias == (model_type == "qwen2")
    assert ("lm_head.weight" in state) == (not tied)
    ours = Transformer(cfg).eval()
    load_into_model(ours, state)
    assert_same_logits(hf, ours, VOCAB)


@pytest.mark.parametrize("name,model_type,max_shard_bytes", [
    ("tiny", "qwen2", 5 * 2**30), ("tiny", "qwen2", SMALL_SHARD_BYTES), ("tiny-tied", "llama", SMALL_SHARD_BYTES)])
def test_transformers_loads_our_checkpoint(tmp_path, name, model_type, max_shard_bytes):
    cfg = get_model_config(name)
    ours = Transformer(cfg).eval()
    init_module(ours, seed=3)
    files = save_hf_checkpoint(ours, cfg, tmp_path, model_type, max_shard_bytes=max_shard_bytes)
    if len(files) > 1:
        assert files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert set(index["weight_map"]) == {("" if n == "lm_head.weight" else "model.") + n for n in ours.state_dict()}
    else:
        assert [f.name for f in files] == [SINGLE_FILE] and not (tmp_path / INDEX_FILE).exists()

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_params()
    assert_same_logits(hf, ours, cfg.vocab_size)


def test_save_from_plain_dict_in_bf16_round_trips(tmp_path):
    cfg = get_model_config("tiny")
    model = Transformer(cfg)
    init_module(model, seed=5)
    # Host tiles: views into one flat buffer, as the streaming engine keeps them.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    host_tiles, offset = {}, 0
    for name, p in model.named_parameters():
        host_tiles[name] = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
    save_hf_checkpoint(host_tiles, cfg, tmp_path, "qwen2", max_shard_bytes=SMALL_SHARD_BYTES, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"

    loaded_cfg, state = load_hf_checkpoint(tmp_path)
    assert loaded_cfg == cfg
    assert state.keys() == host_tiles.keys()
    for name, tensor in state.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, host_tiles[name].to(torch.bfloat16)), name
    _, state32 = load_hf_checkpoint(tmp_path, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in state32.values())


def test_saving_over_an_old_checkpoint_leaves_no_stale_weights(tmp_path):
    cfg = get_model_config("tiny")
    for seed, max_shard_bytes in [(0, SMALL_SHARD_BYTES), (1, 5 * 2**30), (2, SMALL_SHARD_BYTES)]:
        model = Transformer(cfg)
        init_module(model, seed=seed)
        save_hf_checkpoint(model, cfg, tmp_path, "qwen2", max_shard_bytes=max_shard_bytes)
        sharded = max_shard_bytes == SMALL_SHARD_BYTES
        assert (tmp_path / SINGLE_FILE).exists() != sharded and (tmp_path / INDEX_FILE).exists() == sharded
        _, state = load_hf_checkpoint(tmp_path)
        assert all(torch.equal(state[n], p) for n, p in model.state_dict().items())


def test_save_rejects_state_dict_that_does_not_match_config(tmp_path):
    cfg = get_model_config("tiny")
    state = Transformer(cfg).state_dict()
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        save_hf_checkpoint({k: v for k, v in state.items() if k != "lm_head.weight"}, cfg, tmp_path)
    state["norm.weight"] = torch.ones(cfg.hidden_size + 1)
    with pytest.raises(ValueError, match="norm.weight has shape"):
        save_hf_checkpoint(state, cfg, tmp_path)


def test_tied_checkpoint_that_stores_the_head_and_untied_one_without_it(tmp_path):
    cfg = get_model_config("tiny-tied")
    model = Transformer(cfg)
    init_module(model, seed=0)
    save_hf_checkpoint(model, cfg, tmp_path, "llama")
    # A tied checkpoint that also stores lm_head.weight: the head is ignored, as transformers does.
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / SINGLE_FILE)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / SINGLE_FILE, metadata={"format": "pt"})
    _, state = load_hf_checkpoint(tmp_path)
    assert "lm_head.weight" not in state

    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / SINGLE_FILE, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):
        load_hf_checkpoint(tmp_path)


def test_load_into_model_is_strict():
    model = Transformer(get_model_config("tiny"))
    state = dict(model.state_dict())
    state["layers.0.extra.weight"] = state.pop("layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing \['layers.0.mlp.up_proj.weight'\], unexpected \['layers.0.extra"):
        load_into_model(model, state)


@pytest.mark.parametrize("hf_config,name", [(QWEN25_05B, "qwen2.5-0.5b"), (LLAMA3_8B, "llama3-8b")])
def test_published_configs_map_to_registry(hf_config, name):
    assert config_from_hf(hf_config) == get_model_config(name)


@pytest.mark.parametrize("name,model_type", [("tiny", "qwen2"), ("tiny-tied", "llama"), ("qwen2.5-7b", "qwen2"),
                                             ("llama3-70b", "llama")])
def test_config_round_trips_through_transformers(name, model_type):
    cfg = get_model_config(name)
    hf = transformers.AutoConfig.for_model(**config_to_hf(cfg, model_type, torch.bfloat16))
    assert hf.dtype == torch.bfloat16
    assert config_from_hf(hf.to_dict()) == cfg


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling=.* is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_type 'yarn'"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types \['sliding_attention'\]"),
])
def test_unsupported_qwen2_configs_are_refused(change, message):
    hf = transformers.Qwen2Config(num_hidden_layers=2).to_dict() | change
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


@pytest.mark.parametrize("change,message", [
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"attention_bias": True}, "o_proj bias"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}}, "rope_type 'llama3'"),
])
def test_unsupported_llama_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf(transformers.LlamaConfig(num_hidden_layers=2).to_dict() | change)


def test_config_to_hf_refuses_bias_mismatch():
    with pytest.raises(ValueError, match="model_type='llama'"):
        config_to_hf(get_model_config("tiny-tied"), "qwen2")
    with pytest.raises(ValueError, match="saves as 'qwen2'"):
        config_to_hf(get_model_config("tiny"), "llama")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        config_to_hf(get_model_config("tiny"), "gpt2")
