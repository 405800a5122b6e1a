"""Compact AdamW moments (OptimConfig.moments): fewer host bytes per parameter, at a stated cost.

- fp32: exact, the default; 8 B/param for the two moments.
- bf16: each moment kept in bf16, rounded stochastically (E[round(x)] = x, so small updates are not lost the way
  round-to-nearest loses them); 4 B/param. The random bits come from a counter-based hash of (the element's index
  in the store, the step, the moment), so a unit draws the same bits on the host and on the GPU and after a resume.
- int8: per block of QBLOCK elements one fp32 absmax per moment (the blockwise idea of bitsandbytes' 8-bit Adam,
  with our own linear maps); 2.06 B/param. exp_avg signed, q = round(127 m / absmax). exp_avg_sq kept as its square
  root, unsigned, with zero excluded: sqrt(v) = absmax (q + 1) / 256, so a small second moment is rounded up,
  never to zero (which would turn m / sqrt(v) into m / eps).
The update itself runs in fp32 on the decoded moments, exactly as for fp32 moments; only the stored state is
rounded. This module is the reference (torch, any device: resident units on the GPU, the host's torch kernel); the
host's one-pass C++ kernel (csrc/fused_adamw.cpp) implements the same maps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from megatrain.optim.state_bytes import QBLOCK

_MASK32 = 0xFFFFFFFF


@dataclass
class Moments:
    """AdamW's two moments of a flat region in their stored format: fp32 or bf16 tensors, or int8 (exp_avg) and
    uint8 (exp_avg_sq) with one fp32 absmax per QBLOCK elements (the scales; None otherwise)."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_scale: torch.Tensor | None = None
    exp_avg_sq_scale: torch.Tensor | None = None

    @staticmethod
    def zeros(numel: int, moments: str, device: torch.device | str = "cpu",
              allocate: Callable[[str, int, torch.dtype], torch.Tensor] | None = None) -> Moments:
        """Zeroed moments of `numel` elements in format `moments` (OptimConfig.moments); allocate(name, numel, dtype),
        when given, makes each zeroed tensor instead (a shared store maps them from shared memory)."""
        allocate = allocate or (lambda name, k, dtype: torch.zeros(k, dtype=dtype, device=device))
        if moments == "int8":
            blocks = -(-numel // QBLOCK)
            return Moments(allocate("exp_avg", numel, torch.int8), allocate("exp_avg_sq", numel, torch.uint8),
                           allocate("exp_avg_scale", blocks, torch.float32),
                           allocate("exp_avg_sq_scale", blocks, torch.float32))
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[moments]
        return Moments(allocate("exp_avg", numel, dtype), allocate("exp_avg_sq", numel, dtype))

    @property
    def format(self) -> str:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}[self.exp_avg.dtype]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name (the scales only where there are some)."""
        return {f.name: t for f in fields(self) if (t := getattr(self, f.name)) is not None}

    def slice(self, a: int, b: int) -> Moments:
        """Elements a..b (a a multiple of QBLOCK when there are scales: blocks never split)."""
        if self.exp_avg_scale is None:
            return Moments(self.exp_avg[a:b], self.exp_avg_sq[a:b])
        assert a % QBLOCK == 0, a
        sa, sb = a // QBLOCK, -(-b // QBLOCK)
        return Moments(self.exp_avg[a:b], self.exp_avg_sq[a:b], self.exp_avg_scale[sa:sb], self.exp_avg_sq_scale[sa:sb])

    def copy_(self, other: Moments) -> Moments:
        for name, t in self.tensors().items():
            t.copy_(getattr(other, name))
        return self

    def to(self, device: torch.device) -> Moments:
        return Moments(**{name: t.to(device, copy=True) for name, t in self.tensors().items()})

    def decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) in fp32, new tensors."""
        if self.exp_avg_scale is None:
            return self.exp_avg.float(), self.exp_avg_sq.float()
        n = self.exp_avg.numel()
        m = _blocks(self.exp_avg.float()) * (self.exp_avg_scale / 127)[:, None]
        root = (_blocks(self.exp_avg_sq.float()) + 1) * (self.exp_avg_sq_scale / 256)[:, None]
        return m.view(-1)[:n], (root * root).view(-1)[:n]

    def encode_(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, index0: int, step: torch.Tensor) -> None:
        """Store fp32 moments: rounded to bf16 stochastically (bits from the elements' store indices index0..., the
        step and the moment), or quantised to int8 blocks."""
        if self.exp_avg.dtype == torch.float32:
            self.exp_avg.copy_(exp_avg)
            self.exp_avg_sq.copy_(exp_avg_sq)
        elif self.exp_avg.dtype == torch.bfloat16:
            self.exp_avg.copy_(round_bf16_stochastic(exp_avg, index0, step, 0))
            self.exp_avg_sq.copy_(round_bf16_stochastic(exp_avg_sq, index0, step, 1))
        else:
            n = exp_avg.numel()
            m = _blocks(exp_avg)
            absmax = m.abs().amax(1)
            self.exp_avg_scale.copy_(absmax)
            inv = torch.where(absmax > 0, 127 / absmax, 0.0)
            self.exp_avg.copy_((m * inv[:, None]).round_().clamp_(-127, 127).view(-1)[:n])
            root = _blocks(exp_avg_sq).sqrt_()
            absmax = root.amax(1)
            self.exp_avg_sq_scale.copy_(absmax)
            inv = torch.where(absmax > 0, 256 / absmax, 0.0)
            self.exp_avg_sq.copy_((root * inv[:, None]).sub_(1).round_().clamp_(0, 255).view(-1)[:n])


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x as rows of QBLOCK, its last row padded with zeros."""
    return F.pad(x, (0, -x.numel() % QBLOCK)).view(-1, QBLOCK)


def random_bits16(numel: int, index0: int, step: torch.Tensor, stream: int) -> torch.Tensor:
    """16 random bits (int32 in [0, 65536)) per element index0..index0+numel, step and stream: the lowbias32 hash
    (C. Wellons) of a mix of the three, as csrc/fused_adamw.cpp computes it in uint32."""
    idx = torch.arange(index0, index0 + numel, device=step.device, dtype=torch.int64) & _MASK32
    # int64 products of two 32-bit values wrap past 2**63; their low 32 bits, all we keep, stay exact
    x = (idx * 0x9E3779B1 + step.long() * 0x85EBCA77 + stream * 0xC2B2AE3D) & _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return (x & 0xFFFF).to(torch.int32)


def round_bf16_stochastic(x: torch.Tensor, index0: int, step: torch.Tensor, stream: int) -> torch.Tensor:
    """fp32 x rounded to bf16 up or down with probability by distance (unbiased): random bits added below bf16's
    16 kept bits of the fp32 pattern, then truncated (sign-magnitude, so negatives round symmetrically)."""
    bits = x.contiguous().view(torch.int32) + random_bits16(x.numel(), index0, step, stream)
    return (bits & -65536).view(torch.float32).to(torch.bfloat16)
