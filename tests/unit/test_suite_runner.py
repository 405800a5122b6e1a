"""The suite runner survives OOMs, crashes and hangs, stops batch ladders, and resumes.

CPU, a few minutes (case subprocesses), in the subprocess session: pytest -m subprocess tests/unit/test_suite_runner.py
Failures are injected by tests/unit/fake_system.py, which stands in for `python -m megatrain bench`.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import megatrain.bench.env
import megatrain.bench.suite
import megatrain.preflight
from megatrain.bench.record import read_jsonl, validate
from megatrain.bench.suite import load_suite, run_suite
from megatrain.probe import Machine

pytestmark = pytest.mark.subprocess  # every test here runs suites of case subprocesses

FAKE_BENCH = [sys.executable, str(Path(__file__).with_name("fake_system.py"))]
# `python -m megatrain suite` with the fake bench command, in a process of its own that a test can kill
SUITE_CLI = """
import functools, sys
import megatrain.bench.suite as suite
from megatrain.cli import main
suite.run_suite = functools.partial(suite.run_suite, bench_command={fake!r})
sys.exit(main(["suite", {path!r}, "--out-dir", {out!r}, *sys.argv[1:]]))
"""

SUITE = """
description = "runner robustness"
hardware = "cpu-ci"
timeout_s = 120

[defaults]
systems = "native"
models = "tiny"
device = "cpu"
batch = 2
seq = 16
steps = 2
warmup = 1

[[cases]]
name = "good"
seq = [16, 32]

[[cases]]
name = "oom"
seed = 101  # fake_system: OOM

[[cases]]
name = "crash"
seed = 102  # fake_system: exit without a record

[[cases]]
name = "hang"
timeout_s = 3
seed = 103  # fake_system: hang

