"""torchao's CPUOffloadOptimizer: native's whole model on one GPU, its AdamW state offloaded to the host.

The model, its init, compile, autocast policy, evaluation and weights in and out are native's
(megatrain/systems/native.py: mixed keeps fp32 parameters under bf16 autocast, bf16 keeps bf16 parameters). The
parameters and their gradients stay on the GPU; every parameter of at least `minimal_size` elements has a pinned host
copy and a pinned host gradient, its gradient is copied to the host in a post-accumulate-grad hook (overlapping
backward), torch's fused CPU AdamW steps it there (its moments in the parameter dtype), and the parameter is copied
back. Smaller parameters step on a device AdamW. offload_gradients=False: accumulating micro-batches needs the device
gradients.

Clipping is ours exactly (megatrain/systems/torchao_optim.py): clip_grad_norm_ on the GPU as native's, and the same
coefficient applied to the host gradient copies, which were taken before it. One process on one GPU: torchao's
optimizer asserts a CUDA (or XPU) device and is single-GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.optim.groups import adamw_hyperparameters, adamw_param_groups
from megatrain.preflight import activation_bytes, estimate_plan, pinned_bytes
from megatrain.systems import SystemSpec
from megatrain.systems.common import accumulate_and_step, clip_coefficient
from megatrain.systems.native import NativeOptions, NativeSystem, checkpoint_bytes, state_bytes

STATE_FILE = "torchao_state.pt"


@dataclass(frozen=True)
class TorchaoOptions(NativeOptions):
    minimal_size: int = 4096  # torchao's default: parameters of fewer elements step on a device AdamW

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.minimal_size < 0:
            raise ValueError(f"option minimal_size must be >= 0 (0: every parameter on the host), got "
                             f"{self.minimal_size}")


def memory_bytes(case: CaseConfig, world: int = 1) -> tuple[int, int]:
    """(host bytes beyond the process overhead, device bytes) of one process (refusal: never several).

    Device: every parameter and its gradient in the parameter dtype (native's state_bytes), the AdamW moments of the
    parameters below minimal_size (the device optimizer's), and activations (megatrain.preflight.activation_bytes).
    Host, per parameter tensor of at least minimal_size elements: its pinned copy and pinned gradient, each a block
    of torch's pinned allocator (pinned_bytes: a power of two), and AdamW's m and v in unpinned memory.
    """
    per = state_bytes(case)
    host = device_moments = 0
    for n in case.shape().param_numels():
        if n >= case.opts.minimal_size:
            host += pinned_bytes(per["weights"] * n) + pinned_bytes(per["grads"] * n)
            host += (per["exp_avg"] + per["exp_avg_sq"]) * n
        else:
            device_moments += (per["exp_avg"] + per["exp_avg_sq"]) * n
    num_params = case.shape().num_params()
    return host, (per["weights"] + per["grads"]) * num_params + device_moments + activation_bytes(case)


def refusal(case: CaseConfig, world: int = 1) -> str | None:
    """Why torchao's CPUOffloadOptimizer cannot run `case` on `world` ranks, if it cannot."""
    if case.device != "cuda":
        return "torchao's CPUOffloadOptimizer needs a CUDA GPU (it asserts a CUDA or XPU device): run it with " \
               "--device cuda"
    if world > 1:
        return f"torchao's CPUOffloadOptimizer is single-GPU (its hooks copy each rank's own gradient to the host " \
               f"before the ranks would sum them), and this launch has {world} ranks: run torchao as one process " \
               f"without torchrun, or run native, fsdp or deepspeed across the ranks"
    return None


# the pre-flight plan: memory_bytes against the limits, or where torchao cannot run the case, the refusal alone
plan_memory = functools.partial(estimate_plan, memory_bytes, refusal=refusal)


class TorchaoSystem(NativeSystem):
    def __init__(self, case: CaseConfig):
        if reason := refusal(case, distributed.launch_size()[0]):
            raise ValueError(reason)
        import torchao

        self.torchao_version = torchao.__version__
        self.minimal_size = case.opts.minimal_size
        super().__init__(case)

    def _optimizer(self) -> torch.optim.Optimizer:
        """CPUOffloadOptimizer over our decay groups, each host AdamW (and the device one) torch's fused AdamW with our
        hyperparameters."""
        from megatrain.systems.torchao_optim import ClippedCPUOffloadOptimizer

        return ClippedCPUOffloadOptimizer(
            adamw_param_groups(self.model.named_parameters(), self.case.optim), optimizer_class=torch.optim.AdamW,
            offload_gradients=False, minimal_size=self.minimal_size, fused=True,
            **adamw_hyperparameters(self.case.optim))

    def step(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor, segments_BS: torch.Tensor | None = None) -> float:
        loss, stepped, self.last_grad_norm = accumulate_and_step(
            self.model, self.optimizer, self.case, self.device, inputs_BS, labels_BS, self._autocast, segments_BS,
            before_clip=self.optimizer.wait_for_grads,
            step=lambda norm: self.optimizer.step(clip_coefficient(norm, self.case.optim)))
        self.skipped_steps += not stepped
        return loss

    def system_config(self) -> dict:
        offloaded = self.optimizer.param_d2h_map
        return {**super().system_config(),
                "optimizer": "torchao.optim.CPUOffloadOptimizer(torch.optim.AdamW fused, offload_gradients=False)",
                "clip": "clip_grad_norm_ on the GPU, coefficient applied to the host gradient copies",
                "minimal_size": self.minimal_size, "torchao_version": self.torchao_version,
                "host_params": sum(p.numel() for p in offloaded), "host_param_tensors": len(offloaded)}

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(named)
        self.optimizer.params_to_host()

    def save_state(self, out_dir: Path | None) -> None:
        """The model, every host AdamW's state and the device AdamW's (CPUOffloadOptimizer.state_dict)."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "minimal_size": self.minimal_size, "skipped_steps": self.skipped_steps}, Path(out_dir) / STATE_FILE)

    def load_state(self, in_dir: Path) -> None:
        # read to the host: torch moves each optimizer's state to its parameters' device as it loads it
        state = torch.load(Path(in_dir) / STATE_FILE, map_location="cpu", weights_only=True)
        if state["minimal_size"] != self.minimal_size:  # another split of the parameters between the two optimizers
            raise ValueError(f"{in_dir} was saved with --option minimal_size={state['minimal_size']}: resume with it")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.params_to_host()
        self.skipped_steps = state["skipped_steps"]


SPEC = SystemSpec(factory=TorchaoSystem, options=TorchaoOptions, plan_memory=plan_memory,
                  checkpoint_bytes=checkpoint_bytes, package="torchao", state_files=(STATE_FILE,))
