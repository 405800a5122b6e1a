"""Does the host AdamW kernel share host memory with the step's PCIe copies? One JSON record per condition.

    python scripts/host_contention.py OUT.jsonl [--numel 268435456] [--seconds 4] [--threads 15,8]

The delayed update (update_delay=1) runs the host AdamW behind the whole next step; its kernel measured 65-113 GB/s
across H100 hosts against 104-116 GB/s for the exact update, which runs beside the next forward only (issue 29).
Here each load runs alone and then beside the others for --seconds, on the same machine in one process:
- adamw: the engine's one-pass kernel over --numel parameters in mixed precision (fp32 master and moments, bf16
  weights and gradients: 28 bytes read and written a parameter), OPT_CHUNK at a time, as HostOptimizer calls it;
- dma: pinned host <-> GPU copies of 1 GiB, both directions at once on two streams, as the step's weight prefetch and
  gradient offload;
- gemm: bf16 8192^3 matmuls launched from a Python thread, as the training thread feeds the GPU (a CPU-starved
  launcher shows here).
Per condition: each load's rate (AdamW GB/s, DMA GB/s each way, GEMM TFLOPS) and its share of that load alone, per
kernel thread count. Needs CUDA and the kernel's C++ build.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: this checkout's package
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_optim_bench import step, tiles  # noqa: E402

from megatrain.bench.env import environment  # noqa: E402
from megatrain.optim import fused  # noqa: E402
from megatrain.optim.state_bytes import adamw_traffic_bytes_per_param, state_bytes_per_param  # noqa: E402

GIB = 2**30


def adamw_load(t: dict, stop: threading.Event, out: dict) -> None:
    n, count, t0 = t["weights"].numel(), 0, time.perf_counter()
    while not stop.is_set():
        count += 1
        step(t, count + 1)
    out["adamw_params"] = n * count
    out["adamw_s"] = time.perf_counter() - t0


def dma_load(stop: threading.Event, out: dict) -> None:
    host_in = torch.empty(GIB, dtype=torch.uint8, pin_memory=True).fill_(1)
    host_out = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev_in, dev_out = torch.empty(GIB, dtype=torch.uint8, device="cuda"), torch.ones(GIB, dtype=torch.uint8,
                                                                                      device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    copies, t0 = 0, time.perf_counter()
    while not stop.is_set():
        with torch.cuda.stream(h2d):
            dev_in.copy_(host_in, non_blocking=True)
        with torch.cuda.stream(d2h):
            host_out.copy_(dev_out, non_blocking=True)
        h2d.synchronize()
        d2h.synchronize()
        copies += 1
    out["dma_bytes_each_way"] = copies * GIB
    out["dma_s"] = time.perf_counter() - t0


def gemm_load(stop: threading.Event, out: dict, n: int = 8192) -> None:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    done, t0 = 0, time.perf_counter()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            for _ in range(4):
                torch.mm(a, b)
            stream.synchronize()
            done += 4
    out["gemm_flops"] = done * 2 * n**3
    out["gemm_s"] = time.perf_counter() - t0


def run(loads: tuple[str, ...], t: dict, seconds: float) -> dict:
    stop, out = threading.Event(), {}
    targets = {"adamw": lambda: adamw_load(t, stop, out), "dma": lambda: dma_load(stop, out),
               "gemm": lambda: gemm_load(stop, out)}
    threads = [threading.Thread(target=targets[name]) for name in loads]
    for th in threads:
        th.start()
    time.sleep(seconds)
    stop.set()
    for th in threads:
        th.join()
    rates = {}
    if "adamw_s" in out:
        rates["adamw_gparams_s"] = out["adamw_params"] / out["adamw_s"] / 1e9
    if "dma_s" in out:
        rates["dma_gbs_each_way"] = out["dma_bytes_each_way"] / out["dma_s"] / 1e9
    if "gemm_s" in out:
        rates["gemm_tflops"] = out["gemm_flops"] / out["gemm_s"] / 1e12
    return rates


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--numel", type=int, default=2**28, help="parameters of the AdamW load (default 256M: ~7 GiB)")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--threads", default="0,8", help="kernel thread counts (0: all cores but one, the engine's)")
    args = p.parse_args()
    if not torch.cuda.is_available() or not fused.available():
        raise SystemExit("needs CUDA and the host AdamW kernel's C++ build")
    traffic = adamw_traffic_bytes_per_param(state_bytes_per_param(2, "mixed"))
    t = tiles(args.numel, "mixed", "fp32", huge=False)
    step(t, 1)  # first touch and warm-up
    args.out.parent.mkdir(parents=True, exist_ok=True)
    env = environment()
    conditions = [("dma",), ("gemm",), ("dma", "gemm")]
    for threads in (int(x) for x in args.threads.split(",")):
        conditions += [(f"adamw@{threads}",), (f"adamw@{threads}", "dma"), (f"adamw@{threads}", "gemm"),
                       (f"adamw@{threads}", "dma", "gemm")]
    alone: dict[tuple[str, int | None], float] = {}
    with args.out.open("a") as f:
        for loads in conditions:
            threads = next((int(x.split("@")[1]) for x in loads if x.startswith("adamw@")), None)
            if threads is not None:
                os.environ[fused.THREADS_ENV] = str(threads)
            names = tuple(x.split("@")[0] for x in loads)
            rates = run(names, t, args.seconds)
            record = {"what": "host_contention", "loads": list(names), "adamw_threads":
                      (threads or max(1, (os.cpu_count() or 2) - 1)) if threads is not None else None,
                      "seconds": args.seconds, "adamw_numel": args.numel, "adamw_bytes_per_param": traffic, **rates}
            if "adamw_gparams_s" in rates:
                record["adamw_gbs"] = rates["adamw_gparams_s"] * traffic
            for key in ("adamw_gparams_s", "dma_gbs_each_way", "gemm_tflops"):
                if key in rates:
                    base = alone.setdefault((key, threads if key == "adamw_gparams_s" else None), rates[key]) \
                        if len(names) == 1 else alone.get((key, threads if key == "adamw_gparams_s" else None))
                    record[f"{key}_of_alone"] = rates[key] / base if base else None
            record["env"] = env
            f.write(json.dumps(record) + "\n")
            f.flush()
            print(json.dumps({k: v for k, v in record.items() if k != "env"}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
