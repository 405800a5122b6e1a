"""MXFP4 expert weights of GPT-OSS checkpoints, dequantized to a float dtype.

MXFP4 is a format of the OCP Microscaling (MX) specification: values come in blocks of 32 that share one scale.
Each value is FP4 E2M1 (sign, 2 exponent bits, 1 mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}); the block's scale
is E8M0, a bare 8-bit exponent meaning 2**(byte - 127).

GPT-OSS (openai/gpt-oss-20b and -120b) stores its MoE expert projections this way. Per layer, for
proj in (gate_up_proj, down_proj), `model.layers.{i}.mlp.experts.{proj}_blocks` is uint8 [E, N, K/32, 16] (two
values per byte, the low nibble first) and `{proj}_scales` is uint8 [E, N, K/32], where each expert's weight has
N output rows of K inputs: gate_up_proj N = 2I (rows alternate gate, up), K = H; down_proj N = H, K = I.
`dequantize` turns one pair into the [E, K, N] tensor that transformers' GptOssExperts holds (y = x @ weight[e]),
bitwise what transformers' `convert_moe_packed_tensors` returns.
"""

from __future__ import annotations

import torch

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
BYTES_PER_BLOCK = 16  # 32 FP4 values


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, rows_per_chunk: int = 8192
) -> torch.Tensor:
    """The [E, K, N] weights in `dtype` of MXFP4 `blocks` uint8 [E, N, K/32, 16] and `scales` uint8 [E, N, K/32].

    out[e, k, n] is element k of expert e's stored row n. Values are computed as transformers does (torch.ldexp of
    the FP4 value in `dtype` by scale - 127), so a scale byte of 255, which the MX specification reserves for a NaN
    block, scales by 2**128 instead: nonzero values become ±inf.

    Rows are dequantized `rows_per_chunk` at a time, never across experts, straight into the output's layout:
    beside the output, only one chunk's lookup indices and values are held.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8 (packed FP4 pairs, E8M0 exponents), got {blocks.dtype} and "
            f"{scales.dtype}: pass the checkpoint's *_blocks and *_scales tensors as stored"
        )
    if blocks.dim() != 4 or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise ValueError(
            f"MXFP4 blocks must be [experts, rows, blocks per row, {BYTES_PER_BLOCK}], got {list(blocks.shape)}"
        )
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(
            f"MXFP4 scales must be blocks.shape[:-1] = {list(blocks.shape[:-1])} (one per 32-value block), "
            f"got {list(scales.shape)}: pass the *_scales tensor of the same projection as the *_blocks one"
        )
    experts, rows, blocks_per_row, _ = blocks.shape
    values = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    # byte -> (value of its low nibble, value of its high nibble): one lookup per byte gives both, in order.
    byte_values = torch.arange(256, device=blocks.device)
    pair_values = torch.stack((values[byte_values & 0x0F], values[byte_values >> 4]), dim=-1)
    out = torch.empty(experts, blocks_per_row * 2 * BYTES_PER_BLOCK, rows, dtype=dtype, device=blocks.device)
    out_rows = out.transpose(1, 2)  # [E, N, K], the stored order
    for expert in range(experts):
        for r0 in range(0, rows, rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, rows)
            chunk_values = pair_values[blocks[expert, r0:r1].int()].view(r1 - r0, blocks_per_row, -1)
            exponents = scales[expert, r0:r1].int().sub_(E8M0_BIAS).unsqueeze(-1)
            torch.ldexp(chunk_values, exponents, out=out_rows[expert, r0:r1].view(r1 - r0, blocks_per_row, -1))
    return out
