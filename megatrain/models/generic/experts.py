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

import inspect
import types

import torch
from torch import nn


def is_experts_block(module: nn.Module) -> bool:
    """A module whose class transformers' `use_experts_implementation` decorated (the attributes it sets)."""
    return all(isinstance(getattr(module, name, None), bool) for name in ("has_gate", "has_bias", "is_transposed")) \
        and hasattr(getattr(module, "config", None), "_experts_implementation")


def experts_function(module: nn.Module):
    """The function transformers' experts interface dispatches `module`'s forward to (its config's
    `_experts_implementation`: grouped_mm, batched_mm, or the class's own forward for 'eager'), resolved once, as the
    decorated forward resolves it at every call; called as function(module, *args). A forward the decorator did not
    wrap as transformers 5.17 and 5.24 do is returned as it is."""
    decorated = type(module).forward
    original = getattr(decorated, "__wrapped__", None)
    interface = inspect.getclosurevars(decorated).nonlocals.get("experts_interface")
    if original is None or interface is None:
        return decorated
    return interface.get_interface(module.config._experts_implementation, original)


class _Unbound(nn.Module):
    """Holds an experts block so that torch.func.functional_call can bind other weights to it for one call of its
    experts function (not its __call__, which the caster replaced)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts
        self.experts_function = experts_function(experts)

    def forward(self, *args, **kwargs):
        return self.experts_function(self.experts, *args, **kwargs)


def _autocast_forward(self, *args, **kwargs):
    """An experts block's forward once autocast_experts replaced it: its weights cast to autocast's dtype while
    autocast is on. Everything it reads hangs off the block (no closure, no default argument, no interface object):
    Dynamo in torch 2.11 could not trace the experts interface reached through a closure's default argument (a graph
    break in each of native's Gemma-4-26B-A4B layers on the H200; torch 2.13 traces both)."""
    unbound, device_type = self._autocast_unbound, self._autocast_device_type  # plain attributes (autocast_experts)
    if not torch.is_autocast_enabled(device_type):
        return unbound(*args, **kwargs)
    dtype = torch.get_autocast_dtype(device_type)
    weights = {f"experts.{name}": p.to(dtype) if p.is_floating_point() else p
               for name, p in unbound.experts.named_parameters(recurse=False)}
    return torch.func.functional_call(unbound, weights, args, kwargs)


def autocast_experts(model: nn.Module, device_type: str) -> int:
    """Make every experts block of `model` multiply in autocast's dtype while autocast is on (its own dtype
    otherwise); returns how many it found. Call before compiling the layers."""
    found = 0
    for module in model.modules():
        if not is_experts_block(module):
            continue
        found += 1
        # kept in the block's __dict__, not registered: the holder is no child of the model (its parameters stay the
        # block's own, under their own names)
        module.__dict__["_autocast_unbound"] = _Unbound(module)
        module.__dict__["_autocast_device_type"] = device_type
        module.forward = types.MethodType(_autocast_forward, module)
    return found
