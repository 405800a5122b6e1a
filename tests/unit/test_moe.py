"""The mixture-of-experts pieces against their definitions: grouped GEMM against the per-expert loop, the routing of
each family, attention sinks through FlexAttention against the dense softmax. CPU, seconds: pytest
tests/unit/test_moe.py"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatrain.models.handwritten.moe import experts_forward, route
from megatrain.models.handwritten.transformer import attention_with_sinks


def _experts(bias: bool, limit: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t, h, i, e, k = 24, 16, 8, 5, 2
    x = torch.randn(t, h, generator=gen)
    logits = torch.randn(t, e, generator=gen)
    logits[:, 4] = -30  # one expert no token chooses
    weights, experts = route(logits, k, norm_topk_prob=True)
    tensors = [torch.randn(e, 2 * i, h, generator=gen) / 4, torch.randn(e, h, i, generator=gen) / 3]
    tensors += [torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen)] if bias else [None, None]
    return x, weights, experts, tensors, limit


@pytest.mark.parametrize("bias,limit", [(False, 0.0), (True, 0.5)])
def test_grouped_gemm_equals_the_per_expert_loop_forward_and_backward(bias, limit):
    results = []
    for grouped in (True, False):
        x, weights, experts, tensors, limit = _experts(bias, limit)
        leaves = [t.requires_grad_() for t in (x, weights, *tensors) if t is not None]
        y = experts_forward(x, weights, experts, *tensors, limit=limit, alpha=1.702, grouped=grouped)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        results.append([y.detach(), *[leaf.grad for leaf in leaves]])
    for grouped, loop in zip(*results, strict=True):
        torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)
    assert results[1][3][4].abs().sum() == 0  # the unchosen expert's weights get no gradient


def test_under_autocast_the_grouped_experts_compute_in_its_dtype_as_the_loop_does():
    """Native's mixed precision (fp32 weights under bf16 autocast) computes the experts as the bf16 systems do, on the
    grouped kernels where they run: autocast casts F.linear's operands (the loop's), not torch._grouped_mm's, so
    experts_forward casts them itself. The output keeps the input's dtype."""
    x, weights, experts, tensors, limit = _experts(True, 0.5)
    exact = experts_forward(x, weights, experts, *tensors, limit=limit, alpha=1.702)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grouped, loop = (experts_forward(x, weights, experts, *tensors, limit=limit, alpha=1.702, grouped=g)
                         for g in (True, False))
    assert grouped.dtype == loop.dtype == torch.float32
    torch.testing.assert_close(grouped, loop, rtol=0, atol=2e-2)  # bf16 products summed in different orders
    assert (grouped - exact).abs().max() > 1e-3 and (loop - exact).abs().max() > 1e-3  # both in bf16, not fp32


def test_experts_forward_is_each_tokens_weighted_sum_of_its_experts():
    x, weights, experts, (gate_up, down, b1, b2), _ = _experts(bias=True, limit=0.0)
    y = experts_forward(x, weights, experts, gate_up, down, b1, b2)
    for t in (0, 7, 23):
        want = sum(w * (down[e] @ (torch.nn.functional.silu(g) * u) + b2[e])
                   for w, e in zip(weights[t], experts[t].tolist(), strict=True)
                   for g, u in [(gate_up[e] @ x[t] + b1[e]).chunk(2)])
        torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-6)


def test_routing_softmax_then_top_k_or_top_k_then_softmax():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, experts = route(logits, 2, norm_topk_prob=False)
    probs = logits.softmax(-1)
    assert experts.tolist() == [[1, 2]] and torch.allclose(weights, probs[:, [1, 2]])
    weights, experts = route(logits, 2, norm_topk_prob=True)
    assert experts.tolist() == [[1, 2]] and torch.allclose(weights, probs[:, [1, 2]] / probs[:, [1, 2]].sum())


