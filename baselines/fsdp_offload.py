"""PyTorch FSDP2 with CPU offload, one process on one GPU: the PyTorch-native offloading baseline.

Every decoder layer and the root get `fully_shard` with CPUOffloadPolicy: fp32 sharded parameters,
gradients and AdamW state live in host memory, each layer's parameters are copied to the GPU, cast
to the compute dtype and all-gathered (a copy at world size 1) just before use, and gradients are
reduced in fp32 and offloaded back. The optimizer is torch AdamW(fused=True) stepping on the host.

On CPU (CI) the same code path runs with gloo and CPUOffloadPolicy(pin_memory=False): the offload
copies are no-ops there, and pinning needs an accelerator (`pin_memory()` raises without one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from baselines.common import COMPILED_LAYERS, accumulate_and_step, compile_layers
from baselines.dist import single_process_env, warn_if_bf16_precision
from megatrain.config import CaseConfig
from megatrain.models import Transformer
from megatrain.models.init import init_param
from megatrain.optim.groups import torch_adamw


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
        self.optimizer = torch_adamw(self.model.parameters(), case.optim, fused=True)
        self.skipped_steps = 0
        self.last_grad_norm = float("nan")

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor) -> float:
        loss, stepped, self.last_grad_norm = accumulate_and_step(self.model, self.optimizer, self.case,
                                                                 self.device, inputs_BS, labels_BS)
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
                "optimizer": "torch.optim.AdamW(fused=True) on host shards", "clip": "torch.nn.utils.clip_grad_norm_"}

    def metrics(self) -> dict:
        return {}

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().float().cpu() for n, p in self.model.named_parameters()}

    def close(self) -> None:
        del self.model, self.optimizer
        if self.owns_process_group:
            dist.destroy_process_group()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
