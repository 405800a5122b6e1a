"""megatrain.models.generic.experts: transformers' experts blocks under autocast multiply in its dtype (native's
mixed precision, as the other systems' bf16 weights do), their gradient into the fp32 weights. CPU, seconds."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

from megatrain.models import build_model  # noqa: E402
from megatrain.models.generic.experts import autocast_experts, is_experts_block  # noqa: E402
from megatrain.models.registry import model_shape  # noqa: E402


def _experts_and_inputs():
    torch.manual_seed(0)
    model = build_model(model_shape("tiny-hf-gemma4-26b-a4b"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    blocks = [m for m in model.modules() if is_experts_block(m)]
    experts = blocks[0]
    tokens, k = 6, 2
    hidden = torch.randn(tokens, experts.gate_up_proj.shape[-1])
    index = torch.randint(0, experts.num_experts, (tokens, k))
    weights = torch.rand(tokens, k)
    return model, blocks, experts, (hidden, index, weights)


def test_under_autocast_the_experts_multiply_in_its_dtype_and_train_their_fp32_weights():
    model, blocks, experts, inputs = _experts_and_inputs()
    cast = copy.deepcopy(experts).to(torch.bfloat16)  # what the other systems' bf16 weights compute
    plain = copy.deepcopy(experts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = experts(*inputs)
        expected = cast(*inputs)
    assert autocast_experts(model, "cpu") == len(blocks) >= 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        after = experts(*inputs)
    torch.testing.assert_close(after.float(), expected.float(), rtol=0, atol=0)
    assert not torch.equal(before.float(), after.float()), "without the cast the fp32 weights multiplied in fp32"
    after.float().sum().backward()
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.grad is not None
    assert experts.gate_up_proj.grad.dtype == torch.float32 and experts.gate_up_proj.grad.abs().sum() > 0
    # autocast off: the block as it was, its own dtype
    torch.testing.assert_close(experts(*inputs), plain(*inputs), rtol=0, atol=0)
    names = {n for n, _ in model.named_parameters()}
    assert not any("_unbound" in n or n.count("experts.experts") for n in names), "no parameter renamed or added"
