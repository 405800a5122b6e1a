"""AdamW on host-resident flat tiles, one unit at a time, with torch's fused CPU kernel.

Semantics equal torch.optim.AdamW (decoupled weight decay, bias correction, per-element update):
each unit's tile is two flat regions (decayed matrices, undecayed norms/biases), and AdamW is
elementwise, so updating the flat regions is the same computation as updating each parameter.
Gradients arrive already multiplied by the global-norm clip coefficient.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from megatrain.optim.config import OptimConfig


class FlatAdamW:
    """AdamW state (fp32 moments, step counts) for a set of flat regions keyed by an id."""

    def __init__(self, optim: OptimConfig, fused: bool = True):
        self.optim = optim
        self.fused = fused
        self.steps: dict[object, torch.Tensor] = {}

    def update(self, key, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               weight_decay: float, lr: float | None = None) -> None:
        """One AdamW step of the fp32 region `param` in place (grad, moments: same shape, fp32); lr overrides the
        config's (a learning-rate schedule)."""
        if param.numel() == 0:
            return
        step = self.steps.setdefault(key, torch.zeros((), dtype=torch.float32, device=param.device))
        o = self.optim
        adam([param], [grad], [exp_avg], [exp_avg_sq], [], [step], fused=self.fused,
             foreach=False if self.fused else None, decoupled_weight_decay=True, amsgrad=False,
             beta1=o.beta1, beta2=o.beta2, lr=o.lr if lr is None else lr, weight_decay=weight_decay, eps=o.eps,
             maximize=False)
