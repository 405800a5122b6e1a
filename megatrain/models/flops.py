"""FLOP accounting, in one place for every system, table and report.

- `model_flops`: 6 * num_params * tokens, the convention of the paper and its peers (the
  headline 'TFLOPS' of every record), N the parameters a token uses (ModelConfig.active_params: a mixture of
  experts counts the experts each token is routed to, not all of them; records put the all-experts figure beside).
  It counts the input embedding, which does no matmul when untied (a lookup), and the norms and biases; the figure
  beside it ('tflops_no_embed') counts
  6 * ModelConfig.matmul_params * tokens: the layers' matrices and the LM head.
- `hardware_flops`: what the GPU actually executes: matmuls of the layers and the LM head (2 FLOPs
  per multiply-add), causal attention scores and weighted sums, backward at twice the forward, and
  one extra forward of every decoder layer when activations are recomputed, and any further layer forwards
  (megatrain's recomputed inputs: `extra_layer_forwards`).
- `paper_flops`: the paper's long-context convention, 6 * num_params * tokens + 12 * L * H * seq * tokens: the
  model FLOPs plus attention's QK^T and PV as full (not causal) squares, forward and backward, no recompute (the
  Megatron-LM accounting). Found from the paper's 512k point: 7B (Qwen2.5-7B: N 7.62e9, L 28, H 3584), one sequence
  of 524288 tokens, 871 s per step, 407.4 TFLOPS; this formula gives 407.5, 6NT alone 27.5. Its other context
  lengths state no step time, so the convention is assumed for all of them.
- `mfu`: hardware FLOP rate over a measured dense bf16 GEMM peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: a config counts its layers' pairs itself (megatrain.models.masks.attended_pairs)
    from megatrain.models.shape import ModelShape


def model_flops(num_params: int, tokens: int) -> float:
    return 6.0 * num_params * tokens


def attention_flops_per_seq(cfg: ModelShape, seq: int) -> float:
    """Forward attention FLOPs of one sequence over all layers: QK^T and PV over the pairs each layer attends
    (cfg.attended_pairs: a generic model's linear-attention layers count none), at each layer's head width (Gemma 4's
    full layers: 512 beside the sliding layers' 256)."""
    return sum(2 * 2.0 * cfg.attended_pairs(n, seq) * cfg.num_heads * cfg.layer_head_dim(n)
               for n in range(cfg.num_layers))


def hardware_flops(cfg: ModelShape, batch: int, seq: int, recompute: bool = True, extra_layer_forwards: int = 0
                   ) -> float:
    tokens = batch * seq
    layer_fwd = 2.0 * cfg.num_layers * cfg.layer_matmul_params() * tokens + batch * attention_flops_per_seq(cfg, seq)
    head_fwd = 2.0 * cfg.head_matmul_params() * tokens
    passes = 4 if recompute else 3  # forward, (recompute), backward = 2 forwards
    return (passes + extra_layer_forwards / cfg.num_layers) * layer_fwd + 3 * head_fwd


def paper_flops(cfg: ModelShape, batch: int, seq: int) -> float:
    tokens = batch * seq
    return model_flops(cfg.num_params(), tokens) + 12.0 * cfg.num_layers * cfg.hidden_size * seq * tokens


def mfu(hardware_flops_per_s: float, peak_flops_per_s: float | None) -> float | None:
    return None if not peak_flops_per_s else hardware_flops_per_s / peak_flops_per_s
