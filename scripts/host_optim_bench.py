"""The host AdamW kernel's variants against the host's probed memory bandwidth: one JSON record per variant.

    python scripts/host_optim_bench.py OUT.jsonl [--numel 134217728] [--repeats 5] [--quick]

First record: the probe (megatrain.probe.host_mem_bandwidth_gbs: STREAM read/write/copy/triad per thread count).
Then per variant (precision mixed/bf16 x moments fp32/bf16/int8 x kernel threads x transparent huge pages on/off):
G params/s (best of --repeats steps over --numel parameters, chunked as HostOptimizer runs them), the bytes per
parameter the kernel reads and writes (megatrain.optim.state_bytes), GB/s, its share of the probed triad, copy and
update (a = a + s b: AdamW's read-modify-write pattern, the fair limit),
and whether one step equals the default variant's bit for bit. --quick: a small size and few variants (CPU check).
"""

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: this checkout's package
from megatrain.bench.env import environment  # noqa: E402
from megatrain.engine.store import OPT_CHUNK  # noqa: E402
from megatrain.optim import fused  # noqa: E402
from megatrain.optim.compact import Moments  # noqa: E402
from megatrain.optim.state_bytes import MOMENT_BYTES, adamw_traffic_bytes_per_param, state_bytes_per_param  # noqa: E402
from megatrain.probe import host_mem_bandwidth_gbs  # noqa: E402

MADV_HUGEPAGE, HUGE_PAGE = 14, 2 * 2**20


def empty(numel: int, dtype: torch.dtype, huge: bool) -> torch.Tensor:
    """An untouched tensor; huge: its 2 MiB-aligned interior advised MADV_HUGEPAGE before the first touch."""
    t = torch.empty(numel, dtype=dtype)
    if huge:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        length = (t.data_ptr() + t.numel() * t.element_size() - start) // HUGE_PAGE * HUGE_PAGE
        if length > 0 and ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(length),
                                                                     MADV_HUGEPAGE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    return t


def tiles(numel: int, precision: str, moments: str, huge: bool) -> dict:
    """The store's tiles for `numel` parameters (bf16 weights and gradients), first touched here."""
    t = {"weights": empty(numel, torch.bfloat16, huge).fill_(0.5), "grads": empty(numel, torch.bfloat16, huge)}
    t["grads"].copy_(torch.linspace(-1e-3, 1e-3, numel))
    t["master"] = empty(numel, torch.float32, huge).fill_(0.5) if precision == "mixed" else None
    shapes = Moments.zeros(numel, moments, device="meta").tensors()  # the format's tensors, no memory yet
    t["moments"] = Moments(**{name: empty(x.numel(), x.dtype, huge).zero_() for name, x in shapes.items()})
    return t


def step(t: dict, count: int) -> None:
    """One AdamW step over the tiles, OPT_CHUNK at a time, as HostOptimizer calls the kernel."""
    n, compact = t["weights"].numel(), t["moments"].format != "fp32"
    for a in range(0, n, OPT_CHUNK):
        b = min(a + OPT_CHUNK, n)
        w = t["weights"][a:b]
        p = t["master"][a:b] if t["master"] is not None else w
        out = None if p is w else w
        if compact:
            fused.compact_adamw(p, t["grads"][a:b], t["moments"].slice(a, b), out, b - a, a, count, 0.5, 1e-4, 0.9,
                                0.95, 1e-8, 0.1)
        else:
            fused.fused_adamw(p, t["grads"][a:b], t["moments"].exp_avg[a:b], t["moments"].exp_avg_sq[a:b], out, count,
                              0.5, 1e-4, 0.9, 0.95, 1e-8, 0.1)


def snapshot(t: dict) -> torch.Tensor:
    parts = [t["weights"].float()] + ([t["master"]] if t["master"] is not None else [])
    return torch.cat(parts + [x.float() for x in t["moments"].tensors().values()])


def one_step_result(precision: str, moments: str, threads: int, huge: bool, numel: int = 2**20) -> torch.Tensor:
    os.environ[fused.THREADS_ENV] = str(threads)
    t = tiles(numel, precision, moments, huge)
    step(t, 1)
    step(t, 2)
    return snapshot(t)


def measure(precision: str, moments: str, threads: int, huge: bool, numel: int, repeats: int) -> float:
    """G params/s: best of `repeats` steps after one warm-up step."""
    os.environ[fused.THREADS_ENV] = str(threads)
    t = tiles(numel, precision, moments, huge)
    step(t, 1)
    best = float("inf")
    for k in range(repeats):
        t0 = time.perf_counter()
        step(t, k + 2)
        best = min(best, time.perf_counter() - t0)
    del t
    return numel / best / 1e9


def variants(cores: int, quick: bool) -> list[tuple[str, str, int, bool]]:
    """(precision, moments, threads, huge pages): a thread ladder for mixed fp32, then every format at the default
    (0: all cores but one) and all cores, with and without huge pages."""
    ladder = sorted({min(2**k, cores) for k in range(cores.bit_length() + 1)} | {max(1, cores - 1)})
    out = [("mixed", "fp32", t, False) for t in (ladder[-2:] if quick else ladder)]
    for precision in ("mixed", "bf16"):
        for moments in ("fp32", "bf16", "int8"):
            for threads in ((0,) if quick else (0, cores)):
                for huge in (False, True):
                    out.append((precision, moments, threads, huge))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--numel", type=int, default=2**27, help="parameters per step (default 128M: ~2 GiB mixed)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="2M parameters, few variants: a CPU check of the script")
    args = p.parse_args()
    if not fused.available():
        raise SystemExit("the host AdamW kernel does not build here")
    numel = 2**21 if args.quick else args.numel
    cores = os.cpu_count()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    probe = host_mem_bandwidth_gbs(numel=2**22 if args.quick else 64 * 2**20)
    triad, copy, update = max(probe["triad"]), max(probe["copy"]), max(probe.get("update") or [0]) or None
    numa = len(list(Path("/sys/devices/system/node").glob("node[0-9]*")))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    head = {"what": "host_mem_probe", **probe, "cpu_cores": cores, "numa_nodes": numa,
            "transparent_hugepage": thp.read_text().strip() if thp.exists() else None, "env": environment()}
    records = [head]
    print(json.dumps(head), flush=True)
    defaults = {}
    for precision, moments, threads, huge in variants(cores, args.quick):
        per = state_bytes_per_param(2, precision, MOMENT_BYTES[moments])
        traffic = adamw_traffic_bytes_per_param(per)
        result = one_step_result(precision, moments, threads, huge)
        reference = defaults.setdefault((precision, moments), result)  # the first of each format: threads 0 or ladder
        gparams_s = measure(precision, moments, threads, huge, numel, args.repeats)
        record = {"what": "host_adamw_variant", "precision": precision, "moments": moments,
                  "threads": threads or max(1, cores - 1), "threads_setting": threads, "huge_pages": huge,
                  "numel": numel, "gparams_s": round(gparams_s, 3), "bytes_per_param": traffic,
                  "gbs": round(gparams_s * traffic, 2), "of_probed_triad": round(gparams_s * traffic / triad, 3),
                  "of_probed_copy": round(gparams_s * traffic / copy, 3),
                  "of_probed_update": round(gparams_s * traffic / update, 3) if update else None,
                  "bitwise_equal_to_first_variant_of_its_format": bool(torch.equal(result, reference))}
        records.append(record)
        print(json.dumps(record), flush=True)
    os.environ.pop(fused.THREADS_ENV, None)
    with args.out.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
