"""GPU checks leave a record: with MEGATRAIN_GPU_CHECKS=FILE set, every test appends one JSON line to FILE when it
has run: the check's id, whether it passed, its failure text, its duration and the environment (commit, GPU, driver,
torch), and, for a test that takes the `check` fixture, what it measured (option set, largest differences,
tolerances). results/gpu_checks/ keeps the committed ones.

The whole suite runs as several pytest-xdist workers on one GPU (scripts/gpu_checks.sh): the checks are small models
whose steps leave the GPU mostly idle. What makes that fast and safe is here:
- tests that share a process-wide cache (a module-scoped fixture, or a module's own `shares(item)` key: native's runs
  and curves, computed once per process) run in one worker, as one xdist group, split in parts where their last times
  say each part would still end sooner (part_count), unless the module's own `whole(item)` keeps the group whole;
- groups start longest first (durations.json, the last whole run's times: scripts/gpu_durations.py), so the longest
  group does not start last and the workers finish together;
- the checks at a published width run in few lanes, each waiting for its engine's share of the host (host_share),
  and every check hands its cached GPU memory back when it ends;
- a worker that runs a compile-bound check compiles with more Inductor threads than the others' one
  (COMPILE_BOUND_THREADS).
scripts/gpu_plan.py says, before a run, what wall time these groups and the last times make on N workers.
A run resumes: with GPU_CHECKS_PASSED=FILE (scripts/gpu_checks.sh sets it to a copy of the record it appends to), the
checks FILE records as passed at this commit, in a clean tree, are not run again, so a run cut by a device call's limit,
or whose machine was given back, goes on from there in the next call (one was: 155 of 228 checks came back).
"""

import contextlib
import fcntl
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import megatrain.bench.case  # noqa: F401 (imported so that _time_each_run finds it in sys.modules)
from megatrain.bench.env import code_here, environment, same_code_as
from megatrain.bench.record import append_jsonl, relative_paths


@pytest.fixture(scope="module")
def no_tf32():
    """fp32 matmuls in full fp32 (TF32 off) for a module's tight parity checks; restored after it."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def check(request) -> dict:
    """A dict the test fills with what it measured; written out with the test's outcome."""
    data: dict = {}
    request.node.user_properties.append(("check", data))
    return data


