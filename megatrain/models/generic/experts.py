"""transformers' mixture-of-experts blocks under autocast, as autocast treats every other matmul.

transformers multiplies a layer's experts through its experts interface (`@use_experts_implementation`: grouped_mm by
default), which autocast does not cover: under autocast their fp32 weights stay fp32. Native, the one system that
keeps fp32 weights and computes under autocast ('mixed'), then multiplied its experts in fp32 where every other system
(the engine, DeepSpeed, FSDP2: bf16 weights) ran the bf16 grouped GEMM; compiled, transformers takes a per-expert
fallback for weights other than bf16, whose backward in transformers 5.17 (the GPU host's) reads the group sizes
(`offs.tolist()`) and cannot be traced, so Dynamo sent the whole layer eager (Gemma-4-26B-A4B's on the H200, and on
the CPU with 5.17). `autocast_experts` casts an experts block's weights to autocast's dtype at each call, as autocast
casts a Linear's: the same kernels as the other systems, the gradient into the fp32 weights.
"""

from __future__ import annotations

import torch
from torch import nn


def is_experts_block(module: nn.Module) -> bool:
    """A module whose class transformers' `use_experts_implementation` decorated (the attributes it sets)."""
    return all(isinstance(getattr(module, name, None), bool) for name in ("has_gate", "has_bias", "is_transposed")) \
        and hasattr(getattr(module, "config", None), "_experts_implementation")


class _Unbound(nn.Module):
    """Holds an experts block so that torch.func.functional_call can bind other weights to it for one call of its own
    forward (not its __call__, which the caster replaced)."""

    def __init__(self, experts: nn.Module, forward):
        super().__init__()
        self.experts = experts
        self._experts_forward = forward

    def forward(self, *args, **kwargs):
        return self._experts_forward(*args, **kwargs)


def autocast_experts(model: nn.Module, device_type: str) -> int:
    """Make every experts block of `model` multiply in autocast's dtype while autocast is on (its own dtype
    otherwise); returns how many it found. Call before compiling the layers."""
    found = 0
    for module in model.modules():
        if not is_experts_block(module):
            continue
        found += 1
        unbound = _Unbound(module, module.forward)  # not a child of the model: its parameters stay the block's own

        def forward(*args, _unbound=unbound, **kwargs):
            if not torch.is_autocast_enabled(device_type):
                return _unbound(*args, **kwargs)
            dtype = torch.get_autocast_dtype(device_type)
            weights = {f"experts.{name}": p.to(dtype) if p.is_floating_point() else p
                       for name, p in _unbound.experts.named_parameters(recurse=False)}
            return torch.func.functional_call(_unbound, weights, args, kwargs)

        module.forward = forward
    return found
