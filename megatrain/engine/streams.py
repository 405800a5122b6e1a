"""Streams, events and the per-step timeline; on CPU every stream is the host and events are instants.

CUDA: three streams (h2d prefetch, compute, d2h offload) ordered by events. The timeline records
(stream, unit, phase, start event, end event) and resolves them to milliseconds after the step's
first event once the step has synchronised.
"""

from __future__ import annotations

import contextlib
import time

import torch

STREAMS = ("h2d", "compute", "d2h")


class _HostEvent:
    """A CPU stand-in for torch.cuda.Event: work on the host is complete when it is recorded."""

    def __init__(self):
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


class StreamSet:
    def __init__(self, device: torch.device, timeline: bool = True):
        self.cuda = device.type == "cuda"
        self.streams = {name: torch.cuda.Stream(device) for name in STREAMS} if self.cuda else {}
        self.timeline_on = timeline
        self.spans: list[tuple[str, int, str, object, object]] = []
        self.origin = None

    def use(self, name: str):
        return torch.cuda.stream(self.streams[name]) if self.cuda else contextlib.nullcontext()

    def record(self, name: str):
        if not self.cuda:
            return _HostEvent()
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
