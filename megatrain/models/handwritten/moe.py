"""Mixture-of-experts MLP (Qwen3-MoE, GPT-OSS): a top-k router and experts computed over tokens sorted by expert.

Shape legend: T tokens, H hidden, E experts, K experts per token, I expert inner width.

One module for every system. The experts are two stacked tensors ([E, 2I, H] gate-then-up rows, [E, H, I]), so
one expert's weights are one contiguous slice; the tokens routed to each expert are gathered in expert order and
multiplied as one grouped GEMM (torch._grouped_mm, bf16 on Hopper) where it runs, else expert by expert over the
routed ones only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.handwritten.config import ModelConfig


def route(logits_TE: torch.Tensor, k: int, norm_topk_prob: bool,
          experts_TK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, K] in the logits' dtype, experts [T, K]): the top-k of the softmax over all experts, or, with
    norm_topk_prob, the softmax over the top-k logits (the same weights renormalised, as GPT-OSS computes them).

    experts_TK given: those experts, not the top-k of these logits; their weights from these logits as the top-k's
    would be (gather's gradient is topk's: into the chosen logits). The engine's recompute replays its forward's
    routing so: compiled, its forward and its recompute are two Inductor graphs whose roundings of the router's input
    differ, and a rounding that reorders close logits sends a token to another expert (GPT-OSS-20B's layer: 24 of 4096
    tokens on an H200, results/gpu_checks/recompute-3a9538f-h200.jsonl); the gradient would be another routing's
    than the loss's."""
    scores_TE = logits_TE if norm_topk_prob else F.softmax(logits_TE, dim=-1, dtype=torch.float32)
    if experts_TK is None:
        top_TK, experts_TK = torch.topk(scores_TE, k, dim=-1)
    else:
        top_TK = scores_TE.gather(-1, experts_TK)
    weights_TK = F.softmax(top_TK, dim=-1, dtype=torch.float32) if norm_topk_prob else top_TK
    return weights_TK.to(logits_TE.dtype), experts_TK


def _activation(gate_up_TI2: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    gate, up = gate_up_TI2.chunk(2, dim=-1)
    if not limit:
        return F.silu(gate) * up
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)  # GPT-OSS's clamped SwiGLU
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def grouped_mm_runs(x: torch.Tensor, *inner_sizes: int) -> bool:
    """Whether torch._grouped_mm computes these experts: on CUDA in bf16 from compute capability 9.0 (its kernels),
    every row stride a multiple of 16 bytes. Not on CPU: eager it runs, but torch.compile's trace of it takes bf16
    only (the per-expert loop computes the same)."""
    if not hasattr(torch, "_grouped_mm") or any(n * x.element_size() % 16 for n in inner_sizes):
        return False
    return x.device.type == "cuda" and x.dtype == torch.bfloat16 and \
        torch.cuda.get_device_capability(x.device) >= (9, 0)


def experts_forward(x_TH: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                    gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor, gate_up_bias_E2I: torch.Tensor | None = None,
                    down_bias_EH: torch.Tensor | None = None, limit: float = 0.0, alpha: float = 0.0,
                    grouped: bool | None = None) -> torch.Tensor:
    """Sum over each token's K experts of weight x expert(token); `grouped` None picks torch._grouped_mm where it
    runs (grouped_mm_runs)."""
    t, k = experts_TK.shape
    num_experts = gate_up_E2IH.shape[0]
    out_dtype = x_TH.dtype
    if torch.is_autocast_enabled(x_TH.device.type):
        # autocast casts F.linear's operands, not torch._grouped_mm's: cast them as it would, so an fp32 model under
        # bf16 autocast (native's mixed precision) takes the grouped kernels the bf16 systems take
        dtype = torch.get_autocast_dtype(x_TH.device.type)
        x_TH, gate_up_E2IH, down_EHI = x_TH.to(dtype), gate_up_E2IH.to(dtype), down_EHI.to(dtype)
        gate_up_bias_E2I, down_bias_EH = (None if b is None else b.to(dtype) for b in (gate_up_bias_E2I, down_bias_EH))
    flat_experts = experts_TK.flatten()
    order = flat_experts.argsort(stable=True)  # the (token, slot) pairs in expert order
    token_of = order // k
    x_sorted = x_TH[token_of]
    # tokens per expert, a fixed-size result (bincount's size depends on the data, which a compiled graph cannot take)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x_TH.device).index_add_(
        0, flat_experts, torch.ones_like(flat_experts))
    if grouped is None:
        grouped = grouped_mm_runs(x_TH, x_TH.shape[1], gate_up_E2IH.shape[1], down_EHI.shape[2])
    if grouped:
        ends = counts.cumsum(0).to(torch.int32)
        expert_of = flat_experts[order]  # each sorted row's expert, for the biases
        h = torch._grouped_mm(x_sorted, gate_up_E2IH.transpose(1, 2), offs=ends)
        if gate_up_bias_E2I is not None:
            h = h + gate_up_bias_E2I[expert_of]
        y = torch._grouped_mm(_activation(h, limit, alpha), down_EHI.transpose(1, 2), offs=ends)
        if down_bias_EH is not None:
            y = y + down_bias_EH[expert_of]
    else:
        y = _per_expert(x_sorted, counts, gate_up_E2IH, down_EHI, gate_up_bias_E2I, down_bias_EH, limit, alpha)
    y = y * weights_TK.flatten()[order, None]
    return torch.zeros_like(x_TH, dtype=out_dtype).index_add_(0, token_of, y.to(out_dtype))