[[cases]]
name = "ladder"
ladder = "batch"
batch = [1, 2, 4]
seed = 104  # fake_system: OOM from batch 2
"""


PROBED: dict = {}  # rates -> the machine as the first run_suite here that probed so found it


@pytest.fixture(autouse=True)
def one_probe(monkeypatch):
    """Each run_suite probes the machine in a process of its own (~4 s on 2 cores; the tests here call it 14 times):
    the first does, the others plan their cases in this process against the machine it found."""
    probe = megatrain.bench.suite._preflight

    def preflight(cases, rates):
        if rates not in PROBED:
            pre = probe(cases, rates)
            PROBED[rates] = pre["machine"]
            return pre
        plans = megatrain.bench.suite.plan_cases({c.case_id: c.config.to_dict() for c in cases},
                                                 Machine.from_dict(PROBED[rates]))
        return json.loads(json.dumps({"machine": PROBED[rates], "plans": plans}))  # as the probe's process hands them

    monkeypatch.setattr(megatrain.bench.suite, "_preflight", preflight)


def _run(suite, out_dir, **kwargs):
    return run_suite(suite, out_dir, bench_command=FAKE_BENCH, log=lambda *a: None, **kwargs)


def _by_group(records):
    return {(r["suite"]["group"], r["batch"], r["seq"]): r for r in records}


def test_failures_become_records_and_a_rerun_finishes_only_what_is_missing(tmp_path):
    (tmp_path / "robust.toml").write_text(SUITE)
    suite = load_suite(str(tmp_path / "robust.toml"))
    out = tmp_path / "results"

    first = _run(suite, out, only="good|oom")  # an interrupted campaign: part of the suite ran
    assert sorted(r["status"] for r in first) == ["ok", "ok", "oom"]

    second = _run(suite, out)
    got = _by_group(second)
    assert set(got) == {("crash", 2, 16), ("hang", 2, 16), ("ladder", 1, 16), ("ladder", 2, 16)}, \
        "good and oom cases are final; the ladder stops after its first OOM (batch 4 never runs)"
    assert got[("crash", 2, 16)]["status"] == "error"
    assert "injected crash" in got[("crash", 2, 16)]["stderr_tail"]
    assert 'File "tests/unit/fake_system.py"' in got[("crash", 2, 16)]["stderr_tail"], \
        "records are committed: paths in them are relative to the repository, not this machine's"
    assert got[("hang", 2, 16)]["status"] == "timeout"
    assert got[("ladder", 1, 16)]["status"] == "ok" and got[("ladder", 2, 16)]["status"] == "oom"

    records = read_jsonl(out / "records.jsonl")
    assert len(records) == 7
    for r in records:
        validate(r)
        assert r["suite"]["run_id"] == first[0]["suite"]["run_id"], "a resumed run keeps its run_id"
        assert r["suite"]["machine"]["cpu_adamw_gparams_s"] > 0
    ok = [r for r in records if r["status"] == "ok"]
    assert all((out / r["trace"]["path"]).exists() for r in ok), "every case that ran leaves its trace"
    assert all(r["suite"]["command"].startswith("python -m megatrain bench --system native") for r in records)

    third = _run(suite, out)
    assert sorted(r["suite"]["group"] for r in third) == ["crash", "hang"], "only error and timeout are retried"

    fresh = _run(suite, out, new_run=True, only="good")
    assert len(fresh) == 2 and fresh[0]["suite"]["run_id"] != first[0]["suite"]["run_id"]


def test_a_commit_of_records_resumes_other_code_starts_a_new_run_and_a_corrupt_record_line_is_skipped(tmp_path,
                                                                                                    monkeypatch):
    """A run resumes on the same code (its digest), whatever commit holds it: the records committed between two device
    calls made a new commit, and the next call started a new run. Records of other code start one."""
    (tmp_path / "robust.toml").write_text(SUITE)
    suite = load_suite(str(tmp_path / "robust.toml"))
    out = tmp_path / "results"
    monkeypatch.setenv("MEGATRAIN_COMMIT", "a" * 40)
    first = _run(suite, out, only="good")
    with (out / "records.jsonl").open("a") as f:
        f.write('{"status": "ok", "cut sh\n')
    with pytest.warns(UserWarning, match=r"records\.jsonl:3: skipped a line that is not JSON"):
        again = _run(suite, out, only="good|oom")
    assert [r["suite"]["group"] for r in again] == ["oom"], "same code: the run resumes, past the bad line"
    assert again[0]["suite"]["run_id"] == first[0]["suite"]["run_id"]
    monkeypatch.setenv("MEGATRAIN_COMMIT", "b" * 40)  # records committed: another commit, the same code
    with pytest.warns(UserWarning, match=r"records\.jsonl:3: skipped a line that is not JSON"):  # still there
        assert _run(suite, out, only="good|oom") == [], "the same code resumes its run: nothing left to run"
    def other_code(line: str) -> str:  # the run's records as if measured on other code
        if not line.endswith("}"):
            return line
        record = json.loads(line)
        return json.dumps({**record, "env": {**record["env"], "code_sha256": "0" * 64}})

    lines = (out / "records.jsonl").read_text().splitlines()
    (out / "records.jsonl").write_text("\n".join(map(other_code, lines)) + "\n")
    with pytest.warns(UserWarning, match=r"records\.jsonl:3: skipped a line that is not JSON"):
        later = _run(suite, out, only="good")
    assert len(later) == 2 and later[0]["suite"]["run_id"] != first[0]["suite"]["run_id"], \
        "a run never mixes two codes"
    assert all(r["env"]["commit"] == "b" * 40 for r in later)


def test_a_case_run_on_another_kind_of_machine_is_labelled_by_that_machine_and_still_resumes(tmp_path):
    (tmp_path / "elsewhere.toml").write_text(SUITE.replace('hardware = "cpu-ci"', 'hardware = "h100-80g"'))
    suite = load_suite(str(tmp_path / "elsewhere.toml"))
    out = tmp_path / "results"
    assert _run(suite, out, only="good") == [], "not an H100: nothing runs without --any-hardware"
    first = _run(suite, out, only="good", any_hardware=True)
    assert [(r["suite"]["hardware"], r["suite"]["planned_hardware"]) for r in first] == [("cpu-ci", "h100-80g")] * 2
    again = _run(suite, out, only="good|oom", any_hardware=True)
    assert [r["suite"]["group"] for r in again] == ["oom"], "the relabelled cases count as done: the run resumes"


def test_a_case_skipped_for_a_missing_package_runs_when_its_suite_resumes_where_the_package_is(tmp_path,
                                                                                              monkeypatch):
    # on a GPU host the DeepSpeed wheel and the paper's code travel only when carried: a run without them recorded
    # their cases skipped, and the resumed run, with them there, skipped them again as final
    # the skipped records are written in this process, with its cached environment: one another test cached under
    # its own MEGATRAIN_COMMIT would name other code, and the second run would not resume
    megatrain.bench.env.environment.cache_clear()
    (tmp_path / "robust.toml").write_text(SUITE)
    suite = load_suite(str(tmp_path / "robust.toml"))
    _run(suite, tmp_path / "probed", only="good")  # the machine probed once (one_probe), in a run of its own
    out = tmp_path / "results"
    installed = megatrain.preflight.unavailable
    monkeypatch.setattr(megatrain.preflight, "unavailable", lambda system: "package 'x' is not installed")
    first = _run(suite, out, only="good")
    assert [r["status"] for r in first] == ["skipped"] * 2 and first[0]["suite"]["plan"]["missing"]
    monkeypatch.setattr(megatrain.preflight, "unavailable", installed)
    again = _run(suite, out, only="good")
    assert [r["status"] for r in again] == ["ok"] * 2 and again[0]["suite"]["run_id"] == first[0]["suite"]["run_id"]
    assert _run(suite, out, only="good") == [], "ok is final"


def test_a_case_killed_by_a_signal_that_is_not_the_oom_killer_is_recorded_killed_and_run_again(tmp_path):
    sigterm = '\n[[cases]]\nname = "sigterm"\nseed = 105\n'
    (tmp_path / "killed.toml").write_text(SUITE + sigterm)
    suite = load_suite(str(tmp_path / "killed.toml"))
    out = tmp_path / "results"
    first = _run(suite, out, only="sigterm")
    assert [r["status"] for r in first] == ["killed"] and "SIGTERM" in first[0]["error"]
    assert [r["status"] for r in _run(suite, out, only="sigterm")] == ["killed"], "not final: resumed runs retry it"


def test_a_refusal_by_the_cases_own_preflight_is_recorded_skipped_with_its_numbers(tmp_path):
    (tmp_path / "s.toml").write_text(SUITE.replace("seed = 102  # fake_system: exit without a record",
                                                   "seed = 106  # fake_system: refused by its pre-flight"))
    suite = load_suite(str(tmp_path / "s.toml"))
    first = _run(suite, tmp_path / "results", only="crash")
    assert [r["status"] for r in first] == ["skipped"]
    assert first[0]["error"].startswith("native tiny b2 s16 does not fit here: host memory: needs 9.0 GiB")
    assert _run(suite, tmp_path / "results", only="crash") == [], "a refusal is final, not retried like an error"


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process (Linux /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        found[int(stat.parent.name)] = (int(fields[1]), fields[0])
    return found


def _descendants(pid: int) -> set[int]:
    procs, found, todo = _processes(), set(), [pid]
    while todo:
        pid = todo.pop()
        children = {p for p, (parent, _) in procs.items() if parent == pid}
        found |= children
        todo += children
    return found


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:  # it ended meanwhile
        return ""


def _alive(pids: set[int]) -> set[int]:
    procs = _processes()
    return {p for p in pids if p in procs and procs[p][1] != "Z"}  # a zombie has ended, whoever reaps it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_case_ends_with_its_process_though_a_worker_it_left_holds_its_output(tmp_path):
    (tmp_path / "s.toml").write_text(SUITE + '\n[[cases]]\nname = "orphan"\nseed = 108\ntimeout_s = 90\n')
    [record] = _run(load_suite(str(tmp_path / "s.toml")), tmp_path / "results", only="orphan")
    assert record["status"] == "ok", record.get("error")
    assert record["suite"]["wall_s"] < 45, "the runner waited on the worker's pipe, not on the case"
    assert any("fake_system orphan" in c for c in record["suite"]["left_running"]), "the record names the worker"
    deadline = time.monotonic() + 5
    while (left := [p for p in _alive(set(_processes())) if "fake_system orphan" in _command_line(p)]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "the worker outlived its case's group"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_runner_takes_its_running_case_and_the_cases_workers_with_it(tmp_path, sig):
    (tmp_path / "s.toml").write_text(SUITE + '\n[[cases]]\nname = "worker"\nseed = 107\n')
    out = tmp_path / "results"
    code = SUITE_CLI.format(fake=FAKE_BENCH, path=str(tmp_path / "s.toml"), out=str(out))
    runner = subprocess.Popen([sys.executable, "-c", code, "--only", "worker"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any("fake_system worker" in _command_line(p) for p in _descendants(runner.pid)):
            assert runner.poll() is None and time.monotonic() < deadline, "the case never started its worker"
            time.sleep(0.2)
        started = _descendants(runner.pid)
        runner.send_signal(sig)
        _, stderr = runner.communicate(timeout=30)
    finally:
        runner.kill()
    deadline = time.monotonic() + 5
    while _alive(started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(started), "the case or its worker outlived the runner"
    if sig == signal.SIGTERM:
        assert runner.returncode == 130 and "interrupted" in stderr, "SIGTERM stops the suite as Ctrl-C does"
        assert not read_jsonl(out / "records.jsonl"), "nothing recorded for the interrupted case: a rerun runs it"
