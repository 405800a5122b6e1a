"""Data parallel over the ranks of one host, through torch.distributed: `torchrun --nproc-per-node N -m megatrain ...`.

Every rank trains its share of the global batch's micro-batches on its own device, streaming weights from ONE copy
of the training state in shared host memory (engine/shared_store.py). A unit's gradient is summed across the ranks
on the device, before it leaves (in place: a reduce-scatter over the whole shards, an all-reduce of the few elements
left over), and each rank offloads and updates only its shard of every unit's flat tile (ShardedHostOptimizer). The
clip coefficient comes from the global norm: each rank's squared shard norms, summed across ranks with the loss.
Resident units are replicated: their whole gradient is all-reduced and every rank applies the same update to its
own copy (each counts its shard's slice of it in the norm).

Process groups: the default one carries gradients (NCCL on GPUs, gloo on CPU); a gloo group carries the control
traffic (objects from rank 0, the agreed stop signal). Launched without torchrun, a process is the one rank of its
run (Ranks.alone): no process group exists, and each collective hands back what it was given. The baselines run
under torchrun on the same groups (megatrain/systems/dist.py).

Several nodes (hybrid, FSDP2's HSDP): each node holds one copy of the state, shared by its ranks and sharded among
them as above; a shard's gradient is summed within the node first, then across the nodes by the ranks of the same
local rank, so every node applies the same update to its copy. Rank 0 writes the files; each node's local rank 0
fills its copy (init, weights, a saved state) from the same files.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatrain.engine.config import EngineConfig
from megatrain.engine.layout import ALIGN
from megatrain.run_config import share


class RankLost(RuntimeError):
    """Another rank ended, or stopped answering, mid-run (a collective's connection closed or timed out, or its share
    of an update never came)."""


# How long a rank waits on another (a collective, its share of an update) before the run stops naming it: torch's own
# default for gloo; a rank may wait this long while rank 0 verifies or writes a checkpoint of the largest models
RANK_TIMEOUT_ENV = "MEGATRAIN_RANK_TIMEOUT_S"


def rank_timeout_s() -> float:
    """MEGATRAIN_RANK_TIMEOUT_S, else 1800 s."""
    value = os.environ.get(RANK_TIMEOUT_ENV, "1800")
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ValueError(f"{RANK_TIMEOUT_ENV} must be a number of seconds > 0, got {value!r}")
    return seconds


def process_state(pid: int) -> str:
    """'running', 'stopped' (SIGSTOP, a debugger) or 'ended' (gone, or a zombie not yet reaped) for a process of
    this host."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "ended"
    return "ended" if state in ("Z", "X") else "stopped" if state in ("T", "t") else "running"


def reduce_scatter():
    """torch.distributed's reduce-scatter of one flat tensor: reduce_scatter_single from torch 2.13, which
    deprecates the reduce_scatter_tensor that earlier versions have (the GPU hosts run 2.11: looked up, not assumed)."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collective(method: Callable) -> Callable:
    """A Ranks method whose backend error, when a peer has gone, becomes RankLost with its first line."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            raise RankLost(f"rank {self.rank} of {self.world} lost {self.unanswering()} mid-step: "
                           f"{str(exc).splitlines()[0]}") from None
    return call


def launched() -> bool:
    """Whether this process is one rank of a torchrun launch (N >= 1)."""
    return dist.is_torchelastic_launched()


# set once this process has started a one-process world of its own (a baseline run without torchrun: FSDP2,
# DeepSpeed; megatrain.systems.dist.single_process_env)
_OWN_WORLD: list[bool] = []


def started_own_world() -> None:
    _OWN_WORLD.append(True)


def teardown_may_abort() -> bool:
    """Whether the interpreter's teardown may abort this process ('terminate called without an active exception'
    from torch's process-group threads, pytorch/pytorch#179291): a torchrun rank, or a process that made process
    groups of its own, even once destroyed (an FSDP2 resume refused on an unreadable .metadata aborted so, under
    load, after its one-line error: exit -6 for 2)."""
    return launched() or bool(_OWN_WORLD)


# (ranks, ranks per node) that plans are made for meanwhile, from one process (as_launch)
_PLANNED_LAUNCH: list[tuple[int, int]] = []


@contextlib.contextmanager
def as_launch(world: int):
    """Meanwhile, launch_size and planned answer for one node's torchrun launch of `world` ranks: the suite runner
    plans a case of N ranks from its one process before it starts them."""
    _PLANNED_LAUNCH.append((world, world))
    try:
        yield
    finally:
        _PLANNED_LAUNCH.pop()


def launch_size() -> tuple[int, int]:
    """(ranks, ranks per node) of this launch, read before any process group exists: (1, 1) without torchrun (or
    what as_launch plans for)."""
    if _PLANNED_LAUNCH:
        return _PLANNED_LAUNCH[-1]
    if not launched():
        return 1, 1
    return int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])