@torch._disable_dynamo
def _per_expert(x_sorted: torch.Tensor, counts: torch.Tensor, gate_up_E2IH: torch.Tensor, down_EHI: torch.Tensor,
                gate_up_bias_E2I: torch.Tensor | None, down_bias_EH: torch.Tensor | None, limit: float,
                alpha: float) -> torch.Tensor:
    """The experts one by one over their rows (sorted by expert, counts[e] each), where the grouped GEMM does not run.
    Eager under torch.compile: the row counts are data, so a trace breaks at them and its pieces recompiled for every
    grad mode and count until dynamo's recompile limit made them eager anyway (a tiny GPT-OSS on CPU: 99 kernels).
    torch._disable_dynamo (torch.optim's) is torch.compiler.disable taking effect at the first call: the public one
    imports torch._dynamo where it decorates, ~1.3 s of every process that imports the models and compiles nothing."""
    parts = []
    for e, rows in enumerate(x_sorted.split(counts.tolist())):
        if not rows.shape[0]:
            continue  # an expert no token chose: no compute, no gradient beyond its zeros
        h = F.linear(rows, gate_up_E2IH[e], None if gate_up_bias_E2I is None else gate_up_bias_E2I[e])
        parts.append(F.linear(_activation(h, limit, alpha), down_EHI[e],
                              None if down_bias_EH is None else down_bias_EH[e]))
    return torch.cat(parts)


class Router(nn.Module):
    """The router's logits [T, E], in fp32 whatever the compute dtype or autocast (Megatron's moe_router_dtype=fp32):
    bf16 logits round close routing scores together, and a rounding that flips the top-k sends a token to another
    expert; fp32 routing weights then scale the experts' outputs (experts_forward sums them in fp32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.moe_bias else None

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x_TH.device.type, enabled=False):
            return F.linear(x_TH.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if cfg.moe_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, h)) if cfg.moe_bias else None


class MoE(nn.Module):
    """The layer's MLP: route each token to num_experts_per_tok experts, sum their outputs by the routing weights.

    With `router_stats`, forward also returns what the load-balancing loss needs of this layer: the tokens routed to
    each expert [E] (float, no gradient) and the sum over tokens of each expert's router probability [E] (fp32,
    differentiable); asked for its routing, last the experts each token went to [T, K] (the engine's recompute
    replays them: route)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha
        self.router_stats = cfg.router_stats

    def forward(self, x_BSH: torch.Tensor, experts_TK: torch.Tensor | None = None, routing: bool = False):
        """The MLP's output (with router_stats, and the routing counts: the class's doc); experts_TK: route the tokens
        to these experts instead of the router's top-k (route: a replayed forward's); routing: also return the
        experts each token went to [T, K], last."""
        x_TH = x_BSH.flatten(0, 1)
        logits_TE = self.router(x_TH)
        weights_TK, experts_TK = route(logits_TE, self.k, self.norm_topk_prob, experts_TK)
        ex = self.experts
        y_BSH = experts_forward(x_TH, weights_TK, experts_TK, ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_bias,
                                ex.down_proj_bias, self.limit, self.alpha).view_as(x_BSH)
        out = (y_BSH,)
        if self.router_stats:
            num_experts = logits_TE.shape[1]
            routed_E = torch.zeros(num_experts, device=x_TH.device).index_add_(
                0, experts_TK.flatten(), torch.ones(experts_TK.numel(), device=x_TH.device))
            out += (routed_E, F.softmax(logits_TE, dim=-1, dtype=torch.float32).sum(0))
        if routing:
            out += (experts_TK,)
        return out if len(out) > 1 else y_BSH


def load_balancing_loss(routed_E: torch.Tensor, probsum_E: torch.Tensor, rows: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func (Switch Transformer's): E x sum_e (routed share of e) x (mean router
    probability of e), from the routed tokens and probability sums of every layer added up, over `rows` (layers x
    tokens)."""
    return routed_E.shape[0] * torch.dot(routed_E / rows, probsum_E / rows)


def load_balancing_grad(routed_E: torch.Tensor, rows: int, weight: float) -> torch.Tensor:
    """d(weight x load_balancing_loss) / d(one layer's probability sums) [E]: the same for every layer, since the
    routed shares carry no gradient. Known once every layer's forward has run, so a layer recomputed in backward adds
    its router's share of the loss gradient without the other layers."""
    return weight * routed_E.shape[0] * routed_E / rows**2
