"""The GPU suite's grouping (tests/gpu/conftest.py) as pytest-xdist runs it: tests that share a process cache in one
worker, checks at a published width in at most HEAVY_LANES workers. Held on the CPU with stand-in tests, since the
first parallel run on the GPU ran without any group (marked after xdist's worker had read them) and 15 curves at
published widths ran at once, out of GPU memory."""

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from megatrain.bench.env import code_sha256

ROOT = Path(__file__).resolve().parents[2]

# each stand-in check writes which worker ran it to WHO_RAN
RAN = '''
import os
import time

import pytest

pytestmark = pytest.mark.gpu


def _ran(kind, n):
    with open(os.environ["WHO_RAN"], "a") as f:
        f.write(f"{kind} {n} {os.environ['PYTEST_XDIST_WORKER']}\\n")
    time.sleep(0.2)
'''

STAND_INS = RAN + '''

def shares(item):
    return "cache" if item.originalname == "test_shared" else None


def heavy(item):
    return item.originalname == "test_heavy"


@pytest.mark.parametrize("n", range(4))
def test_shared(n):
    _ran("shared", n)


@pytest.mark.parametrize("n", range(6))
def test_heavy(n):
    _ran("heavy", n)


@pytest.mark.parametrize("n", range(6))
def test_alone(n):
    _ran("alone", n)
'''


def _module(path: Path, name: str):
    """The file `path` (a script or a GPU test module, neither importable by name) loaded as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inherited_env() -> dict:
    """This process's environment less what this run's own pytest and records set."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("PYTEST_XDIST_") and k not in ("MEGATRAIN_GPU_CHECKS", "GPU_CHECKS_PASSED")}


def _stand_ins(tmp_path: Path, module: str, source: str) -> None:
    """tmp_path as a GPU suite of stand-in checks: the suite's own conftest beside the test module `module`."""
    shutil.copy(ROOT / "tests" / "gpu" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / module).write_text(source)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: stand-in\n")


def _pytest(tmp_path: Path, env: dict, workers: int = 0) -> subprocess.CompletedProcess:
    """pytest over the stand-ins in tmp_path (through `workers` xdist workers, if any), with `env` over this process's
    environment less what this run's own pytest and records set (the checkout and tests/ importable)."""
    inherited = _inherited_env()
    xdist = ["-n", str(workers), "--dist", "loadgroup"] if workers else []
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist, str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env={
                              **inherited, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **env})


def _workers_of_each_kind(tmp_path: Path) -> dict[str, set[str]]:
    """The stand-ins in tmp_path run by 4 xdist workers: which workers ran each kind of check (RAN's WHO_RAN)."""
    who = tmp_path / "who_ran.txt"
    done = _pytest(tmp_path, {"WHO_RAN": str(who)}, workers=4)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = defaultdict(set)
    for line in who.read_text().splitlines():
        kind, _, worker = line.split()
        workers[kind].add(worker)
    return workers


@pytest.mark.subprocess
def test_xdist_runs_a_shared_cache_in_one_worker_and_heavy_checks_in_few(tmp_path):
    pytest.importorskip("xdist")
    _stand_ins(tmp_path, "test_stand_ins.py", STAND_INS)
    workers = _workers_of_each_kind(tmp_path)
    assert len(workers["shared"]) == 1, workers
    assert len(workers["heavy"]) <= _gpu_conftest().HEAVY_LANES, workers
    assert len(workers["alone"]) > 1, workers  # what shares nothing spreads (the run was in parallel)


def test_durations_take_each_passed_checks_time_by_its_node_id_and_keep_the_rest(tmp_path, monkeypatch):
    """scripts/gpu_durations.py: a record's check id carries the @group pytest-xdist appends (a key conftest would
    never look up), and a check out of memory in 0.1 s is no measure of its length."""
    module = _module(ROOT / "scripts" / "gpu_durations.py", "gpu_durations")
    durations = tmp_path / "durations.json"
    durations.write_text('{"tests/gpu/t.py::test_b[x]": 50.0, "tests/gpu/t.py::test_c": 7.0}')
    monkeypatch.setattr(module, "DURATIONS", durations)
    records = tmp_path / "run.jsonl"
    records.write_text("\n".join([
        '{"file": "tests/gpu/t.py", "check": "test_a@heavy-lane-0", "passed": true, "duration_s": 12.5}',
        '{"file": "tests/gpu/t.py", "check": "test_b[x]@t:cache", "passed": false, "duration_s": 0.1}',
    ]) + "\n")
    module.main([str(records)])
    assert json.loads(durations.read_text()) == {"tests/gpu/t.py::test_a": 12.5, "tests/gpu/t.py::test_b[x]": 50.0,
                                                 "tests/gpu/t.py::test_c": 7.0}


