"""PyTorch FSDP2 with CPU offload, one process on one GPU or, under torchrun, one per GPU sharded over them all:
the PyTorch-native offloading baseline.

Every decoder layer and the root get `fully_shard` over the world's mesh with CPUOffloadPolicy: fp32 sharded
parameters, gradients and AdamW state live in host memory (each rank holds its shard of each), each layer's
parameters are copied to the GPU, cast to the compute dtype and all-gathered (a copy at world size 1) just before
use, and gradients are reduce-scattered in fp32 and offloaded back. The optimizer is torch AdamW(fused=True)
stepping on each rank's host shards.

At its best setting by what PyTorch and torchtitan recommend (each the same arithmetic; the record states it): each
decoder layer explicitly prefetches the next 2 layers' copies in forward and the 2 before it in backward (PyTorch's
FSDP2 example, `set_modules_to_forward_prefetch`/`set_modules_to_backward_prefetch`; its implicit prefetch issues a
layer's copy only once the previous layer's compute is queued), and the last decoder layer stays gathered after
forward for the backward that starts with it (torchtitan does not reshard its last blocks); pinned host shards, and
compiled blocks where the case compiles. `--option prefetch_layers=0 --option reshard_last_layer=true` is FSDP2's own
default, as this system ran before, for a side-by-side run.

On CPU (CI) the same code path runs with gloo and CPUOffloadPolicy(pin_memory=False): the offload
copies are no-ops there, and pinning needs an accelerator (`pin_memory()` raises without one).

`--option cpu_offload=false` is FSDP2 without offload: the same sharding, precision policy, prefetch and fused AdamW,
with the sharded fp32 state (16 B/param over the ranks) on the GPUs. It is no host-memory system: the GPU suite's
reference for the mixed-precision curves of the engine (fp32 master weights, bf16 compute: FSDP2's precision policy),
where the offloaded reference's host AdamW took 237 s of Gemma-3-27B's 12 steps to native's 12 s and the engine's
plan after it was refused with 31.5 GiB of the host usable (d0c54b8).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from megatrain.compile_check import compile_check
from megatrain.config import CaseConfig
from megatrain.engine.distributed import accumulation_steps
from megatrain.models import build_model
from megatrain.models.generic.module import reset_buffers
from megatrain.models.init import init_param
from megatrain.models.weights import copy_named_weights, persistent_buffers
from megatrain.optim.groups import torch_adamw
from megatrain.optim.state_bytes import FP32_BYTES, checkpoint_bytes_per_param, state_bytes_per_param
from megatrain.options import CommonOptions
from megatrain.preflight import activation_bytes, estimate_plan, largest_unit_params, pinned_bytes
from megatrain.systems import SystemSpec
from megatrain.systems.common import (
    COMPILED_LAYERS,
    accumulate_and_step,
    compile_layers,
    draws_of,
    evaluate_micro_batches,
)
from megatrain.systems.dist import (
    kept_on_first,
    ranks_of,
    save_on_every_rank,
    single_process_env,
    warn_if_bf16_precision,
)

# torch.distributed.fsdp and torch.distributed.checkpoint take about a second to import: they are imported where
# FSDP2 is built and where it saves, so that this module, which the pre-flight reads for SPEC, stays light.

SYSTEM_FILE = "fsdp_system.json"  # beside torch.distributed.checkpoint's folder: the skipped-step count


# fp32 sharded parameters, their fp32 gradients, fp32 AdamW moments, whatever the compute dtype
SHARD_STATE_BYTES = state_bytes_per_param(FP32_BYTES, "mixed")


@dataclass(frozen=True)
class FSDPOptions(CommonOptions):
    # every micro-batch but the last keeps its unsharded fp32 gradients on the GPU (set_requires_gradient_sync(False)):
    # one reduce-scatter and offload a step instead of one per micro-batch, for 4 B/param of GPU memory
    accumulate_on_gpu: bool = False
    # each decoder layer prefetches the next N layers' copies in forward and the N before it in backward (explicitly);
    # 0: FSDP2's implicit prefetch
    prefetch_layers: int = 2
    reshard_last_layer: bool = False  # true: the last decoder layer resharded after forward, as FSDP2's default
    # false: no CPUOffloadPolicy, the sharded fp32 parameters, gradients and AdamW state on the GPU
    cpu_offload: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefetch_layers < 0:
            raise ValueError(f"option prefetch_layers counts the layers each one prefetches (0: FSDP2's implicit "
                             f"prefetch), >= 0, got {self.prefetch_layers}")


def memory_bytes(case: CaseConfig, world: int = 1) -> tuple[int, int]:
    """(host bytes of a rank beyond its process overhead, device bytes of a rank) of FSDP2 with
    CPUOffloadPolicy(pin_memory=True), sharded over `world` ranks; without offload (option cpu_offload=false) the
    shard's fp32 parameters, gradients and moments (16 B/param) are on the GPU instead, and nothing on the host.

    The fp32 sharded parameters and their fp32 gradients live in pinned host memory, whose caching allocator rounds
    every block up to a power of two, and AdamW runs on the host with fp32 m and v (8 B/param). Per parameter
    tensor of a rank's shard (numel/world, rounded up as FSDP2 pads it): 2 * next_pow2(4 * numel) + 8 * numel; this
    gives 18.1, 19.7 and 21.8 B/param for 1.5B, 3B and 14B on one rank, measured 16.9, 19.1 and 21.7 beyond the
    process overhead (results/smoke_gpu, results/reproduce_14b). GPU: the gathered bf16 unit being computed plus
    the prefetched ones (prefetch_layers, at least the one FSDP2 prefetches itself), its bf16 gradient before the
    reduce, activations; with accumulate_on_gpu and micro-batches to accumulate, every parameter's unsharded fp32
    gradient too.
    """
    per = SHARD_STATE_BYTES
    shards = [-(-n // world) for n in case.shape().param_numels()]
    gathered = 1 + max(1, case.opts.prefetch_layers) + 1  # computing, prefetched, the gradient before its reduce
    gpu = gathered * 2 * largest_unit_params(case) + activation_bytes(case)
    if case.opts.cpu_offload:
        host = sum(pinned_bytes(per["weights"] * k) + pinned_bytes(per["grads"] * k)
                   + (per["exp_avg"] + per["exp_avg_sq"]) * k for k in shards)
    else:
        host, gpu = 0, gpu + sum(per.values()) * sum(shards)
    if case.opts.accumulate_on_gpu and accumulation_steps(case.batch, case.micro_batch, world) > 1:
        gpu += FP32_BYTES * case.shape().num_params()
    return host, gpu


def checkpoint_bytes(case: CaseConfig) -> int:
    """One save_state: the sharded fp32 parameters and both fp32 moments."""
    return case.shape().num_params() * checkpoint_bytes_per_param(SHARD_STATE_BYTES)


class _ShardTarget:
    """An FSDP2 parameter as a weight-copy target (megatrain.models.weights.copy_named_weights): its full shape, and a
    copy that keeps this rank's shard of the full tensor, which every rank holds (nothing is sent)."""

    def __init__(self, param: torch.nn.Parameter):
        self.param, self.shape = param, param.shape

    @torch.no_grad()
    def copy_(self, tensor: torch.Tensor) -> None:
        from torch.distributed.tensor import distribute_tensor

        shard = distribute_tensor(tensor, self.param.device_mesh, self.param.placements, src_data_rank=None)
        self.param.to_local().copy_(shard.to_local())


