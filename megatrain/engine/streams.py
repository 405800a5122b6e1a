"""Streams, events and the per-step timeline; on CPU every stream is the host and events are instants.

CUDA: three streams (h2d prefetch, compute, d2h offload) ordered by events. The timeline records
(stream, unit, phase, start event, end event) and resolves them to milliseconds after the step's
first event once the step has synchronised.

Stream stress (a debug setting for the GPU correctness suite): with `stress_seed` set, every hand-off
(entering a stream, recording an event on it) first queues a random busy-wait of up to `stress_max_ms`
on that stream. Work that is ordered by an event waits along with it; work that is missing a wait
runs ahead and reads or overwrites what it should not, so a missing cross-stream wait changes the
result every run instead of once in a while.
"""

from __future__ import annotations

import contextlib
import random
import time

import torch

STREAMS = ("h2d", "compute", "d2h")
_CYCLES_PER_MS = 1_700_000  # torch.cuda._sleep counts GPU clock cycles: ~1.7 GHz on an H100/H200 under load


class _HostEvent:
    """A CPU stand-in for torch.cuda.Event: work on the host is complete when it is recorded."""

    def __init__(self):
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


class StreamSet:
    def __init__(self, device: torch.device, timeline: bool = True, stress_seed: int | None = None,
                 stress_max_ms: float = 2.0):
        self.cuda = device.type == "cuda"
        self.streams = {name: torch.cuda.Stream(device) for name in STREAMS} if self.cuda else {}
        self.timeline_on = timeline
        self.spans: list[tuple[str, int, str, object, object]] = []
        self.origin = None
        self.stress = random.Random(stress_seed) if stress_seed is not None and self.cuda else None
        self._stress_max_cycles = int(stress_max_ms * _CYCLES_PER_MS)

    def _jitter(self, name: str) -> None:
        """Stress mode: a random busy-wait queued on stream `name` (half the hand-offs get none)."""
        if self.stress is not None and self.stress.random() < 0.5:
            with torch.cuda.stream(self.streams[name]):
                torch.cuda._sleep(self.stress.randint(1, self._stress_max_cycles))

    @contextlib.contextmanager
    def use(self, name: str):
        if not self.cuda:
            yield
            return
        with torch.cuda.stream(self.streams[name]):
            self._jitter(name)
            yield

    def record(self, name: str):
        if not self.cuda:
            return _HostEvent()
        self._jitter(name)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.streams[name])
        return ev

    def wait(self, name: str, event) -> None:
        if self.cuda and event is not None:
            self.streams[name].wait_event(event)

    def begin_step(self) -> None:
        self.spans.clear()
        self.origin = self.record("compute")

    def span(self, stream: str, unit: int, phase: str, start, end) -> None:
        if self.timeline_on:
            self.spans.append((stream, unit, phase, start, end))

    def resolve_timeline(self) -> list[dict]:
        """Spans of the last step in ms after its origin; call after the step synchronised."""
        return [{"stream": s, "unit": u, "phase": p, "start_ms": self.origin.elapsed_time(a),
                 "end_ms": self.origin.elapsed_time(b)} for s, u, p, a, b in self.spans]
