"""PyTorch FSDP2 with CPU offload, one process on one GPU: the PyTorch-native offloading baseline.

Every decoder layer and the root get `fully_shard` with CPUOffloadPolicy: fp32 sharded parameters,
gradients and AdamW state live in host memory, each layer's parameters are copied to the GPU, cast
to the compute dtype and all-gathered (a copy at world size 1) just before use, and gradients are
reduced in fp32 and offloaded back. The optimizer is torch AdamW(fused=True) stepping on the host.

On CPU (CI) the same code path runs with gloo and CPUOffloadPolicy(pin_memory=False): the offload
copies are no-ops there, and pinning needs an accelerator (`pin_memory()` raises without one).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from baselines.common import COMPILED_LAYERS, accumulate_and_step, compile_layers, evaluate_micro_batches
from baselines.dist import single_process_env, warn_if_bf16_precision
from megatrain.compile_check import compile_check
from megatrain.config import CaseConfig
from megatrain.models import Transformer
from megatrain.models.hf import copy_named_weights
from megatrain.models.init import init_param
from megatrain.optim.groups import torch_adamw
from megatrain.optim.state_bytes import FP32_BYTES, checkpoint_bytes_per_param, state_bytes_per_param
from megatrain.options import CommonOptions
from megatrain.preflight import activation_bytes, estimate_plan, largest_unit_params
from megatrain.systems import SystemSpec

# torch.distributed.fsdp and torch.distributed.checkpoint take about a second to import: they are imported where
# FSDP2 is built and where it saves, so that this module, which the pre-flight reads for SPEC, stays light.


# fp32 sharded parameters, their fp32 gradients, fp32 AdamW moments, whatever the compute dtype
SHARD_STATE_BYTES = state_bytes_per_param(FP32_BYTES, "mixed")


@dataclass(frozen=True)
class FSDPOptions(CommonOptions):
    pass


def memory_bytes(case: CaseConfig) -> tuple[int, int]:
    """(host bytes beyond the process overhead, device bytes) of FSDP2 with CPUOffloadPolicy(pin_memory=True).

    The fp32 sharded parameters and their fp32 gradients live in pinned host memory, whose caching allocator rounds
    every block up to a power of two, and AdamW runs on the host with fp32 m and v (8 B/param). Per parameter
    tensor: 2 * next_pow2(4 * numel) + 8 * numel; this gives 18.1, 19.7 and 21.8 B/param for 1.5B, 3B and 14B,
    measured 16.9, 19.1 and 21.7 beyond the process overhead (results/smoke_gpu, results/reproduce_14b). GPU: the
    gathered bf16 unit being computed plus the prefetched one, its bf16 gradient before the reduce, activations.
    """
    per = SHARD_STATE_BYTES
    host = sum(_pow2(per["weights"] * k) + _pow2(per["grads"] * k) + (per["exp_avg"] + per["exp_avg_sq"]) * k
               for k in case.model_config().param_numels())
    gpu = 3 * 2 * largest_unit_params(case) + activation_bytes(case)
    return host, gpu


def _pow2(nbytes: int) -> int:
    return 1 << (nbytes - 1).bit_length()


def checkpoint_bytes(case: CaseConfig) -> int:
    """One save_state: the sharded fp32 parameters and both fp32 moments."""
    return case.model_config().num_params() * checkpoint_bytes_per_param(SHARD_STATE_BYTES)


class FSDPSystem:
    def __init__(self, case: CaseConfig):
        self.case = case
        self.device = torch.device(case.device)
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
            self.model = Transformer(case.model_config(), activation_checkpointing=True)
        self.mp_policy = None if self.dtype == torch.float32 else \
            MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        self.pin_memory = self.device.type == "cuda"
        fsdp_kwargs = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=self.pin_memory)}
        if self.mp_policy is not None:
            fsdp_kwargs["mp_policy"] = self.mp_policy
        if case.compile:  # each block compiled, then sharded (torchtitan's order)
            compile_layers(self.model)
        for layer in self.model.layers:
            fully_shard(layer, **fsdp_kwargs)
        fully_shard(self.model, **fsdp_kwargs)
        # Offloaded shards live on the host (FSDP pins them here); the random draws happen on the compute device,
        # so the weights equal native's on the same device type.
        self.model.to_empty(device="cpu")
        for name, p in self.model.named_parameters():
            init_param(name, p.to_local(), case.seed, device=self.device)
        self.optimizer = torch_adamw(self.model.named_parameters(), case.optim, fused=True)
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        loss, stepped, self.last_grad_norm = accumulate_and_step(self.model, self.optimizer, self.case, self.device,
                                                                 inputs_BS, labels_BS, segments_BS=segments_BS)
        self.skipped_steps += not stepped
        return loss

    def system_config(self) -> dict:
        mp = None if self.mp_policy is None else \
            {"param_dtype": str(self.mp_policy.param_dtype), "reduce_dtype": str(self.mp_policy.reduce_dtype)}
        return {"fully_shard": "each decoder layer, then the root", "world_size": dist.get_world_size(),
                "backend": self.backend, "mixed_precision": mp, "sharded_param_dtype": "torch.float32",
                "offload_policy": f"CPUOffloadPolicy(pin_memory={self.pin_memory})",
                "reshard_after_forward": "default (layers True, root False)", "activation_checkpointing": True,
                "compile": COMPILED_LAYERS + ", before fully_shard" if self.case.compile else False,
                "compile_check": compile_check() if self.case.compile else None,
                "optimizer": "torch.optim.AdamW(fused=True) on host shards", "clip": "torch.nn.utils.clip_grad_norm_"}

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

    def _local_params(self) -> dict[str, torch.Tensor]:
        """Each parameter's host shard: in a one-process world the whole tensor."""
        if dist.get_world_size() != 1:
            raise RuntimeError("fsdp's weight loading and export assume one process (world size 1)")
        return {n: p.to_local() for n, p in self.model.named_parameters()}

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        copy_named_weights(self._local_params(), named)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self._local_params().items()}

    def save_state(self, out_dir: Path) -> None:
        """torch.distributed.checkpoint of the sharded model and optimizer state dicts (PyTorch's own API)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(out_dir) / "fsdp")
        (Path(out_dir) / "fsdp_system.json").write_text(json.dumps({"skipped_steps": self.skipped_steps}))

    def load_state(self, in_dir: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # the targets, loaded in place
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=Path(in_dir) / "fsdp")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.skipped_steps = json.loads((Path(in_dir) / "fsdp_system.json").read_text())["skipped_steps"]

    def close(self) -> None:
        del self.model, self.optimizer
        if self.owns_process_group:
            dist.destroy_process_group()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


SPEC = SystemSpec(factory=FSDPSystem, options=FSDPOptions, plan_memory=functools.partial(estimate_plan, memory_bytes),
                  checkpoint_bytes=checkpoint_bytes)
