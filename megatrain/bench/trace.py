"""Background sampling of a running case: NVML (PCIe rx/tx, GPU utilisation, memory) and psutil.

The suite runner sets MEGATRAIN_TRACE_FILE for each case subprocess; megatrain.bench.case then
samples from before the system is built until the record is complete, writes the samples to that
sidecar file (JSON, one list per field) and puts a summary with the file's path in the record
under `trace`. Without the variable nothing is sampled. Without a GPU or NVML the GPU fields are
absent and the host fields are still sampled.

Host memory of the node: every process of the case (under torchrun: every rank, the launcher and their children;
else this process and its children) as PSS summed over them, which counts a page shared by N processes (the
engine's one host copy of the state in /dev/shm, mapped by every rank) once in all, not N times as summed RSS would.
PSS is read from /proc/PID/smaps_rollup, a walk of each process's page tables, so it is sampled once a second.

NVML's PCIe counters (nvmlDeviceGetPcieThroughput) are KB/s averaged over a 20 ms window, so
each sample costs ~40 ms of this thread's time; the default interval leaves it idle most of it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import psutil
import torch.distributed as dist

GIB = 2**30
TRACE_ENV = "MEGATRAIN_TRACE_FILE"
PSS_INTERVAL_S = 1.0


def _nvml_handle():
    """An NVML handle for the GPU this process uses (first of CUDA_VISIBLE_DEVICES), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        index = int(visible) if visible.isdigit() else 0
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # no driver, no GPU, no package: a CPU machine samples the host only
        return None


class Sampler:
    """Samples every `interval_s` in a daemon thread between start() and stop()."""

    def __init__(self, path: str | Path, interval_s: float = 0.15):
        self.path, self.interval_s = Path(path), interval_s
        self.process = psutil.Process()
        # under torchrun the launcher (this rank's parent) heads every rank of the node
        self.node_root = self.process.parent() if dist.is_torchelastic_launched() else self.process
        self.pss_readable = Path(f"/proc/{self.process.pid}/smaps_rollup").is_file()  # Linux 4.14+
        self.handle = _nvml_handle()
        fields = ["t_s", "rss_gib", "cpu_pct", "pss_t_s", "node_pss_gib"]
        if self.handle is not None:
            fields += ["pcie_rx_gbs", "pcie_tx_gbs", "gpu_util_pct", "gpu_mem_used_gib"]
        self.samples: dict[str, list[float]] = {f: [] for f in fields}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="megatrain-trace", daemon=True)
        self._cpu_seen: dict[int, psutil.Process] = {}

    def _tree(self, root: psutil.Process | None = None) -> list[psutil.Process]:
        root = root or self.process
        try:
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return [root]

    def _node_pss_gib(self) -> float:
        """PSS summed over every process of the case (module docstring)."""
        total = 0
        for proc in self._tree(self.node_root):
            try:
                rollup = Path(f"/proc/{proc.pid}/smaps_rollup").read_text()
            except OSError:  # a process that just exited
                continue
            total += next((int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss:")), 0)
        return total / GIB

    def _sample(self) -> None:
        rss, cpu = 0, 0.0
        for proc in self._tree():
            try:
                # cpu_percent needs the same Process object between calls to measure an interval.
                proc = self._cpu_seen.setdefault(proc.pid, proc)
                rss += proc.memory_info().rss
                cpu += proc.cpu_percent(None)
            except psutil.Error:  # a child that just exited
                continue
        s = self.samples
        s["t_s"].append(round(time.perf_counter() - self.t0, 3))
        s["rss_gib"].append(round(rss / GIB, 4))
        s["cpu_pct"].append(round(cpu, 1))
        if self.pss_readable and (not s["pss_t_s"] or s["t_s"][-1] - s["pss_t_s"][-1] >= PSS_INTERVAL_S):
            s["pss_t_s"].append(s["t_s"][-1])
            s["node_pss_gib"].append(round(self._node_pss_gib(), 4))
        if self.handle is not None:
            import pynvml

            rx = pynvml.nvmlDeviceGetPcieThroughput(self.handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
            tx = pynvml.nvmlDeviceGetPcieThroughput(self.handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
            # rx = bytes the GPU received (host -> device), tx = bytes it sent (device -> host).
            s["pcie_rx_gbs"].append(round(rx * 1024 / 1e9, 3))
            s["pcie_tx_gbs"].append(round(tx * 1024 / 1e9, 3))
            s["gpu_util_pct"].append(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            s["gpu_mem_used_gib"].append(round(pynvml.nvmlDeviceGetMemoryInfo(self.handle).used / GIB, 3))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def start(self) -> Sampler:
        self.t0, self.t0_unix = time.perf_counter(), time.time()
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling, write the sidecar file, and return the summary for the record."""
        self._stop.set()
        self._thread.join()
        self._sample()  # the final state, so even a sub-interval case has two samples
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"interval_s": self.interval_s, "t0_unix": self.t0_unix,
                                         "samples": self.samples}))
        s = self.samples
        summary = {"path": str(self.path), "num_samples": len(s["t_s"]), "interval_s": self.interval_s,
                   "peak_rss_gib": max(s["rss_gib"]), "mean_cpu_pct": sum(s["cpu_pct"]) / len(s["cpu_pct"])}
        if s["node_pss_gib"]:
            summary.update(peak_node_pss_gib=max(s["node_pss_gib"]), node_processes=len(self._tree(self.node_root)))
        if self.handle is not None:
            summary.update(max_pcie_rx_gbs=max(s["pcie_rx_gbs"]), max_pcie_tx_gbs=max(s["pcie_tx_gbs"]),
                           mean_gpu_util_pct=sum(s["gpu_util_pct"]) / len(s["gpu_util_pct"]),
                           peak_gpu_mem_used_gib=max(s["gpu_mem_used_gib"]))
        return summary


def start_trace() -> Sampler | None:
    """Start sampling into $MEGATRAIN_TRACE_FILE when it is set; None (no sampling) otherwise."""
    path = os.environ.get(TRACE_ENV)
    return Sampler(path).start() if path else None


def stop_trace(sampler: Sampler | None) -> dict | None:
    """The record's `trace` entry: the sampler's summary, or None when nothing was sampled."""
    return sampler.stop() if sampler is not None else None
