"""Llama/Qwen2/Qwen3/Mistral-style decoder, and Qwen3-MoE/GPT-OSS (handwritten.moe), as plain nn.Modules: the model
every system trains for the hand-written families (handwritten.families).

Shape legend: B batch, S sequence, H hidden, N query heads, K kv heads, D head dim, V vocab, T tokens.
The model knows nothing about offloading; each system applies its memory policy to it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from megatrain.models.handwritten.config import ModelConfig
from megatrain.models.handwritten.moe import MoE, load_balancing_loss
from megatrain.models.loss import IGNORE_INDEX, linear_cross_entropy
from megatrain.models.masks import Mask, rope_and_masks
from megatrain.models.rope import apply_rotary, rotary_tables


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as the Hugging Face Qwen2/Llama code does."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x32 = x_BSH.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x_BSH.dtype)


@functools.cache
def compiled_flex_attention():
    """FlexAttention runs as fused kernels only compiled (eager, it materialises the scores)."""
    return torch.compile(flex_attention, dynamic=False)


# Its own graph also inside a compiled layer (Dynamo breaks the layer's graph around the call; torch._dynamo loads at
# the first call, not at import): every system, eager or compiled, runs the one standalone flex kernel on q, k and v
# of fixed strides. Lowered inside a layer's graph, torch 2.11's Inductor (its flex templates not yet frozen to their
# input layouts, `always_freeze_layout`) can build the kernel on strides of a q or k layout it re-decides later: the
# engine's no-grad forward on packed rows sat 4e-5 from native at step 1 on an H200, the size of keys read wrongly.
@torch._disable_dynamo(recursive=False)
def standalone_flex_attention(*args, **kwargs):
    """compiled_flex_attention()(*args, **kwargs), outside any enclosing compiled graph."""
    return compiled_flex_attention()(*args, **kwargs)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # Qwen3: each head's queries and keys normalised over the head dimension, before RoPE
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
                mask_B1SS: Mask = None) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        q = self.q_proj(x_BSH).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x_BSH).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x_BSH).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos_SD, sin_SD), apply_rotary(k, cos_SD, sin_SD)
        gqa = self.num_kv_heads != self.num_heads
        if self.sinks is not None:
            o = attention_with_sinks(q, k, v, mask_B1SS, self.sinks)
        elif isinstance(mask_B1SS, BlockMask):
            o = standalone_flex_attention(q, k, v, block_mask=mask_B1SS, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1SS, is_causal=mask_B1SS is None,
                                               enable_gqa=gqa)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


def attention_with_sinks(q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask_B1SS: Mask,
                         sinks_N: torch.Tensor, flex=None) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, sinks_N, with no value (GPT-OSS): the output without it
    times exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), lse each query's log-sum-exp of its scores.

    A block mask runs FlexAttention (compiled unless `flex` is given), which returns the lse; a dense mask (or None:
    causal) computes the scores, as transformers' eager GPT-OSS does."""
    gqa = k_BKSD.shape[1] != q_BNSD.shape[1]
    if isinstance(mask_B1SS, BlockMask):
        o, lse_BNS = (flex or standalone_flex_attention)(q_BNSD, k_BKSD, v_BKSD, block_mask=mask_B1SS,
                                                          enable_gqa=gqa, return_lse=True)
        scale_BNS = torch.sigmoid(lse_BNS.float() - sinks_N.float()[:, None])
        return (o * scale_BNS[..., None].to(o.dtype)).to(q_BNSD.dtype)
    groups = q_BNSD.shape[1] // k_BKSD.shape[1]
    k, v = k_BKSD.repeat_interleave(groups, dim=1), v_BKSD.repeat_interleave(groups, dim=1)
    scores = (q_BNSD @ k.transpose(-2, -1)) * q_BNSD.shape[-1] ** -0.5
    s = scores.shape[-1]
    if mask_B1SS is None:
        mask_B1SS = torch.ones(s, s, dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask_B1SS, float("-inf"))
    sink = sinks_N.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1, dtype=torch.float32)[..., :-1]
    return probs.to(v.dtype) @ v


def _swiglu(x_BSH, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None):
    return F.linear(F.silu(F.linear(x_BSH, w_gate, b_gate)) * F.linear(x_BSH, w_up, b_up), w_down, b_down)