def test_durations_say_where_the_checks_time_went_by_system_and_model():
    module = _module(ROOT / "scripts" / "gpu_durations.py", "gpu_durations")
    native = {"system": "native", "model": "big", "compile": False, "build_s": 10.0, "trained_s": 20.0}
    ours = {"system": "megatrain", "model": "big", "compile": True, "build_s": 5.0, "trained_s": 40.0}
    failed = {"system": "megatrain", "model": "tiny", "compile": True, "build_s": 1.0}  # no close: the check failed
    went = module.where_the_time_went([{"duration_s": 100.0, "runs": [native, ours]},
                                       {"duration_s": 3.0, "runs": [failed]}, {"duration_s": 50.0},
                                       # the sanitizer check's own runs (its subprocess's sets) time no build
                                       {"duration_s": 140.0, "runs": [{"set": "streamed", "status": "ok"}]}])
    assert went["checks"] == 2 and went["total_s"] == 103.0 and went["outside_runs_s"] == 103.0 - 76.0
    assert went["by_system"] == {"megatrain compiled": {"build_s": 6.0, "trained_s": 40.0},
                                 "native": {"build_s": 10.0, "trained_s": 20.0}}
    assert went["by_model"] == {"big": 75.0, "tiny": 1.0}


FIXTURE_FAULTS = '''
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")


@pytest.fixture
def absent():
    pytest.skip("what it needs is absent")


def test_passes():
    pass


def test_setup_error(broken):
    pass


def test_setup_skip(absent):
    pass
'''


@pytest.mark.subprocess
def test_a_check_whose_fixture_fails_or_skips_leaves_a_record(tmp_path):
    """The record is what survives a run cut short by the device call's limit (before pytest's summary): a check
    that errored in its fixture left none, so two checks of the first rerun were missing without a trace."""
    _stand_ins(tmp_path, "test_faults.py", FIXTURE_FAULTS)
    out = tmp_path / "checks.jsonl"
    _pytest(tmp_path, {"MEGATRAIN_GPU_CHECKS": str(out)})
    records = {r["check"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert {name: (r["passed"], r["outcome"]) for name, r in records.items()} == {
        "test_passes": (True, "passed"), "test_setup_error": (False, "failed in setup"),
        "test_setup_skip": (False, "skipped in setup")}
    assert "the fixture broke" in records["test_setup_error"]["failure"]
    assert "absent" in records["test_setup_skip"]["failure"]


def _gpu_conftest():
    return _module(ROOT / "tests" / "gpu" / "conftest.py", "gpu_conftest_ledger")


def test_a_heavy_check_waits_for_its_share_of_the_host_and_a_dead_workers_share_lapses(tmp_path, monkeypatch):
    """host_share: the heavy checks' lanes are fixed at the start, so two 45 GiB curves could meet; the second now
    waits while the first holds the allowance, and takes it when the first is done or its worker is dead."""
    conftest = _gpu_conftest()
    monkeypatch.setattr(conftest, "LEDGER_POLL_S", 0.05)
    ledger = tmp_path / "ledger.json"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ledger.write_text(json.dumps({str(other.pid): 60.0}))
        got = threading.Event()

        def second():
            with conftest.host_share(40.0, ledger, limit=80.0):
                got.set()
                assert json.loads(ledger.read_text())[str(os.getpid())] == 40.0

        waiter = threading.Thread(target=second)
        waiter.start()
        assert not got.wait(0.5)  # 60 + 40 > 80: it waits
        with conftest.host_share(15.0, ledger, limit=80.0):  # 60 + 15 fits beside the first
            pass
        other.kill()
        other.wait()
        waiter.join(10)
        assert got.is_set()  # the dead worker's 60 lapsed
        assert json.loads(ledger.read_text()) == {}
        # alone, a check larger than the allowance still runs
        with conftest.host_share(120.0, ledger, limit=80.0):
            pass
    finally:
        other.kill()


def test_each_heavy_curve_declares_the_host_its_engine_will_hold(monkeypatch):
    """heavy_host_gib from the engine's own plan: GPT-OSS-20B's two layers in mixed precision at the 44.8 GiB its
    refusal on the H200 named; every heavy curve some, none beyond what the 128 GiB host has, no other check any."""
    from types import SimpleNamespace
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "gpu"))
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    checks = _module(ROOT / "tests" / "gpu" / "test_engine_gpu.py", "gpu_engine_checks")
    gib = {}
    for shape, name in checks.CURVE_CASES:
        item = SimpleNamespace(originalname="test_bf16_loss_curve_tracks_native",
                               callspec=SimpleNamespace(params={"shape": shape, "name": name}))
        gib[shape, name] = checks.heavy_host_gib(item)
        assert (gib[shape, name] > 0) == (shape in checks.HEAVY_SHAPES), (shape, name)
        assert gib[shape, name] < 100, (shape, name)
    assert 44 < gib["gpt-oss-20b-2l-b4-s1024", "mixed"] < 45.5
    assert gib["gpt-oss-20b-2l-b4-s1024", "bf16"] < gib["gpt-oss-20b-2l-b4-s1024", "mixed"]
    light = SimpleNamespace(originalname="test_fp32_engine_matches_native_tightly",
                            callspec=SimpleNamespace(params={"name": "eager", "clipping": "clip-active"}))
    assert checks.heavy_host_gib(light) == 0.0


