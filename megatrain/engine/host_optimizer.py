"""The overlapped host optimizer: AdamW unit by unit on a worker thread.

Step t's update can only start when its global gradient norm is known (end of backward). It then
runs in forward order (embedding, layer 0, ..., head) while step t+1's forward consumes the
results: the prefetch of unit u waits only for unit u's update, so the optimizer hides behind
compute instead of adding to the step.

With the update delayed a step (MegaTrainOptions.update_delay=1) the update of step t's gradient
writes the weights of step t+2 into the store's second copy while step t+1 streams the first:
step t+1 waits for nothing, and the schedule waits for the whole update only at its own end.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from megatrain.engine.layout import Unit
from megatrain.engine.store import OPT_CHUNK, HostStore
from megatrain.optim import fused
from megatrain.optim.compact import Moments
from megatrain.optim.config import OptimConfig
from megatrain.optim.host_adamw import FlatAdamW


def regions(unit: Unit, weight_decay: float, shard: tuple[int, int] | None = None,
            moments: str = "fp32") -> tuple[tuple, ...]:
    """(start, end, weight decay) of the unit's decayed region and of the rest, within `shard` [lo, hi) of its tile
    (default all of it; a rank's share over several ranks): a region outside the shard comes out empty. Compact
    moments: the shard as one region, weight decay None (their int8 blocks do not split at the decayed region's
    end; the update splits it)."""
    lo, hi = shard or (0, unit.numel)
    if moments != "fp32":
        return ((lo, hi, None),)
    d = unit.decay_numel
    return (lo, min(d, hi), weight_decay), (max(d, lo), hi, 0.0)


def torch_adamw_unit(adamw: FlatAdamW, unit: Unit, weights: torch.Tensor, grads: torch.Tensor,
                     master: torch.Tensor | None, moments: Moments, clip: float,
                     weight_decay: float, grad_scratch: torch.Tensor | None,
                     param_scratch: torch.Tensor | None, lr: float, shard: tuple[int, int] | None = None) -> None:
    """torch's AdamW over one unit's flat tensors (host tiles or resident GPU buffers), its decayed region
    then the rest, in chunks of OPT_CHUNK: gradients in fp32 (converted in grad_scratch when they are
    not) times the clip coefficient, weights updated in fp32 (the master, the weights themselves, or a
    copy in param_scratch rounded back to bf16). shard: the part of the tile updated (default all). Compact moments
    go chunk by chunk through the whole shard, decoded and encoded around the same update."""
    for lo, hi, wd in regions(unit, weight_decay, shard, moments.format):
        for a in range(lo, hi, OPT_CHUNK):
            b = min(a + OPT_CHUNK, hi)
            weights_chunk = weights[a:b]
            if master is not None:
                p32 = master[a:b]
            elif weights_chunk.dtype == torch.float32:
                p32 = weights_chunk
            else:  # bf16 mode: update in fp32, round back to the stored bf16 weights
                p32 = param_scratch[:b - a].copy_(weights_chunk)
            g32 = grads[a:b] if grads.dtype == torch.float32 else grad_scratch[:b - a].copy_(grads[a:b])
            if clip != 1.0:  # torch's clip_grad_norm_ multiplies by the clamped coefficient; x1.0 is exact
                g32.mul_(clip)
            if wd is None:  # compact moments
                update_compact(adamw, unit, a, p32, g32, moments.slice(a, b), weight_decay, lr)
            else:
                adamw.update((unit.index, a), p32, g32, moments.exp_avg[a:b], moments.exp_avg_sq[a:b], wd, lr)
            if p32 is not weights_chunk:
                weights_chunk.copy_(p32)  # the bf16 weights the next step streams


def update_compact(adamw: FlatAdamW, unit: Unit, a: int, p32: torch.Tensor, g32: torch.Tensor, moments: Moments,
                   weight_decay: float, lr: float) -> None:
    """AdamW of unit elements a.. (fp32 weights p32 and gradients g32) with compact moments: decoded to fp32, updated
    by FlatAdamW (the decayed part, then the rest), encoded back with the random bits of their store indices."""
    m32, v32 = moments.decode()
    split = min(max(unit.decay_numel - a, 0), p32.numel())
    for lo, hi, wd in ((0, split, weight_decay), (split, p32.numel(), 0.0)):
        adamw.update((unit.index, a + lo), p32[lo:hi], g32[lo:hi], m32[lo:hi], v32[lo:hi], wd, lr)
    moments.encode_(m32, v32, unit.offset + a, adamw.steps[(unit.index, a + (0 if split else split))])


class HostOptimizer:
    def __init__(self, store: HostStore, optim: OptimConfig, kernel: str = "fused", skip: frozenset = frozenset()):
        if kernel not in ("fused", "torch"):
            raise ValueError(f"optimizer kernel must be 'fused' or 'torch', got {kernel!r}")
        self.store = store
        self.optim = optim
        self.adamw = FlatAdamW(optim)
        self.weight_decay = optim.weight_decay
        self.kernel = "fused" if kernel == "fused" and fused.available() else "torch"
        # torch's AdamW works on fp32 tensors: one optimizer chunk of fp32 scratch for the streamed bf16
        # gradients and, in bf16 mode, the weights (the one-pass kernel reads and writes bf16 directly)
        chunk = min(OPT_CHUNK, store.max_unit_numel)
        torch_kernel = self.kernel == "torch"
        self.grad_scratch = torch.empty(chunk, dtype=torch.float32) \
            if torch_kernel and store.grads.dtype != torch.float32 else None
        self.param_scratch = torch.empty(chunk, dtype=torch.float32) \
            if torch_kernel and store.master is None and store.weights.dtype != torch.float32 else None
        self.step_count = 0
        self.skip = skip  # resident units: their state lives and is updated on the GPU
        self.done = [threading.Event() for _ in store.units]
        for ev in self.done:
            ev.set()
        # (unit, host start s, host end s) of the updates finished: the worker appends, the training thread takes
        self._spans: list[tuple[int, float, float]] = []
        self.busy_s, self.updated_params = 0.0, 0  # the worker's totals (its shards'): its achieved rate (metrics)
        self._spans_lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="megatrain-host-adamw", daemon=True)
        self._thread.start()

    def submit(self, clip_coef: float, grad_ready: list, lr: float, delayed: bool = False) -> None:
        """Queue one optimizer step at learning rate lr; grad_ready[u] is the event after which unit u's gradients
        are on the host. delayed: of the pending gradients (HostStore.hand_over_grads), into the next step's weights;
        else in place."""
        done = [threading.Event() for _ in self.store.units]
        self.done = done
        self.step_count += 1
        tiles = self.store.update_tiles(delayed)
        self.store.ahead = delayed  # the next step's weights are ahead of the streamed ones once it lands
        self._jobs.put((done, clip_coef, grad_ready, self.step_count, lr, tiles))

    def shard(self, unit: Unit) -> tuple[int, int]:
        """[lo, hi) of unit's tile this optimizer updates: all of it (a sharded one: its rank's shard)."""
        return 0, unit.numel

    def take_spans(self) -> list[tuple[int, float, float]]:
        """(unit, host start s, host end s) of each update finished since the last call. The list is swapped under a
        lock: the worker thread appends to it while the training thread reads."""
        with self._spans_lock:
            spans, self._spans = self._spans, []
        return spans

    def wait(self, unit_index: int) -> float:
        """Block until unit_index's pending update has landed; returns the seconds spent waiting."""
        ev = self.done[unit_index]
        if ev.is_set():
            self._raise()
            return 0.0
        t0 = time.perf_counter()
        ev.wait()
        self._raise()
        return time.perf_counter() - t0

    def flush(self) -> None:
        for i in range(len(self.store.units)):
            self.wait(i)

    def close(self) -> None:
        """End the worker once it has run every update queued (this process's own: not another rank's)."""
        self._jobs.put(None)
        self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("host optimizer failed") from self._error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            done, clip_coef, grad_ready, step, lr, tiles = job
            try:
                for unit in self.store.units:
                    if unit.index in self.skip:
                        done[unit.index].set()
                        continue
                    grad_ready[unit.index].synchronize()
                    t0 = time.perf_counter()
                    self._update(unit, clip_coef, step, lr, tiles)
                    t1 = time.perf_counter()
                    with self._spans_lock:
                        self._spans.append((unit.index, t0, t1))
                    self.busy_s += t1 - t0
                    lo, hi = self.shard(unit)
                    self.updated_params += hi - lo
                    done[unit.index].set()
            except BaseException as exc:  # surfaced to the training thread by wait()
                self._error = exc
                for ev in done:
                    ev.set()

    def _update(self, unit, clip_coef: float, step: int, lr: float, tiles: tuple) -> None:
        """One unit's update. tiles: the job's HostStore.update_tiles; where the weights read and written differ and
        there is no master, the streamed weights are copied to the next step's first."""
        s, o = self.store, self.optim
        grads, weights = s.tile(tiles[0], unit), s.tile(tiles[2], unit)
        master = s.tile(s.master, unit) if s.master is not None else None
        if tiles[2] is not tiles[1] and master is None:
            lo, hi = self.shard(unit)
            weights[lo:hi].copy_(s.tile(tiles[1], unit)[lo:hi])
        moments = s.moment_tiles(unit)
        if self.kernel == "torch":
            torch_adamw_unit(self.adamw, unit, weights, grads, master, moments, clip_coef, self.weight_decay,
                             self.grad_scratch, self.param_scratch, lr, self.shard(unit))
            return
        for lo, hi, weight_decay in regions(unit, self.weight_decay, self.shard(unit), moments.format):
            for a in range(lo, hi, OPT_CHUNK):
                b = min(a + OPT_CHUNK, hi)
                weights_chunk = weights[a:b]
                # mixed: the fp32 master updated, a bf16 copy out; bf16: the weights updated in place
                p = master[a:b] if master is not None else weights_chunk
                copy_out = None if p is weights_chunk else weights_chunk
                if weight_decay is None:  # compact moments: decay on the unit's first decay_numel elements
                    fused.compact_adamw(p, grads[a:b], moments.slice(a, b), copy_out, unit.decay_numel - a,
                                        unit.offset + a, step, clip_coef, lr, o.beta1, o.beta2, o.eps,
                                        self.weight_decay)
                else:
                    fused.fused_adamw(p, grads[a:b], moments.exp_avg[a:b], moments.exp_avg_sq[a:b], copy_out, step,
                                      clip_coef, lr, o.beta1, o.beta2, o.eps, weight_decay)
