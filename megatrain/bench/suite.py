"""Suites: declarative case lists (suites/*.toml) and the runner that turns them into records.

A suite file holds suite-wide settings and `[[cases]]` groups. In a group, `systems`, `models`,
`batch`, `seq`, `num_layers`, `precision`, `compile` and `hardware` may be lists: the group's cases are
their product. Every other key is a CaseConfig field (micro_batch, steps, options, ...) or one of
`label` (a format string over {system} and {precision}; a compiled case's label ends in '-compiled'),
`timeout_s` and `ladder`. A model is a registry name, or (as `bench --model` takes) a config.json or a checkpoint
folder, its path relative to the suite file unless absolute: its shape alone, the case labelled name@sha256, so
that its case id follows the file's contents, not where it lies.

A top-level `[num_layers_by_hardware]` table (profile name = depth) sets the depth of every case on that profile
whose group names none: how a suite asks one question at the depth each host admits for every system (a cut
model on a smaller host, the registry's full depth where no entry names the profile).

`ladder = "batch"` (or "seq", or "num_layers": a model's depth) makes that list a ladder: per system
(and every other setting), the values run in increasing order and the runner stops climbing after the
first case that does not end `ok` (OOM, skipped as not fitting, error, time-out). This is how "each
system's largest batch" (or deepest model) is found. Cases above the stop are not run and not recorded.

The runner (`run_suite`) probes the machine once (in a subprocess, so that this process never
holds a CUDA context), keeps the cases whose hardware profile this machine matches, asks each
system whether the case fits (megatrain.preflight) and runs every case in a fresh
`python -m megatrain bench` subprocess under a time limit. Each case appends one record to
`<out_dir>/records.jsonl`, with a `suite` block: run_id, case_id, group, label, hardware profile,
the measured machine, the memory plan, the exact command, wall time.

A case runs in a process group of its own with a watchdog process, which kills the group (the case and every
process it started: DeepSpeed's, torch.compile's workers) when the case ends or the runner dies, even by SIGKILL.
Ctrl-C or SIGTERM to the runner kills the running case's group, records nothing for that case (a rerun runs it) and
stops the suite: `python -m megatrain suite` exits 130.

Resume: a rerun continues the latest run in `out_dir` when it is on the same kind of machine and
the same code (same run_id; megatrain.bench.env.same_code: the code on disk, so a commit of records alone between two
device calls resumes), and skips the cases that run already recorded with a final status (ok, oom,
skipped). Cases that ended `error`, `timeout` or `killed` (a signal that was not the OOM killer's,
Ctrl-C included) are run again: all are often transient (a compile cache race, a slow first start)
and a retry costs only that case. `new_run=True` starts a
fresh run_id and runs everything.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

import megatrain.user_files as user_files
from megatrain.bench.args import BenchFlags, model_file
from megatrain.bench.env import same_code
from megatrain.bench.record import Record, append_jsonl, problem, read_jsonl, relative_paths, summary_line
from megatrain.config import CaseConfig
from megatrain.flags import flag_argv, parse
from megatrain.hardware import actual_profile, get_profile, same_machine
from megatrain.optim.config import OptimConfig
from megatrain.options import check_values
from megatrain.probe import Machine, measure
from megatrain.workspace import CHECKOUT, WORKSPACE

# the workspace's suites/ where it has one, else the suites the package ships (a checkout's own, an install's copy)
SUITES_DIR = WORKSPACE / "suites" if (WORKSPACE / "suites").is_dir() else Path(__file__).parents[1] / "suites"
# where the probe and every case run: a checkout's root, so that `python -m megatrain` is its code; else the workspace
CASE_CWD = CHECKOUT or WORKSPACE
# error, timeout and killed are run again on resume; so is a case skipped for what the environment lacked (_lacked)
FINAL_STATUSES = ("ok", "oom", "skipped")
# Group keys whose values (scalar or list) span the product, and the case field each sets.
PRODUCT_KEYS = {"systems": "system", "models": "model", "batch": "batch", "seq": "seq", "num_layers": "num_layers",
                "precision": "precision", "compile": "compile", "hardware": "hardware", "ranks": "ranks"}
GROUP_KEYS = {"name", "label", "timeout_s", "ladder"}
CASE_FIELDS = set(CaseConfig.__dataclass_fields__) - set(PRODUCT_KEYS.values())
STDERR_TAIL_CHARS = 3000


@dataclass(frozen=True)
class SuiteCase:
    """One case of a suite: a CaseConfig on an expected kind of machine.

    Attributes:
        config: the case itself.
        hardware: name of the profile (megatrain.hardware.PROFILES) it is meant for.
        group: the suite group it came from.
        label: the system's name in tables and plots ('megatrain-bf16').
        timeout_s: wall-clock limit of its subprocess.
        ladder: key of its ladder chain, or None (see the module docstring).
    """

    config: CaseConfig
    hardware: str
    group: str
    label: str
    timeout_s: float
    ladder: str | None = None
    model_path: str | None = None  # a model named by its config.json or checkpoint folder: where bench reads it

    @property
    def case_id(self) -> str:
        """Stable hash of the case config and hardware profile (label and group are presentation)."""
        blob = json.dumps({"config": self.config.to_dict(), "hardware": self.hardware}, sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        c = self.config
        depth = f"@{c.num_layers}L" if c.num_layers is not None else ""
        ranks = f" x{c.ranks} ranks" if c.ranks > 1 else ""
        return f"{self.label} {c.model}{depth} b{c.batch} s{c.seq}{ranks} [{self.hardware}]"


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    cases: list[SuiteCase]


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def _check_group_types(group: dict) -> None:
    """Each value of a group (each item of a product key's list) of the type its key takes: ValueError naming it."""
    for key, value in group.items():
        if key in PRODUCT_KEYS and key != "hardware":
            for item in _as_list(value):
                check_values(CaseConfig, {PRODUCT_KEYS[key]: item}, "case setting")
        elif key == "optim" and not isinstance(value, dict):
            raise ValueError(f"optim={value!r}: expected a table of AdamW settings")
        elif key in CASE_FIELDS and key != "optim":
            check_values(CaseConfig, {key: value}, "case setting")
        elif key == "timeout_s" and not seconds(value):
            raise ValueError(f"timeout_s={value!r}: expected a number of seconds > 0")
        elif key in GROUP_KEYS - {"timeout_s"} and not isinstance(value, str):
            raise ValueError(f"{key}={value!r}: expected a string")


def seconds(value) -> bool:
    """Whether value is a time limit: a finite number of seconds > 0 (TOML's nan and inf are numbers)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _label(template: str, config: CaseConfig) -> str:
    try:
        return template.format(system=config.system, precision=config.precision)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"label {template!r} cannot be filled ({exc!r}): a label may name {{system}} and "
                         "{precision}") from None


def _model_file(point: dict, suite_dir: Path) -> str | None:
    """A case's model named by a config.json or a checkpoint folder, relative to the suite file's folder unless
    absolute (bench's model_file): the point's model becomes its label and its shape the case's model_shape; the
    file's path is returned for the case's bench command."""
    named = model_file(point["model"], suite_dir) if isinstance(point["model"], str) else None
    if named is None:
        return None  # a registry name (CaseConfig refuses one it does not know, naming the registry)
    path = (suite_dir / point["model"]).resolve()
    point.update(model=named[0], model_shape=named[1])
    return str(path)


def _expand_group(group: dict, index: int, default_timeout_s: float,
                  depth_by_hardware: dict[str, int] | None = None, suite_dir: Path = SUITES_DIR) -> list[SuiteCase]:
    unknown = set(group) - set(PRODUCT_KEYS) - GROUP_KEYS - CASE_FIELDS
    if unknown:
        raise ValueError(f"group {index}: unknown keys {sorted(unknown)}; use {sorted(PRODUCT_KEYS)}, "
                         f"{sorted(GROUP_KEYS)} or CaseConfig fields")
    _check_group_types(group)
    for key in ("systems", "models", "hardware"):
        if key not in group:
            raise ValueError(f"group {index}: {key!r} is required")
    name = group.get("name", f"group{index}")
    ladder = group.get("ladder")
    if ladder is not None:
        if ladder not in ("batch", "seq", "num_layers"):
            raise ValueError(f"group {name}: ladder must be 'batch', 'seq' or 'num_layers', got {ladder!r}")
        steps = _as_list(group.get(ladder))
        if steps != sorted(set(steps)):
            raise ValueError(f"group {name}: ladder {ladder} values must increase, got {steps}")
    fields = {k: v for k, v in group.items() if k in CASE_FIELDS}
    if "optim" in fields:
        fields["optim"] = OptimConfig(**fields["optim"])
    dims = {k: _as_list(group[k]) for k in PRODUCT_KEYS if k in group}
    cases = []
    for values in itertools.product(*dims.values()):
        point = {PRODUCT_KEYS[k]: v for k, v in zip(dims, values, strict=True)}
        hardware = get_profile(point.pop("hardware")).name
        if "num_layers" not in point and hardware in (depth_by_hardware or {}):
            point["num_layers"] = depth_by_hardware[hardware]
        model_path = _model_file(point, suite_dir)
        config = CaseConfig(**fields, **point)
        label = group.get("label", "{system}" if config.precision == "mixed" else "{system}-{precision}")
        label += "-compiled" if config.compile else ""
        chain = None
        if ladder is not None:
            chain = json.dumps({"group": name, "hardware": hardware,
                                **{k: v for k, v in config.to_dict().items() if k not in (ladder, "micro_batch")}},
                               sort_keys=True)
        cases.append(SuiteCase(config, hardware, name, _label(label, config),
                               float(group.get("timeout_s", default_timeout_s)), chain, model_path))
    return cases


def _depth_by_hardware(path: Path, table: dict) -> dict[str, int]:
    """The suite's [num_layers_by_hardware], keyed by canonical profile name; ValueError names an unknown profile or a
    depth that is not a positive whole number."""
    depths = {}
    for profile, depth in table.items():
        try:
            name = get_profile(profile).name
        except ValueError as exc:
            raise ValueError(f"{path}: [num_layers_by_hardware] {exc}") from None
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"{path}: [num_layers_by_hardware] {profile} = {depth!r}: a depth is a whole number of "
                             "layers >= 1")
        depths[name] = depth
    return depths


def load_suite(name_or_path: str) -> Suite:
    """Load suites/<name>.toml (or a .toml path) and expand it into cases."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = SUITES_DIR / f"{name_or_path}.toml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in SUITES_DIR.glob("*.toml")))
        raise ValueError(f"no suite {name_or_path!r}; known suites: {known}")
    try:
        spec = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:  # its message names the line and column
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    except (UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from None
    except OSError as exc:  # a folder named like a suite file
        raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
    for key, kind, what in (("description", str, "a string"), ("hardware", str | list, "hardware profile names"),
                            ("timeout_s", int | float, "a number of seconds"), ("defaults", dict, "a table"),
                            ("num_layers_by_hardware", dict, "a table of profile = depth"),
                            ("cases", list, "[[cases]] tables")):
        if key in spec and (not isinstance(spec[key], kind) or isinstance(spec[key], bool)):
            raise ValueError(f"{path}: {key} = {json.dumps(spec[key], default=str)[:60]} must be {what}")
    if "timeout_s" in spec and not seconds(spec["timeout_s"]):
        raise ValueError(f"{path}: timeout_s = {spec['timeout_s']!r} must be a number of seconds > 0")
    if bad := [i for i, group in enumerate(spec.get("cases", [])) if not isinstance(group, dict)]:
        raise ValueError(f"{path}: cases entry {bad[0]} is not a table: write each group as a [[cases]] table")
    defaults = spec.get("defaults", {})
    timeout_s = spec.get("timeout_s", 600)
    depth_by_hardware = _depth_by_hardware(path, spec.get("num_layers_by_hardware", {}))
    cases = []
    for index, group in enumerate(spec.get("cases", [])):
        merged = {"hardware": spec.get("hardware"), **defaults, **group}
        if merged["hardware"] is None:
            merged.pop("hardware")
        try:
            cases.extend(_expand_group(merged, index, timeout_s, depth_by_hardware, path.parent))
        except (TypeError, ValueError) as exc:  # a value of the wrong type or range, an unknown optim key
            raise ValueError(f"{path}: [[cases]] group {group.get('name', index)!r}: {exc}") from None
    ids = [c.case_id for c in cases]
    duplicates = sorted({c.name for c in cases if ids.count(c.case_id) > 1})
    if duplicates:
        raise ValueError(f"suite {path.stem}: the same case appears twice: {duplicates}")
    return Suite(path.stem, spec.get("description", ""), cases)


def bench_args(config: CaseConfig, gemm_peak_tflops: float | None = None, model_path: str | None = None) -> list[str]:
    """`python -m megatrain bench` arguments that rebuild exactly `config` (its model read from model_path, a
    config.json or checkpoint folder, where the case was named by one)."""
    flags = replace(BenchFlags.of_case(config), gemm_peak_tflops=gemm_peak_tflops, json=True)
    args = flag_argv(replace(flags, model=model_path) if model_path else flags)
    rebuilt = parse(BenchFlags, args).case()
    if model_path and rebuilt.model != config.model:
        raise ValueError(f"{model_path} changed since its suite was read (now {rebuilt.model}): run the suite again")
    if rebuilt != config:
        raise ValueError(f"the bench CLI cannot express this case (optim betas/eps are not flags): {config}")
    return args


def _preflight(cases: list[SuiteCase], rates: bool) -> dict:
    """Probe the machine and plan every case, in a subprocess (CUDA is initialised there, not here)."""
    payload = json.dumps({"rates": rates, "cases": {c.case_id: c.config.to_dict() for c in cases}})
    code = "from megatrain.bench.suite import preflight_child; preflight_child()"
    proc = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True,
                          cwd=CASE_CWD)
    if proc.returncode != 0:
        raise RuntimeError(f"pre-flight probe failed (exit {proc.returncode}):\n{proc.stderr[-STDERR_TAIL_CHARS:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def preflight_child() -> None:
    """Subprocess side of _preflight: read cases from stdin, print the machine and the plans as JSON."""
    request = json.loads(sys.stdin.read())
    machine = measure(rates=request["rates"])
    print(json.dumps({"machine": machine.to_dict(), "plans": plan_cases(request["cases"], machine)}))


def plan_cases(cases: dict[str, dict], machine: Machine) -> dict[str, dict]:
    """Each case's pre-flight plan on `machine`, by case id, from the cases as _preflight sends them (CaseConfig
    dicts)."""
    from megatrain.preflight import plan_case

    return {cid: plan_case(CaseConfig.from_dict(d), machine) for cid, d in cases.items()}


def _last_json_line(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return None
        return record if isinstance(record, dict) and "status" in record else None
    return None


# Leads the case's process group and kills it once its stdin closes: when the runner closes it after the case, or
# when the runner dies, by a signal no handler sees (SIGKILL) included.
_WATCHDOG = "import os, signal, sys; sys.stdin.buffer.read(); os.killpg(0, signal.SIGKILL)"


@dataclass(frozen=True)
class Finished:
    """How a command run_grouped ran ended: its exit code, its output, whether its time ran out, and what it left
    running in its group when it ended by itself (each process's program name and arguments: group_members)."""
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    left_running: list[str]


def run_grouped(command: list[str], timeout_s: float, env: dict | None = None, cwd: Path | None = None) -> Finished:
    """Run `command` in a process group of its own, led by a watchdog that kills the group once the command ends, its
    time runs out, or this process dies (by SIGKILL too). Its output goes to files, not pipes, and it ends when its own
    process does: a worker it leaves running (DeepSpeed SuperOffload's CPU-Adam process, a daemon that a bench ending
    without the interpreter's teardown never stops) held a pipe open, and waiting for the pipe's end held two
    SuperOffload cases until the device call's limit killed them, their records written. Ctrl-C or SIGTERM kills the
    group and is raised."""
    # A group of its own (Ctrl-C at the terminal reaches the runner only), in the runner's session: a process can
    # join only a group of its own session.
    watchdog = subprocess.Popen([sys.executable, "-c", _WATCHDOG], stdin=subprocess.PIPE, process_group=0)
    group = watchdog.pid
    left_running: list[str] = []
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as out, \
            tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as err:
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, text=True, env=env,
                                    cwd=cwd, process_group=group)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
                left_running = group_members(group, but=watchdog.pid)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(group, signal.SIGKILL)  # the whole group: DeepSpeed/compile workers too
                proc.wait()
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the whole group goes too, then the caller stops
                os.killpg(group, signal.SIGKILL)
                proc.wait()
                raise
        finally:
            watchdog.stdin.close()  # the watchdog kills the group: whatever the command left running goes with it
            watchdog.wait()
        out.seek(0)
        err.seek(0)
        return Finished(proc.returncode, out.read(), err.read(), timed_out, left_running)


def run_case_subprocess(case: SuiteCase, command: list[str], trace_file: Path) -> tuple[dict, dict]:
    """Run one case's command (run_grouped); return (record, facts about the process for the suite block: what the
    case left running among them)."""
    # the case runs in CASE_CWD: a relative --out-dir's trace went there, outside the folder named
    env = {**os.environ, "MEGATRAIN_TRACE_FILE": str(trace_file.absolute())}
    t0 = time.perf_counter()
    oom_kills_before = cgroup_oom_kills()
    proc = run_grouped(command, case.timeout_s, env=env, cwd=CASE_CWD)
    stdout, stderr, timed_out = proc.stdout, proc.stderr, proc.timed_out
    facts = {"exit_code": proc.returncode, "wall_s": round(time.perf_counter() - t0, 3),
             **({"left_running": proc.left_running} if proc.left_running else {})}
    record = _last_json_line(stdout)
    tail = relative_paths(stderr)[-STDERR_TAIL_CHARS:]
    if record is not None:
        return record, facts
    if timed_out:
        status, error = "timeout", f"no record after {case.timeout_s:.0f} s; killed"
    elif proc.returncode == -signal.SIGKILL and (evidence := _oom_killed(oom_kills_before)):
        status, error = "oom", "killed by the kernel's OOM killer (host memory): " + evidence
    elif proc.returncode == 2 and PREFLIGHT_REFUSAL in tail:
        # the case's own pre-flight refused it: the memory free when it started was less than at the suite's check
        status = "skipped"
        error = next(line for line in tail.splitlines() if PREFLIGHT_REFUSAL in line).removeprefix("error: ")
    elif proc.returncode < 0:
        status = "killed"
        error = f"killed by signal {signal.Signals(-proc.returncode).name} from outside the runner, not by the OOM " \
                "killer (the cgroup's OOM counter did not move); run again on resume"
    else:
        status = "error"
        error = f"exit code {proc.returncode} without a record: " + (tail.strip().splitlines() or [""])[-1]
    return Record(case.config, status, error, stderr_tail=tail).to_dict(), facts


def group_members(group: int, but: int) -> list[str]:
    """The command lines of the running processes of process group `group` but `but` (its watchdog), from /proc (none
    where there is no /proc): the program's name, not its path, and its arguments, cut to 120 characters. What a
    command run_grouped ran left behind when its own process ended."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            if int(fields[2]) != group or int(stat.parent.name) == but or fields[0] == "Z":
                continue
            argv = (stat.parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):  # it ended meanwhile
            continue
        found.append(relative_paths(shlex.join([Path(argv[0]).name, *filter(None, argv[1:])]))[:120])
    return sorted(found)


def _lacked(record: dict) -> bool:
    """A case skipped because this environment lacked a package or the system's code (preflight.plan_case's
    `missing`): not final, as what it lacked may be there now (the wheels or the paper's code not carried to a GPU
    host: its resumed run skipped them again)."""
    return record["status"] == "skipped" and bool(((record.get("suite") or {}).get("plan") or {}).get("missing"))


PREFLIGHT_REFUSAL = "does not fit here"  # megatrain.preflight.preflight's refusal (exit code 2)


def cgroup_oom_kills() -> int | None:
    """This process's cgroup (v2) count of OOM kills, or None where it cannot be read."""
    try:
        group = Path("/proc/self/cgroup").read_text().strip().splitlines()[-1].split("::", 1)[1]
        events = (Path("/sys/fs/cgroup") / group.lstrip("/") / "memory.events").read_text()
    except (OSError, IndexError):
        return None
    counts = dict(line.split() for line in events.splitlines() if line.strip())
    return int(counts["oom_kill"]) if "oom_kill" in counts else None


