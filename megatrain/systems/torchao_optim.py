"""torchao's CPUOffloadOptimizer, stepping the clipped gradient as every other system does. Imported only when the
torchao system is built (megatrain/systems/torchao_offload.py): importing torchao takes seconds, and needs it installed.

CPUOffloadOptimizer copies each gradient to pinned host memory in a post-accumulate-grad hook, on a side stream, as
backward makes it: its copies are unclipped. Here clip_grad_norm_ still clips on the GPU (the small parameters the
device optimizer keeps step on those gradients), and each host copy is multiplied by torch's own coefficient
(megatrain.systems.common.clip_coefficient) just before its AdamW step, after torchao's step has waited for that copy.
"""

from __future__ import annotations

import torch
from torchao.optim import CPUOffloadOptimizer


class ClippedCPUOffloadOptimizer(CPUOffloadOptimizer):
    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.clip_coef: torch.Tensor | None = None  # this step's, on the host; None: nothing to multiply
        for host_optimizer in self.optim_dict.values():  # torchao steps each once its gradient's copy has arrived
            host_optimizer.register_step_pre_hook(self._clip_host_grad)

    def wait_for_grads(self) -> None:
        """Make the compute stream wait for the gradient copies still in flight: clipping scales the device gradients
        in place, which must not happen under a copy that is still reading one."""
        getattr(torch, self.device).current_stream().wait_stream(self.stream)

    def step(self, clip_coef: torch.Tensor | None = None) -> None:
        """torchao's step (the device AdamW on the small parameters, then each host AdamW once its gradient's copy has
        arrived, then the weights back to the device), each host gradient first multiplied by clip_coef: a 0-dim
        tensor in the gradients' dtype (clip_coefficient); None or exactly 1 multiplies nothing."""
        self.clip_coef = None if clip_coef is None or bool(clip_coef == 1) else clip_coef.cpu()
        super().step()

    def _clip_host_grad(self, host_optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if self.clip_coef is not None:
            for group in host_optimizer.param_groups:
                for p in group["params"]:
                    p.grad.mul_(self.clip_coef)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torchao's (the device gradients dropped), and its queue of copied gradients emptied: after a skipped update
        (a non-finite norm: no step, which is what empties it) none of them may be stepped by the next step."""
        super().zero_grad(set_to_none)
        self.queue.clear()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self.d_opt is not None:  # torch's load replaces the device optimizer's groups: set_lr must reach these
            self.d_param_groups = self.d_opt.param_groups

    @torch.no_grad()
    def params_to_host(self) -> None:
        """The device weights into the host copies the host AdamW updates and copies back (after the weights were
        replaced: a Hugging Face checkpoint, a resume)."""
        for p_device, p_host in self.param_d2h_map.items():
            p_host.copy_(p_device)