class FSDPSystem:
    def __init__(self, case: CaseConfig):
        self.case = case
        self.ranks = ranks_of(case)  # under torchrun: the process group, made before the mesh
        self.device = self.ranks.device
        self.dtype = case.torch_dtype
        warn_if_bf16_precision(case, "fsdp")
        self.owns_process_group = not dist.is_initialized()
        if self.owns_process_group:
            single_process_env()
            # Offloaded shards are CPU tensors: gradient clipping's norm all-reduce and full_tensor() on them need
            # a CPU backend next to NCCL.
            self.backend = "cuda:nccl,cpu:gloo" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(self.backend)
        else:
            self.backend = dist.get_backend()
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))

        with torch.device("meta"):
            self.model = build_model(case.shape(), activation_checkpointing=True)
        self.mp_policy = None if self.dtype == torch.float32 else \
            MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        self.pin_memory = self.device.type == "cuda"
        offload = case.opts.cpu_offload
        fsdp_kwargs = {"mesh": mesh, **({"offload_policy": CPUOffloadPolicy(pin_memory=self.pin_memory)} if offload
                                        else {})}
        if self.mp_policy is not None:
            fsdp_kwargs["mp_policy"] = self.mp_policy
        if case.compile:  # each block compiled, then sharded (torchtitan's order)
            compile_layers(self.model)
        layers = list(self.model.layers)
        for module in [*layers, self.model]:
            keep = module is layers[-1] and not case.opts.reshard_last_layer  # the backward starts with it
            fully_shard(module, **fsdp_kwargs, **({"reshard_after_forward": False} if keep else {}))
            # the ranks' gradients summed, not averaged: the loss is normalised by the global batch's valid tokens
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied one)
        if k := case.opts.prefetch_layers:  # a layer's copies issued before its compute, not after the previous one's
            for i, layer in enumerate(layers):
                if after := layers[i + 1:i + 1 + k]:
                    layer.set_modules_to_forward_prefetch(after)
                if before := layers[max(0, i - k):i][::-1]:
                    layer.set_modules_to_backward_prefetch(before)
        # Offloaded shards live on the host (FSDP pins them here), else on the GPU; each full weight is drawn on the
        # compute device and each rank keeps its shard, so the weights equal native's on the same device type whatever
        # the ranks.
        self.model.to_empty(device="cpu" if offload else self.device)
        for name, p in self.model.named_parameters():
            full = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            init_param(name, full, case.seed)
            _ShardTarget(p).copy_(full)
        reset_buffers(self.model, self.device)  # a generic model's (rotary tables, router biases): to_empty left none
        self.optimizer = torch_adamw(self.model.named_parameters(), case.optim, fused=True)
        self.draws = draws_of(self.model, case.seed)  # dropout's seeds (None: the model draws nothing)
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        loss, stepped, self.last_grad_norm = accumulate_and_step(self.model, self.optimizer, self.case, self.device,
                                                                 inputs_BS, labels_BS, segments_BS=segments_BS,
                                                                 ranks=self.ranks, accumulating=self._accumulating)
        self.skipped_steps += not stepped
        return loss

    @contextlib.contextmanager
    def _accumulating(self):
        """Every micro-batch but the last: with accumulate_on_gpu, no reduce-scatter and offload of its gradients."""
        on_gpu = self.case.opts.accumulate_on_gpu
        if on_gpu:
            self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            if on_gpu:
                self.model.set_requires_gradient_sync(True)

    def system_config(self) -> dict:
        o = self.case.opts
        mp = None if self.mp_policy is None else \
            {"param_dtype": str(self.mp_policy.param_dtype), "reduce_dtype": str(self.mp_policy.reduce_dtype)}
        return {"fully_shard": "each decoder layer, then the root", "world_size": dist.get_world_size(),
                "backend": self.backend, "mixed_precision": mp, "sharded_param_dtype": "torch.float32",
                "offload_policy": f"CPUOffloadPolicy(pin_memory={self.pin_memory})" if o.cpu_offload else
                "none: the sharded fp32 state on the GPU (option cpu_offload=false)",
                "reshard_after_forward": "layers True, root False (FSDP2's default)" if o.reshard_last_layer else
                "layers True but the last, root False (torchtitan's: the backward starts with the last layer)",
                "prefetch": f"explicit: each layer the next {o.prefetch_layers} in forward, the {o.prefetch_layers} "
                            "before it in backward (set_modules_to_forward_prefetch, set_modules_to_backward_prefetch)"
                            if o.prefetch_layers else
                            "FSDP2's implicit (forward) and reverse post-forward order (backward)",
                "gradient_reduction": "summed over the ranks (gradient divide factor 1)",
                "gradient_accumulation": "unsharded fp32 gradients on the GPU until the last micro-batch (set_requires_"
                                         "gradient_sync(False)), then one reduce-scatter and offload"
                if self.case.opts.accumulate_on_gpu else "reduce-scattered and offloaded every micro-batch",
                "activation_checkpointing": True,
                "compile": COMPILED_LAYERS + ", before fully_shard" if self.case.compile else False,
                "compile_check": compile_check() if self.case.compile else None,
                "optimizer": f"torch.optim.AdamW(fused=True) on {'host' if o.cpu_offload else 'GPU'} shards",
                "clip": "torch.nn.utils.clip_grad_norm_"}

    def metrics(self, warmup_steps: int = 0) -> dict:
        return {}

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().float().cpu() for n, p in self.model.named_parameters()}

    def evaluate(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                 segments_BS: torch.Tensor | None = None) -> float:
        return evaluate_micro_batches(self.model, self.case, self.device, inputs_BS, labels_BS, segments_BS)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every weight, one at a time, each rank keeping its shard (under torchrun every rank reads `named`); buffers
        whole on every rank."""
        copy_named_weights({**persistent_buffers(self.model),
                            **{n: _ShardTarget(p) for n, p in self.model.named_parameters()}}, named)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """One process: the host shards, which are the whole tensors (no copy). Under torchrun every rank calls it,
        each weight is gathered in turn and rank 0 keeps them all (fp32: 4 B/param on its host while it exports)."""
        buffers = {n: b.detach() for n, b in persistent_buffers(self.model).items()}
        if not self.ranks.launched:  # the host shards as they are; without offload, a host copy of the GPU's
            return {**{n: p.to_local().detach().cpu() for n, p in self.model.named_parameters()}, **buffers}
        return {**kept_on_first(self.ranks, ((n, p.full_tensor().detach()) for n, p in self.model.named_parameters())),
                **buffers}

    def save_state(self, out_dir: Path | None) -> None:
        """torch.distributed.checkpoint of the sharded model and optimizer state dicts (PyTorch's own API); under
        torchrun every rank writes its shards into rank 0's out_dir (the others pass None). It reshards on load, so
        a run resumes on any number of ranks."""
        save_on_every_rank(self.ranks, out_dir, self._save)

    def _save(self, out_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=out_dir / "fsdp")
        if self.ranks.first:
            (out_dir / SYSTEM_FILE).write_text(json.dumps({"skipped_steps": self.skipped_steps}))

    def load_state(self, in_dir: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # the targets, loaded in place
        state = {"model": model_sd, "optim": optim_sd}
        _load_checked(state, Path(in_dir) / "fsdp")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.skipped_steps = json.loads((Path(in_dir) / SYSTEM_FILE).read_text())["skipped_steps"]

    def close(self) -> None:
        del self.model, self.optimizer
        if self.owns_process_group:
            dist.destroy_process_group()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _load_checked(state: dict, path: Path) -> None:
    """dcp.load of the checkpoint at path into state, its every file (the .metadata and each .distcp, each opened
    once) opened through open_checked: the bytes dcp unpickles are those checked and signed. open_checked's refusal
    is raised as it is, not inside the errors dcp gathers from its ranks and metadata files; files it cannot load
    (a .metadata of another checkpoint, with --trust-checkpoint) are one ValueError, without the tracebacks dcp logs
    as it falls back from one metadata file to another."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystem

    from megatrain.checked_files import open_checked

    refusals = []

    class Checked(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            assert mode == "rb", "a checkpoint is only read while it loads"
            if not os.path.lexists(path):  # dcp's fallback to a rank's own metadata file, which no save wrote
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
            try:
                stream = open_checked(path)
            except ValueError as exc:
                refusals.append(exc)
                raise
            with stream:
                yield stream

    reader = dcp.FileSystemReader(path)
    reader.fs = Checked()
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)  # dcp logs each metadata file it fails to read, traceback and all, on the root
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as exc:  # the latter a BaseException
        if refusals:
            raise refusals[0] from None
        failures = getattr(exc, "failures", None)  # a CheckpointException's, by rank: (exception, its stack)
        cause = next(iter(failures.values()))[0] if failures else exc
        raise ValueError(f"{path}: torch.distributed.checkpoint cannot load it into this model "
                         f"({type(cause).__name__}: {str(cause).splitlines()[0][:300]})") from None
    finally:
        logging.disable(disabled)


# dcp unpickles .metadata, and the non-tensor values of the .distcp files (the optimizer's settings), with pickle
SPEC = SystemSpec(factory=FSDPSystem, options=FSDPOptions, plan_memory=functools.partial(estimate_plan, memory_bytes),
                  checkpoint_bytes=checkpoint_bytes, pickled=("fsdp/.metadata", "fsdp/*.distcp"),
                  state_files=("fsdp/.metadata", SYSTEM_FILE))
