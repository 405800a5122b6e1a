"""The engine's own settings: what it needs to stream one training run, and its typed options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatrain.models.shape import ModelShape
from megatrain.options import CommonOptions
from megatrain.run_config import RunConfig


@dataclass(frozen=True)
class MegaTrainOptions(CommonOptions):
    # saved layer inputs in pinned host memory (long contexts): all (true), none (false), the first K layers' (K), or
    # 'auto': as few as the GPU needs (the memory plan chooses)
    offload_activations: bool | int | Literal["auto"] = False
    # the saved inputs of layers 2..R+1 not kept at all: backward re-runs layers 1..R forward to regenerate them (their
    # weights cross PCIe a third time); 'auto': as few as let the host hold the offloaded rest (the memory plan chooses)
    recompute_inputs: int | Literal["auto"] = 0
    mlp_chunk_tokens: int = 0  # run the SwiGLU in chunks of this many tokens (0: whole micro-batch)
    optimizer_kernel: Literal["fused", "torch"] = "fused"  # host AdamW: one-pass kernel, or torch's fused AdamW
    resident_embedding: bool | Literal["auto"] = "auto"  # embedding state on the GPU ('auto': when it fits)
    resident_layers: int | Literal["auto"] = "auto"  # first K layers' state on the GPU ('auto': as many as fit)
    # 1: each update applies the previous step's gradient (bounded staleness of one step, as DeepSpeed ZeRO-Offload's
    # delayed parameter update): the host optimizer then overlaps the whole next step instead of its forward alone.
    # Not exact AdamW; +2 host B/param twice (the next step's weights, the pending gradient); every unit streams
    update_delay: int = 0
    # with update_delay=1: the first K updates exact, the rest delayed (a warm-up while the gradients change fast, as
    # ZeRO-Offload's delayed update starts after some steps and ZenFlow's full_warm_up_rounds)
    update_delay_warmup: int = 0
    # 1: the paper's ablation of double buffering: one weight slot, so each use's weights load only once the previous
    # use's compute has finished (no copy beside compute); the same arithmetic, slower
    weight_slots: Literal[1, 2] = 2
    # which compiled graph the forward runs a hand-written layer through: 'no-grad' (Inductor's inference graph; the
    # recompute in backward runs the training graph, a mixture's routing replayed from the forward), or 'training'
    # (debug: the training graph, as native's checkpointed layer does, its autograd graph dropped at once: forward and
    # recompute one graph, so the recompute routes as the forward did without a replay; more memory and time a layer)
    forward_graph: Literal["no-grad", "training"] = "no-grad"
    stream_stress: int | None = None  # debug: seed of random delays on every stream hand-off
    timeline: bool = True  # record the per-step stream timeline

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_chunk_tokens < 0:
            raise ValueError(f"option mlp_chunk_tokens must be >= 0 (0: no chunking), got {self.mlp_chunk_tokens}")
        if type(self.offload_activations) is int and self.offload_activations < 0:
            raise ValueError(f"option offload_activations must be true, false, 'auto' or a layer count >= 0, got "
                             f"{self.offload_activations}")
        if self.recompute_inputs != "auto" and self.recompute_inputs < 0:
            raise ValueError(f"option recompute_inputs must be 'auto' or an integer >= 0, got {self.recompute_inputs}")
        if self.resident_layers != "auto" and self.resident_layers < 0:
            raise ValueError(f"option resident_layers must be 'auto' or an integer >= 0, got {self.resident_layers}")
        if self.update_delay not in (0, 1):
            raise ValueError(f"option update_delay must be 0 (exact AdamW) or 1 (each update applies the previous "
                             f"step's gradient), got {self.update_delay}")
        if self.update_delay_warmup < 0 or (self.update_delay_warmup and not self.update_delay):
            raise ValueError(f"option update_delay_warmup counts the exact updates before update_delay=1 delays the "
                             f"rest: a step count >= 0 with update_delay=1, got {self.update_delay_warmup}")
        if self.update_delay and (self.resident_embedding is True or self.resident_layers not in ("auto", 0)):
            raise ValueError("option update_delay=1 streams every unit (resident units update on the GPU at once): "
                             "drop resident_embedding/resident_layers or set them to false/0")


def refuse_delay_across_ranks(options: MegaTrainOptions, several: bool) -> None:
    """update_delay=1 runs in one process: its second copies are not in the shared store of several ranks."""
    if several and options.update_delay:
        raise ValueError("option update_delay=1 runs in one process for now: launch without torchrun, or drop it")


@dataclass(frozen=True, kw_only=True)
class EngineConfig(RunConfig):
    """What the streaming engine needs to train: the settings every system shares (megatrain.run_config.RunConfig:
    one step's work, precision, device, seed, AdamW, compile), the model and the engine's options.

    Attributes:
        model: the model's shape.
        options: the engine's typed options.
        ranks: processes sharing one host copy of the state (torchrun ranks, engine/distributed.py); batch is then
            one rank's share.
    """

    model: ModelShape
    options: MegaTrainOptions = field(default_factory=MegaTrainOptions)
    ranks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse_delay_across_ranks(self.options, self.ranks > 1)

    @property
    def micro_batches(self) -> int:
        """Forward/backward passes per optimizer step."""
        return self.batch // self.micro_batch
