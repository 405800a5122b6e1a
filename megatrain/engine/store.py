"""Host store: every byte of training state in host memory, as flat per-unit tiles.

Per parameter, by precision mode (compute dtype bf16; megatrain.optim.state_bytes):
- mixed: bf16 weights (pinned, streamed to the GPU) 2 B, bf16 gradients (pinned, streamed back)
  2 B, fp32 master weights 4 B, fp32 Adam moments 8 B: 16 B/param.
- bf16: bf16 weights 2 B, bf16 gradients 2 B, fp32 Adam moments 8 B: 12 B/param (the paper's
  layout; updates run in fp32 and are rounded back to bf16).
With compute dtype fp32 (CPU parity runs) weights are the master weights and gradients are fp32. Compact moments
(OptimConfig.moments, megatrain.optim.compact) take 4 (bf16) or 2.06 (int8) B/param instead of 8. With the update
delayed a step (MegaTrainOptions.update_delay) the weights and gradients have second copies that trade places every
step: the host optimizer writes the next step's weights while this step streams its own, and reads the pending
gradient while this step's backward writes the next.
Only tiles that DMA reads or writes are pinned (page-locked in place with cudaHostRegister, which
does not round sizes up the way the caching pinned allocator does).
"""

from __future__ import annotations

import functools

import torch

from megatrain.engine.layout import Unit, build_units, total_numel
from megatrain.models.init import init_param
from megatrain.models.shape import ModelShape
from megatrain.optim.compact import Moments
from megatrain.optim.state_bytes import QBLOCK, state_bytes_per_param

OPT_CHUNK = 2**25  # elements the optimizer updates at a time: bounds its fp32 scratch to 128 MiB


def pin_tensor(t: torch.Tensor) -> int:
    """Page-lock `t` in place; returns the bytes pinned."""
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed with CUDA error {int(err)}")
    return nbytes


def unpin_tensor(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostStore:
    def __init__(self, cfg: ModelShape, compute_dtype: torch.dtype, precision: str, pin: bool,
                 moments: str = "fp32", update_delay: int = 0):
        if precision == "bf16" and compute_dtype != torch.bfloat16:
            raise ValueError("--precision bf16 stores bf16 weights: it needs --dtype bfloat16")
        self.cfg = cfg
        self.units: list[Unit] = build_units(cfg)
        self.precision = precision
        self.compute_dtype = compute_dtype
        n = total_numel(self.units)
        self.max_unit_numel = max(u.numel for u in self.units)
        self.weights = self._allocate("weights", n, compute_dtype)
        self.grads = self._allocate("grads", n, compute_dtype)
        # an fp32 master copy only where mixed precision streams weights narrower than fp32
        tiles = state_bytes_per_param(compute_dtype.itemsize, precision, update_delay=update_delay)
        self.master = self._allocate("master", n, torch.float32) if "master" in tiles else None
        # int8: its blocks start on unit tiles (QBLOCK divides ALIGN)
        self.moments = Moments.zeros(n, moments, allocate=functools.partial(self._allocate, zeroed=True))
        # update_delay: the next step's weights (written by the host optimizer) and the pending gradient (read by it)
        self.weights_next = self._allocate("weights_next", n, compute_dtype) if "weights_next" in tiles else None
        self.grads_pending = self._allocate("grads_pending", n, compute_dtype) if "grads_pending" in tiles else None
        self.ahead = False  # weights_next holds an update the streamed weights lack yet
        self._pinned: list[torch.Tensor] = []
        self.pinned_bytes = 0
        if pin:
            for t in (self.weights, self.grads, self.weights_next, self.grads_pending):
                if t is None:
                    continue
                self._fault_in(t)
                self.pinned_bytes += pin_tensor(t)
                self._pinned.append(t)

    def _fault_in(self, t: torch.Tensor) -> None:
        """Touch every page of a tile about to be pinned, on every core (a fill is parallel): cudaHostRegister faults
        a fresh allocation's pages in one by one in one thread, which on a VM that backs memory as it is touched may
        be what kept a 72B build (290 GB pinned) past 19 minutes. The values are initialise's and the steps' to write.
        """
        t.zero_()

    def _allocate(self, name: str, numel: int, dtype: torch.dtype, zeroed: bool = False) -> torch.Tensor:
        """One flat host tensor of the store (`name`: which; a shared store maps it from shared memory): zeroed, or
        a tile of which only the padding before aligned tensors is (layout.SLOT_ALIGN; no parameter writes it, and
        left as it was allocated it would make equal states differ)."""
        if zeroed:
            return torch.zeros(numel, dtype=dtype)
        tile = torch.empty(numel, dtype=dtype)
        for unit in self.units:
            for a, b in unit.gaps:
                tile[unit.offset + a:unit.offset + b].zero_()
        return tile

    def advance_weights(self) -> None:
        """update_delay: the weights the host optimizer wrote become the ones the next step streams."""
        self.weights, self.weights_next = self.weights_next, self.weights
        self.ahead = False

    def hand_over_grads(self) -> None:
        """update_delay: the gradients this step wrote become the pending ones; the next step writes the other copy."""
        self.grads, self.grads_pending = self.grads_pending, self.grads

    def update_tiles(self, delayed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The flat (gradients, weights read, weights written) of the next host update: the gradients and weights in
        place, or with the update delayed the pending gradients and the next step's weights."""
        if not delayed:
            return self.grads, self.weights, self.weights
        if self.weights_next is None:
            raise RuntimeError("a delayed update needs the store's second copies: build it with update_delay=1")
        return self.grads_pending, self.weights, self.weights_next

    @property
    def latest_weights(self) -> torch.Tensor:
        """The weights with every submitted update applied (once the optimizer has flushed): the next step's copy
        while the update delay keeps one ahead of the streamed weights."""
        return self.weights_next if self.ahead else self.weights

    def tile(self, flat: torch.Tensor, unit: Unit) -> torch.Tensor:
        return flat[unit.offset:unit.offset + unit.numel]

    def moment_tiles(self, unit: Unit) -> Moments:
        assert unit.offset % QBLOCK == 0
        return self.moments.slice(unit.offset, unit.offset + unit.numel)

    @torch.no_grad()
    def initialise(self, seed: int, device: torch.device) -> None:
        """Deterministic init by parameter name (values equal a model initialised on `device`)."""
        for unit in self.units:
            dst = self.tile(self.master if self.master is not None else self.weights, unit)
            for slot in unit.params:
                init_param(slot.name, unit.view(dst, slot), seed, device=device)
            if self.master is not None:
                self.tile(self.weights, unit).copy_(dst)

    def host_bytes(self) -> int:
        tensors = [self.weights, self.grads, self.master, self.weights_next, self.grads_pending,
                   *self.moments.tensors().values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def named_parameters_fp32(self) -> dict[str, torch.Tensor]:
        src = self.master if self.master is not None else self.latest_weights
        return {slot.name: unit.view(self.tile(src, unit), slot).float().clone()
                for unit in self.units for slot in unit.params}

    def close(self) -> None:
        for t in self._pinned:
            unpin_tensor(t)
        self._pinned.clear()