# What the heavy checks running at one time may hold of the host (GiB; GPU_CHECK_HEAVY_HOST_GIB sets it): the rest
# of a 128 GiB host is the light workers' and the system's. A heavy check that needs more runs alone among them. The
# same figure bounds their GPU memory too: native, their reference, holds on the GPU about the state the engine holds
# on the host (weights, gradients, AdamW). So three lanes: the ledger, not the lane count, keeps them apart.
HEAVY_HOST_GIB = float(os.environ.get("GPU_CHECK_HEAVY_HOST_GIB", "80"))
LEDGER_POLL_S = 2.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def host_share(gib: float, ledger: Path, limit: float = HEAVY_HOST_GIB):
    """Hold `gib` of the heavy checks' host allowance for the block, waiting while the workers' holdings in `ledger`
    (pid -> GiB, behind a lock file; a dead worker's holding lapses) leave too little. The lanes are fixed when the
    run starts, not when each check does: two lanes' published-width curves met at once and GPT-OSS's engine was
    refused its 45 GiB (the suite at 5ec0d0c, twice)."""
    lock = ledger.with_suffix(".lock")
    me = str(os.getpid())
    while True:
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            holdings = json.loads(ledger.read_text()) if ledger.exists() else {}
            holdings = {pid: g for pid, g in holdings.items() if _alive(int(pid))}
            if not holdings or sum(holdings.values()) + gib <= limit:
                ledger.write_text(json.dumps({**holdings, me: gib}))
                break
        time.sleep(LEDGER_POLL_S)
    try:
        yield
    finally:
        with open(lock, "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            holdings = json.loads(ledger.read_text()) if ledger.exists() else {}
            holdings.pop(me, None)
            ledger.write_text(json.dumps(holdings))


@pytest.fixture(autouse=True)
def _share_the_gpu_host(request):
    """A heavy check waits for its share of the host (host_share) when workers run side by side; and the GPU memory
    a check's caching allocator kept goes back to the device when it ends: the workers share one GPU, and a worker's
    cache of a finished curve (74 GiB once) left the next checks of the others out of memory. So does the pinned host
    memory torch's caching host allocator kept (where this torch can free it: torch.accelerator.empty_host_cache):
    after an offloaded FSDP2 reference the engine in the same check was refused by its plan with 31.5 GiB of the host
    usable (d0c54b8), and what the allocator still cached of the reference's pinned shards was not measured."""
    gib = getattr(request.module, "heavy_host_gib", lambda item: 0.0)(request.node)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    share = (host_share(gib, Path(tempfile.gettempdir()) / f"megatrain-gpu-checks-{run}.json") if gib and run
             else contextlib.nullcontext())
    with share:
        yield
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            gc.collect()
            torch.cuda.empty_cache()
            if empty_host_cache := getattr(torch.accelerator, "empty_host_cache", None):
                empty_host_cache()


@pytest.fixture(autouse=True)
def _running(request):
    """While a check runs, RECORD.running/WORKER names it (RECORD: MEGATRAIN_GPU_CHECKS): a worker that dies (one did,
    "node down", its check unnamed) or a run cut by a device call's limit leaves the file, which says what was running
    and since when; a check that ends removes it."""
    path = os.environ.get("MEGATRAIN_GPU_CHECKS")
    if not path:
        yield
        return
    running = Path(f"{path}.running") / os.environ.get("PYTEST_XDIST_WORKER", "main")
    running.parent.mkdir(parents=True, exist_ok=True)
    running.write_text(json.dumps({"check": request.node.nodeid,
                                   "since_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
    yield
    running.unlink(missing_ok=True)


# Inductor's compile threads in a worker once it runs a compile-bound check (a module's `compile_bound(item)`: the
# generic path's fp32 sets, whose first compile took 150-460 s of a check at one thread per worker under the suite's
# load, on the suite's critical path: scripts/gpu_plan.py). scripts/gpu_checks.sh gives every worker one thread (a pool
# of 16 per worker took the host memory the published-width curves needed); such a worker gets a pool of this many
# (GPU_CHECK_COMPILE_THREADS) from its first compile-bound check on: a pool, once made, keeps its size.
COMPILE_BOUND_THREADS = int(os.environ.get("GPU_CHECK_COMPILE_THREADS", "3"))


@pytest.fixture(autouse=True)
def _compile_threads(request):
    """More Inductor compile threads for a compile-bound check (COMPILE_BOUND_THREADS), set before its first compile
    (Inductor reads its config's compile_threads when it first makes its pool)."""
    if getattr(request.module, "compile_bound", lambda item: False)(request.node):
        from torch._inductor import config as inductor

        inductor.compile_threads = max(inductor.compile_threads or 1, COMPILE_BOUND_THREADS)
    yield


# where the checks build their systems: run_case's and the test helpers' own name for it
BUILDERS = ("megatrain.bench.case", "engine_helpers", "train_helpers")


@pytest.fixture(autouse=True)
def _time_each_run(request, monkeypatch):
    """Each system a check builds, in its record's `runs`: which (system, model, compile, precision), its build's
    seconds and its training's, build to close (a run a process cache answered builds nothing). The suite is ~100 min
    of check time where 10 minutes are wanted: these say what in a check the time goes to (the build, native's
    references, a first compile), so that cuts are made where they cost no judgement."""
    runs: list[dict] = []
    request.node.user_properties.append(("runs", runs))

    def timed(build):
        def build_system(case, *args, **kwargs):
            t0 = time.perf_counter()
            system = build(case, *args, **kwargs)
            run = {"system": case.system, "model": case.model, "compile": case.compile, "precision": case.precision,
                   "build_s": round(time.perf_counter() - t0, 2)}
            runs.append(run)
            close = system.close

            def timed_close():
                run["trained_s"] = round(time.perf_counter() - t0 - run["build_s"], 2)
                return close()

            system.close = timed_close
            return system
        return build_system

    for name in BUILDERS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "build_system"):
            monkeypatch.setattr(module, "build_system", timed(module.build_system))
    yield


DURATIONS = Path(__file__).with_name("durations.json")
UNTIMED_S = 30.0  # a test the last whole run did not time (new, or skipped there)
# Checks at a published width hold 15-45 GiB of host state each (a 128 GiB host): this many lanes of them, each one
# worker running its share one after another, and a check starting only when host_share admits it (GPU_CHECK_HEAVY_LANES
# sets the lanes)
HEAVY_LANES = int(os.environ.get("GPU_CHECK_HEAVY_LANES", "3"))
# A group longer than this is split in parts, each paying for the shared cache once: one worker on a 400 s group
# would end the suite alone
GROUP_CAP_S = 240.0


def part_count(times: list[float], cap: float = GROUP_CAP_S) -> int:
    """How many parts a group of checks that share a process cache is split in, from their last times: each part pays
    the cache once (the group's longest check less its median: the native runs and the first compile of a process;
    Qwen3-Next's hybrid layers take ~150-340 s to compile first and 15-50 s a check after), so a group is split only
    as far as each part's own checks plus that cost stay within `cap`; a cost past `cap` keeps it whole (cut in three,
    the hybrid group paid its compile three times)."""
    ordered = sorted(times)
    once = ordered[-1] - ordered[len(ordered) // 2]
    if once >= cap:
        return 1
    return max(1, min(len(times), math.ceil((sum(times) - once) / (cap - once))))


def share_key(item) -> str | None:
    """What a test shares with others of its module (a module-scoped fixture of ours, or the module's own
    `shares(item)` key: native's runs and curves, computed once per process), or None where it shares nothing."""
    shares = getattr(item.module, "shares", None)
    key = shares(item) if shares else None
    if key is None:
        defs = item._fixtureinfo.name2fixturedefs
        key = "+".join(sorted(name for name in item.fixturenames if name in defs and defs[name][-1].baseid
                              and name != "no_tf32" and defs[name][-1].scope in ("module", "session"))) or None
    return f"{item.module.__name__}:{key}" if key else None


def _lanes(groups: dict[str, list], seconds, count: int) -> list[list]:
    """The groups packed into `count` lanes, longest first onto the least loaded lane."""
    lanes: list[list] = [[] for _ in range(count)]
    loads = [0.0] * count
    for key in sorted(groups, key=lambda k: -seconds(groups[k])):
        lane = loads.index(min(loads))
        lanes[lane] += groups[key]
        loads[lane] += seconds(groups[key])
    return [lane for lane in lanes if lane]


def node_id(record: dict) -> str:
    """The pytest node id of a check's record (pytest_runtest_makereport writes them): its file and name, less the
    @group pytest-xdist appends to the name."""
    return f"{record['file']}::{record['check'].split('@', 1)[0]}"


def passed_before(path: Path) -> set[str]:
    """The node ids of the checks the record file `path` holds as passed on the code that runs here (same_code_as: its
    code digest, so a commit of records between two device calls resumes; an older record's commit in a clean tree)
    (a line torn by a kill is passed over)."""
    done, here = set(), code_here()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("passed") is True and same_code_as(record.get("env") or {}, here):
            done.add(node_id(record))
    return done


def _resume(config, items) -> None:
    """Leave out the checks GPU_CHECKS_PASSED records as passed on this code. Every xdist worker reads the same file,
    so it must not change during the run: a copy, not the record being appended to."""
    path = os.environ.get("GPU_CHECKS_PASSED")
    if not path or not Path(path).is_file():
        return
    done = passed_before(Path(path))
    kept = [item for item in items if item.nodeid not in done]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = kept


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Group the GPU tests that share a cache (an xdist group runs in one worker), the heavy ones into HEAVY_LANES
    lanes, and order the groups longest first by the last whole run's durations. First of the hooks: xdist's worker
    reads the groups in its own (it renames each grouped test), and a group marked after it is none (the first parallel
    run on the GPU ran every test anywhere: the curves at published widths 15 at once, out of GPU memory)."""
    _resume(config, items)
    timed = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def seconds(members):
        return sum(timed.get(item.nodeid, UNTIMED_S) for item in members)

    shared: dict[str, list] = {}
    heavy: dict[str, list] = {}
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        key = share_key(item) or item.nodeid
        is_heavy = getattr(item.module, "heavy", lambda item: False)(item)
        (heavy if is_heavy else shared).setdefault(key, []).append(item)
    groups = {f"heavy-lane-{n}": lane for n, lane in enumerate(_lanes(heavy, seconds, HEAVY_LANES))}
    for key, members in shared.items():
        times = [timed.get(item.nodeid, UNTIMED_S) for item in members]
        whole = any(getattr(item.module, "whole", lambda item: False)(item) for item in members)
        parts = _lanes({item.nodeid: [item] for item in members}, seconds,
                       part_count(times)) if len(members) > 1 and not whole else [members]
        groups.update({f"{key}:{n}" if len(parts) > 1 else key: part for n, part in enumerate(parts)})
    order = {}
    for key, members in groups.items():
        for n, item in enumerate(members):
            if len(members) > 1:
                item.add_marker(pytest.mark.xdist_group(key))
            order[item.nodeid] = (-seconds(members), key, n)
    # a stable sort: the tests outside tests/gpu keep their order, after the GPU ones
    items.sort(key=lambda item: order.get(item.nodeid, (0.0, "", 0)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("MEGATRAIN_GPU_CHECKS")
    # a check's call, or its setup where that did not pass (a fixture's error or skip: the call never comes, and the
    # first run that cut the log short left two such checks without a trace)
    if not path or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    data = dict(item.user_properties).get("check", {})
    runs = dict(item.user_properties).get("runs")
    append_jsonl(path, {
        "check": item.nodeid.split("::", 1)[1],
        "file": item.nodeid.split("::", 1)[0],
        "passed": report.passed,
        "outcome": report.outcome if report.when == "call" else f"{report.outcome} in setup",
        **json.loads(json.dumps(data, default=str)),
        **({"runs": runs} if runs else {}),
        "failure": relative_paths(str(report.longrepr))[-3000:] if not report.passed else None,
        "duration_s": round(report.duration, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "env": environment(),
    })
