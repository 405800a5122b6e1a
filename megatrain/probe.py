"""The probe: a short measurement of the machine a run is on, a `Machine`.

The pre-flight (megatrain.preflight) judges a case against its memory; the suite runner stores it (`to_dict()`) with
every record of the run, so that a number is always read beside the link and GEMM rates of the machine it came from; a
suite's cases run where the probe matches their hardware profile (megatrain.hardware).

The probe takes seconds: pinned PCIe copies (H2D, D2H, both at once), a bf16 8192^3 GEMM, host
memory, its bandwidth (STREAM's read, write, copy and triad per thread count, by C++ kernels where the engine's host
AdamW extension builds, else by torch's ops), torch's fused CPU AdamW rate and the engine's own host AdamW kernel in
each precision (the performance model's host ingredient, megatrain.perf_model). GPU numbers are None on a machine
without CUDA.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from megatrain.memory import GIB, host_memory_gib


@dataclass(frozen=True)
class Machine:
    """What the probe measured; a rate is None where the machine cannot have it (GPU ones without CUDA) or it was not
    asked for. Records keep it as to_dict(), in these keys."""

    cpu: str
    cpu_cores: int
    host_mem_gib: float
    host_available_gib: float
    host_mem_source: str | None = None  # MemTotal, or where a declared total came from (megatrain.memory)
    gpu_name: str | None = None
    gpu_count: int = 0
    gpu_mem_gib: float | None = None
    h2d_gbs: float | None = None  # pinned copies, 1e9 bytes/s
    d2h_gbs: float | None = None
    both_gbs: float | None = None
    gemm_bf16_tflops: float | None = None
    cpu_adamw_gparams_s: float | None = None  # torch's fused CPU AdamW
    engine_adamw_gparams_s: dict[str, float] | None = None  # the engine's host AdamW kernel, by precision
    # STREAM-style host memory bandwidth, 1e9 bytes/s: {"threads": [1, 2, 4, ...], "read": [...], "write": [...],
    # "copy": [...], "triad": [...]}, one rate per thread count, and "write_nt" (non-temporal stores) where native
    # (host_mem_bandwidth_gbs)
    host_mem_gbs: dict[str, list] | None = None
    host_mem_probe: str | None = None  # which kernels measured host_mem_gbs: "native" (C++) or "torch"
    probe_s: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> Machine:
        """A machine a record keeps; older records lack the later keys (None here), and unknown keys are left out."""
        return Machine(**{k: v for k, v in d.items() if k in Machine.__dataclass_fields__})

    def host_mem_peak_gbs(self, kind: str = "triad") -> float | None:
        """The best rate of one STREAM kernel over the thread counts probed (None where not probed)."""
        return max(self.host_mem_gbs[kind]) if self.host_mem_gbs and kind in self.host_mem_gbs else None

    def describe(self) -> str:
        """One line for logs and reports."""
        def fmt(value, spec):
            return "n/a" if value is None else format(value, spec)
        gpu = f"{self.gpu_count}x {self.gpu_name} ({self.gpu_mem_gib:.0f} GiB)" if self.gpu_name else "no GPU"
        return (f"{gpu}; {self.cpu} ({self.cpu_cores} cores), host {self.host_mem_gib:.0f} GiB; PCIe pinned H2D "
                f"{fmt(self.h2d_gbs, '.1f')} / D2H {fmt(self.d2h_gbs, '.1f')} / both {fmt(self.both_gbs, '.1f')} GB/s; "
                f"bf16 GEMM {fmt(self.gemm_bf16_tflops, '.0f')} TFLOPS; "
                f"host memory triad {fmt(self.host_mem_peak_gbs(), '.0f')} GB/s; "
                f"CPU AdamW {fmt(self.cpu_adamw_gparams_s, '.2f')} G params/s")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pcie_gbs(nbytes: int = GIB // 2, repeats: int = 5) -> dict:
    """Pinned host <-> device copy rates in GB/s (1e9 bytes/s): each way, and both at once."""
    host_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def h2d():
        dev_dst.copy_(host_src, non_blocking=True)
        torch.cuda.synchronize()

    def d2h():
        host_dst.copy_(dev_src, non_blocking=True)
        torch.cuda.synchronize()

    def both():
        with torch.cuda.stream(h2d_stream):
            dev_dst.copy_(host_src, non_blocking=True)
        with torch.cuda.stream(d2h_stream):
            host_dst.copy_(dev_src, non_blocking=True)
        torch.cuda.synchronize()

    h2d(), d2h()  # warm up
    return {"h2d_gbs": nbytes / _median_s(h2d, repeats) / 1e9, "d2h_gbs": nbytes / _median_s(d2h, repeats) / 1e9,
            "both_gbs": 2 * nbytes / _median_s(both, repeats) / 1e9}


def _gemm_bf16_tflops(n: int = 8192, iters: int = 20, repeats: int = 5) -> float:
    """Dense bf16 n^3 matmul rate: median over repeats of `iters` back-to-back GEMMs."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)

    def run():
        for _ in range(iters):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()

    run()
    return 2 * n**3 * iters / _median_s(run, repeats) / 1e12


def _cpu_adamw_gparams_s(numel: int = 64 * 2**20, repeats: int = 3) -> float:
    """torch.optim.AdamW(fused=True) updates per second on one fp32 tensor, in G params/s."""
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()  # allocates the moments
    return numel / _median_s(opt.step, repeats) / 1e9