def sink_case(window: int, device: str = "cpu"):
    """q, k, v, sinks and the (dense, block) masks of a causal attention, sliding when window > 0."""
    gen = torch.Generator().manual_seed(1)
    b, n, kv, s, d = 2, 4, 2, 16, 16  # head size 16: the least FlexAttention's GPU kernels take
    q, k, v = (torch.randn(b, heads, s, d, generator=gen).to(device) for heads in (n, kv, kv))
    sinks = torch.randn(n, generator=gen).to(device)

    def visible(b, h, qi, ki):
        return (ki <= qi) & ((qi - ki < window) if window else True)

    dense = visible(0, 0, torch.arange(s, device=device)[:, None], torch.arange(s, device=device)[None, :])
    return (q, k, v, sinks), dense, create_block_mask(visible, None, None, s, s, device=device)


@pytest.mark.parametrize("window", [0, 3])
# eager FlexAttention on purpose (the CPU has no compiled backward to test); its lse keyword's rename to return_aux
# changes the GPU path, so it waits for a GPU session
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile", "ignore:return_lse is deprecated")
def test_sinks_through_flex_attention_equal_the_dense_softmax(window):
    """Forward only: FlexAttention has no backward on CPU (tests/gpu/test_moe_gpu.py checks the gradients)."""
    (q, k, v, sinks), dense, block = sink_case(window)
    with torch.no_grad():
        flex = attention_with_sinks(q, k, v, block, sinks, flex=flex_attention)
        plain = attention_with_sinks(q, k, v, dense, sinks)
        torch.testing.assert_close(flex, plain, rtol=1e-5, atol=1e-5)
        without = attention_with_sinks(q, k, v, dense, torch.full_like(sinks, -torch.inf))
        torch.testing.assert_close(without, torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, enable_gqa=True), rtol=1e-5, atol=1e-5)  # a sink at -inf takes no weight


@pytest.mark.slow
def test_a_compiled_mixture_of_experts_trains_like_the_eager_one():
    """torch.compile of a MoE layer (its per-expert loop breaks the graph where the routing is read) gives the eager
    losses: it once failed in every system on CPU (torch._grouped_mm's trace takes bf16 only)."""
    from megatrain.bench.case import run_case
    from megatrain.config import CaseConfig

    runs = [run_case(CaseConfig(system="megatrain", model="tiny-gpt-oss", batch=2, seq=32, steps=2, compile=compile_))
            for compile_ in (False, True)]
    assert [r["status"] for r in runs] == ["ok", "ok"], [r["error"] for r in runs]
    torch.testing.assert_close(torch.tensor(runs[1]["losses"]), torch.tensor(runs[0]["losses"]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-weights", "fp32-weights-under-autocast"])
def test_router_logits_are_fp32_whatever_the_compute_dtype(autocast):
    """Megatron's moe_router_dtype=fp32 in every system: the engine's bf16 weights and native's autocast both route
    from fp32 logits of the same (bf16) inputs, where a bf16 GEMM would round them; the layer's output keeps the
    input's dtype."""
    from megatrain.models import model_shape
    from megatrain.models.handwritten.moe import MoE
    from megatrain.models.init import init_module

    moe = MoE(model_shape("tiny-moe"))
    init_module(moe, 0, "mlp.")
    if not autocast:
        moe.to(torch.bfloat16)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w = moe.router.weight
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = moe.router(x.flatten(0, 1))
        y = moe(x)
    assert logits.dtype == torch.float32 and y.dtype == torch.bfloat16
    torch.testing.assert_close(logits, x.flatten(0, 1).float() @ w.float().t(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(logits, (x.flatten(0, 1) @ w.to(torch.bfloat16).t()).float())  # a bf16 GEMM rounds them


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_routing_to_given_experts_is_the_top_k_routing_with_its_gradient(norm_topk_prob):
    """route with a forward's experts (the engine's recompute replaying them) weighs them as the top-k would, with
    the same gradient into the logits; given other experts, it sends the tokens there."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, generator=gen, requires_grad=True)
    dw = torch.randn(6, 2, generator=gen)
    weights, experts = route(logits, 2, norm_topk_prob)
    (grad,) = torch.autograd.grad((weights * dw).sum(), logits)
    replayed, same = route(logits, 2, norm_topk_prob, experts)
    (replayed_grad,) = torch.autograd.grad((replayed * dw).sum(), logits)
    assert torch.equal(same, experts) and torch.equal(replayed, weights) and torch.equal(replayed_grad, grad)
    other = (experts + 1) % 5
    _, sent = route(logits, 2, norm_topk_prob, other)
    assert torch.equal(sent, other)