def _oom_killed(before: int | None) -> str | None:
    """The evidence that a SIGKILL came from the OOM killer, or None when the evidence says it did not. Where the
    cgroup counter cannot be read, the OOM killer is assumed (a retried host OOM could take the machine down)."""
    after = cgroup_oom_kills()
    if before is None or after is None:
        return "assumed (no cgroup OOM counter readable here)"
    return f"the cgroup's OOM counter rose {before} -> {after}" if after > before else None


# what the runner's resume and the report read of a record's suite block and environment
SUITE_BLOCK_KEYS = ("name", "run_id", "case_id", "group", "label", "hardware", "machine", "started_at", "command")
ENV_KEYS = ("commit", "dirty", "python", "torch", "cuda", "deepspeed", "transformers", "gpu", "driver", "cpu",
            "cpu_cores", "host_mem_gib")
_ID = re.compile(r"[\w.-]+")  # a run or case id: it names files (traces, figures)


def _suite_record_problem(record: dict) -> str | None:
    """What makes a record with a suite block unreadable to the runner and the report, or None."""
    block, env = record["suite"], record.get("env")
    if not isinstance(block, dict):
        return "has a suite block that is not an object"
    if missing := [k for k in SUITE_BLOCK_KEYS if k not in block]:
        return f"lacks suite.{missing[0]}"
    if not all(_ID.fullmatch(str(block[k])) for k in ("run_id", "case_id")):
        return f"has suite.run_id {str(block['run_id'])[:40]!r} or case_id {str(block['case_id'])[:40]!r}, not " \
            "letters, digits, '.', '_' and '-'"
    if isinstance(env, dict) and (missing := [k for k in ENV_KEYS if k not in env]):
        return f"lacks env.{missing[0]}"
    return problem(record)


