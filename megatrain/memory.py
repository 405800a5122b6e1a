"""Host and GPU memory: the one budget every pre-flight judges against, and what this process has used.

The rule, used by the engine's own plan, by `bench`'s and the suite's pre-flight of every system, and by
the report's batch projections:
- host: HOST_USABLE of the memory available when asked (MemAvailable, or a declared total less what is in
  use on VMs whose MemTotal grows as memory is touched: option host_mem_gib or MEGATRAIN_HOST_MEM_GIB).
  Estimates are estimates, and a host OOM takes more than the case down.
- GPU: a case is refused above the device's whole memory (a CUDA OOM ends only its case, and a margin
  would refuse batches that fit, which a largest-batch ladder measures); what a plan chooses to fill by
  itself (resident units) and what a projection assumes stops at GPU_FILL of it, leaving the allocator's
  fragmentation room.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import psutil
import torch

GIB = 2**30
HOST_USABLE = 0.92
GPU_FILL = 0.92


def host_memory_gib(declared_gib: float | None = None) -> tuple[float, float, str]:
    """(total, available, source) host memory in GiB. A declared total (argument, else MEGATRAIN_HOST_MEM_GIB)
    replaces MemTotal, for VMs whose MemTotal grows as memory is touched (the lent multi-GPU hosts read ~31 GiB
    until they have been filled); available is then that total less what is in use now."""
    vm = psutil.virtual_memory()
    declared, source = declared_gib, "option host_mem_gib"
    if declared is None and os.environ.get("MEGATRAIN_HOST_MEM_GIB"):
        declared, source = float(os.environ["MEGATRAIN_HOST_MEM_GIB"]), "MEGATRAIN_HOST_MEM_GIB"
    if declared is not None:
        return float(declared), float(declared) - (vm.total - vm.available) / GIB, source
    return vm.total / GIB, vm.available / GIB, "MemTotal"


def peak_host_rss_gib() -> float:
    """This process's peak resident set so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


@dataclass(frozen=True)
class Budget:
    """Bytes a case may use: host_bytes (HOST_USABLE already applied) and gpu_bytes (the whole device; None
    without a GPU)."""

    host_bytes: int
    gpu_bytes: int | None
    host_source: str

    @property
    def gpu_fill_bytes(self) -> int | None:
        return None if self.gpu_bytes is None else int(GPU_FILL * self.gpu_bytes)

    @staticmethod
    def of(host_available_gib: float, gpu_gib: float | None, host_source: str = "MemAvailable") -> Budget:
        gpu = None if gpu_gib is None else int(gpu_gib * GIB)
        return Budget(int(HOST_USABLE * host_available_gib * GIB), gpu, host_source)


def budget(device: str, host_mem_gib: float | None = None) -> Budget:
    """This machine's budget now, for a case on `device` ('cpu' or 'cuda')."""
    _, available, source = host_memory_gib(host_mem_gib)
    gpu = None
    if device == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_properties(0).total_memory / GIB
    return Budget.of(available, gpu, source)