def test_a_group_is_split_only_where_each_part_pays_its_first_check_and_still_ends_sooner():
    conftest = _gpu_conftest()
    # Qwen3-Next's hybrid set at 5ec0d0c: the first check 343 s (the native runs and the layers' first compile), the
    # rest 18-56 s: one part, not the three that each paid the compile
    hybrid = [342.9, 26.1, 31.7, 46.2, 17.7, 18.7, 55.7, 21.8, 20.8]
    assert conftest.part_count(hybrid) == 1
    # checks of even length with little shared: split as before
    assert conftest.part_count([30.0] * 20, cap=240.0) == 3
    assert conftest.part_count([100.0, 20.0, 20.0, 20.0], cap=240.0) == 1
    assert conftest.part_count([5.0, 5.0], cap=1.0) == 2  # never more parts than checks


WHOLE = RAN + '''

def shares(item):
    return item.originalname


def whole(item):
    return item.originalname == "test_compiled_once"


@pytest.mark.parametrize("n", range(4))
def test_compiled_once(n):
    _ran("whole", n)


@pytest.mark.parametrize("n", range(4))
def test_split(n):
    _ran("split", n)
'''


@pytest.mark.subprocess
def test_a_group_the_module_keeps_whole_runs_in_one_worker_whatever_its_last_times(tmp_path):
    """A split run's times show each part's first check long (each paid the shared compile), which would split the
    group again: a group whose module says `whole` stays in one worker; the same times split a group that does not."""
    pytest.importorskip("xdist")
    _stand_ins(tmp_path, "test_whole.py", WHOLE)
    (tmp_path / "durations.json").write_text(json.dumps(
        {f"test_whole.py::test_{name}[{n}]": 200.0 for name in ("compiled_once", "split") for n in range(4)}))
    workers = _workers_of_each_kind(tmp_path)
    assert len(workers["whole"]) == 1 and len(workers["split"]) > 1, workers


RESUMED = '''
import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", range(4))
def test_check(n):
    pass
'''


