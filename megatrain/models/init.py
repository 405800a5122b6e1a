"""Deterministic, order-independent weight initialisation shared by every system.

Each parameter draws from its own generator seeded by (seed, parameter name), so a system that
materialises the model layer by layer (the streaming engine), sharded (DeepSpeed, FSDP2) or whole
(native) gets bit-identical initial weights on the same device type. Matrices ~ N(0, 0.02),
norm weights 1, biases 0 (attention sinks are drawn like matrices, as transformers does).
"""

from __future__ import annotations

import zlib

import torch

INIT_STD = 0.02


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_param(name: str, out: torch.Tensor, seed: int, device: torch.device | str | None = None) -> None:
    """Fill `out` with the initial value of parameter `name` (HF-free naming of our modules).

    Random values are drawn on `device` (default: out's device) and copied into `out`, so host-resident
    tensors of a GPU run can be initialised at GPU speed with the values a GPU-resident model gets.
    """
    if name.endswith("norm.weight"):
        out.fill_(1.0)
        return
    if name.endswith("bias"):  # also the experts' gate_up_proj_bias and down_proj_bias
        out.zero_()
        return
    device = torch.device(device) if device is not None else out.device
    gen = torch.Generator(device=device).manual_seed(param_seed(seed, name))
    if device == out.device and out.dtype == torch.float32:
        out.normal_(0.0, INIT_STD, generator=gen)
    else:
        tmp = torch.empty(out.shape, dtype=torch.float32, device=device).normal_(0.0, INIT_STD, generator=gen)
        # rounded to out's dtype where it was drawn (the same round-to-nearest-even as on the host): a GPU-to-host
        # copy that also converts stages the fp32 values in a fresh pageable host buffer the size of the tensor and
        # converts on the host (290 GB of fresh pages for a bf16 72B; such a build outlasted a 19-minute case on a
        # VM whose pages are slow to fault in: a suspect, not yet a measured cause)
        out.copy_(tmp.to(out.dtype))


@torch.no_grad()
def init_module(module: torch.nn.Module, seed: int, prefix: str = "") -> None:
    """Initialise every parameter of `module`, naming them with `prefix` (e.g. 'layers.3.')."""
    for name, p in module.named_parameters():
        init_param(prefix + name, p, seed)
