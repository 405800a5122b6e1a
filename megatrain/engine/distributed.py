"""Data parallel over the ranks of one host, through torch.distributed: `torchrun --nproc-per-node N -m megatrain ...`.

Every rank trains its share of the global batch's micro-batches on its own device, streaming weights from ONE copy
of the training state in shared host memory (engine/shared_store.py). A unit's gradient is summed across the ranks
on the device, before it leaves (in place: a reduce-scatter over the whole shards, an all-reduce of the few elements
left over), and each rank offloads and updates only its shard of every unit's flat tile (ShardedHostOptimizer). The
clip coefficient comes from the global norm: each rank's squared shard norms, summed across ranks with the loss.
Resident units are replicated: their whole gradient is all-reduced and every rank applies the same update to its
own copy (each counts its shard's slice of it in the norm).

Process groups: the default one carries gradients (NCCL on GPUs, gloo on CPU); a gloo group carries the control
traffic (objects from rank 0, the agreed stop signal). Launched without torchrun, nothing here runs: one process
trains exactly as before.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatrain.engine.config import EngineConfig
from megatrain.engine.layout import ALIGN


class RankLost(RuntimeError):
    """Another rank ended mid-run (a collective's connection closed, or its share of an update never came)."""


def _collective(method: Callable) -> Callable:
    """A Ranks method whose backend error, when a peer has gone, becomes RankLost with its first line."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            raise RankLost(f"rank {self.rank} of {self.world} lost another rank mid-step: "
                           f"{str(exc).splitlines()[0]}") from None
    return call


def launched() -> bool:
    """Whether this process is one rank of a torchrun launch (N >= 1)."""
    return dist.is_torchelastic_launched()


def check_system(system: str) -> None:
    """Refuse a system other than megatrain under torchrun: the baselines run one process each so far."""
    if launched() and system != "megatrain":
        raise ValueError(f"--system {system} runs in one process: start it without torchrun (under torchrun only "
                         "megatrain runs, data parallel over the ranks)")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks of one host, and the collectives the engine uses."""

    rank: int
    world: int
    device: torch.device
    control: dist.ProcessGroup | None  # gloo, for objects and flags (None: the default group is gloo already)

    @property
    def first(self) -> bool:
        """Rank 0: the one that reads and writes files for the run."""
        return self.rank == 0

    def shard(self, numel: int, rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of a unit's numel elements that `rank` (default this one) reduces, offloads and updates: equal
        ALIGN-multiple shards, the last rank also taking what is left over (fewer than world * ALIGN elements)."""
        rank = self.rank if rank is None else rank
        whole = self._whole_shard(numel)
        return rank * whole, numel if rank == self.world - 1 else (rank + 1) * whole

    def _whole_shard(self, numel: int) -> int:
        return numel // (self.world * ALIGN) * ALIGN

    def split_rows(self, *batches: torch.Tensor | None) -> list[torch.Tensor | None]:
        """This rank's contiguous share of each [B, ...] batch (its micro-batches, in order)."""
        def mine(t):
            share = t.shape[0] // self.world
            return t[self.rank * share:(self.rank + 1) * share]
        return [None if t is None else mine(t) for t in batches]

    @_collective
    def sum_gradient(self, grad: torch.Tensor, replicated: bool) -> torch.Tensor:
        """Sum the flat gradient `grad` across the ranks in place; returns this rank's shard of the sum (with
        replicated=True every element is summed, for a resident unit; else only this shard is valid)."""
        numel = grad.numel()
        lo, hi = self.shard(numel)
        if replicated:
            self.sum_(grad)
            return grad[lo:hi]
        whole = self._whole_shard(numel)
        if whole:  # in place: this rank's shard of the sum lands where its shard of the input was
            dist.reduce_scatter_single(grad[lo:lo + whole], grad[:whole * self.world])
        if whole * self.world < numel:  # the last rank's remainder
            self.sum_(grad[whole * self.world:])
        return grad[lo:hi]

    @_collective
    def sum_(self, t: torch.Tensor) -> None:
        """All-reduce t in place (a sum), over the gradients' group."""
        dist.all_reduce(t)

    @_collective
    def from_first(self, obj):
        """Rank 0's obj, on every rank (others pass anything)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    @_collective
    def agree(self, value: int) -> int:
        """The largest of every rank's value (a stop signal that reached any rank stops all at the same step)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t)

    @_collective
    def gather(self, obj) -> list:
        """Every rank's obj, in rank order, on every rank."""
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    @_collective
    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def per_rank(self, config: EngineConfig) -> EngineConfig:
        """The engine's config for this rank: its share of the global batch."""
        return per_rank(config, self.world)


def per_rank(config: EngineConfig, world: int) -> EngineConfig:
    """The engine's config for one of `world` ranks: its share of the global batch, the host copy shared."""
    if config.batch % (world * config.micro_batch):
        raise ValueError(f"--batch {config.batch} must be a multiple of the {world} ranks x --micro-batch "
                         f"{config.micro_batch}: each rank trains whole micro-batches, as many as the others")
    return replace(config, batch=config.batch // world, ranks=world)


def planned(config: EngineConfig) -> EngineConfig:
    """config as one rank of this launch runs it (unchanged for one process): for the memory plan, before any
    process group exists."""
    return per_rank(config, int(os.environ["WORLD_SIZE"])) if launched() else config


@functools.cache
def current(device: str) -> Ranks | None:
    """This process's Ranks under torchrun (the process groups made on first call, for `device` 'cpu' or 'cuda';
    NCCL and this rank's GPU on CUDA), or None for one process started without it."""
    if not launched():
        return None
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", local_rank) if cuda else None)
    if int(os.environ["LOCAL_WORLD_SIZE"]) != dist.get_world_size():
        raise ValueError("megatrain runs data parallel over the GPUs of one host: launch it with torchrun "
                         "--nproc-per-node N (one node)")
    control = dist.new_group(backend="gloo") if cuda else None
    return Ranks(dist.get_rank(), dist.get_world_size(), torch.device("cuda", local_rank) if cuda else
                 torch.device("cpu"), control)


def first_rank(device: str) -> bool:
    """Whether this process writes the run's files and output: one process, or rank 0 of several."""
    ranks = current(device)
    return ranks is None or ranks.first


def leave() -> None:
    """Destroy the process groups, if this process made them."""
    if dist.is_initialized():
        dist.destroy_process_group()