@pytest.mark.subprocess
def test_a_run_resumes_past_the_checks_passed_at_this_commit_and_only_those(tmp_path):
    """The queue's machine was given back between its two calls and took the suite's second half with it: a run
    named again goes on from its record, leaving out what passed at this commit in a clean tree; not what failed,
    what passed at another commit, or anything when the tree is dirty. Through xdist: every worker leaves out the
    same checks."""
    pytest.importorskip("xdist")
    _stand_ins(tmp_path, "test_resumed.py", RESUMED)
    before = tmp_path / "before.jsonl"

    def record(n, passed, commit, **code):
        return json.dumps({"check": f"test_check[{n}]@group", "file": "test_resumed.py", "passed": passed,
                           "env": {"commit": commit, "dirty": False, **code}})

    # [3] passed at a commit before a commit of records alone: its code digest is this code's
    before.write_text("\n".join([record(0, True, "abc"), record(1, False, "abc"), record(2, True, "older"),
                                 record(3, True, "older", code_sha256=code_sha256()), '{"check": "torn']) + "\n")

    def ran(dirty):
        out = tmp_path / f"run-{dirty}.jsonl"
        done = _pytest(tmp_path, {"MEGATRAIN_GPU_CHECKS": str(out), "GPU_CHECKS_PASSED": str(before),
                                  "MEGATRAIN_COMMIT": "abc", "MEGATRAIN_DIRTY": dirty}, workers=2)
        assert done.returncode == 0, done.stdout + done.stderr
        return sorted(json.loads(line)["check"] for line in out.read_text().splitlines())

    assert ran("0") == ["test_check[1]", "test_check[2]"]
    assert ran("1") == ["test_check[0]", "test_check[1]", "test_check[2]"], "a dirty tree is not the commit's code"


TIMED = '''
import pytest
from engine_helpers import train

from megatrain.bench.case import run_case
from megatrain.config import CaseConfig

pytestmark = pytest.mark.gpu


def test_two_runs():
    assert run_case(CaseConfig(system="native", model="tiny", device="cpu", batch=2, seq=16, steps=2))["status"] == "ok"
    train("megatrain", 2, model="tiny", device="cpu", batch=2, seq=16)
'''


@pytest.mark.subprocess
def test_a_checks_record_times_each_system_it_builds_and_trains(tmp_path):
    """What a check's time goes to, per run: run_case's and the helpers' builds, each to its close."""
    _stand_ins(tmp_path, "test_timed.py", TIMED)
    out = tmp_path / "checks.jsonl"
    done = _pytest(tmp_path, {"MEGATRAIN_GPU_CHECKS": str(out)})
    assert done.returncode == 0, done.stdout + done.stderr
    [record] = map(json.loads, out.read_text().splitlines())
    assert [(r["system"], r["model"], r["compile"]) for r in record["runs"]] == [("native", "tiny", False),
                                                                              ("megatrain", "tiny", False)]
    assert all(r["build_s"] > 0 and r["trained_s"] > 0 for r in record["runs"])
    assert sum(r["build_s"] + r["trained_s"] for r in record["runs"]) <= record["duration_s"]


RUNNING = '''
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


# the conftest orders checks of one (untimed) length by node id: this one runs first
def test_1_names_itself():
    running = json.loads(Path(os.environ["MEGATRAIN_GPU_CHECKS"] + ".running", "main").read_text())
    assert running["check"].endswith("test_1_names_itself")


def test_2_dies():
    os._exit(1)
'''


@pytest.mark.subprocess
def test_a_check_that_kills_its_worker_is_named_by_the_file_it_leaves(tmp_path):
    """A worker died in the whole run at 4e32950 ("node down") and nothing said which check it was running."""
    _stand_ins(tmp_path, "test_running.py", RUNNING)
    out = tmp_path / "checks.jsonl"
    _pytest(tmp_path, {"MEGATRAIN_GPU_CHECKS": str(out)})
    [passed] = map(json.loads, out.read_text().splitlines())
    assert passed["check"] == "test_1_names_itself" and passed["passed"] and passed["worker"] == "main"
    running = json.loads((tmp_path / "checks.jsonl.running" / "main").read_text())
    assert running["check"].endswith("test_2_dies") and running["since_utc"]


COMPILE_BOUND = '''
import json
import os

import pytest
from torch._inductor import config
from torch._inductor.async_compile import get_compile_threads

pytestmark = pytest.mark.gpu


def compile_bound(item):
    return item.originalname == "test_2_bound"


def _threads(name):
    with open(os.environ["WHO_RAN"], "a") as f:
        f.write(json.dumps([name, config.compile_threads, get_compile_threads()]) + "\\n")


# run in this order (conftest orders checks of equal times by name)
def test_1_light():
    _threads("light")


def test_2_bound():
    _threads("bound")


def test_3_after():
    _threads("after")
'''


