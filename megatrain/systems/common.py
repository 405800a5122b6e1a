"""What the baselines share: the micro-batches of a step and the held-out loss over them (all of them), and for the
module-owning ones (native, FSDP2, torchao) one optimizer step with gradient accumulation and clipping, and per-layer
compilation (DeepSpeed steps and compiles its own way, megatrain.engine has its templates); DeepSpeed's CPU Adam op
loaded with a word (DeepSpeed and the paper's code)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

import torch

from megatrain.build_log import BUILD_LOG
from megatrain.config import CaseConfig
from megatrain.engine.distributed import Ranks
from megatrain.models.draws import Draws
from megatrain.models.loss import valid_tokens
from megatrain.optim.config import OptimConfig
from megatrain.systems.dist import rows_of_rank, summed_loss


def micro_batches(case: CaseConfig, device: torch.device, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                  segments_BS: torch.Tensor | None = None, draws: Draws | None = None, rank: int = 0):
    """(inputs, labels, segments or None) of each micro-batch of a step, on `device`; with `draws`, each one's place
    in the global batch (rank `rank`'s rows after the lower ranks') set as theirs before it is yielded
    (megatrain.models.draws: ranks draw as one process would)."""
    mb = case.micro_batch
    if draws is not None:
        draws.first_micro_batch = rank * (inputs_BS.shape[0] // mb)
    for start in range(0, inputs_BS.shape[0], mb):
        if draws is not None:
            draws.micro_batch = start // mb
        seg = None if segments_BS is None else segments_BS[start:start + mb].to(device, non_blocking=True)
        yield (inputs_BS[start:start + mb].to(device, non_blocking=True),
               labels_BS[start:start + mb].to(device, non_blocking=True), seg)


def aux_weight(micro_BS: torch.Tensor, step_BS: torch.Tensor) -> float:
    """A micro-batch's share of the step's load-balancing loss (models.Transformer): its share of the sequences."""
    return micro_BS.shape[0] / step_BS.shape[0]


def accumulate_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, case: CaseConfig,
                        device: torch.device, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                        autocast=contextlib.nullcontext, segments_BS: torch.Tensor | None = None,
                        ranks: Ranks | None = None, accumulating=contextlib.nullcontext,
                        before_clip: Callable[[], None] | None = None,
                        step: Callable[[torch.Tensor], None] | None = None) -> tuple[float, bool, float]:
    """One optimizer step of a module-owning system over the global batch (under torchrun, this rank's rows of it):
    micro-batches accumulate gradients of the summed token loss over the step's valid tokens, then global-norm
    clipping and AdamW. A non-finite global norm skips the update (weights and AdamW state untouched, as AMP's
    overflow skip). accumulating: the context of every micro-batch but the last (DDP's no_sync: the ranks sum the
    gradients once, in the last backward). before_clip: called once the last backward is done, before clipping scales
    the gradients in place; step: the update given the global norm (default optimizer.step()). A system whose
    optimizer read the gradients before clipping (torchao's copies them to the host as backward makes them) waits for
    those reads in before_clip and scales what it read by clip_coefficient(norm) in step. Returns (the mean loss,
    whether the update was applied, the global gradient norm before clipping)."""
    batch_BS = inputs_BS  # the load-balancing loss weighs a micro-batch by its share of the global batch
    ranks = ranks or Ranks.alone(device)  # a system that runs one process alone passes none
    normalizer, inputs_BS, labels_BS, segments_BS = rows_of_rank(ranks, inputs_BS, labels_BS, segments_BS)
    total = torch.zeros((), device=device)
    last = (inputs_BS.shape[0] - 1) // case.micro_batch
    draws = draws_of(model)
    for m, (x, y, seg) in enumerate(micro_batches(case, device, inputs_BS, labels_BS, segments_BS, draws,
                                                  ranks.rank)):
        with accumulating() if m < last else contextlib.nullcontext():
            with autocast():
                loss = model(x, y, normalizer, seg, aux_weight(x, batch_BS))
            loss.backward()
        total += loss.detach().float()
    if before_clip is not None:
        before_clip()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm(case.optim))
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
        norm = norm.full_tensor()
    stepped = bool(torch.isfinite(norm))
    if stepped:
        optimizer.step() if step is None else step(norm)
    optimizer.zero_grad(set_to_none=True)
    if draws is not None:
        draws.step += 1
    return summed_loss(ranks, total), stepped, float(norm)


def draws_of(model: torch.nn.Module, seed: int | None = None) -> Draws | None:
    """The random draws of a module (megatrain.models.draws; under DDP or DeepSpeed's engine, of the module inside),
    None when its training draws nothing; with `seed`, seeded by it (the case's seed, as the engine's)."""
    draws = getattr(getattr(model, "module", model), "draws", None)
    if draws is not None and seed is not None:
        draws.seed = seed
    return draws


def max_norm(optim: OptimConfig) -> float:
    """clip_grad_norm_'s max_norm: with clipping off (max_grad_norm 0), inf only measures the norm (the coefficient
    clamps to exactly 1)."""
    return float(optim.max_grad_norm) if optim.max_grad_norm > 0 else math.inf


def clip_coefficient(norm: torch.Tensor, optim: OptimConfig) -> torch.Tensor:
    """The factor torch.nn.utils.clip_grad_norm_ scaled every gradient by, given the global norm it returned: torch's
    own expression, min(max_norm / (norm + 1e-6), 1), evaluated on the norm's device in its dtype, so a copy of a
    gradient taken before clipping and scaled by it is the clipped gradient bit for bit. Exactly 1 with clipping off."""
    return torch.clamp(max_norm(optim) / (norm + 1e-6), max=1.0)


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer in place (per block, as torchtitan does): the same Inductor graphs of a layer's
    forward and recompute+backward that the engine's compiled template runs. Whole-model compile is not what any
    system here does."""
    from megatrain.compile_check import watch

    watch()
    # A layer's forward that writes state outside itself under activation checkpointing (transformers' Gemma 4 keeps
    # each layer type's last keys and values in a dict for layers that share them; its large checkpoints store them
    # too, though none reads them) is a side effect Dynamo will not trace inside the checkpoint: it broke the layer in
    # two graphs, in 2 of the 3 layers of Gemma-4-26B-A4B's cut. Replaying it in the recompute changes nothing (the
    # layers that read it recompute before the one that wrote it, from what the forward stored), so it is skipped
    # there, as torchtitan does when it compiles checkpointed blocks.
    import torch._dynamo

    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in model.layers:
        layer.compile(dynamic=False)


COMPILED_LAYERS = ("torch.compile(dynamic=False) of each decoder layer (forward side effects not replayed in the "
                   "checkpoint's recompute where this torch has the setting, as torchtitan compiles)")


@torch.no_grad()
def evaluate_micro_batches(model: torch.nn.Module, case: CaseConfig, device: torch.device, inputs_BS: torch.Tensor,
                           labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None,
                           autocast=contextlib.nullcontext) -> float:
    """The summed token loss over the batch's valid tokens, micro-batch by micro-batch, without gradients (`model`:
    a module, or DeepSpeed's engine around one); the cross-entropy alone, without a router's load-balancing loss."""
    normalizer, total = valid_tokens(labels_BS), 0.0
    training = model.training
    model.eval()  # no dropout or jitter in a held-out loss
    try:
        for x, y, seg in micro_batches(case, device, inputs_BS, labels_BS, segments_BS):
            with autocast():
                total += float(model(x, y, normalizer, seg, 0.0))
    finally:
        model.train(training)
    return total


def load_deepspeed_cpu_adam() -> None:
    """Load DeepSpeed's CPU Adam op (DeepSpeedCPUAdam's, ZenFlowCPUAdam's) and say so with the time it took: its first
    use on a machine compiles it (minutes of g++ on a few cores), which DeepSpeed does without a word."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    BUILD_LOG.info("megatrain build: loading DeepSpeed's CPU Adam op (its first use on a machine compiles it: minutes)")
    t0 = time.perf_counter()
    CPUAdamBuilder().load()
    BUILD_LOG.info("megatrain build: DeepSpeed's CPU Adam op loaded in %.1f s", time.perf_counter() - t0)
