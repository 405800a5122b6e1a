"""The GPU suite's durations.json (tests/gpu/durations.json: test id -> seconds) from a whole run's records, which
tests/gpu/conftest.py reads to start the longest groups of checks first. Where a run timed a test more than once, the
latest time counts.
    python scripts/gpu_durations.py results/gpu_checks/run-COMMIT-h200.jsonl [more records...]"""

import json
import sys
from pathlib import Path

from megatrain.bench.record import read_jsonl


def main(paths: list[str]) -> None:
    seconds = {}
    for path in paths:
        for record in read_jsonl(path):
            seconds[f"{record['file']}::{record['check']}"] = record["duration_s"]
    out = Path(__file__).resolve().parents[1] / "tests" / "gpu" / "durations.json"
    out.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    print(f"{out.name}: {len(seconds)} tests, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