class MLP(nn.Module):
    """SwiGLU. With chunk_tokens > 0 the sequence is processed in chunks, each recomputed in backward,
    so the [tokens, I] intermediates exist for one chunk at a time (long contexts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.chunk_tokens = 0

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        projections = (self.gate_proj, self.up_proj, self.down_proj)
        weights = tuple(p.weight for p in projections)
        if projections[0].bias is not None:
            weights += tuple(p.bias for p in projections)
        b, s, _ = x_BSH.shape
        if not self.chunk_tokens or b * s <= self.chunk_tokens:
            return _swiglu(x_BSH, *weights)
        # weights are explicit checkpoint inputs: a stateless template's bound views are gone by backward
        chunk_seq = max(1, self.chunk_tokens // b)
        return torch.cat([torch.utils.checkpoint.checkpoint(_swiglu, c, *weights, use_reentrant=False)
                          for c in x_BSH.split(chunk_seq, dim=1)], dim=1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe else MLP(cfg)

    def forward(self, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor, mask_B1SS: Mask = None,
                experts_TK: torch.Tensor | None = None, routing: bool = False):
        """The layer's output; with the config's load-balancing loss, (output, routed tokens [E], router probability
        sums [E]) (handwritten.moe.MoE). A mixture of experts' routing: experts_TK replays a forward's (its tokens sent
        to those experts), `routing` returns the experts each token went to [T, K] last (the engine's recompute
        replays its forward's)."""
        h = x_BSH + self.self_attn(self.input_layernorm(x_BSH), cos_SD, sin_SD, mask_B1SS)
        normed = self.post_attention_layernorm(h)
        mlp = self.mlp(normed, experts_TK, routing) if isinstance(self.mlp, MoE) else self.mlp(normed)
        if isinstance(mlp, tuple):
            return h + mlp[0], *mlp[1:]
        return h + mlp


class Transformer(nn.Module):
    """Embedding, decoder layers, final norm, LM head (tied to the embedding or not).

    forward(tokens) returns logits [B, S, V]; forward(tokens, labels, normalizer) returns the summed
    token cross-entropy divided by `normalizer` (the valid-token count of the whole step, so
    micro-batches add up to the full-batch mean), without materialising the full logits; plus, when the config asks
    for it, router_aux_loss_coef x aux_weight x the load-balancing loss of these tokens (aux_weight: this
    micro-batch's share of the step's sequences, so the step's loss has the micro-batches' mean).
    """

    def __init__(self, cfg: ModelConfig, activation_checkpointing: bool = False, mlp_chunk_tokens: int = 0):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        for layer in self.layers:
            if isinstance(layer.mlp, MLP):
                layer.mlp.chunk_tokens = mlp_chunk_tokens
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor | None = None,
                normalizer: float | None = None, segments_BS: torch.Tensor | None = None,
                aux_weight: float = 1.0) -> torch.Tensor:
        h = self.embed_tokens(tokens_BS)
        cfg = self.cfg
        cos, sin, masks = rope_and_masks(*rotary_tables(cfg, tokens_BS.shape[1], h.device, h.dtype), segments_BS,
                                         h.device, cfg.sliding_window, cfg.layer_types)
        stats = []
        for n, layer in enumerate(self.layers):
            mask = masks[cfg.layer_type(n)]
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, mask, use_reentrant=False)
            else:
                h = layer(h, cos, sin, mask)
            if cfg.router_stats:
                h, *layer_stats = h
                stats.append(layer_stats)
        h = self.norm(h)
        if labels_BS is None:
            return F.linear(h, self.head_weight())
        if normalizer is None:
            normalizer = max(int((labels_BS != IGNORE_INDEX).sum()), 1)
        loss = linear_cross_entropy(h.flatten(0, 1), self.head_weight(), labels_BS.flatten(), normalizer)
        if cfg.router_stats and aux_weight:
            routed, probsum = (sum(t) for t in zip(*stats, strict=True))
            aux = load_balancing_loss(routed, probsum, len(stats) * tokens_BS.numel())
            loss = loss + cfg.router_aux_loss_coef * aux_weight * aux
        return loss


