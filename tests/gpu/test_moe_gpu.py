"""The mixture-of-experts kernels the CPU cannot run: gradients through FlexAttention's log-sum-exp (attention sinks,
compiled as the engine runs it) against the dense softmax, torch._grouped_mm in bf16 against the per-expert loop, and
experts that follow an odd-sized tensor in their layer tile through it (it needs 16-byte aligned operands, which the
CPU's does not check). Needs CUDA (grouped GEMM: compute capability 9.0); seconds:
    MEGATRAIN_GPU_CHECKS=results/gpu_checks/records.jsonl pytest tests/gpu/test_moe_gpu.py -m gpu
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_moe import _experts, sink_case  # noqa: E402

from megatrain.checks.walk import causal_lm_types, curve_family  # noqa: E402
from megatrain.models.handwritten.moe import experts_forward, grouped_mm_runs  # noqa: E402
from megatrain.models.handwritten.transformer import attention_with_sinks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("window", [0, 3])
def test_sinks_gradients_through_compiled_flex_attention_equal_the_dense_softmax(window, check, no_tf32):
    inputs, dense, block = sink_case(window, device="cuda")
    results = []
    for mask in (dense, block):
        leaves = [t.clone().requires_grad_() for t in inputs]
        o = attention_with_sinks(*leaves[:3], mask, leaves[3])
        o.backward(torch.linspace(-1, 1, o.numel(), device="cuda").view_as(o))
        results.append([o.detach(), *[leaf.grad for leaf in leaves]])
    diffs = [float((a - b).abs().max()) for a, b in zip(*results, strict=True)]
    check.update(window=window, max_abs_diff_out_q_k_v_sinks=diffs)
    assert max(diffs) < 1e-4, diffs


def test_grouped_gemm_in_bf16_equals_the_per_expert_loop(check):
    x, weights, experts, tensors, limit = _experts(bias=True, limit=0.5)
    to = [t.cuda().bfloat16() for t in (x, weights, *tensors)]
    experts = experts.cuda()
    assert grouped_mm_runs(to[0], 16, 16, 8) == (torch.cuda.get_device_capability() >= (9, 0))
    outs = []
    for grouped in (True, False):
        leaves = [t.clone().requires_grad_() for t in to]
        y = experts_forward(leaves[0], leaves[1], experts, *leaves[2:], limit=limit, alpha=1.702, grouped=grouped)
        y.float().sum().backward()
        outs.append([y.detach().float(), *[leaf.grad.float() for leaf in leaves]])
    diffs = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for a, b in zip(*outs, strict=True)]
    check.update(relative_diff_out_and_grads=diffs)
    assert max(diffs) < 2e-2, diffs  # bf16: both round each product sum once, in different orders


def test_experts_behind_an_odd_sized_tensor_in_their_tile_train_through_grouped_gemm(check):
    """Kimi-Linear's layer tile holds a 4-element A_log before its experts: packed back to back, they sat 8 bytes off
    16-byte alignment and torch._grouped_mm refused them (the walk's GPU column at 6a6515e). Each tensor of a tile now
    starts aligned (megatrain.engine.layout.SLOT_ALIGN): its bf16 curve through the engine tracks transformers' own."""
    curve = curve_family("kimi_linear", causal_lm_types()["kimi_linear"], "cuda")
    check.update({k: v for k, v in curve.items() if k not in ("model_type", "causal_lm")})
    assert curve["status"] == "tracks", curve["detail"]
