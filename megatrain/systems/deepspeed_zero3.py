"""DeepSpeed ZeRO-3 with parameter and optimizer offload to CPU, one process on one GPU or, under torchrun, one per
GPU with the partitions spread over them all (DeepSpeed's own data parallel); or ZeRO-Offload.

The recommended ZeRO-Infinity-to-host recipe: the model is built under zero.Init (partitioned as it
is constructed, bf16 shards in pinned host memory), DeepSpeedCPUAdam steps fp32 master weights on
the host, overlap_comm and contiguous_gradients on, bucket sizes from the hidden size H.

`--option zero_stage=2` runs ZeRO-Offload instead, for models whose parameters fit the GPU: ZeRO-2,
the parameters and their gradients on the GPU (in the compute dtype), the optimizer offloaded (fp32
master weights, moments and gradient partition on the host, DeepSpeedCPUAdam stepping there).
`--option zero_stage=2 --option zenflow=true` adds ZenFlow (DeepSpeed's stall-free offload: the top 5% of
gradient columns updated on the GPU every step, the rest accumulated and applied by the host optimizer every 4th
step, overlapped with the next steps' compute). It is not AdamW with exact clipping: its records say "bounded
staleness" and compare speed only.
`--option super_offload=true` runs DeepSpeed's SuperOffload (ZeRO-3's optimizer with DeepSpeedCPUAdam in a worker
process pinned to `cpuadam_cores_perc` of this process's cores, the training process to the rest); with gradient
clipping set, as every case sets it, DeepSpeed 0.19.8 steps no sub-group before the global norm is known, so it is
AdamW with exact clipping (exact_update says why; metrics count its speculative steps and rollbacks).
`--option optimizer_ratio=R` is partial optimizer offload (offload_optimizer.ratio): the share R of the optimizer's
sub-groups stepped by DeepSpeedCPUAdam on the host, the rest kept and stepped on the GPU by torch AdamW, each clipped
by the global norm first. Both run ZeRO-3 on CUDA only (refusal says why).
`--option offload_param=false` keeps ZeRO-3's bf16 parameter partitions on the GPU (offload_optimizer alone, no
offload_param): with partial offload, the GPU sub-groups' updated fp32 masters are then written into partitions on
the GPU, not through PyTorch's dtype-changing copy to the host (a pageable fp32 temporary, converted on the CPU: the
step model's gpu_to_host_convert_gbs), the suspect in partial offload's ~4 s more a step than ZeRO-3 offload on
the 14B's width (issue 74); a model whose bf16 parameters fit the GPU beside its activations can take it.

On CPU (CI) the same engine runs on DeepSpeed's CPU accelerator with gloo. DeepSpeedCPUAdam needs a
C++ JIT build there (about 1.5 minutes on 2 cores), so CPU runs default to a client torch AdamW on
the same fp32 partitions (`--option optimizer=cpu_adam` asks for the DeepSpeed one); CUDA runs
always use DeepSpeedCPUAdam.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
import torch

from megatrain.compile_check import compile_check
from megatrain.config import CaseConfig
from megatrain.engine.distributed import accumulation_steps
from megatrain.engine.programs import named
from megatrain.engine.templates import CompiledCall
from megatrain.models import build_model
from megatrain.models.generic.module import reset_buffers
from megatrain.models.init import init_module, init_param
from megatrain.models.kinds import kind_of
from megatrain.models.weights import copy_named_weights, persistent_buffers
from megatrain.optim.fused import find_ninja
from megatrain.optim.groups import adamw_param_groups
from megatrain.optim.state_bytes import FP32_BYTES, checkpoint_bytes_per_param, state_bytes_per_param
from megatrain.options import CommonOptions
from megatrain.preflight import activation_bytes, estimate_plan, largest_unit_params
from megatrain.systems import SystemSpec
from megatrain.systems.common import (
    aux_weight,
    draws_of,
    evaluate_micro_batches,
    load_deepspeed_cpu_adam,
    micro_batches,
)
from megatrain.systems.dist import (
    kept_on_first,
    ranks_of,
    rows_of_rank,
    save_on_every_rank,
    single_process_env,
    summed_loss,
    warn_if_bf16_precision,
)


@dataclass(frozen=True)
class DeepSpeedOptions(CommonOptions):
    optimizer: Literal["cpu_adam", "torch_adamw"] | None = None  # None: DeepSpeedCPUAdam on GPU, torch AdamW on CPU
    zero_stage: Literal[2, 3] = 3  # 3: parameters and optimizer offloaded; 2: ZeRO-Offload, the optimizer only
    zenflow: bool = False  # ZeRO-Offload with ZenFlow's selective, overlapped updates (bounded staleness)
    super_offload: bool = False  # ZeRO-3 with SuperOffload's optimizer (offload_optimizer.super_offload)
    cpuadam_cores_perc: float | None = None  # SuperOffload's worker's share of the cores (None: DeepSpeed's 0.8)
    # offload_optimizer.ratio: the share of the optimizer's sub-groups stepped on the host, the rest on the GPU
    optimizer_ratio: float = 1.0
    offload_param: bool = True  # ZeRO-3's offload_param; false: the bf16 parameter partitions stay on the GPU

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.zenflow and self.zero_stage != 2:
            raise ValueError("option zenflow=true extends ZeRO-Offload: add --option zero_stage=2")
        # DeepSpeed builds SuperOffload's optimizer in its ZeRO-3 branch alone (engine._configure_zero_optimizer):
        # in stage 2 the flag would be ignored; its config refuses a ratio below 1 outside stage 3
        if self.super_offload and self.zero_stage != 3:
            raise ValueError("option super_offload=true is a ZeRO-3 optimizer (DeepSpeed ignores it in stage 2): "
                             "drop --option zero_stage=2")
        if self.cpuadam_cores_perc is not None and not self.super_offload:
            raise ValueError("option cpuadam_cores_perc is SuperOffload's share of the cores for its host optimizer: "
                             "add --option super_offload=true, or drop it")
        if self.cpuadam_cores_perc is not None and not 0 < self.cpuadam_cores_perc < 1:
            raise ValueError(f"option cpuadam_cores_perc must be > 0 and < 1 (the share of the cores SuperOffload's "
                             f"host optimizer takes; the training process keeps the rest), got "
                             f"{self.cpuadam_cores_perc}")
        if not 0 <= self.optimizer_ratio <= 1:
            raise ValueError(f"option optimizer_ratio is the share of the optimizer stepped on the host, 0 to 1 (1: "
                             f"all of it, ZeRO-3 offload), got {self.optimizer_ratio}")
        if self.optimizer_ratio < 1 and self.zero_stage != 3:
            raise ValueError("option optimizer_ratio below 1 (partial optimizer offload) is ZeRO-3's alone: drop "
                             "--option zero_stage=2")
        if not self.offload_param and self.zero_stage != 3:
            raise ValueError("option offload_param=false is ZeRO-3's (ZeRO-Offload, zero_stage=2, keeps the "
                             "parameters on the GPU already): drop one of them")
        if not self.offload_param and self.super_offload:
            raise ValueError("options offload_param=false and super_offload=true together: SuperOffload is checked "
                             "against native with its parameters offloaded only (tests/gpu/test_baselines_gpu.py); "
                             "drop one of them")
        if self.optimizer_ratio < 1 and self.super_offload:
            raise ValueError("options super_offload=true and optimizer_ratio below 1 together: each is checked "
                             "against native alone (tests/gpu/test_baselines_gpu.py) and memory-modelled alone; run "
                             "one of them")


# DeepSpeed's ZenFlow tutorial settings: the top 5% of gradient columns by importance updated on the GPU each step,
# the rest applied every 4th step by the host optimizer, overlapped with compute
ZENFLOW = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
           "full_warm_up_rounds": 0, "overlap_step": True}


HOST_BYTES_PER_PARAM = 25  # ZeRO-3 offload's measured host peak beyond the process, rounded up (memory_bytes)
MOE_HOST_BYTES_PER_PARAM = 30  # the same with a MoE block as the ZeRO-3 leaf
ZERO2_HOST_BYTES_PER_PARAM = 28  # ZeRO-Offload's, one micro-batch a step (_zero2_memory_bytes)
# ZenFlow over ZeRO-Offload: killed by the kernel at 10 layers of the 7B width (3.42B) in one micro-batch of 16 on a
# 126 GiB host (results/host_optimizer, 3a2d6d9), so at least ~37 B/param; a lower bound, never measured where it fits
ZENFLOW_HOST_BYTES_PER_PARAM = 38
# SuperOffload, measured-pending (no record yet; the 14B-width cases of suites/reproduce_14b on a 128 GiB host measure
# it: perf_model.deepspeed_check puts each record's node PSS beside these). Issue 74's hand run: killed by the kernel
# at 10 layers of the 14B width (4.31B) on a 128 GiB host where ZeRO-3 offload peaked at ~103 GiB, ran at 5 (2.93B):
# at least ~30 B/param, a lower bound. Read from its code, not measured: its worker process holds Adam's moments and
# a pinned gradient scratch of a sub-group, each fp32 partition it is sent moves into shared memory
# (torch.multiprocessing) while torch's pinned cache may keep the pinned copy (metrics.superoffload's
# fp32_grads_pinned_share tells), and the worker makes a CUDA context of its own on the GPU.
SUPER_OFFLOAD_HOST_BYTES_PER_PARAM = 30
SUPER_OFFLOAD_WORKER_GPU_BYTES = 2**30
SUPER_OFFLOAD_CORES_PERC = 0.8  # DeepSpeed's default share of the cores for its worker (offload_config.py)
# ZeRO-3 with its parameters on the GPU (option offload_param=false): the bf16 parameter partition (2 B/param of
# DeepSpeed's estimator's 18) lives on the GPU instead of in pinned host memory. Measured once, with partial offload
# (14B width, 5 layers, b96, H200, ed47da2): host 12.5 B/param against the 17.4 planned, GPU 56.6 GiB against 68.6:
# conservative, kept so until more records say by how much
PARAM_PARTITION_BYTES_PER_PARAM = 2
# Partial optimizer offload, measured-pending (as SuperOffload's): the GPU share's fp32 master weights, gradient and
# Adam moments live on the GPU (16 B/param; its gradient is staged in pinned host memory once at build, kept by
# torch's pinned cache, so the host saves 12 of ZeRO-3's 25), and torch AdamW's foreach temporaries of one sub-group
OPTIMIZER_GPU_BYTES_PER_PARAM = 16
PARTIAL_HOST_SAVED_BYTES_PER_PARAM = 12
GPU_ADAMW_SCRATCH_BYTES_PER_PARAM = 2 * FP32_BYTES


def memory_bytes(case: CaseConfig, world: int = 1) -> tuple[int, int]:
    """(host bytes of a rank beyond its process overhead, device bytes of a rank) of ZeRO-3 with params and optimizer
    offloaded to CPU, partitioned over `world` ranks, or of ZeRO-Offload (zero_stage=2: _zero2_memory_bytes).

    DeepSpeed's own estimator (deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs, zero_init=True)
    puts a node's host at 18 B/param whatever its GPUs: fp32 master weights, Adam m and v (12), fp32 gradient
    partition (4), bf16 parameter partition (2), each rank holding its partition. Measured peak RSS beyond the process
    overhead is 24.4-24.9 B/param on one GPU (1.5B, 3B and 14B at batches 8-512, H200 and H100 hosts:
    results/smoke_gpu, results/reproduce_14b): its pinned swap and bucket buffers; we count 25, a rank 25/world.
    A mixture of experts, its MoE block a ZeRO-3 leaf, peaked at 29.5 (Qwen3-30B-A3B's layer, 6 deep, H200:
    results/moe) and GPT-OSS-20B's 4 layers, estimated at 25, were killed by the kernel on a 126 GiB host: MoE
    models count MOE_HOST_BYTES_PER_PARAM. GPU: 4 B per parameter of the largest module (bf16 params and grads,
    gathered), plus the prefetch buffers, plus activations. SuperOffload and partial optimizer offload add what their
    constants say (measured-pending: SUPER_OFFLOAD_HOST_BYTES_PER_PARAM, OPTIMIZER_GPU_BYTES_PER_PARAM), the latter
    for the sub-groups DeepSpeed keeps on the GPU (optimizer_sub_groups, gpu_sub_groups); without offload_param the
    bf16 parameter partition moves from the host to the GPU (PARAM_PARTITION_BYTES_PER_PARAM, measured-pending).
    """
    if case.opts.zero_stage == 2:
        return _zero2_memory_bytes(case, world)
    cfg = case.shape()
    n = cfg.num_params()
    per = MOE_HOST_BYTES_PER_PARAM if cfg.is_moe else HOST_BYTES_PER_PARAM
    if case.opts.super_offload:  # its worker process's state and copies (SUPER_OFFLOAD_HOST_BYTES_PER_PARAM)
        per = max(per, SUPER_OFFLOAD_HOST_BYTES_PER_PARAM)
    host = -(-n * per // world)
    gpu = 4 * largest_unit_params(case) * 2 + activation_bytes(case)
    if case.opts.super_offload:
        gpu += SUPER_OFFLOAD_WORKER_GPU_BYTES
    if not case.opts.offload_param:  # the bf16 parameter partitions on the GPU (PARAM_PARTITION_BYTES_PER_PARAM)
        partition = -(-n * PARAM_PARTITION_BYTES_PER_PARAM // world)
        host, gpu = host - partition, gpu + partition
    if case.opts.optimizer_ratio < 1:  # the sub-groups of the optimizer DeepSpeed keeps on the GPU
        sub_groups = optimizer_sub_groups(case, world)
        on_gpu = sub_groups[:gpu_sub_groups(case.opts.optimizer_ratio, len(sub_groups))]
        host -= PARTIAL_HOST_SAVED_BYTES_PER_PARAM * sum(on_gpu)
        gpu += OPTIMIZER_GPU_BYTES_PER_PARAM * sum(on_gpu) + GPU_ADAMW_SCRATCH_BYTES_PER_PARAM * max(on_gpu, default=0)
    return host, gpu


DEEPSPEED_SUB_GROUP_SIZE = 10**9  # zero_optimization.sub_group_size's default (deepspeed/runtime/zero/config.py)


def sub_group_size(case: CaseConfig) -> int:
    """The optimizer's sub-group size in parameters: with partial offload a decoder layer's, which deepspeed_config
    sets so that the host's share is the ratio asked to within a layer (DeepSpeed's default cuts a 3B model into 4
    sub-groups); else DeepSpeed's default."""
    return case.shape().layer_params() if case.opts.optimizer_ratio < 1 else DEEPSPEED_SUB_GROUP_SIZE


