"""Model registry, shapes and the chunked loss. CPU, seconds: pytest tests/unit/test_models.py"""

import pytest
import torch
import torch.nn.functional as F

from megatrain.models import MODELS, DecoderLayer, ModelConfig, Transformer, model_shape
from megatrain.models.init import init_module
from megatrain.models.loss import IGNORE_INDEX, linear_cross_entropy

# Published sizes (model cards): parameters in billions, to the digits they publish.
PUBLISHED_B = {
    "qwen2.5-0.5b": 0.49, "qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.77, "qwen2.5-32b": 32.76, "qwen2.5-72b": 72.71, "llama3-8b": 8.03, "llama3-70b": 70.55,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_param_counts_match_published(name):
    assert round(MODELS[name].num_params() / 1e9, 2) == PUBLISHED_B[name]


def test_exact_counts():
    assert MODELS["qwen2.5-7b"].num_params() == 7_615_616_512
    assert MODELS["qwen2.5-14b"].num_params() == 14_770_033_664
    assert MODELS["llama3-8b"].num_params() == 8_030_261_248
    assert 115e9 < MODELS["dense-120b"].num_params() < 125e9


# The mixtures of experts' model cards: total and active parameters. OpenAI's active count leaves out the input
# embedding (a lookup): it is our matmul count; Qwen's includes it: our active_params.
@pytest.mark.parametrize("name,total_b,active_b,active_as", [
    ("gpt-oss-120b", "116.83", "5.13", "matmul"), ("gpt-oss-20b", "20.91", "3.61", "matmul"),
    ("qwen3-30b-a3b", "30.5", "3.3", "active"), ("qwen3-235b-a22b", "235", "22", "active")])
def test_expert_counts_match_the_model_cards(name, total_b, active_b, active_as):
    """To the digits the cards publish (Qwen's cut: 3.35B activated reads 3.3B)."""
    def published(count: int, text: str) -> bool:
        unit = 10.0 ** -len(text.partition(".")[2])
        return float(text) - unit / 2 <= count / 1e9 < float(text) + unit

    cfg = MODELS[name]
    assert published(cfg.num_params(), total_b)
    assert published(cfg.matmul_params() if active_as == "matmul" else cfg.active_params(), active_b)
    unrouted = cfg.num_layers * (cfg.num_experts - cfg.num_experts_per_tok) * cfg.expert_params()
    assert cfg.active_params() == cfg.num_params() - unrouted


@pytest.mark.parametrize("name", ["tiny", "tiny-tied", "small", "tiny-moe", "tiny-gpt-oss"])
def test_count_matches_module(name):
    model = Transformer(MODELS[name])
    assert sum(p.numel() for p in model.parameters()) == MODELS[name].num_params()


@pytest.mark.parametrize("name", ["tiny", "tiny-tied", "small", "qwen2.5-7b", "llama3-8b", "tiny-moe", "gpt-oss-120b",
                                  "qwen3-235b-a22b"])
def test_named_shapes_are_the_modules(name):
    """Every count derives from ModelConfig's named shapes (and the engine lays its tiles out by them): they are the
    modules' parameters, names, order and shapes."""
    cfg = MODELS[name]
    with torch.device("meta"):
        model, layer = Transformer(cfg), DecoderLayer(cfg)
    assert {n: tuple(p.shape) for n, p in layer.named_parameters()} == cfg.layer_shapes()
    assert list(cfg.layer_shapes()) == [n for n, _ in layer.named_parameters()]
    assert list(cfg.param_shapes().items()) == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert sum(p.numel() for p in model.parameters()) == sum(cfg.param_numels()) == cfg.num_params()


def test_matmul_params_are_the_layers_matrices_and_the_lm_head():
    cfg = MODELS["qwen2.5-7b"]
    with torch.device("meta"):
        layer = DecoderLayer(cfg)
    matrices = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    assert cfg.matmul_params() == cfg.num_layers * matrices + cfg.vocab_size * cfg.hidden_size == 7_070_285_824
    tied = MODELS["qwen2.5-1.5b"]  # the tied head's matrix is the embedding's: counted once, as the head
    assert tied.matmul_params() == tied.num_layers * tied.layer_matmul_params() + tied.embedding_params()


def test_72b_on_meta_device_is_counted_without_allocation():
    with torch.device("meta"):
        model = Transformer(MODELS["qwen2.5-72b"])
    assert sum(p.numel() for p in model.parameters()) == MODELS["qwen2.5-72b"].num_params()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="divide hidden_size"):
        ModelConfig(vocab_size=10, hidden_size=30, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="must divide num_heads"):
        ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown model"):
        model_shape("gpt-5")
    with pytest.raises(ValueError, match="num_layers"):
        model_shape("tiny", num_layers=0)


def test_depth_override():
    assert model_shape("qwen2.5-7b", num_layers=180).num_layers == 180


def test_init_is_order_independent():
    a, b = Transformer(MODELS["tiny"]), Transformer(MODELS["tiny"])
    init_module(a, seed=3)
    for i in reversed(range(len(b.layers))):
        init_module(b.layers[i], seed=3, prefix=f"layers.{i}.")
    init_module(b.embed_tokens, seed=3, prefix="embed_tokens.")
    init_module(b.norm, seed=3, prefix="norm.")
    init_module(b.lm_head, seed=3, prefix="lm_head.")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_init_of_a_narrower_tensor_is_the_fp32_draw_rounded_once():
    from megatrain.models.init import init_param

    wide, narrow = torch.empty(64, 48), torch.empty(64, 48, dtype=torch.bfloat16)
    init_param("layers.0.mlp.up_proj.weight", wide, seed=5)
    init_param("layers.0.mlp.up_proj.weight", narrow, seed=5, device="cpu")
    assert torch.equal(narrow, wide.to(torch.bfloat16)) and wide.std() > 0.01


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_loss_matches_full_cross_entropy(chunk):
    torch.manual_seed(0)
    h = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (50,))
    labels[::5] = IGNORE_INDEX
    valid = int((labels != IGNORE_INDEX).sum())
    ours = linear_cross_entropy(h, w, labels, valid, chunk_tokens=chunk)
    ref = F.cross_entropy(h @ w.t(), labels, ignore_index=IGNORE_INDEX)
    g_ours = torch.autograd.grad(ours * 2, [h, w])
    g_ref = torch.autograd.grad(ref * 2, [h, w])
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_model_loss_equals_logits_cross_entropy():
    model = Transformer(MODELS["tiny-tied"])
    init_module(model, seed=0)
    x = torch.randint(0, 256, (2, 9))
    y = torch.randint(0, 256, (2, 9))
    y[1, -4:] = IGNORE_INDEX
    ref = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(model(x, y), ref, rtol=1e-6, atol=1e-6)
