"""Build (once, JIT, cached) and call the one-pass host AdamW kernel in csrc/fused_adamw.cpp.

Falls back to torch's fused AdamW (more passes over memory, same result) where no C++ compiler
is available; `available()` says which one runs.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

_SRC = Path(__file__).parent / "csrc" / "fused_adamw.cpp"


@functools.lru_cache(maxsize=1)
def _module():
    from torch.utils.cpp_extension import load

    try:
        return load(name="megatrain_fused_adamw", sources=[str(_SRC)],
                    extra_cflags=["-O3", "-fopenmp", "-march=native", "-fno-math-errno"],  # errno blocks vector sqrt
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler or ninja: the torch path computes the same update
        warnings.warn(f"one-pass host AdamW kernel unavailable ({exc}); using torch fused AdamW", stacklevel=2)
        return None


def available() -> bool:
    return _module() is not None


def fused_adamw(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                weight_out: torch.Tensor | None, step: int, clip: float, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float) -> None:
    out = weight_out if weight_out is not None else torch.empty(0, dtype=torch.bfloat16)
    _module().fused_adamw(param, grad, exp_avg, exp_avg_sq, out, step, clip, lr, beta1, beta2, eps, weight_decay)
