"""The GPU suite's wall time before it runs: the checks as tests/gpu/conftest.py groups and orders them (collected here,
no GPU needed), each at its last time (tests/gpu/durations.json: scripts/gpu_durations.py), handed to N workers as
pytest-xdist's loadgroup scheduler hands them (a group goes whole to one worker; a worker is given the next group
while it has two checks or fewer left to run, and starts with two groups). It says where a whole run's wall goes:
the last worker to finish and the group it ran, against the two floors (the longest group; all the time over N).
    python scripts/gpu_plan.py [--workers 10] [--start-s 75] [-k EXPR] [--top 8]
A plan, not a measurement: the times are one earlier run's, under that run's load (a first compile at one Inductor
thread per worker beside nine others), and the heavy checks' host ledger (host_share) may hold a lane back."""

import argparse
import contextlib
import heapq
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFTEST = ROOT / "tests" / "gpu" / "conftest.py"


class _Collected:
    """The checks as conftest left them: (node id, xdist group or None), in its order; and conftest itself (its
    DURATIONS and UNTIMED_S, the times it ordered them by)."""

    def __init__(self):
        self.items: list[tuple[str, str | None]] = []
        self.conftest = None

    def pytest_collection_finish(self, session):
        self.conftest = next(p for p in session.config.pluginmanager.get_plugins()
                             if Path(getattr(p, "__file__", "") or ".").resolve() == CONFTEST)
        for item in session.items:
            marker = item.get_closest_marker("xdist_group")
            group = (marker.args[0] if marker.args else marker.kwargs.get("name")) if marker else None
            self.items.append((item.nodeid, group))


def collect(select: str | None = None) -> _Collected:
    collected = _Collected()
    args = [str(ROOT / "tests" / "gpu"), "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider",
            "--rootdir", str(ROOT)] + (["-k", select] if select else [])
    with contextlib.redirect_stdout(io.StringIO()) as said:
        code = pytest.main(args, plugins=[collected])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise SystemExit(f"{said.getvalue()}\ncollecting tests/gpu failed (pytest exit {int(code)})")
    return collected  # node ids from the checkout's root, as durations.json keys them


def units(items: list[tuple[str, str | None]]) -> list[tuple[str, list[str]]]:
    """The scheduler's work units in its order: a group's checks together where the group first appears, every
    ungrouped check alone (loadgroup's scopes, with --no-loadscope-reorder as scripts/gpu_checks.sh asks)."""
    order: dict[str, list[str]] = {}
    for nodeid, group in items:
        order.setdefault(group or nodeid, []).append(nodeid)
    return list(order.items())


def simulate(work: list[tuple[str, list[str]]], seconds: dict[str, float], workers: int, untimed_s: float) -> dict:
    """Each worker's end and the units it ran, as xdist's LoadScopeScheduling hands out `work` (a check `seconds` does
    not time takes untimed_s)."""
    queue = list(work)
    pending: list[list[str]] = [[] for _ in range(workers)]
    ran: list[list[str]] = [[] for _ in range(workers)]

    def assign(w: int) -> None:
        if queue:
            name, tests = queue.pop(0)
            pending[w] += tests
            ran[w].append(name)

    for w in range(workers):
        assign(w)
    for w in range(workers):
        if len(pending[w]) <= 2:
            assign(w)
    clock = [0.0] * workers
    events = [(seconds.get(pending[w][0], untimed_s), w) for w in range(workers) if pending[w]]
    heapq.heapify(events)
    while events:
        now, w = heapq.heappop(events)
        clock[w] = now
        pending[w].pop(0)
        if len(pending[w]) <= 2:
            assign(w)
        if pending[w]:
            heapq.heappush(events, (now + seconds.get(pending[w][0], untimed_s), w))
    return {"ends": clock, "ran": ran}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--start-s", type=float, default=75.0,
                        help="the workers' start before their first check (~75 s measured at 4e32950)")
    parser.add_argument("-k", dest="select", help="pytest's -k, as scripts/gpu_checks.sh passes it")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args(argv)
    collected = collect(args.select)
    work, untimed_s, durations = units(collected.items), collected.conftest.UNTIMED_S, collected.conftest.DURATIONS
    seconds = json.loads(durations.read_text()) if durations.exists() else {}
    if not work:
        raise SystemExit(f"no check of tests/gpu is selected{f' by -k {args.select!r}' if args.select else ''}")
    length = {name: sum(seconds.get(t, untimed_s) for t in tests) for name, tests in work}
    total = sum(length.values())
    plan = simulate(work, seconds, args.workers, untimed_s)
    last = max(range(args.workers), key=lambda w: plan["ends"][w])
    untimed = sum(t not in seconds for _, tests in work for t in tests)
    print(f"{sum(len(t) for _, t in work)} checks in {len(work)} units, {total:.0f} s of check time"
          f" ({untimed} untimed, {untimed_s:.0f} s each)")
    print(f"{args.workers} workers: wall ~{args.start_s + plan['ends'][last]:.0f} s "
          f"({args.start_s:.0f} s start + {plan['ends'][last]:.0f} s); floors: longest unit "
          f"{max(length.values()):.0f} s, check time over the workers {total / args.workers:.0f} s")
    print(f"last to end: worker {last}, ran " + ", ".join(f"{n} ({length[n]:.0f} s)" for n in plan["ran"][last]))
    print("longest units: " + ", ".join(f"{n} {s:.0f} s" for n, s in
                                        sorted(length.items(), key=lambda kv: -kv[1])[:args.top]))


if __name__ == "__main__":
    sys.exit(main())