def host_mem_bandwidth_gbs(numel: int = 64 * 2**20, repeats: int = 3, max_threads: int | None = None,
                           native: bool = True) -> dict:
    """STREAM's kernels on fp32 arrays of `numel` (256 MiB each: larger than any last-level cache) at 1, 2, 4, ...
    threads up to the cores, best of `repeats`, in GB/s counted as STREAM counts (read a: 4 B/element, write a: 4,
    copy a to b: 8, triad a = b + s c: 12; no write-allocate traffic). native: by the C++ kernels built with the host
    AdamW kernel (megatrain.optim.fused; also "write_nt", the write's non-temporal stores, and "update", a = a + s b:
    12, read-modify-write as AdamW's state, the fair limit for the host optimizer's counted bytes), where they build;
    else, or native=False, by torch's ops. "host_mem_probe" says which measured: "native" or "torch"."""
    from megatrain.optim import fused

    cores = max_threads or psutil.cpu_count()
    counts = sorted({min(2**k, cores) for k in range(cores.bit_length() + 1)})
    if native and fused.available():
        rates = fused.host_mem_bandwidth_gbs(numel, counts, repeats)
        return {"host_mem_probe": "native", "threads": counts,
                **{kind: [round(r, 2) for r in rates[kind]] for kind in sorted(rates)}}
    return {"host_mem_probe": "torch", "threads": counts, **_torch_host_mem_bandwidth_gbs(numel, repeats, counts)}


def _torch_host_mem_bandwidth_gbs(numel: int, repeats: int, counts: list[int]) -> dict[str, list[float]]:
    """host_mem_bandwidth_gbs's kernels by torch's ops, one rate per thread count in `counts`."""
    a, b, c = torch.ones(numel), torch.ones(numel), torch.ones(numel)
    kernels = {"read": (lambda: a.sum(), 4), "write": (lambda: a.fill_(2.0), 4), "copy": (lambda: b.copy_(a), 8),
               "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 12)}
    result: dict[str, list] = {kind: [] for kind in kernels}
    before = torch.get_num_threads()
    try:
        for t in counts:
            torch.set_num_threads(t)
            for kind, (fn, bytes_per_element) in kernels.items():
                fn()
                best = min(_median_s(fn, 1) for _ in range(repeats))
                result[kind].append(round(numel * bytes_per_element / best / 1e9, 2))
    finally:
        torch.set_num_threads(before)
    return result


def engine_adamw_gparams_s(precision: str, numel: int = 2**26, repeats: int = 3) -> float:
    """The engine's one-pass host AdamW kernel (megatrain.optim.fused, as HostOptimizer runs it in chunks) over
    `numel` parameters of host tiles in the store's layout, in G params/s."""
    from megatrain.engine.store import OPT_CHUNK
    from megatrain.optim import fused

    if not fused.available():
        raise RuntimeError("the fused host AdamW extension is not built here")
    weights = torch.zeros(numel, dtype=torch.bfloat16)
    grads = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    master = torch.zeros(numel, dtype=torch.float32) if precision == "mixed" else None
    m, v = torch.zeros(numel), torch.zeros(numel)
    step_count = [0]

    def step() -> None:
        step_count[0] += 1
        for a in range(0, numel, OPT_CHUNK):
            b = min(a + OPT_CHUNK, numel)
            w = weights[a:b]
            p = master[a:b] if master is not None else w
            fused.fused_adamw(p, grads[a:b], m[a:b], v[a:b], None if p is w else w, step_count[0], 1.0, 1e-4, 0.9,
                              0.95, 1e-8, 0.1)

    step()
    return numel / _median_s(step, repeats) / 1e9


QUICK_ENV = "MEGATRAIN_PROBE_QUICK"


def measure(rates: bool = True) -> Machine:
    """Probe this machine: devices and memory, and (rates=True, seconds) link, GEMM and AdamW rates. With
    MEGATRAIN_PROBE_QUICK=1 (the test suite sets it: each suite run probes, and the suite-runner tests run many) the
    host rates come from 4 MiB arrays, once: a fraction of a second, rough figures."""
    t0 = time.perf_counter()
    quick = {"numel": 2**20, "repeats": 1} if os.environ.get(QUICK_ENV) == "1" else {}
    host_total, host_available, host_source = host_memory_gib()
    found = {"cpu": cpu_name(), "cpu_cores": psutil.cpu_count(), "host_mem_gib": round(host_total, 1),
             "host_available_gib": round(host_available, 1), "host_mem_source": host_source}
    cuda = torch.cuda.is_available()
    if cuda:
        props = torch.cuda.get_device_properties(0)
        found.update(gpu_name=props.name, gpu_count=torch.cuda.device_count(),
                     gpu_mem_gib=round(props.total_memory / GIB, 1))
    if rates and cuda:
        found.update(_pcie_gbs())
        found["gemm_bf16_tflops"] = _gemm_bf16_tflops()
        torch.cuda.empty_cache()
    if rates:
        found["host_mem_gbs"] = host_mem_bandwidth_gbs(**quick)
        found["host_mem_probe"] = found["host_mem_gbs"].pop("host_mem_probe")
        found["cpu_adamw_gparams_s"] = _cpu_adamw_gparams_s(**quick)
        try:
            found["engine_adamw_gparams_s"] = {p: engine_adamw_gparams_s(p, **quick) for p in ("bf16", "mixed")}
        except RuntimeError:  # no compiler for the extension: the torch rate stands in (perf_model)
            pass
    return Machine(**found, probe_s=time.perf_counter() - t0)
