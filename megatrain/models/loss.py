"""Causal-LM loss over token chunks, so that the full [T, V] logits never exist.

The forward pass computes the loss and, when gradients are wanted, the gradients with respect to
the hidden states and the head matrix chunk by chunk; backward only scales them. Peak extra memory
is one [chunk, V] fp32 block instead of [T, V]; the weight gradient accumulates in fp32.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
# fp32 logits of one chunk stay under ~1 GiB: chunk_tokens * vocab * 4 bytes. Larger chunks make
# the head's weight-gradient GEMMs larger relative to the fp32 accumulation pass over [V, H].
_CHUNK_BYTES = 2**30


def valid_tokens(labels_BS: torch.Tensor) -> int:
    """The loss normaliser of a step: labels that are not IGNORE_INDEX (at least 1)."""
    return max(int((labels_BS != IGNORE_INDEX).sum()), 1)


def chunk_tokens_for(vocab_size: int) -> int:
    return max(128, _CHUNK_BYTES // (4 * vocab_size))


def _chunk_loss(h_TH, w_VH, labels_T):
    """Per-chunk logits (fp32, or fp64 for fp64 inputs), log-sum-exp and the summed loss over valid tokens."""
    logits = (h_TH @ w_VH.t()).to(torch.promote_types(h_TH.dtype, torch.float32))
    lse = torch.logsumexp(logits, dim=-1)
    valid = labels_T != IGNORE_INDEX
    safe = torch.where(valid, labels_T, 0)
    target = logits.gather(1, safe[:, None]).squeeze(1)
    return logits, lse, valid, safe, ((lse - target) * valid).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_VH, labels_T, normalizer, chunk):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        w = w_VH.to(h_TH.dtype)
        acc_dtype = torch.promote_types(h_TH.dtype, torch.float32)
        total = torch.zeros((), dtype=acc_dtype, device=h_TH.device)
        grad_h = torch.empty_like(h_TH) if need_grad else None
        grad_w = torch.zeros(w_VH.shape, dtype=acc_dtype, device=w_VH.device) if need_grad else None
        for start in range(0, h_TH.shape[0], chunk):
            h_c, y_c = h_TH[start:start + chunk], labels_T[start:start + chunk]
            logits, lse, valid, safe, loss_sum = _chunk_loss(h_c, w, y_c)
            total += loss_sum
            if need_grad:
                # d(loss)/d(logits) = (softmax - onehot) / normalizer on valid rows, 0 elsewhere
                probs = torch.exp_(logits.sub_(lse[:, None]))
                probs.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
                probs.mul_((valid.to(probs.dtype) / normalizer)[:, None])
                d = probs.to(h_TH.dtype)
                grad_h[start:start + chunk] = d @ w
                grad_w.add_(d.t() @ h_c)
        if need_grad:
            ctx.save_for_backward(grad_h, grad_w.to(w_VH.dtype))
        return total / normalizer

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None


def linear_cross_entropy(h_TH: torch.Tensor, w_VH: torch.Tensor, labels_T: torch.Tensor, normalizer: float,
                         chunk_tokens: int | None = None) -> torch.Tensor:
    """sum over valid tokens of CE(h @ w.T, labels) / normalizer, in chunks of tokens.

    Args:
        h_TH: final hidden states (after the last norm), [T, H].
        w_VH: LM head matrix, [V, H].
        labels_T: next-token ids, IGNORE_INDEX (-100) where no loss is taken.
        normalizer: divisor, usually the valid-token count of the whole optimizer step.
        chunk_tokens: tokens per chunk; default keeps one fp32 chunk of logits near 256 MiB.
    """
    chunk = chunk_tokens or chunk_tokens_for(w_VH.shape[0])
    return _LinearCrossEntropy.apply(h_TH, w_VH, labels_T, float(normalizer), chunk)