def read_suite_records(path: Path) -> list[dict]:
    """The runner's records in a JSONL file (records a bare `bench --out` appended carry no suite block), their
    run ids as strings: a hand-written or tool-written record may hold one as a number (20261124), which would
    not sort or compare with the runner's. A record the runner or the report cannot read is skipped with a warning
    naming its file and line."""
    records = read_jsonl(path, check=lambda r: _suite_record_problem(r) if "suite" in r else None)
    records = [r for r in records if "suite" in r]
    for r in records:
        r["suite"]["run_id"] = str(r["suite"]["run_id"])
    return records


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _current_run(records: list[dict], machine: Machine) -> str | None:
    """run_id of the latest run in these records if it ran on the same kind of machine and code.

    A run is one version of the code (a commit and its uncommitted changes): cases added to a suite after a commit
    (or code changed under it, committed or not) start a new run, so that no run mixes two versions of the code.
    """
    if not records:
        return None
    last = records[-1]
    if same_code(last["env"]) and same_machine(Machine.from_dict(last["suite"]["machine"]), machine):
        return last["suite"]["run_id"]
    return None


@contextlib.contextmanager
def sole_runner(out_dir: Path):
    """Sole use of out_dir by this suite runner: an flock on the directory (user_files.locked), which the kernel drops
    when the runner ends however it ends. Two runners there would run every case twice at once, each slowing the
    other, and record both ok."""
    user_files.make_dir(out_dir, "--out-dir")
    for name in ("records.jsonl", "traces"):  # appended to, written into
        user_files.plain_entry(out_dir / name, f"which the suite writes in --out-dir {out_dir}")
    with user_files.locked(out_dir, f"--out-dir {out_dir} is in use by another suite runner: wait for it to end, "
                                    "or choose another --out-dir"):
        yield


