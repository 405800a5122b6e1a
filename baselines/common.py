"""What the baselines share: the micro-batches of a step and the held-out loss over them (all three), and for the
module-owning ones (native, FSDP2) one optimizer step with gradient accumulation and per-layer compilation
(DeepSpeed steps and compiles its own way, megatrain.engine has its templates)."""

from __future__ import annotations

import contextlib
import math

import torch

from baselines.dist import rows_of_rank, summed_loss
from megatrain.config import CaseConfig
from megatrain.engine.distributed import Ranks
from megatrain.models.loss import valid_tokens


def micro_batches(case: CaseConfig, device: torch.device, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                  segments_BS: torch.Tensor | None = None):
    """(inputs, labels, segments or None) of each micro-batch of a step, on `device`."""
    mb = case.micro_batch
    for start in range(0, inputs_BS.shape[0], mb):
        seg = None if segments_BS is None else segments_BS[start:start + mb].to(device, non_blocking=True)
        yield (inputs_BS[start:start + mb].to(device, non_blocking=True),
               labels_BS[start:start + mb].to(device, non_blocking=True), seg)


def aux_weight(micro_BS: torch.Tensor, step_BS: torch.Tensor) -> float:
    """A micro-batch's share of the step's load-balancing loss (models.Transformer): its share of the sequences."""
    return micro_BS.shape[0] / step_BS.shape[0]


def accumulate_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, case: CaseConfig,
                        device: torch.device, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                        autocast=contextlib.nullcontext, segments_BS: torch.Tensor | None = None,
                        ranks: Ranks | None = None, accumulating=contextlib.nullcontext) -> tuple[float, bool, float]:
    """One optimizer step of a module-owning system over the global batch (under torchrun, this rank's rows of it):
    micro-batches accumulate gradients of the summed token loss over the step's valid tokens, then global-norm
    clipping and AdamW. A non-finite global norm skips the update (weights and AdamW state untouched, as AMP's
    overflow skip). accumulating: the context of every micro-batch but the last (DDP's no_sync: the ranks sum the
    gradients once, in the last backward). Returns (the mean loss, whether the update was applied, the global
    gradient norm before clipping)."""
    batch_BS = inputs_BS  # the load-balancing loss weighs a micro-batch by its share of the global batch
    normalizer, inputs_BS, labels_BS, segments_BS = rows_of_rank(ranks, inputs_BS, labels_BS, segments_BS)
    total = torch.zeros((), device=device)
    last = (inputs_BS.shape[0] - 1) // case.micro_batch
    for m, (x, y, seg) in enumerate(micro_batches(case, device, inputs_BS, labels_BS, segments_BS)):
        with accumulating() if m < last else contextlib.nullcontext():
            with autocast():
                loss = model(x, y, normalizer, seg, aux_weight(x, batch_BS))
            loss.backward()
        total += loss.detach().float()
    # with clipping off, max_norm=inf only measures the norm (the coefficient clamps to exactly 1)
    max_norm = case.optim.max_grad_norm if case.optim.max_grad_norm > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    stepped = bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return summed_loss(ranks, total), stepped, float(norm)


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer in place (per block, as torchtitan does): the same Inductor graphs of a layer's
    forward and recompute+backward that the engine's compiled template runs. Whole-model compile is not what any
    system here does."""
    for layer in model.layers:
        layer.compile(dynamic=False)


COMPILED_LAYERS = "torch.compile(dynamic=False) of each decoder layer"


@torch.no_grad()
def evaluate_micro_batches(model: torch.nn.Module, case: CaseConfig, device: torch.device, inputs_BS: torch.Tensor,
                           labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None,
                           autocast=contextlib.nullcontext) -> float:
    """The summed token loss over the batch's valid tokens, micro-batch by micro-batch, without gradients (`model`:
    a module, or DeepSpeed's engine around one); the cross-entropy alone, without a router's load-balancing loss."""
    normalizer, total = valid_tokens(labels_BS), 0.0
    for x, y, seg in micro_batches(case, device, inputs_BS, labels_BS, segments_BS):
        with autocast():
            total += float(model(x, y, normalizer, seg, 0.0))
    return total