def optimizer_sub_groups(case: CaseConfig, world: int = 1) -> list[int]:
    """Parameters of each of a rank's optimizer sub-groups, in DeepSpeed's order: our AdamW groups (decay, no decay) of
    the model's partitions, each cut as deepspeed.runtime.zero.stage3._create_fp16_sub_groups cuts it (a sub-group
    closes once it reaches the size, a parameter never split)."""
    with torch.device("meta"):
        model = build_model(case.shape(), activation_checkpointing=False)
    size = sub_group_size(case)
    out = []
    for group in adamw_param_groups(model.named_parameters(), case.optim):
        numels = [-(-p.numel() // world) for p in group["params"]]
        if size >= sum(numels):
            out.append(sum(numels))
            continue
        total = 0
        for i, numel in enumerate(numels):
            total += numel
            if total >= size or i == len(numels) - 1:
                out.append(total)
                total = 0
    return out


def gpu_sub_groups(ratio: float, count: int) -> int:
    """How many of `count` sub-groups, the first ones, DeepSpeed keeps on the GPU with offload_optimizer.ratio `ratio`
    (stage3._create_fp32_partitions: sub-group i goes to the host when i >= int((1 - ratio) * count))."""
    return int((1 - ratio) * count)


def _zero2_memory_bytes(case: CaseConfig, world: int = 1) -> tuple[int, int]:
    """ZeRO-Offload: the GPU holds every parameter and its gradient in the compute dtype, and the activations; the
    host the fp32 master weights, Adam m and v and the fp32 gradient partition with DeepSpeed's pinned buffers,
    partitioned over the ranks. DeepSpeed's estimate_zero2_model_states_mem_needs says 24 B/param; the host peak
    beyond the process measured 27.9 (116.25 GiB RSS: Qwen2.5-7B width, 14 layers, batch 16 in one micro-batch, H100:
    results/host_optimizer), and the same case accumulating 4 micro-batches was killed by the kernel on a 126 GiB host
    (its fp32 accumulation buffer on the host: 4 B/param more). The footprint is not linear in the parameters: at
    10 layers (3.42B) the same cases peaked at 69 and 82 GiB (21.8 and 25.6 B/param with the process), as if each of
    DeepSpeed's pinned fp32 buffers were rounded up to a power of two (torch's pinned host allocator does so; not
    measured buffer by buffer): 28 bounds both depths. Its estimate leaves the gradients off the GPU (reduced
    in buckets and offloaded as backward goes): counting them all is the bound."""
    n = case.shape().num_params()
    accumulates = accumulation_steps(case.batch, case.micro_batch, world) > 1
    per = ZERO2_HOST_BYTES_PER_PARAM + (FP32_BYTES if accumulates else 0)
    if case.opts.zenflow:  # its overlapped host step keeps more (ZENFLOW_HOST_BYTES_PER_PARAM: a bound from an OOM)
        per = max(per, ZENFLOW_HOST_BYTES_PER_PARAM)
    return -(-n * per // world), 2 * case.dtype_bytes * n + activation_bytes(case)


def refusal(case: CaseConfig, world: int = 1) -> str | None:
    """Why DeepSpeed cannot run `case` as asked on `world` ranks, if it cannot (said before anything is built):
    - ZenFlow sets DeepSpeed's gradient accumulation steps to its update_interval and steps its GPU-side selective
      update at every micro-batch, so micro-batches accumulated into one batch would be that many steps (at batch 64
      in 4 micro-batches it was also killed by the kernel on a 126 GiB host at 3.42B, where ZeRO-Offload peaked at
      82 GiB: results/host_optimizer);
    - SuperOffload asserts a CUDA accelerator (superoffload_stage3._validate_superoffload_accelerator), and pins its
      worker to the last share of this process's cores and the process to the rest: ranks of one host would all
      take the same cores;
    - partial offload keeps its GPU share on the accelerator, on CPU the host itself, and builds its GPU optimizer
      only beside DeepSpeedCPUAdam ('Hybrid Optimizer Only Supports DeepSpeedCPUAdam'), which CUDA runs use."""
    o = case.opts
    if o.zenflow and accumulation_steps(case.batch, case.micro_batch, world) > 1:
        return ("ZenFlow steps at every micro-batch (its update_interval replaces DeepSpeed's gradient accumulation), "
                "so accumulated micro-batches would not be one step of the batch: give it --micro-batch equal to the "
                "batch per rank")
    if o.super_offload and case.device != "cuda":
        return "SuperOffload (option super_offload=true) runs on CUDA GPUs only (DeepSpeed asserts it): --device cuda"
    if o.super_offload and world > 1:
        return ("SuperOffload pins its host optimizer to the last of its process's cores and the process to the "
                "rest: ranks of one host would share the same cores; run it in one process (without torchrun)")
    if o.optimizer_ratio < 1 and case.device != "cuda":
        return ("partial optimizer offload (option optimizer_ratio below 1) keeps a share on the GPU: on CPU it would "
                "stay on the host, and DeepSpeed builds it only beside DeepSpeedCPUAdam; use --device cuda")
    return None


def checkpoint_bytes(case: CaseConfig) -> int:
    """One save_state: the fp32 master weights (its fp32 parameter partitions) and both fp32 moments."""
    return case.shape().num_params() * checkpoint_bytes_per_param(state_bytes_per_param(FP32_BYTES, "mixed"))


def deepspeed_config(case: CaseConfig, world: int = 1) -> dict:
    """The DeepSpeed config dict of a case on `world` ranks: ZeRO-3, params and optimizer offloaded to (pinned) host
    memory (SuperOffload's optimizer, or a share of the optimizer kept on the GPU, where its options ask); or
    ZeRO-Offload (zero_stage=2), the optimizer alone offloaded; each rank accumulating its share of the global
    batch."""
    h = case.shape().hidden_size
    o = case.opts
    pin = case.device == "cuda"
    offload = {"device": "cpu", "pin_memory": pin}
    offload_optimizer = dict(offload)
    if o.super_offload:
        offload_optimizer.update(super_offload=True,
                                 cpuadam_cores_perc=o.cpuadam_cores_perc or SUPER_OFFLOAD_CORES_PERC)
    if o.optimizer_ratio < 1:
        offload_optimizer["ratio"] = o.optimizer_ratio
    zero = {"stage": o.zero_stage, "offload_optimizer": offload_optimizer, "overlap_comm": True,
            "contiguous_gradients": True, "reduce_bucket_size": h * h}
    if o.optimizer_ratio < 1:
        zero["sub_group_size"] = sub_group_size(case)
    if o.zero_stage == 3:
        zero.update({
            **({"offload_param": offload} if o.offload_param else {}),
            "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h,
            # Its memory-efficient linear, an autograd.Function patched over F.linear, reads each weight's ds_id and
            # ds_status, on which Dynamo then guards; DeepSpeed's own compile path restores torch's linear too.
            "memory_efficient_linear": not case.compile,
        })
    extra = {}
    if case.opts.zenflow:
        zero["zenflow"] = dict(ZENFLOW)
        # ZenFlow builds its optimizers itself (ZenFlowCPUAdam on the host, its selective AdamW on the GPU) from the
        # config's optimizer: a client optimizer leaves the selective one without parameters
        o = case.optim
        extra["optimizer"] = {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                                                          "weight_decay": o.weight_decay}}
    return {
        "train_batch_size": case.batch,
        "train_micro_batch_size_per_gpu": case.micro_batch,
        "gradient_accumulation_steps": accumulation_steps(case.batch, case.micro_batch, world),
        "gradient_clipping": case.optim.max_grad_norm,
        "bf16": {"enabled": case.dtype == "bfloat16"},
        "zero_optimization": zero,
        # Allows the client torch AdamW of CPU runs; CUDA runs pass DeepSpeedCPUAdam, which this does not affect.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        **extra,
    }


def _import_deepspeed(device: torch.device):
    """Import DeepSpeed with the accelerator of `device` (auto-detection would pick CUDA on a GPU host)."""
    os.environ.setdefault("DS_ACCELERATOR", device.type)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != device.type:
        raise RuntimeError(f"DeepSpeed is set to the {get_accelerator().device_name()!r} accelerator in this process; "
                           f"run the device={device.type!r} case in a fresh process (or set DS_ACCELERATOR)")
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # Every bucket reduce/gather of ZeRO-3 calls these torch APIs; the warning would repeat thousands of times.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    return deepspeed


def _init_units(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The model's (name, parameter) pairs in groups gathered one at a time for initialisation: each decoder layer's,
    then the rest's by top-level module."""
    layer_of = {id(p): i for i, layer in enumerate(model.layers) for p in layer.parameters()}
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        key = ("layer", layer_of[id(p)]) if id(p) in layer_of else ("module", name.split(".")[0])
        groups.setdefault(key, []).append((name, p))
    return list(groups.values())


def _full_shape(p: torch.nn.Parameter) -> torch.Size:
    """A parameter's full shape: a ZeRO-3 parameter's own tensor is an empty 1-D stub (our AdamW decay groups, decided
    on p.ndim, would put every matrix in the no-decay group)."""
    return p.ds_shape if hasattr(p, "ds_shape") else p.shape


def _zero3_model(ds, case: CaseConfig, config: dict) -> torch.nn.Module:
    """The model built partitioned (zero.Init), initialised one gathered unit at a time."""
    cfg = case.shape()
    # a generic model's transformers imported (and the model checked) before zero.Init: its tensor patches break
    # torch._dynamo's first import, which transformers' modeling makes
    cfg.check()
    with ds.zero.Init(config_dict_or_path=config):
        model = build_model(cfg, activation_checkpointing=True)
    for group in _init_units(model):
        with ds.zero.GatheredParameters([p for _, p in group], modifier_rank=0):
            for name, p in group:
                init_param(name, p, case.seed)
    # The loss reads the head matrix (or the tied embedding) outside that module's forward: ZeRO-3 must gather it
    # for the root's forward and backward too.
    ds.zero.register_external_parameter(model, model.head_weight())
    # A ZeRO-3 leaf module gathers all its parameters in its own hook, eager, instead of in hooks on every submodule:
    # which of its module's classes, and why, is the model's kind's (megatrain.models.kinds: zero3_leaves)
    from deepspeed.utils import set_z3_leaf_modules

    if leaves := kind_of(cfg).zero3_leaves(model, case.compile):
        set_z3_leaf_modules(model, leaves)
    return model


def _compile_layers(model: torch.nn.Module) -> list[CompiledCall]:
    """Run every decoder layer through a compiled stateless layer, as the engine does (a meta-device layer called with
    the weights as tensor arguments: LayerTemplate, or for transformers' own modules one ModuleTemplate per distinct
    layer structure, each layer still checkpointed: the kind's compile_layers), and return the templates. Compiling
    each layer's own forward instead let Dynamo guard on that layer's ZeRO-3 parameters (their ds_id): on the GPU host
    every layer was a new compile up to Dynamo's recompile limit (8), the layers after it eager."""
    return named(kind_of(model.cfg).compile_layers)(model)


PHASES = ("forward", "backward", "step")  # the engine calls of a micro-batch, timed in the record


def exact_update(case: CaseConfig) -> tuple[bool, str]:
    """Whether `case`'s update is AdamW with the global-norm clipping it asks (exact), and why, in its record's words.
    SuperOffload's speculation (its worker stepping sub-groups during backward, before the global norm is known, and
    rolling them back on a non-finite norm) runs in DeepSpeed 0.19.8 only without clipping (partition_grads checks
    `not self.clip_grad`): with clipping each sub-group is clipped and then stepped after backward
    (_step_with_clipping); without, AdamW needs no norm but to skip a non-finite step, which the rollback does."""
    o = case.opts
    clipping = "exact global-norm clipping" if case.optim.max_grad_norm > 0 else "no clipping (max_grad_norm 0)"
    if o.zenflow:
        return False, f"not AdamW with exact clipping: ZenFlow's bounded staleness ({ZENFLOW})"
    if o.super_offload and case.optim.max_grad_norm > 0:
        return True, ("AdamW with exact global-norm clipping: with gradient_clipping set, DeepSpeed 0.19.8's "
                      "SuperOffload steps no sub-group before the norm of the whole gradient is known (it speculates "
                      "only without clipping); after backward each sub-group is clipped, then stepped by "
                      "DeepSpeedCPUAdam in its worker process, so nothing is rolled back (metrics.superoffload)")
    if o.super_offload:
        return True, ("AdamW without clipping: SuperOffload's worker steps each sub-group once its gradient is "
                      "complete in backward, before the global norm is known, and rolls the step back where that norm "
                      "is not finite, the step then skipped as every system skips it (metrics.superoffload counts "
                      "both)")
    if o.optimizer_ratio < 1:
        return True, (f"AdamW with {clipping}: the host's share of the sub-groups stepped by DeepSpeedCPUAdam, the "
                      "GPU's by torch.optim.AdamW, each clipped by the norm of the whole gradient first")
    return True, f"AdamW with {clipping}, after the norm of the whole gradient"


class _SuperOffloadCounts:
    """What SuperOffload's optimizer did, counted by wrapping its two calls: sub-group steps its worker was sent
    during backward, before the global norm (speculative: every submission but the synchronous ones), and sub-group
    steps it rolled back; and how it split the cores and kept its host gradients pinned."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.submitted = self.synchronous = self.rollbacks = 0
        worker = optimizer.superoffload_cpu_optimizer
        submit, synchronous = worker.async_step, optimizer._sync_cpu_optimizer_step

        def counted_submit(*args, **kwargs):
            self.submitted += 1
            return submit(*args, **kwargs)

        def counted_synchronous(*args, rollback: bool = False, **kwargs):
            self.synchronous += 1
            self.rollbacks += rollback
            return synchronous(*args, rollback=rollback, **kwargs)

        worker.async_step = counted_submit
        optimizer._sync_cpu_optimizer_step = counted_synchronous

    def to_dict(self) -> dict:
        opt = self.optimizer
        process = opt.superoffload_cpu_optimizer.cpuadam_process
        host = [g.grad for i, g in enumerate(opt.fp32_partitioned_groups_flat) if opt.subgroup_to_device[i] == "cpu"]
        pinned = sum(g.numel() for g in host if g.is_pinned())
        return {"speculative_steps": self.submitted - self.synchronous, "rollbacks": self.rollbacks,
                "training_process_cores": len(psutil.Process().cpu_affinity()),
                "worker_cores": len(psutil.Process(process.pid).cpu_affinity()) if process.is_alive() else None,
                # torch.multiprocessing moves a tensor it sends into shared memory: the pinned gradient may not stay so
                "fp32_grads_pinned_share": pinned / max(1, sum(g.numel() for g in host))}


CHECKPOINT_TAG = "deepspeed"  # the tag directory engine.save_checkpoint writes inside a train checkpoint
SAVED_PARTITIONS = "zero_pp_rank_*_optim_states.pt"  # in it, one file of each rank's ZeRO partitions


class _GatheredMasters(Mapping):
    """name -> the full fp32 master weight of a ZeRO parameter, assembled on each access (on the host); a persistent
    buffer's name -> the buffer (a generic model's router biases: never partitioned)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], buffers: dict[str, torch.Tensor]):
        self.params, self.buffers = params, buffers

    def __getitem__(self, name: str) -> torch.Tensor:
        from deepspeed.utils import safe_get_full_fp32_param

        if name in self.buffers:
            return self.buffers[name].detach().cpu()
        return safe_get_full_fp32_param(self.params[name]).detach().float().cpu()

    def __iter__(self) -> Iterator[str]:
        return iter([*self.params, *self.buffers])

    def __len__(self) -> int:
        return len(self.params) + len(self.buffers)