@pytest.mark.subprocess
def test_a_compile_bound_check_compiles_with_more_inductor_threads_than_the_workers_one(tmp_path):
    """scripts/gpu_checks.sh gives each worker one Inductor thread; the generic sets' first compiles (150-460 s a check
    at that) take COMPILE_BOUND_THREADS from the check on, as Inductor reads them when it makes its pool."""
    _stand_ins(tmp_path, "test_compile_bound.py", COMPILE_BOUND)
    who = tmp_path / "threads.jsonl"
    done = _pytest(tmp_path, {"WHO_RAN": str(who), "TORCHINDUCTOR_COMPILE_THREADS": "1",
                              "GPU_CHECK_COMPILE_THREADS": "3"})
    assert done.returncode == 0, done.stdout + done.stderr
    threads = {name: (set_to, read) for name, set_to, read in map(json.loads, who.read_text().splitlines())}
    # a pool, once made, keeps its size: the worker's later checks keep the threads
    assert threads == {"light": (1, 1), "bound": (3, 3), "after": (3, 3)}


def _gpu_plan():
    return _module(ROOT / "scripts" / "gpu_plan.py", "gpu_plan")


def test_the_plan_hands_out_groups_as_xdist_loadgroup_does():
    """scripts/gpu_plan.py: a worker starts with two units and is given the next while it has two checks or fewer
    left, so a long group's worker may already hold the next unit (xdist's LoadScopeScheduling)."""
    plan = _gpu_plan()
    work = plan.units([("a1", "A"), ("b", None), ("a2", "A"), ("c", None), ("d", None), ("e", None)])
    assert work == [("A", ["a1", "a2"]), ("b", ["b"]), ("c", ["c"]), ("d", ["d"]), ("e", ["e"])]
    seconds = {"a1": 100.0, "a2": 100.0, "b": 10.0, "c": 10.0, "d": 10.0, "e": 10.0}
    # A to worker 0 and b to worker 1, then each a second unit (two checks or fewer pending): c to 0, d to 1; e goes
    # to worker 1 when b ends (one check left there), while worker 0 still runs A
    got = plan.simulate(work, seconds, workers=2, untimed_s=30.0)
    assert got["ran"] == [["A", "c"], ["b", "d", "e"]]
    assert got["ends"] == [210.0, 30.0]


