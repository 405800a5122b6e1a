"""The GPU suite's durations.json (tests/gpu/durations.json: test id -> seconds) from runs' records, which
tests/gpu/conftest.py reads to start the longest groups of checks first. The records update the file: a check a run
timed takes its time there (where a run timed it more than once, the latest), a check it did not pass keeps its old
time (one that ran out of memory in 0.1 s would otherwise be packed as if it took nothing).
It then says where the records' time went, from each check's `runs` (tests/gpu/conftest.py: every system a check
built, its build's seconds and its training's): by system and kernels, by model, and what no build accounts for.
    python scripts/gpu_durations.py results/gpu_checks/run-COMMIT-h200.jsonl [more records...]"""

import importlib.util
import json
import sys
from collections import defaultdict
from pathlib import Path

from megatrain.bench.record import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
DURATIONS = ROOT / "tests" / "gpu" / "durations.json"


def _conftest():
    """tests/gpu/conftest.py, which writes the records and so knows a record's check (node_id)."""
    spec = importlib.util.spec_from_file_location("gpu_conftest", ROOT / "tests" / "gpu" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def where_the_time_went(records: list[dict]) -> dict:
    """Check seconds of `records` (those with `runs`): in all; in builds and in training, by (system, compiled) and
    by model; and the rest (the check's own work: its comparisons, a process cache's lookups, the GPU's start)."""
    # the sanitizer check's own `runs` (the sets its subprocess ran) time nothing: a build's runs carry build_s
    timed = [r for r in records if r.get("runs") and all("build_s" in run for run in r["runs"])]
    by_system: dict = defaultdict(lambda: [0.0, 0.0])
    by_model: dict = defaultdict(float)
    for record in timed:
        for run in record["runs"]:
            seconds = by_system[f"{run['system']}{' compiled' if run['compile'] else ''}"]
            seconds[0] += run["build_s"]
            seconds[1] += run.get("trained_s", 0.0)  # a run whose check failed before its close has no training time
            by_model[run["model"]] += run["build_s"] + run.get("trained_s", 0.0)
    total = sum(r["duration_s"] for r in timed)
    in_runs = sum(sum(v) for v in by_system.values())
    return {"checks": len(timed), "total_s": total, "outside_runs_s": total - in_runs,
            "by_system": {k: {"build_s": v[0], "trained_s": v[1]} for k, v in
                          sorted(by_system.items(), key=lambda kv: -sum(kv[1]))},
            "by_model": dict(sorted(by_model.items(), key=lambda kv: -kv[1]))}


def main(paths: list[str]) -> None:
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    records = [record for path in paths for record in read_jsonl(path)]
    node_id = _conftest().node_id
    for record in records:
        if record["passed"]:
            seconds[node_id(record)] = record["duration_s"]
    DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    print(f"{DURATIONS.name}: {len(seconds)} tests, {sum(seconds.values()):.0f} s in all")
    went = where_the_time_went(records)
    if went["checks"]:
        print(f"{went['checks']} checks timed their runs: {went['total_s']:.0f} s, "
              f"{went['outside_runs_s']:.0f} s of it outside any build or training")
        for name, s in went["by_system"].items():
            print(f"  {name}: build {s['build_s']:.0f} s, training {s['trained_s']:.0f} s")
        print("  by model: " + ", ".join(f"{m} {t:.0f} s" for m, t in list(went["by_model"].items())[:12]))


if __name__ == "__main__":
    main(sys.argv[1:])
