"""One host copy of the training state for every rank of a host, and the sharded host optimizer that updates it.

The store's flat tensors are files in /dev/shm that every rank maps (torch.from_file(shared=True)): rank 0 names
them, every rank maps them, and once all have, rank 0 unlinks them, so the memory lives exactly as long as the
ranks and a crash leaks nothing. Pages are the host's once, however many ranks touch them (the kernel counts them
in each rank's RSS, and once in PSS summed over the ranks). On a GPU each rank page-locks its own mapping of the
streamed weights and gradients (cudaHostRegister, as the one-process store does).

Each rank's optimizer updates its shard of every unit's tile (Ranks.shard) and then counts the update in a shared
[ranks, units] table; a rank streams a unit's weights only once every rank has counted as many updates of it as
this rank submitted, so no rank reads a tile that another is still writing.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import torch

from megatrain.engine.distributed import RANK_TIMEOUT_ENV, RankLost, Ranks, process_state, rank_timeout_s
from megatrain.engine.host_optimizer import HostOptimizer
from megatrain.engine.layout import Unit
from megatrain.engine.store import HostStore
from megatrain.models.shape import ModelShape

SHM_DIR = Path("/dev/shm")


class SharedHostStore(HostStore):
    """A HostStore whose tensors are shared by the ranks of one host (node); `updates` [local ranks, units] counts
    each rank's finished updates of each unit, `pids` [local ranks] says who they are (to notice one that ended)."""

    def __init__(self, cfg: ModelShape, compute_dtype: torch.dtype, precision: str, pin: bool, ranks: Ranks,
                 moments: str = "fp32", update_delay: int = 0):
        self.ranks = ranks
        self._prefix = ranks.from_first(str(SHM_DIR / f"megatrain-{os.getpid()}-{uuid.uuid4().hex[:12]}"), node=True)
        self._paths: list[str] = []
        super().__init__(cfg, compute_dtype, precision, pin, moments, update_delay)
        n = ranks.local_world
        self.updates = self._allocate("updates", n * len(self.units), torch.int64).view(n, -1)
        self.pids = self._allocate("pids", n, torch.int64)
        self.pids[ranks.local_rank] = os.getpid()
        ranks.barrier(node=True)  # every rank of the node has mapped every file: their names can go
        if ranks.node_first:
            for path in self._paths:
                os.unlink(path)

    def _fault_in(self, t: torch.Tensor) -> None:
        """The node's first rank touches the shared pages (a new file reads as zeros already); the others pin pages
        it has faulted in, or fault in the rest as they pin."""
        if self.ranks.node_first:
            super()._fault_in(t)

    def _allocate(self, name: str, numel: int, dtype: torch.dtype, zeroed: bool = False) -> torch.Tensor:
        """A file of /dev/shm mapped shared; a new file reads as zeros."""
        path = f"{self._prefix}-{name}"
        self._paths.append(path)
        return torch.from_file(path, shared=True, size=numel, dtype=dtype)

    def mapped_bytes(self) -> tuple[int, int]:
        """(RSS, PSS) of this rank's mappings of the store: the pages it touched, and those divided by the number of
        ranks mapping each (summed over the ranks, PSS counts every page of the one copy once)."""
        rss = pss = 0
        with open("/proc/self/smaps") as f:
            mine = False
            for line in f:
                fields = line.split()
                if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line: address range first
                    mine = len(fields) >= 6 and fields[5].startswith(self._prefix)
                elif mine and fields[0] in ("Rss:", "Pss:"):
                    kib = int(fields[1]) * 1024
                    rss, pss = (rss + kib, pss) if fields[0] == "Rss:" else (rss, pss + kib)
        return rss, pss

    def initialise(self, seed: int, device: torch.device) -> None:
        """The node's local rank 0 initialises its copy; every rank of the node returns once it is done."""
        if self.ranks.node_first:
            super().initialise(seed, device)
        self.ranks.barrier(node=True)


class ShardedHostOptimizer(HostOptimizer):
    """The host optimizer of one rank: its shard of every streamed unit; wait(u) returns once every rank's shard
    of unit u's pending update has landed."""

    store: SharedHostStore

    def __init__(self, store: SharedHostStore, *args, **kwargs):
        super().__init__(store, *args, **kwargs)
        self.ranks = store.ranks
        self.submitted = 0  # updates queued by this process: every rank queues the same ones
        self.limit_s = rank_timeout_s()  # the longest wait for another rank's share of an update

    def shard(self, unit: Unit) -> tuple[int, int]:
        return self.ranks.shard(unit.numel)

    def submit(self, clip_coef: float, grad_ready: list, lr: float, delayed: bool = False) -> None:
        self.submitted += 1
        super().submit(clip_coef, grad_ready, lr, delayed)

    def _update(self, unit, *args) -> None:
        super()._update(unit, *args)
        self.store.updates[self.ranks.local_rank, unit.index] += 1  # after the shard's writes: the others may read it

    def wait(self, unit_index: int) -> float:
        waited = super().wait(unit_index)
        if unit_index in self.skip:
            return waited
        counts = self.store.updates[:, unit_index]
        t0, pause = time.perf_counter(), 1e-5
        while len(behind := (counts < self.submitted).nonzero()):
            rank = int(behind[0])
            pid = int(self.store.pids[rank])
            state = process_state(pid)
            if state == "ended" or time.perf_counter() - t0 > self.limit_s:
                raise RankLost(f"local rank {rank} (pid {pid}, {state}) has not done its share of unit {unit_index}'s "
                               "update" + (f" in {self.limit_s:g} s ({RANK_TIMEOUT_ENV})" if state != "ended" else ""))
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return waited + time.perf_counter() - t0
