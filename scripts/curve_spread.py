"""How far one bf16 loss curve of the GPU suite (tests/gpu/test_engine_gpu.py, section 4) wanders from run to run, for
native and the engine alike: each series runs its curve RUNS times in one process (an engine set that has stream
stress takes seed 1, 2, ... in turn), every curve appended to OUT as one JSON line. Needs CUDA.
    python scripts/curve_spread.py run OUT SHAPE SERIES [--runs 10]
        SERIES: native:PRECISION[:compiled] | megatrain:SET[:OPTION=VALUE...] (a CURVE_SETS name, engine options
        over the set's, a JSON value each or a bare word: megatrain:bf16:forward_graph=training)
    python scripts/curve_spread.py judge NATIVE_OUT ENGINE_OUT
        each engine run inside or outside the check's band from a pair of the native runs (narrower than the check's)
    python scripts/curve_spread.py analyse OUT [OUT ...]
        per step: each series' mean, standard deviation and range, and each engine series' mean against each native
        one's in standard errors (Welch's t: beyond ~3 the two series do not share a mean)
"""

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]


def run(out: str, shape: str, series: str, runs: int) -> None:
    import test_engine_gpu as checks

    from megatrain.bench.env import environment
    from megatrain.bench.record import append_jsonl
    from megatrain.flags import parse_option_flags

    system, name, *more = series.split(":")
    for n in range(runs):
        if system == "native":
            losses = checks._curve("native", shape, name, {"compile": more == ["compiled"]})
        else:
            precision, fields, options = checks.CURVE_SETS[name]
            options = {**options, **parse_option_flags(more, "a series' engine option")}
            options = {**options, "stream_stress": n + 1} if "stream_stress" in options else options
            losses = checks._curve("megatrain", shape, precision, fields, options)
        append_jsonl(out, {"shape": shape, "series": series, "run": n, "steps": checks.CURVE_STEPS,
                           "losses": losses, "env": environment()})
        print(f"{series} run {n}: {' '.join(f'{x:.4g}' for x in losses)}", flush=True)


def analyse(paths: list[str]) -> None:
    from megatrain.bench.record import read_jsonl

    curves: dict[str, list[list[float]]] = {}
    for path in paths:
        for record in read_jsonl(path):
            curves.setdefault(record["series"], []).append(record["losses"])
    steps = min(len(c) for runs in curves.values() for c in runs)
    for series, runs in curves.items():
        print(f"{series}: {len(runs)} runs")
        for step in range(steps):
            at = [c[step] for c in runs]
            mean, std = statistics.fmean(at), statistics.stdev(at) if len(at) > 1 else 0.0
            print(f"  step {step:2d}: mean {mean:.5g} std {std:.3g} ({std / mean:.1%}) "
                  f"range {min(at):.5g}-{max(at):.5g}")
    for ours in (s for s in curves if s.startswith("megatrain")):
        for native in (s for s in curves if s.startswith("native")):
            t = [_welch_t([c[step] for c in curves[ours]], [c[step] for c in curves[native]]) for step in range(steps)]
            print(f"{ours} against {native}, Welch's t by step: {' '.join(f'{x:+.1f}' for x in t)}")


def judge(native_path: str, engine_path: str) -> None:
    """Each engine run judged as the GPU suite's curve check judges it, against a pair of native runs of the same
    session (run i against native runs i and i+1): the band from their repeat spread, its unlearnt steps raised to
    the largest share of the loss any had, its learnt steps to the largest among them. The check adds, for a mixture,
    native's reordered run to the spread and, past the band, native compiled beside eager: this band is without
    them, so narrower than the check's. Prints each run's largest excess over the band (<= 0: inside)."""
    import torch

    from megatrain.bench.record import read_jsonl
    from megatrain.checks.band import MEMORISED, band_excess, share_floor

    native = [torch.tensor(r["losses"], dtype=torch.float64) for r in read_jsonl(native_path)]
    engine = [torch.tensor(r["losses"], dtype=torch.float64) for r in read_jsonl(engine_path)]
    inside = 0
    for i, ours in enumerate(engine):
        ref, again = native[i % len(native)], native[(i + 1) % len(native)]
        spread = share_floor((again - ref).abs(), ref)
        _, excess = band_excess(ours, ref, spread, ref < MEMORISED)
        inside += excess <= 0
        print(f"run {i}: largest excess over the band {excess:+.3g} ({'inside' if excess <= 0 else 'OUTSIDE'})")
    print(f"{inside} of {len(engine)} engine runs inside the band")


def _welch_t(a: list[float], b: list[float]) -> float:
    """(mean a - mean b) over the standard error of that difference."""
    error = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return (statistics.fmean(a) - statistics.fmean(b)) / error if error else 0.0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run")
    one.add_argument("out"), one.add_argument("shape"), one.add_argument("series")
    one.add_argument("--runs", type=int, default=10)
    many = sub.add_parser("analyse")
    many.add_argument("paths", nargs="+")
    judged = sub.add_parser("judge")
    judged.add_argument("native"), judged.add_argument("engine")
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.shape, args.series, args.runs)
    elif args.command == "analyse":
        analyse(args.paths)
    else:
        judge(args.native, args.engine)
