"""Saved layer inputs of one step: kept on the GPU, offloaded to pinned host memory, or recomputed.

Activations index i is the input of layer i+1 (index 0 the embedding's output, index L the head's input). Each
index has one place: with R recomputed, indices 1..R are dropped once the next layer has read them and the
schedule regenerates them in backward by re-running layers 1..R from index 0, which then stays on the GPU; the K
offloaded are the first K indices after those (0..K-1 when R is 0); the rest stay on the GPU.

Offloaded (long contexts): each of those layers' outputs leaves on the D2H stream as soon as it is computed,
its GPU copy is dropped once the next layer has consumed it, and in backward the input of the next layer to
recompute streams back on the H2D stream while the current layer's backward runs. The early layers' inputs are
the ones offloaded (and recomputed) because they hide their transfers best: they leave at the start of the forward
and are needed last in backward, when the later layers' inputs have freed the GPU memory a regeneration needs.
With all offloaded at most about three activations per micro-batch live on the GPU. The last layer's output stays
on the GPU for the head. A host slot is read back only after its offload finished (`written`),
and overwritten only after its last read-back finished (`read`): the two copies run on different
streams, and without these waits the head's read-back of the last offloaded layer raced its offload.
"""

from __future__ import annotations

import torch

from megatrain.engine.store import pin_tensor, unpin_tensor
from megatrain.engine.streams import StreamSet


class ActivationStore:
    def __init__(self, streams: StreamSet, device: torch.device, offloaded: int, num_layers: int,
                 micro_batches: int, shape: tuple[int, ...], dtype: torch.dtype, recomputed: int = 0):
        """offloaded, recomputed: how many saved inputs go to host memory, and how many are regenerated instead."""
        self.streams, self.device = streams, device
        self.recomputed = min(recomputed, num_layers - 1)  # the head's input (index num_layers) never leaves
        first = self.recomputed + 1 if self.recomputed else 0
        self.host_indices = range(first, min(first + offloaded, num_layers))
        self.offloaded = len(self.host_indices)
        self.stats = {"h2d_bytes": 0, "d2h_bytes": 0}  # the schedule hands in each step's counters
        self.gpu: dict[int, list] = {}
        self.ready: dict[int, object] = {}  # h2d event: activations index are back on the GPU
        self.written: dict[int, object] = {}  # d2h event: host slot index holds activations index
        self.read: dict[int, object] = {}  # h2d event: the last read-back of host slot index finished
        self.host = None
        self.pinned_bytes = 0
        if self.offloaded:
            self.host = torch.empty((self.offloaded, micro_batches, *shape), dtype=dtype)
            if streams.cuda:
                self.pinned_bytes = pin_tensor(self.host)

    def put(self, index: int, xs: list[torch.Tensor]) -> None:
        """Save the activations `index` (the input of layer index+1, the head's for the last); a recomputed input,
        saved again when regenerated in backward, stays on the GPU until taken."""
        self.gpu[index] = xs
        if index not in self.host_indices:
            return
        slot = index - self.host_indices.start
        s = self.streams
        s.wait("d2h", s.record("compute"))
        s.wait("d2h", self.read.pop(index, None))
        start = s.record("d2h")
        with s.use("d2h"):
            for m, x in enumerate(xs):
                self.host[slot, m].copy_(x, non_blocking=True)
                if s.cuda:
                    x.record_stream(s.streams["d2h"])  # its memory is reused only after the copy
        self.written[index] = s.record("d2h")
        s.span("d2h", index, "act_offload", start, self.written[index])
        self.stats["d2h_bytes"] += sum(x.numel() * x.element_size() for x in xs)

    def consumed(self, index: int) -> None:
        """The forward no longer needs activations `index` on the GPU."""
        if index in self.host_indices or 1 <= index <= self.recomputed:
            del self.gpu[index]

    def prefetch(self, index: int) -> None:
        """Start bringing activations `index` back for backward (no-op when they never left)."""
        if index not in self.host_indices or index in self.gpu:
            return
        slot = index - self.host_indices.start
        s = self.streams
        s.wait("h2d", self.written.pop(index))
        start = s.record("h2d")
        with s.use("h2d"):
            xs = [torch.empty(self.host.shape[2:], dtype=self.host.dtype, device=self.device)
                  for _ in range(self.host.shape[1])]
            for m, x in enumerate(xs):
                x.copy_(self.host[slot, m], non_blocking=True)
                if s.cuda:
                    x.record_stream(s.streams["compute"])  # freed only after backward used it
        end = s.record("h2d")
        s.span("h2d", index, "act_load", start, end)
        self.stats["h2d_bytes"] += sum(x.numel() * x.element_size() for x in xs)
        self.gpu[index], self.ready[index], self.read[index] = xs, end, end

    def take(self, index: int) -> list[torch.Tensor]:
        """Activations `index` on the GPU, ordered after their prefetch; the store forgets them."""
        self.prefetch(index)
        self.streams.wait("compute", self.ready.pop(index, None))
        return self.gpu.pop(index)

    def close(self) -> None:
        if self.pinned_bytes:
            unpin_tensor(self.host)
            self.pinned_bytes = 0