@contextlib.contextmanager
def _sigterm_as_ctrl_c():
    """SIGTERM (a scheduler's, `kill`'s) raises KeyboardInterrupt meanwhile, so it stops the suite as Ctrl-C does
    instead of ending the runner before it kills the running case."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@_sigterm_as_ctrl_c()
def run_suite(suite: Suite, out_dir: Path, only: str | None = None, timeout_s: float | None = None,
              dry_run: bool = False, new_run: bool = False, any_hardware: bool = False,
              bench_command: list[str] | None = None, log=None) -> list[dict]:
    """Run (or with dry_run, list) the suite's cases and append their records; returns the new records.

    Args:
        suite: from load_suite.
        out_dir: results directory (records.jsonl, traces/).
        only: regular expression over '<group> <case name> <case_id>'; None runs all.
        timeout_s: per-case limit overriding the suite's.
        dry_run: print what would run and the memory plans; run nothing.
        new_run: start a fresh run_id instead of resuming the latest run.
        any_hardware: run cases whose hardware profile does not match this machine.
        bench_command: the command prefix a case's arguments are appended to (tests substitute it).
        log: where progress lines go (default: tqdm.write, beside the progress bar).
    """
    from tqdm import tqdm

    log = log or tqdm.write
    cases = [c for c in suite.cases if not only or re.search(only, f"{c.group} {c.name} {c.case_id}")]
    if timeout_s is not None:
        cases = [replace(c, timeout_s=timeout_s) for c in cases]
    pre = _preflight(cases, rates=not dry_run)
    machine = Machine.from_dict(pre["machine"])
    log(f"suite {suite.name}: {len(cases)} cases; machine: {machine.gpu_name or 'no GPU'}, "
        f"host {machine.host_mem_gib:.0f} GiB")
    mismatch = {c.case_id: get_profile(c.hardware).mismatch(machine) for c in cases}
    for profile, why in sorted({(c.hardware, mismatch[c.case_id]) for c in cases if mismatch[c.case_id]}):
        log(f"  {'running anyway' if any_hardware else 'not running'} the cases for {profile}: {why}")
    if not any_hardware:
        cases = [c for c in cases if not mismatch[c.case_id]]
    records_path = out_dir / "records.jsonl"
    existing = read_suite_records(records_path)
    run_id = None if new_run else _current_run(existing, machine)
    resumed = run_id is not None
    run_id = run_id or new_run_id()
    latest = {r["suite"]["case_id"]: r for r in existing if r["suite"]["run_id"] == run_id}
    done = {cid for cid, r in latest.items() if r["status"] in FINAL_STATUSES and not _lacked(r)}
    log(f"run {run_id} ({'resumed: ' + str(len(done)) + ' cases already final' if resumed else 'new'}); "
        f"records: {records_path}")
    stopped: dict[str, str] = {}  # ladder chain -> why it stopped
    new_records = []
    # The bar (with its ETA) shows on a terminal; logs get one line per case with the ETA in it.
    bar = tqdm(total=len(cases), unit="case", dynamic_ncols=True, disable=True if dry_run else None, file=sys.stderr)
    t0 = time.perf_counter()
    for position, case in enumerate(cases, 1):
        bar.set_postfix_str(case.name, refresh=True)
        plan = pre["plans"][case.case_id]
        if case.ladder in stopped:
            log(f"  not run (ladder stopped: {stopped[case.ladder]}): {case.name}")
            bar.update()
            continue
        if case.case_id in done or dry_run:
            status = latest[case.case_id]["status"] if case.case_id in done else None
            if dry_run:
                need = f"host ~{plan['host_bytes'] / 2**30:.1f} GiB, GPU ~{plan['gpu_bytes'] / 2**30:.1f} GiB, " \
                    if "host_bytes" in plan else ""
                fit = "fits" if plan["fits"] else f"SKIP ({plan['reason']})"
                log(f"  {case.case_id} {case.name}: {need}{fit}{'; done: ' + status if status else ''}")
        else:
            record = _run_one(case, plan, machine, run_id, suite.name, out_dir,
                              bench_command or launch_command(case.config.ranks))
            append_jsonl(records_path, record)
            new_records.append(record)
            status = record["status"]
            log(f"[{status} {_progress(position, len(cases), time.perf_counter() - t0)}] {summary_line(record)}")
        if case.ladder and status is not None and status != "ok":
            stopped[case.ladder] = f"{case.name} was {status}"
        bar.update()
    bar.close()
    counts = {s: sum(r["status"] == s for r in new_records) for s in ("ok", "oom", "error", "timeout", "skipped")}
    log(f"suite {suite.name}, run {run_id}: {len(new_records)} new records " +
        ", ".join(f"{k} {v}" for k, v in counts.items() if v))
    return new_records


def launch_command(ranks: int) -> list[str]:
    """The command a case's bench arguments follow: `python -m megatrain bench`, through torchrun for several ranks
    (one node; --standalone takes a free port, so two launches on one machine cannot collide)."""
    module = [sys.executable, "-m", "megatrain", "bench"]
    if ranks == 1:
        return module
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            *module[1:]]


def _progress(done: int, total: int, elapsed_s: float) -> str:
    eta_s = elapsed_s / done * (total - done)
    return f"{done}/{total}, {elapsed_s / 60:.1f} min, ETA {eta_s / 60:.1f} min"


def _run_one(case: SuiteCase, plan: dict, machine: Machine, run_id: str, suite_name: str, out_dir: Path,
             command_prefix: list[str]) -> dict:
    gemm = machine.gemm_bf16_tflops if case.config.device == "cuda" else None
    args = bench_args(case.config, round(gemm, 1) if gemm else None, case.model_path)
    trace_rel = Path("traces") / f"{run_id}-{case.case_id}.json"  # a rerun in a new run keeps the old trace
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    if plan["fits"]:
        (out_dir / "traces").mkdir(parents=True, exist_ok=True)
        (out_dir / trace_rel).unlink(missing_ok=True)
        record, facts = run_case_subprocess(case, command_prefix + args, out_dir / trace_rel)
    else:
        record, facts = Record(case.config, "skipped", plan["reason"]).to_dict(), {"exit_code": None, "wall_s": 0.0}
    if record.get("trace"):
        record["trace"]["path"] = str(trace_rel)  # relative to the results directory, wherever it travels
    # the profile of the machine it ran on; the suite's, when different (--any-hardware), beside it
    hardware = actual_profile(case.hardware, machine)
    record["suite"] = {
        "name": suite_name, "run_id": run_id, "case_id": case.case_id, "group": case.group, "label": case.label,
        "hardware": hardware, **({"planned_hardware": case.hardware} if hardware != case.hardware else {}),
        "ladder": case.ladder, "timeout_s": case.timeout_s, "plan": plan,
        "machine": machine.to_dict(),
        "command": shlex.join(["python", *launch_command(case.config.ranks)[1:], *args]),
        "started_at": started_at, **facts,
    }
    achieved = (record.get("metrics") or {}).get("host_optim_gbs")
    for kind in ("triad", "update"):  # the host optimizer against the host's memory, as PCIe against its probed peak
        probed = machine.host_mem_peak_gbs(kind)
        if achieved and probed:
            record["metrics"][f"host_optim_of_probed_{kind}"] = achieved / probed
    return record
