"""The reference trainer: plain PyTorch, whole model on one device. The correctness oracle. Under torchrun, data
parallel: a whole copy on every rank's device, torch DistributedDataParallel summing the gradients once per step.

Precision modes:
- mixed: fp32 parameters and AdamW state; with dtype=bfloat16 the forward/backward runs under
  bf16 autocast (the usual mixed-precision recipe).
- bf16: parameters, gradients and AdamW state all bf16 on the device (the cheapest whole-model
  setup, the on-GPU throughput ceiling); torch AdamW keeps its moments in the parameter dtype.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from megatrain.compile_check import compile_check
from megatrain.config import CaseConfig
from megatrain.models import build_model
from megatrain.models.generic.experts import autocast_experts
from megatrain.models.init import init_module
from megatrain.models.weights import copy_named_weights, named_weights
from megatrain.optim.groups import torch_adamw
from megatrain.optim.state_bytes import FP32_BYTES, checkpoint_bytes_per_param, state_bytes_per_param
from megatrain.options import CommonOptions
from megatrain.preflight import activation_bytes, estimate_plan
from megatrain.systems import SystemSpec
from megatrain.systems.common import (
    COMPILED_LAYERS,
    accumulate_and_step,
    compile_layers,
    draws_of,
    evaluate_micro_batches,
)
from megatrain.systems.dist import ranks_of

STATE_FILE = "native_state.pt"  # what save_state writes: the model, AdamW's state, the skipped steps


@dataclass(frozen=True)
class NativeOptions(CommonOptions):
    activation_checkpointing: bool = True  # every layer checkpointed, as every system
    mlp_chunk_tokens: int = 0  # as megatrain's

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_chunk_tokens < 0:
            raise ValueError(f"option mlp_chunk_tokens must be >= 0 (0: no chunking), got {self.mlp_chunk_tokens}")


def state_bytes(case: CaseConfig) -> dict[str, int]:
    """Bytes per parameter of each state tensor: mixed keeps fp32 weights, grads, Adam m and v (16 B/param); bf16 keeps
    them all in the compute dtype (8 B/param in bf16: torch AdamW keeps its moments in the parameter dtype)."""
    param_bytes = case.dtype_bytes if case.precision == "bf16" else FP32_BYTES
    return state_bytes_per_param(param_bytes, case.precision, moment_bytes=param_bytes)


def memory_bytes(case: CaseConfig, world: int = 1) -> tuple[int, int]:
    """(host bytes of a rank beyond its process overhead, device bytes of a rank): the whole model and its state on
    each rank's device (state_bytes; DDP's gradient buckets are the gradients themselves), and activations
    (megatrain.preflight.activation_bytes)."""
    return 0, case.shape().num_params() * sum(state_bytes(case).values()) + activation_bytes(case)


def checkpoint_bytes(case: CaseConfig) -> int:
    """One save_state: the parameters and both moments, in the parameter dtype."""
    return case.shape().num_params() * checkpoint_bytes_per_param(state_bytes(case))


def _no_buffer_sync() -> dict:
    """DDP's keyword that stops it syncing buffers at every forward: forward_sync_buffers from torch 2.13, which
    deprecates the broadcast_buffers that earlier versions have (the GPU hosts run 2.11: looked up, not assumed)."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}


def _summed(_, bucket):  # unannotated: DDP checks the annotations' objects, which this module's future import hides
    """DDP's all-reduce of a gradient bucket (a dist.GradBucket) without its division by the world size: the loss is
    normalised by the global batch's valid tokens already, so the ranks' gradients add up to one process's."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda done: done.value()[0])


class NativeSystem:
    def __init__(self, case: CaseConfig, activation_checkpointing: bool | None = None):
        self.case = case
        self.ranks = ranks_of(case)
        self.device = self.ranks.device
        self.dtype = case.torch_dtype
        ckpt = case.opts.activation_checkpointing if activation_checkpointing is None \
            else activation_checkpointing
        with torch.device(self.device):
            self.model = build_model(case.shape(), activation_checkpointing=ckpt,
                                     mlp_chunk_tokens=case.opts.mlp_chunk_tokens)
        init_module(self.model, case.seed)
        self.param_dtype = self.dtype if case.precision == "bf16" else torch.float32
        self.model.to(self.param_dtype)
        self.autocast = case.precision == "mixed" and self.dtype != torch.float32
        if self.autocast:  # transformers' experts under autocast in its dtype, as every other system multiplies them
            autocast_experts(self.model, self.device.type)
        if case.compile:
            compile_layers(self.model)
        self.trained = self.model  # what a step calls: the model, or DDP around it
        if self.ranks.launched:  # DDP starts every rank from rank 0's weights; the buffers are constants
            self.trained = DistributedDataParallel(
                self.model, device_ids=None if self.device.type == "cpu" else [self.device],
                gradient_as_bucket_view=True, **_no_buffer_sync())
            self.trained.register_comm_hook(None, _summed)
        self.optimizer = self._optimizer()
        self.draws = draws_of(self.model, case.seed)  # dropout's seeds (None: the model draws nothing)
        self.ckpt = ckpt
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")

    def _optimizer(self) -> torch.optim.Optimizer:
        """torch AdamW(fused=True) beside the weights, over our decay groups (a subclass may keep it elsewhere)."""
        return torch_adamw(self.model.named_parameters(), self.case.optim, fused=True)

    def _autocast(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        loss, stepped, self.last_grad_norm = accumulate_and_step(
            self.trained, self.optimizer, self.case, self.device, inputs_BS, labels_BS, self._autocast, segments_BS,
            self.ranks, self.trained.no_sync if self.ranks.launched else contextlib.nullcontext)
        self.skipped_steps += not stepped
        return loss

    def system_config(self) -> dict:
        return {"param_dtype": str(self.param_dtype), "autocast": self.autocast, "activation_checkpointing": self.ckpt,
                "compile": COMPILED_LAYERS if self.case.compile else False,
                "compile_check": compile_check() if self.case.compile else None,
                "optimizer": "torch.optim.AdamW(fused=True)", "clip": "torch.nn.utils.clip_grad_norm_",
                **({} if not self.ranks.launched else {
                    "ranks": self.ranks.world, "data_parallel": "DistributedDataParallel(gradient_as_bucket_view="
                    "True), gradients summed (a comm hook), no_sync until the last micro-batch"})}

    def metrics(self, warmup_steps: int = 0) -> dict:
        return {}

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().float().cpu().clone() for n, p in self.model.named_parameters()}  # a snapshot

    def evaluate(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                 segments_BS: torch.Tensor | None = None) -> float:
        return evaluate_micro_batches(self.model, self.case, self.device, inputs_BS, labels_BS, segments_BS,
                                      self._autocast)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_named_weights(named_weights(self.model), named)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in named_weights(self.model).items()}

    def save_state(self, out_dir: Path | None) -> None:
        """The model and AdamW state (under torchrun every rank calls it, rank 0 with out_dir, and it writes its copy,
        which resumes on any number of ranks)."""
        if not self.ranks.first:
            return
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "skipped_steps": self.skipped_steps}, Path(out_dir) / STATE_FILE)

    def load_state(self, in_dir: Path) -> None:
        state = torch.load(Path(in_dir) / STATE_FILE, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped_steps = state["skipped_steps"]

    def close(self) -> None:
        del self.model, self.trained, self.optimizer


SPEC = SystemSpec(factory=NativeSystem, options=NativeOptions,
                  plan_memory=functools.partial(estimate_plan, memory_bytes), checkpoint_bytes=checkpoint_bytes,
                  state_files=(STATE_FILE,))