@pytest.mark.subprocess
def test_the_plan_reads_the_suites_own_groups():
    """The plan collects tests/gpu with its conftest (no GPU needed): the generic path's Qwen3-Next fp32 set is one
    unit, kept whole, and the plan names it as the last worker's."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_plan.py"), "--workers", "2", "-k",
                           "hybrid and fp32"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    counts = done.stdout.splitlines()[-4]
    checks, units = int(counts.split()[0]), int(counts.split()[3])
    assert checks >= 4 and units == 1, done.stdout
    assert "tiny-hf-qwen3-next" in done.stdout.splitlines()[-2], done.stdout


def _compile_cache():
    return _module(ROOT / "scripts" / "compile_cache.py", "compile_cache")


def test_unpacking_keeps_the_caches_own_files_and_refuses_a_member_outside_it(tmp_path):
    packer = _compile_cache()
    (tmp_path / "cache" / "fxgraph").mkdir(parents=True)
    (tmp_path / "cache" / "fxgraph" / "entry").write_text("carried")
    (tmp_path / "cache" / "locks").mkdir()
    (tmp_path / "cache" / "locks" / "entry.lock").write_text("")
    assert [p.name for p in packer.pack(tmp_path / "cache", tmp_path / "c.tar.xz")] == ["c.tar.xz.0"]
    (tmp_path / "here" / "fxgraph").mkdir(parents=True)
    (tmp_path / "here" / "fxgraph" / "entry").write_text("its own")
    assert packer.unpack(tmp_path / "c.tar.xz", tmp_path / "here") == 0
    assert (tmp_path / "here" / "fxgraph" / "entry").read_text() == "its own"
    assert not (tmp_path / "here" / "locks").exists()  # Inductor's lock files are not carried
    assert packer.unpack(tmp_path / "c.tar.xz", tmp_path / "empty") == 1
    assert (tmp_path / "empty" / "fxgraph" / "entry").read_text() == "carried"
    # a crafted archive: a member climbing out of the cache is refused before anything lands
    evil = tmp_path / "evil.tar.xz"
    with tarfile.open(evil.with_name("evil.tar.xz.0"), "w:xz") as tar:
        tar.addfile(tarfile.TarInfo("fine"), io.BytesIO(b""))
        tar.addfile(tarfile.TarInfo("../outside"), io.BytesIO(b""))
    with pytest.raises(SystemExit, match="refused"):
        packer.unpack(evil, tmp_path / "victim")
    assert not (tmp_path / "outside").exists() and not (tmp_path / "victim").exists()
    # a part lost on the way (a big cache's second of three): the archive is not whole, said as such, nothing landed
    big = tmp_path / "big"
    (big / "fxgraph").mkdir(parents=True)
    (big / "fxgraph" / "entry").write_bytes(os.urandom(300_000))
    (big / "fxgraph" / "last").write_text("after the entry")
    assert len(packer.pack(big, tmp_path / "b.tar.xz", part_mib=0.1)) == 3  # in parts, as a device call's files must be
    assert packer.unpack(tmp_path / "b.tar.xz", tmp_path / "whole") == 2
    assert (tmp_path / "whole" / "fxgraph" / "entry").read_bytes() == (big / "fxgraph" / "entry").read_bytes()
    (tmp_path / "b.tar.xz.1").unlink()
    with pytest.raises(SystemExit, match="not a whole archive"):
        packer.unpack(tmp_path / "b.tar.xz", tmp_path / "torn")
    assert not (tmp_path / "torn").exists()
    (tmp_path / "c.tar.xz.0").write_bytes((tmp_path / "c.tar.xz.0").read_bytes()[:40])
    with pytest.raises(SystemExit, match="not a whole archive"):
        packer.unpack(tmp_path / "c.tar.xz", tmp_path / "torn")


CARRIED = '''
import os
import time

import pytest
import torch
from torch._dynamo.utils import counters

pytestmark = pytest.mark.gpu


def test_compiles():
    @torch.compile
    def f(x):
        return (x.sin() * x.cos()).sum(dim=-1)

    f(torch.randn(8, 16))
    with open(os.environ["WHO_RAN"], "a") as out:
        out.write(f"{counters['inductor']['fxgraph_cache_hit']} {counters['inductor']['fxgraph_cache_miss']}\\n")
    time.sleep(float(os.environ.get("STAND_IN_SLEEP_S", "0")))
'''


def _gpu_checks(tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    inherited = _inherited_env()
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_checks.sh"), str(tmp_path / "run.jsonl"), str(ROOT)],
                          capture_output=True, text=True, timeout=300, env={
                              **inherited, "PYTHON": sys.executable, "GPU_TESTS": str(tmp_path / "suite"),
                              "GPU_CHECK_WORKERS": "1", "WHO_RAN": str(tmp_path / "who.txt"), **env})


@pytest.mark.subprocess
def test_the_suite_carries_its_compile_cache_to_the_next_run_and_packs_it_when_its_time_is_up(tmp_path):
    """scripts/gpu_checks.sh: GPU_CHECK_CACHE_OUT packs the run's Inductor cache after the checks, also when
    GPU_CHECK_TIMEOUT_S stopped them (a device call's limit would have killed the packing with them), and the next
    run, on a bare machine, unpacks what GPU_CHECK_CACHE_IN names into another folder and compiles nothing the first
    compiled (an entry naming its first folder would miss)."""
    pytest.importorskip("xdist")
    (tmp_path / "suite").mkdir()
    _stand_ins(tmp_path / "suite", "test_carried.py", CARRIED)
    parts = tmp_path / "out" / "inductor.tar.xz"
    parts.parent.mkdir()
    first = _gpu_checks(tmp_path, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "first"),
                                   "GPU_CHECK_CACHE_OUT": str(parts), "GPU_CHECK_TIMEOUT_S": "30",
                                   "STAND_IN_SLEEP_S": "300"})
    assert first.returncode == 124, first.stdout + first.stderr  # stopped by its time, and still packed
    assert (tmp_path / "out" / "inductor.tar.xz.0").is_file(), first.stdout + first.stderr
    second = _gpu_checks(tmp_path, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "bare"),
                                    "GPU_CHECK_CACHE_IN": str(parts)})
    assert second.returncode == 0, second.stdout + second.stderr
    assert (tmp_path / "who.txt").read_text().splitlines() == ["0 1", "1 0"]