def accumulation_steps(batch: int, micro_batch: int, world: int) -> int:
    """Micro-batches each rank accumulates a step: its share of the global batch (share) in micro-batches."""
    return share(batch, micro_batch, world) // micro_batch


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks (of one host, or of several nodes: one copy of the state per node),
    and the collectives the engine and the systems use. Groups None stand for the whole world. A process started
    without torchrun is one rank of one (alone; launched False): its collectives hand back what they are given."""

    rank: int
    world: int
    device: torch.device
    control: dist.ProcessGroup | None  # gloo, for objects and flags (None: the default group is gloo already)
    local_rank: int = 0  # within the node
    local_world: int = 0  # ranks of a node, sharing its copy of the state (0: all, one node)
    node: dist.ProcessGroup | None = None  # the node's ranks, for gradients (several nodes only)
    node_control: dist.ProcessGroup | None = None  # the node's ranks, gloo
    peers: dist.ProcessGroup | None = None  # this local rank on every node: shards summed across nodes
    pids: tuple[int, ...] = ()  # each rank's process id (those of this node's ranks can be looked at)
    launched: bool = True  # one rank of a torchrun launch (of one or more); False: a process started alone

    @classmethod
    def alone(cls, device: str | torch.device) -> Ranks:
        """A process started without torchrun: rank 0 of 1 on `device`, with no process group."""
        return cls(0, 1, torch.device(device), None, pids=(os.getpid(),), launched=False)

    def __post_init__(self) -> None:
        if not self.local_world:  # one node: the world
            object.__setattr__(self, "local_world", self.world)
            object.__setattr__(self, "local_rank", self.rank)
            object.__setattr__(self, "node_control", self.control)

    def unanswering(self, settle_s: float = 2.0) -> str:
        """The other ranks of this node that stopped or ended, in words ('rank 1 (pid 4242, stopped)'), as a
        collective that failed names none; 'another rank' when none of them did (one on another node). A killed
        process closes its sockets before it is a zombie, so its peer may hear of it while it still reads as
        running: the states are read again for up to settle_s."""
        node = range(self.rank - self.local_rank, self.rank - self.local_rank + self.local_world)
        deadline = time.monotonic() + settle_s
        while True:
            states = {r: process_state(pid) for r, pid in enumerate(self.pids) if r in node and r != self.rank}
            named = [f"rank {r} (pid {self.pids[r]}, {state})" for r, state in states.items() if state != "running"]
            if named or time.monotonic() >= deadline:
                return ", ".join(named) or "another rank"
            time.sleep(0.05)

    @property
    def first(self) -> bool:
        """Rank 0: the one that writes files for the run."""
        return self.rank == 0

    @property
    def node_first(self) -> bool:
        """Local rank 0: the one that fills its node's copy of the state (initialises, reads weights and states)."""
        return self.local_rank == 0

    def shard(self, numel: int, local_rank: int | None = None) -> tuple[int, int]:
        """[lo, hi) of a unit's numel elements that `local_rank` (default this one) of a node reduces, offloads and
        updates: equal ALIGN-multiple shards (whole int8 moment blocks: QBLOCK divides ALIGN), the last also taking
        what is left over (< local_world x ALIGN)."""
        r = self.local_rank if local_rank is None else local_rank
        whole = self._whole_shard(numel)
        return r * whole, numel if r == self.local_world - 1 else (r + 1) * whole

    def _whole_shard(self, numel: int) -> int:
        return numel // (self.local_world * ALIGN) * ALIGN

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
        if not self.launched:
            return grad
        numel = grad.numel()
        lo, hi = self.shard(numel)
        if replicated:
            dist.all_reduce(grad)
            return grad[lo:hi]
        whole, n = self._whole_shard(numel), self.local_world
        if whole:  # in place: this rank's shard of the node's sum lands where its shard of the input was
            reduce_scatter()(grad[lo:lo + whole], grad[:whole * n], group=self.node)
        if whole * n < numel:  # the last local rank's remainder
            dist.all_reduce(grad[whole * n:], group=self.node)
        if self.peers is not None:  # then across the nodes: every node's copy takes the same update
            dist.all_reduce(grad[lo:hi], group=self.peers)
        return grad[lo:hi]

    @_collective
    def sum_norm_and_loss(self, norm_sq_and_loss: torch.Tensor) -> None:
        """Sum [squared norm of this rank's shards, its micro-batches' loss] in place: the norm over a node's ranks
        (their shards make every unit once; each node holds the same sums), the loss over all."""
        if not self.launched:
            return
        if self.peers is None:
            dist.all_reduce(norm_sq_and_loss)
            return
        dist.all_reduce(norm_sq_and_loss[:1], group=self.node)
        dist.all_reduce(norm_sq_and_loss[1:])

    @_collective
    def from_first(self, obj, node: bool = False):
        """Rank 0's obj, on every rank (others pass anything); node=True: the node's local rank 0's, on its ranks."""
        if not self.launched:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.rank - self.local_rank if node else 0, group=self._control(node))
        return box[0]

    @_collective
    def agree(self, value: int) -> int:
        """The largest of every rank's value (a stop signal that reached any rank stops all at the same step)."""
        if not self.launched:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t)

    @_collective
    def gather(self, obj, node: bool = False) -> list:
        """Every rank's obj (node=True: of this node's ranks), in rank order, on each of them."""
        if not self.launched:
            return [obj]
        out = [None] * (self.local_world if node else self.world)
        dist.all_gather_object(out, obj, group=self._control(node))
        return out

    @_collective
    def barrier(self, node: bool = False) -> None:
        """Every rank (node=True: of this node) has come here."""
        if self.launched:
            dist.barrier(group=self._control(node))

    @_collective
    def summed(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over every rank, in place (the default group: gradients' backend)."""
        if self.launched:
            dist.all_reduce(t)
        return t

    def _control(self, node: bool) -> dist.ProcessGroup | None:
        return self.node_control if node else self.control

    def per_rank(self, config: EngineConfig) -> EngineConfig:
        """The engine's config for this rank: its share of the global batch."""
        return per_rank(config, self.world, self.local_world)


def per_rank(config: EngineConfig, world: int, local_world: int) -> EngineConfig:
    """The engine's config for one of `world` ranks: its share of the global batch, the host copy shared by the
    `local_world` ranks of its node."""
    return replace(config, batch=share(config.batch, config.micro_batch, world), ranks=local_world)


def planned(config: EngineConfig) -> EngineConfig:
    """config as one rank of this launch runs it (unchanged for one process): for the memory plan, before any
    process group exists."""
    if not launched() and not _PLANNED_LAUNCH:
        return config
    return per_rank(config, *launch_size())


@functools.cache
def current(device: str) -> Ranks:
    """This process's Ranks: under torchrun its rank's (the process groups made on first call, for `device` 'cpu' or
    'cuda'; NCCL and this rank's GPU on CUDA), else the one rank of a process started alone."""
    if not launched():
        return Ranks.alone(device)
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    # gloo beside NCCL on CUDA for the CPU tensors of a collective: FSDP2's offloaded shards (clipping's norm)
    timeout = datetime.timedelta(seconds=rank_timeout_s())
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo",
                            device_id=torch.device("cuda", local_rank) if cuda else None, timeout=timeout)
    rank, world, local_world = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    control = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
    global _leave_group
    _leave_group = control
    # a process that ends without leave() (a script driving megatrain.Engine: train's ranks leave, then skip the
    # interpreter's teardown) leaves at its exit, after meeting the other ranks: a rank tearing its groups down while
    # another still talked to it aborted a finished rank at exit ('terminate called without an active exception')
    atexit.register(leave)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=control)
    if local_world == world:
        return Ranks(rank, world, device, control, pids=tuple(pids))
    if world % local_world or rank != int(os.environ["GROUP_RANK"]) * local_world + local_rank:
        raise ValueError("several nodes need the same --nproc-per-node on each, and ranks numbered node by node")
    nodes = [list(range(n, n + local_world)) for n in range(0, world, local_world)]
    node, _ = dist.new_subgroups_by_enumeration(nodes)
    node_control = dist.new_subgroups_by_enumeration(nodes, backend="gloo")[0] if cuda else node
    peers, _ = dist.new_subgroups_by_enumeration([list(range(r, world, local_world)) for r in range(local_world)])
    return Ranks(rank, world, device, control, local_rank, local_world, node, node_control, peers, tuple(pids))


def first_rank(device: str) -> bool:
    """Whether this process writes the run's files and output: one process, or rank 0 of several."""
    return current(device).first


LEAVE_TIMEOUT_S = 120
_leave_group: dist.ProcessGroup | None = None  # the gloo group every rank meets in before leaving (None: the default)


def leave() -> None:
    """Destroy the process groups, if this process made them: after every rank has come here (a gloo barrier, bounded,
    passed over when a peer is gone), so that no rank tears its groups down while another still talks to it. A rank
    that left early while rank 0 still exported aborted at exit now and then ('terminate called without an active
    exception' from gloo's threads: CI, the FSDP2 2-rank test)."""
    if not dist.is_initialized():
        return
    try:
        dist.monitored_barrier(_leave_group, timeout=datetime.timedelta(seconds=LEAVE_TIMEOUT_S))
    except (RuntimeError, ValueError):
        pass  # a rank already gone (the run is ending on its error), or a group this module did not make
    dist.destroy_process_group()


def exit_rank(code: int) -> None:
    """End a torchrun rank with `code` without the interpreter's finalisation: torch's process-group threads can
    still abort a process there after destroy_process_group (pytorch/pytorch#179291 describes the teardown race), and
    a rank's output is all written and flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
