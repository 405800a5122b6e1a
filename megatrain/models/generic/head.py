"""The causal-LM loss of a generic model over token chunks, each chunk's gradients computed in the forward, so that
the full [T, V] logits never exist (megatrain.models.loss does the same for the plain linear head).

A chunk's logits are whatever the model's own forward makes of its hidden states (skeleton.head_logits: the final
norm, the LM head, softcapping or scaling), so the loss of any family is transformers' own; the cross-entropy is
transformers' too (fp32 logits, summed over valid tokens, divided by the step's valid-token count).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatrain.models.loss import IGNORE_INDEX, chunk_tokens_for

# chunk_loss(params by name, hidden states [1, C, H], labels [C]) -> the chunk's summed loss over the normaliser
ChunkLoss = Callable[[dict, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits_1TV: torch.Tensor, labels_T: torch.Tensor, normalizer: float) -> torch.Tensor:
    """transformers' causal-LM cross-entropy of a chunk: fp32 logits, summed over the valid labels, over the
    normaliser."""
    return F.cross_entropy(logits_1TV[0].float(), labels_T, ignore_index=IGNORE_INDEX, reduction="sum") / normalizer


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chunk_loss: ChunkLoss, names: list[str], bound: bool, chunk: int, h_TH, labels_T, *params):
        need = ctx.needs_input_grad[4] or any(ctx.needs_input_grad[6:])
        total = torch.zeros((), dtype=torch.float32, device=h_TH.device)
        grad_h = torch.empty_like(h_TH) if need else None
        grads = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in params] if need else []
        for start in range(0, h_TH.shape[0], chunk):
            h_c, y_c = h_TH[start:start + chunk], labels_T[start:start + chunk]
            if not need:
                total += chunk_loss(dict(zip(names, params, strict=True)), h_c[None], y_c).float()
                continue
            with torch.enable_grad():
                h_leaf = h_c.detach().requires_grad_()
                leaves = [p.detach().requires_grad_() for p in params] if bound else list(params)
                loss = chunk_loss(dict(zip(names, leaves, strict=True)), h_leaf[None], y_c)
                g_h, *g_params = torch.autograd.grad(loss, [h_leaf, *leaves], allow_unused=True,
                                                     materialize_grads=True)
            total += loss.detach().float()
            grad_h[start:start + chunk] = g_h
            for acc, g in zip(grads, g_params, strict=True):
                acc.add_(g)
        if need:
            ctx.save_for_backward(grad_h, *(g.to(p.dtype) for g, p in zip(grads, params, strict=True)))
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, *grads = ctx.saved_tensors
        return (None, None, None, None, grad_h * grad_out.to(grad_h.dtype), None,
                *(g * grad_out.to(g.dtype) for g in grads))


def chunked_loss(chunk_loss: ChunkLoss, params: dict[str, torch.Tensor], h_BSH: torch.Tensor, labels_BS: torch.Tensor,
                 vocab_size: int, bound: bool = True) -> torch.Tensor:
    """The loss of hidden states h_BSH against labels_BS, chunk by chunk of tokens (half the plain head's chunk:
    autograd keeps a chunk's logits a few times over), differentiable with respect to h_BSH and `params`.

    bound: chunk_loss is given the parameters to compute with (the engine's bound views, each chunk's gradients taken
    with respect to a detached copy of the view); else they are a module's own, which its forward reads itself (a
    sharding system's hooks gather them), and chunk_loss's gradients are taken with respect to them."""
    chunk = max(1, chunk_tokens_for(vocab_size) // 2)
    return _ChunkedLoss.apply(chunk_loss, list(params), bound, chunk, h_BSH.flatten(0, 1), labels_BS.flatten(),
                              *params.values())
