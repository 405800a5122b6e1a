"""MXFP4 dequantization of GPT-OSS expert weights: hand-checked values and layout, bitwise agreement with
transformers' convert_moe_packed_tensors, input errors. CPU, about a second: pytest tests/unit/test_mxfp4.py"""

import pytest
import torch

from megatrain.models.handwritten.mxfp4 import dequantize


def _random_blocks_and_scales(experts: int, rows: int, blocks_per_row: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, blocks_per_row, 16), dtype=torch.uint8, generator=generator)
    # Realistic exponents 2**-10..2**10, plus the E8M0 extremes: 0 (2**-127) and 255 (NaN in the MX spec).
    scales = torch.randint(117, 138, (experts, rows, blocks_per_row), dtype=torch.uint8, generator=generator)
    flat_scales = scales.view(-1)
    flat_scales[::7] = 0
    flat_scales[torch.arange(flat_scales.numel() - 1, -1, -11)] = 255  # from the last, so never only zeros
    return blocks, scales


def test_one_block_by_hand():
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0, :3] = torch.tensor([0x21, 0xF7, 0x8A])  # low nibble first: 0.5, 1 | 6, -6 | -1, -0
    scales = torch.tensor([[[129]]], dtype=torch.uint8)  # 2**(129 - 127) = 4
    out = dequantize(blocks, scales)
    assert out.shape == (1, 32, 1) and out.dtype == torch.bfloat16
    expected = torch.tensor([2.0, 4.0, 24.0, -24.0, -4.0, -0.0] + [0.0] * 26, dtype=torch.bfloat16)
    assert torch.equal(out[0, :, 0], expected)
    assert torch.signbit(out[0, :, 0]).tolist() == torch.signbit(expected).tolist()


def test_layout_by_hand():
    """out[e, k, n] is element k of stored row n: each (row, block) pair has its own scale here."""
    blocks = torch.full((2, 2, 2, 16), 0x22, dtype=torch.uint8)  # every value 1.0
    blocks[1] = 0x33  # expert 1: every value 1.5
    scales = torch.tensor([[127, 128], [130, 126]], dtype=torch.uint8).expand(2, 2, 2).contiguous()
    out = dequantize(blocks, scales, dtype=torch.float32, rows_per_chunk=1)
    assert out.shape == (2, 64, 2)
    for expert, value in ((0, 1.0), (1, 1.5)):
        for row, block, factor in ((0, 0, 1.0), (0, 1, 2.0), (1, 0, 8.0), (1, 1, 0.5)):
            assert torch.all(out[expert, 32 * block : 32 * (block + 1), row] == value * factor)


def _transformers_convert():
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:
        pytest.skip("this transformers has no integrations.mxfp4.convert_moe_packed_tensors (added in 4.55)")
    return convert_moe_packed_tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("experts", "rows", "blocks_per_row", "rows_per_chunk"),
    [(1, 1, 2, 1), (3, 7, 2, 3), (2, 10, 3, 4), (4, 5, 2, 64)],
)
def test_matches_transformers_bitwise(experts, rows, blocks_per_row, rows_per_chunk, dtype):
    convert_moe_packed_tensors = _transformers_convert()
    blocks, scales = _random_blocks_and_scales(experts, rows, blocks_per_row, seed=rows)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = dequantize(blocks, scales, dtype=dtype, rows_per_chunk=rows_per_chunk)
    assert ours.shape == theirs.shape == (experts, 32 * blocks_per_row, rows)
    assert ours.dtype == theirs.dtype and ours.is_contiguous()
    assert torch.equal(ours.flatten().view(torch.uint8), theirs.flatten().view(torch.uint8))
    assert ours.isinf().any()  # the scale-255 edge was exercised


def test_input_errors():
    blocks = torch.zeros(2, 3, 4, 16, dtype=torch.uint8)
    scales = torch.zeros(2, 3, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(blocks.to(torch.int8), scales)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize(blocks, scales.int())
    with pytest.raises(ValueError, match=r"blocks must be \[experts, rows, blocks per row, 16\]"):
        dequantize(blocks[..., :15], scales)
    with pytest.raises(ValueError, match=r"blocks must be \[experts"):
        dequantize(blocks[0], scales[0])
    with pytest.raises(ValueError, match=r"scales must be blocks.shape\[:-1\]"):
        dequantize(blocks, scales[:, :, :3])
