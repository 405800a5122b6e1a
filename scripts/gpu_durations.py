"""The GPU suite's durations.json (tests/gpu/durations.json: test id -> seconds) from runs' records, which
tests/gpu/conftest.py reads to start the longest groups of checks first. The records update the file: a check a run
timed takes its time there (where a run timed it more than once, the latest), a check it did not pass keeps its old
time (one that ran out of memory in 0.1 s would otherwise be packed as if it took nothing).
    python scripts/gpu_durations.py results/gpu_checks/run-COMMIT-h200.jsonl [more records...]"""

import json
import sys
from pathlib import Path

from megatrain.bench.record import read_jsonl

DURATIONS = Path(__file__).resolve().parents[1] / "tests" / "gpu" / "durations.json"


def test_id(record: dict) -> str:
    """The pytest node id of a check's record: its file and name, less the @group pytest-xdist appends to it."""
    return f"{record['file']}::{record['check'].split('@', 1)[0]}"


def main(paths: list[str]) -> None:
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    for path in paths:
        for record in read_jsonl(path):
            if record["passed"]:
                seconds[test_id(record)] = record["duration_s"]
    DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")
    print(f"{DURATIONS.name}: {len(seconds)} tests, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
