"""Attention masks and positions of a micro-batch: causal, sliding-window, packed documents, and their combinations.

A layer attends either fully (causal) or through a sliding window (a token sees itself and the window - 1 tokens
before it, transformers' `kv > q - window`); with packed rows, also only within its own document, whose positions
restart at 0. Without packing, full attention needs no mask (SDPA's causal kernel). On a GPU every mask is a
FlexAttention BlockMask (only the 128x128 blocks that hold allowed pairs are computed, and it keeps block indices, not
[S, S]); on CPU a boolean [B or 1, 1, S, S] mask for SDPA. MEGATRAIN_DENSE_MASKS=1 takes the CPU's dense masks on the
GPU too: PyTorch's CUDA stream sanitizer cannot dispatch FlexAttention, and the engine's streams are the same.
"""

from __future__ import annotations

import functools
import os

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

Mask = torch.Tensor | BlockMask | None


def _allowed(q, kv, window: int, segments_BS=None, b=None):
    """Whether query position q may attend to key position kv (broadcasting index tensors)."""
    ok = q >= kv
    if window:
        ok = ok & (kv > q - window)
    if segments_BS is not None:
        ok = ok & (segments_BS[b, q] == segments_BS[b, kv])
    return ok


@functools.lru_cache(maxsize=8)
def _sliding_block_mask(seq: int, window: int, device: torch.device) -> BlockMask:
    """The sliding-window causal BlockMask of unpacked rows: the same every step of a run, so built once."""
    def sliding_causal(b, h, q, kv):
        return _allowed(q, kv, window)

    return create_block_mask(sliding_causal, None, None, seq, seq, device=device)


def _mask(window: int, segments_BS: torch.Tensor | None, seq: int, device: torch.device) -> Mask:
    if not window and segments_BS is None:
        return None
    if device.type == "cuda" and os.environ.get("MEGATRAIN_DENSE_MASKS") != "1":
        if segments_BS is None:
            return _sliding_block_mask(seq, window, device)

        def document_mask(b, h, q, kv):
            return _allowed(q, kv, window, segments_BS, b)

        return create_block_mask(document_mask, segments_BS.shape[0], None, seq, seq, device=device)
    index = torch.arange(seq, device=device)
    if segments_BS is None:
        return _allowed(index[:, None], index[None, :], window)[None, None]
    b = torch.arange(segments_BS.shape[0], device=device)[:, None, None]
    return _allowed(index[None, :, None], index[None, None, :], window, segments_BS, b)[:, None]


def document_positions(segments_BS: torch.Tensor) -> torch.Tensor:
    """Each token's position in its document [B, S]: 0 at every document's first token of a packed row."""
    b, s = segments_BS.shape
    index = torch.arange(s, device=segments_BS.device).expand(b, s)
    starts = torch.ones_like(segments_BS, dtype=torch.bool)
    starts[:, 1:] = segments_BS[:, 1:] != segments_BS[:, :-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values  # index of each token's document start
    return index - first


def rope_and_masks(cos_SD: torch.Tensor, sin_SD: torch.Tensor, segments_BS: torch.Tensor | None, device: torch.device,
                   sliding_window: int = 0, layer_types: tuple[str, ...] = ()):
    """(cos, sin, {layer type: mask}) of a micro-batch, for the layer types the model has (full only when none).

    Args:
        cos_SD, sin_SD: the step's rotary tables (models.rope.rotary_tables).
        segments_BS: segments_BS[b, t] the document of token t in a packed row, or None (one sequence per row).
        device: where the masks are built (a GPU gets BlockMasks).
        sliding_window: the window of sliding layers in tokens (0: the model has none).
        layer_types: the model's per-layer attention types (ModelShape.layer_types).

    With packed rows (more than one document in some row), positions restart at each document: cos and sin become
    [B, 1, S, D].
    """
    seq = cos_SD.shape[0]
    if segments_BS is not None and bool((segments_BS == segments_BS[:, :1]).all()):
        segments_BS = None
    if segments_BS is not None:
        positions = document_positions(segments_BS)
        cos_SD, sin_SD = cos_SD[positions][:, None], sin_SD[positions][:, None]
    masks = {FULL: _mask(0, segments_BS, seq, device)}
    if SLIDING in layer_types:
        # a window as long as the sequence hides nothing: the full mask is the same mask
        masks[SLIDING] = masks[FULL] if sliding_window >= seq else _mask(sliding_window, segments_BS, seq, device)
    return cos_SD, sin_SD, masks


def attended_pairs(seq: int, window: int = 0) -> float:
    """(query, key) pairs one causal sequence computes: half the square (with the diagonal, as the kernels' count
    goes), or with a sliding window the pairs within it (each query sees at most `window` keys)."""
    if not window or window >= seq:
        return seq * seq / 2
    return window * seq - window * (window - 1) / 2