class _ZeroParam:
    """A ZeRO parameter as a weight-copy target (models.weights.copy_named_weights): its full shape, and a copy
    that writes both copies of the weight, the module's (ZeRO-3: its partition, gathered, written, re-partitioned)
    and the optimizer's fp32 master partition."""

    def __init__(self, param: torch.nn.Parameter, ds, device: torch.device):
        self.param, self.ds, self.device, self.shape = param, ds, device, _full_shape(param)

    def copy_(self, tensor: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        with self.ds.zero.GatheredParameters([self.param], modifier_rank=0):
            self.param.data.copy_(tensor)
        safe_set_full_fp32_param(self.param, tensor.to(self.device, torch.float32))


class DeepSpeedSystem:
    def __init__(self, case: CaseConfig):
        self.case = case
        self.ranks = ranks_of(case)  # under torchrun: the process group, which DeepSpeed takes up
        self.world, self.device = self.ranks.world, self.ranks.device
        self.dtype = case.torch_dtype
        warn_if_bf16_precision(case, "deepspeed")
        if reason := refusal(case, self.world):
            raise ValueError(reason)
        self.optimizer_name = case.opts.optimizer or ("cpu_adam" if self.device.type == "cuda" else "torch_adamw")
        if self.device.type == "cuda" and self.optimizer_name != "cpu_adam":
            raise ValueError("deepspeed on CUDA runs DeepSpeedCPUAdam (its recommended offload optimizer); "
                             "drop --option optimizer=...")
        ds = self.ds = _import_deepspeed(self.device)
        find_ninja()  # its ops (DeepSpeedCPUAdam, ZenFlow's) build through torch's load(), which runs ninja from PATH

        if self.device.type == "cpu":
            # The CPU accelerator's shared-memory all-reduce op serves inference only (training reduces through
            # gloo), and its C++ JIT build costs minutes on a fresh machine.
            ds.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.owns_process_group = not torch.distributed.is_initialized()
        if self.owns_process_group:
            single_process_env()
        # DeepSpeed's own init from the launch's environment (torchrun's, or the one-process world's); under torchrun
        # it takes up the process group already made
        ds.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo", verbose=False)

        self.config = deepspeed_config(case, self.world)
        if case.opts.zero_stage == 3:
            model = _zero3_model(ds, case, self.config)
        else:  # whole on the device, built in the compute dtype (ZeRO-3's partitions are too): no fp32 copy there
            with torch.device("meta"):
                model = build_model(case.shape(), activation_checkpointing=True)
            model.to(self.dtype).to_empty(device=self.device)
            init_module(model, case.seed)
            reset_buffers(model, self.device)  # a generic model's: to_empty left none
        self.templates = _compile_layers(model) if case.compile else []

        groups = adamw_param_groups(model.named_parameters(), case.optim, shape_of=_full_shape)
        o = case.optim
        if self.optimizer_name == "cpu_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            load_deepspeed_cpu_adam()
            if case.opts.zenflow:  # DeepSpeed builds ZenFlowCPUAdam from the config's optimizer over our groups
                optimizer = None
                self.optimizer_desc = "deepspeed.ops.adam.ZenFlowCPUAdam(adamw_mode=True, overlap_step=True), built " \
                    "by DeepSpeed from the config's AdamW over the parameter groups; ZenFlowSelectiveAdamW on the GPU"
            else:
                optimizer = DeepSpeedCPUAdam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, adamw_mode=True)
                self.optimizer_desc = "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)"
        else:
            optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
            self.optimizer_desc = "torch.optim.AdamW (client optimizer on the host partitions)"
        self.engine, *_ = ds.initialize(model=model, optimizer=optimizer,
                                        model_parameters=groups if optimizer is None else None, config=self.config)
        self.draws = draws_of(model, case.seed)
        self.superoffload = _SuperOffloadCounts(self.engine.optimizer) if case.opts.super_offload else None
        self.phase_times_s: dict[str, list[float]] = {phase: [] for phase in PHASES}

    def _now(self) -> float:
        """Wall-clock seconds once the device has run what was queued: a phase's time is the host's time in its call
        and the device work it queued."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        """One step over the global batch (under torchrun, this rank's rows of it)."""
        batch_BS = inputs_BS  # the load-balancing loss weighs a micro-batch by its share of the global batch
        normalizer, inputs_BS, labels_BS, segments_BS = rows_of_rank(self.ranks, inputs_BS, labels_BS, segments_BS)
        total = torch.zeros((), device=self.device)
        steps_before = self.engine.global_steps
        spent = dict.fromkeys(PHASES, 0.0)
        for x, y, seg in micro_batches(self.case, self.device, inputs_BS, labels_BS, segments_BS, self.draws,
                                       self.ranks.rank):
            t0 = self._now()
            loss = self.engine(x, y, normalizer, seg, aux_weight(x, batch_BS))
            t1 = self._now()
            # The normaliser already spans the global batch: DeepSpeed's own 1/GAS scaling would count the
            # accumulation twice, and it averages the ranks' gradients where their sum is the one-process gradient.
            self.engine.backward(loss * self.world, scale_wrt_gas=False)
            t2 = self._now()
            self.engine.step()  # the optimizer steps (clipping first) only at the accumulation boundary
            t3 = self._now()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                spent[phase] += seconds
            total += loss.detach().float()
        for phase, seconds in spent.items():
            self.phase_times_s[phase].append(seconds)
        # ZenFlow counts a global step at each of its host updates (every update_interval steps, its accumulation
        # steps), and one micro-batch is its step (refusal): there is nothing of ours to check against
        assert self.case.opts.zenflow or self.engine.global_steps == steps_before + 1, \
            "micro-batches and gradient_accumulation_steps disagree"
        if self.draws is not None:
            self.draws.step += 1
        return summed_loss(self.ranks, total)

    @property
    def skipped_steps(self) -> int:
        """DeepSpeed's own count of steps it skipped (its overflow check; the policy is DeepSpeed's)."""
        return int(self.engine.skipped_steps)

    @property
    def last_grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float("nan") if norm is None else float(norm)

    def system_config(self) -> dict:
        o = self.case.opts
        zero3 = o.zero_stage == 3
        compiled = "torch.compile(dynamic=False) of one stateless decoder layer (LayerTemplate), every layer calling " \
            "it with its parameters" + (", the layer a ZeRO-3 leaf module (gathered whole)" if zero3 else "")
        params = "parameters offloaded to the host" if o.offload_param else "parameters on the GPU (no offload_param)"
        mode = ("ZeRO-3, parameters and optimizer offloaded to the host" if o.offload_param else
                f"ZeRO-3, optimizer offloaded to the host, {params}") if zero3 else \
            "ZeRO-Offload: ZeRO-2, parameters and gradients on the device, optimizer offloaded to the host"
        if o.zenflow:
            mode = f"ZenFlow (bounded staleness: {ZENFLOW}) over " + mode
        if o.super_offload:
            mode = ("SuperOffload: " + mode + ", DeepSpeedCPUAdam in a worker process on "
                    f"{self.config['zero_optimization']['offload_optimizer']['cpuadam_cores_perc']:g} of the cores")
        if o.optimizer_ratio < 1:
            mode = (f"partial optimizer offload: ZeRO-3, {params}, {o.optimizer_ratio:g} of the optimizer's "
                    "sub-groups on the host (DeepSpeedCPUAdam), the rest on the GPU (torch AdamW)")
        exact, update = exact_update(self.case)
        return {"mode": mode, "exact_adamw": exact, "update": update,
                "phase_times": "wall-clock of each engine call (forward, backward, step), the device synchronised "
                               "at each call's end; summed over a step's micro-batches (metrics.phase_times_s)",
                "deepspeed_config": self.config, "ranks": self.world, "zero_init": zero3,
                "activation_checkpointing": True,
                "compile": compiled if self.templates and all(t.compiled for t in self.templates) else False,
                "compile_check": compile_check(fell_back=not all(t.compiled for t in self.templates))
                if self.templates else None,
                "checkpointing": "torch.utils.checkpoint(use_reentrant=False) per layer",
                "optimizer": self.optimizer_desc,
                "loss_scaling": "engine.backward(loss x ranks, scale_wrt_gas=False), loss / valid tokens of the "
                                "global step (DeepSpeed divides the ranks' summed gradients by their number)"}

    def metrics(self, warmup_steps: int = 0) -> dict:
        out = {"deepspeed_version": self.ds.__version__, "optimizer": self.optimizer_name,
               "accelerator": self.ds.accelerator.get_accelerator().device_name(),
               "last_grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
               "phase_times_s": self.phase_times_s}
        if self.superoffload is not None:
            out["superoffload"] = self.superoffload.to_dict()
        if self.case.opts.optimizer_ratio < 1:  # where DeepSpeed put each sub-group (memory_bytes models the same)
            opt = self.engine.optimizer
            numels = opt.fp16_partitioned_groups_flat_numel
            out.update(optimizer_params=int(sum(numels)),
                       optimizer_params_on_gpu=int(sum(n for i, n in enumerate(numels)
                                                       if opt.subgroup_to_device[i] != "cpu")),
                       optimizer_sub_groups=len(numels))
        return out

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights (the optimizer's partitions), gathered, under our names."""
        return {n: w.clone() for n, w in self.export_weights().items()}

    def evaluate(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor,
                 segments_BS: torch.Tensor | None = None) -> float:
        return evaluate_micro_batches(self.engine, self.case, self.device, inputs_BS, labels_BS, segments_BS)

    def set_lr(self, lr: float) -> None:
        # the client optimizer's groups, read at every step; partial offload's GPU optimizer shares them but its first
        # (stage3's backup_optimizer is made with its own first group)
        gpu = getattr(self.engine.optimizer, "backup_optimizer", None)
        for group in [*self.engine.optimizer.param_groups, *(gpu.param_groups if gpu is not None else [])]:
            group["lr"] = lr

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Both copies of each weight, one weight at a time (_ZeroParam); a generic model's buffers as they are."""
        module = self.engine.module
        copy_named_weights({**persistent_buffers(module),
                            **{n: _ZeroParam(p, self.ds, self.device) for n, p in module.named_parameters()}}, named)

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        """The fp32 master weights by name. One process: each gathered when read (never the whole model at once).
        Under torchrun every rank calls it, each weight is gathered in turn and rank 0 keeps them all (4 B/param on
        its host while it exports)."""
        masters = _GatheredMasters(dict(self.engine.module.named_parameters()),
                                   persistent_buffers(self.engine.module))
        return kept_on_first(self.ranks, masters.items()) if self.ranks.launched else masters

    def save_state(self, out_dir: Path | None) -> None:
        """DeepSpeed's own checkpoint (engine.save_checkpoint: module, fp32 partitions, AdamW state, step and
        skipped-step counts); under torchrun every rank writes its partitions into rank 0's out_dir (the others pass
        None)."""
        save_on_every_rank(self.ranks, out_dir, lambda d: self.engine.save_checkpoint(str(d), tag=CHECKPOINT_TAG))

    def load_state(self, in_dir: Path) -> None:
        """Continue from save_state's checkpoint, saved by as many ranks: ZeRO-3's partitions do not move between
        ranks (DeepSpeed's universal checkpoint would convert them; not done here)."""
        saved = len(list((Path(in_dir) / CHECKPOINT_TAG).glob(SAVED_PARTITIONS)))
        if saved and saved != self.world:
            raise ValueError(f"{in_dir} holds DeepSpeed ZeRO-3 partitions of {saved} rank(s) and this run has "
                             f"{self.world}: resume it on {saved} (torchrun --nproc-per-node {saved}"
                             + (", or without torchrun)" if saved == 1 else ")"))
        from megatrain.checked_files import open_checked

        def load(path: str, map_location=None):  # DeepSpeed's own torch.load, of the very bytes checked and signed
            with open_checked(path) as f:
                return torch.load(f, map_location=map_location, weights_only=False)

        engine = self.engine.checkpoint_engine
        engine.load = load  # every file load_checkpoint reads, it reads through its checkpoint engine
        try:
            path, _ = self.engine.load_checkpoint(str(in_dir), tag=CHECKPOINT_TAG)
        finally:
            del engine.load
        if path is None:
            raise ValueError(f"{in_dir}: no DeepSpeed checkpoint '{CHECKPOINT_TAG}' to resume from")

    def close(self) -> None:
        # SuperOffload's CPU-Adam worker is a daemon process that neither engine.destroy() (DeepSpeed 0.19.8) nor a
        # bench ending without the interpreter's teardown (megatrain.engine.distributed.exit_rank) stops: it stayed
        # with ~27 GiB of host memory and the case's output open, and held the suite runner until the device call's
        # limit killed it (the runner now ends a case with its process and kills its group)
        worker = getattr(self.engine.optimizer, "superoffload_cpu_optimizer", None)
        if worker is not None:
            worker.close()
        self.engine.destroy()
        del self.engine
        if self.owns_process_group:
            self.ds.comm.destroy_process_group()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


SPEC = SystemSpec(factory=DeepSpeedSystem, options=DeepSpeedOptions,
                  plan_memory=functools.partial(estimate_plan, memory_bytes, refusal=refusal),
                  checkpoint_bytes=checkpoint_bytes,
                  package="deepspeed", pickled=("**/*.pt",),  # torch.load(weights_only=False) of every .pt
                  state_files=(f"{CHECKPOINT_TAG}/*_model_states.pt",))
