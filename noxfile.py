"""Sessions: tests, tests_subprocess, tolerance, smoke, gpu, reproduce_14b, report, perf_model, bench, lint. Every
session runs in the environment nox itself runs in (python=False, the interpreter is nox's own): a per-session
virtualenv would download a fresh (CUDA) torch. Set up first with scripts/setup.sh, then run .venv/bin/python -m nox."""

import logging
import sys
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
PY = sys.executable
# nox looks for uv on every session, to build virtualenvs these sessions never make (python=False), and says so
logging.getLogger("nox").addFilter(lambda record: record.getMessage() != "uv binary not found.")


# The hot-path benchmarks (nox -s bench) skip outside --benchmark-only: the test sessions leave them and their plugin
# out (it warns in every xdist process that it is disabled)
NOT_BENCH = ("--ignore", "tests/bench", "-p", "no:benchmark")


@nox.session(python=False)
def tests(session):
    """The fast tests on CPU (~2 min on 2 cores, measured on a 2-core Xeon; GPU tests skip without CUDA), two
    processes at a time of one torch thread each (tests/conftest.py): their shapes are small, so a test's time is
    Python's, which a second thread does not share. The tests that spawn `python -m megatrain` processes, run suites
    or compile are the session tests_subprocess."""
    session.run(PY, "-m", "pytest", "tests", *NOT_BENCH, "-q", "-m", "not subprocess and not slow", "-n", "2",
                *session.posargs)


@nox.session(python=False)
def tests_subprocess(session):
    """The tests that spawn `python -m megatrain` processes (CLI contracts, kills, signals, torchrun ranks, the suite
    runner) or compile (torch.compile on CPU): CI runs them after the fast ones, ~5.5 min on 2 cores with empty
    compile caches. Two test files at a time (pytest-xdist; a file's tests stay together, sharing its fixtures): most
    of their time is processes starting and waiting on each other, so two at once take ~0.6x of one after the other."""
    session.run(PY, "-m", "pytest", "tests", *NOT_BENCH, "-q", "-m", "subprocess or slow", "-n", "2", "--dist",
                "loadfile", "--durations=15", *session.posargs)


# A second CPU code path: ATen's kernels without vector instructions, and MKL's GEMMs on their SSE2-compatible path.
# Each moves the rounding of every kernel a training step runs (matmul, sums, softmax, exp, tanh, SDPA: measured on
# torch 2.13), as another CPU's vector width does.
SECOND_CPU_PATH = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
# The tests whose bounds are float rounding's against transformers: the engine's training of every family (the
# generic ones judged by float64, train_helpers.AS_NEAR; the hand-written ones at constant bounds) and Gemma 4's
# gradients (one plan: the plans' rounding is the same)
ROUNDING_TESTS = ("tests/unit/test_generic.py::test_train_matches_transformers_and_the_export_reloads_with_its_logits",
                  "tests/unit/test_generic.py::test_state_crossing_layers_has_transformers_gradient_for_every_weight",
                  "tests/unit/test_train.py::"
                  "test_train_matches_transformers_with_adamw_and_exports_a_checkpoint_transformers_loads")


@nox.session(python=False)
def tolerance(session):
    """The tests whose bounds are float rounding's, again on a second CPU code path (SECOND_CPU_PATH), so that a bound
    that holds on one vector width only fails in CI, not on a user's CPU (~20 s on 2 cores: 37 tests)."""
    session.run(PY, "-c", "import torch; assert torch.backends.cpu.get_cpu_capability() == 'DEFAULT', "
                "'this torch ignores ATEN_CPU_CAPABILITY'", env=SECOND_CPU_PATH)
    session.run(PY, "-m", "pytest", *ROUNDING_TESTS, *NOT_BENCH, "-q", "-m", "not subprocess and not slow", "-k",
                "megatrain or streamed", "-n", "2", *session.posargs, env=SECOND_CPU_PATH)


@nox.session(python=False)
def gpu(session):
    """The GPU correctness suite (needs CUDA): 8 pytest workers side by side on one GPU (scripts/gpu_checks.sh), a
    record per check in results/gpu_checks/records.jsonl; its wall time is the last line it prints."""
    session.run("bash", "scripts/gpu_checks.sh", "results/gpu_checks/records.jsonl", ".", *session.posargs,
                env={"PYTHON": PY}, external=True)


@nox.session(python=False)
def lint(session):
    session.run(PY, "-m", "ruff", "check", "megatrain", "tests", "noxfile.py")


@nox.session(python=False)
def smoke(session):
    """The main job on a fresh machine: the smoke suite (megatrain, native, deepspeed and fsdp on tiny models, CPU;
    torchao and paper need CUDA) and its report.

    Records go to the git-ignored results/smoke-local/ (a new run each time), the report to
    results/smoke-local/report/index.html. Only curated GPU runs are committed under results/<suite>/.
    """
    out = "results/smoke-local"
    session.run(PY, "-m", "megatrain", "suite", "smoke", "--out-dir", out, "--new-run", *session.posargs)
    session.run(PY, "-m", "megatrain", "report", out, "--out", f"{out}/report")


@nox.session(python=False)
def reproduce_14b(session):
    """Qwen2.5-14B: MegaTrain and the paper's own code against DeepSpeed ZeRO-3 offload, and FSDP2 offload, on an H200
    (256 or 512 GiB host; the paper's code needs .paper/, scripts/paper_code.sh).

    Resumes the latest run in results/reproduce_14b/; on other hardware no case runs. Then rewrites
    reports/reproduce_14b/ from the records.
    """
    session.run(PY, "-m", "megatrain", "suite", "reproduce_14b", *session.posargs)
    if not Path("results/reproduce_14b/records.jsonl").exists():
        session.skip("no records: this machine matches none of the suite's hardware profiles")
    session.run(PY, "-m", "megatrain", "report", "reproduce_14b")


@nox.session(python=False)
def report(session):
    """Rewrite every reports/<suite>/ from the committed records in results/<suite>/records.jsonl."""
    session.run(PY, "-m", "megatrain", "report", *session.posargs)


@nox.session(python=False)
def perf_model(session):
    """The performance model against every committed engine record, its projections of the paper's machines, the
    DeepSpeed step model against every DeepSpeed record and both on the paper's GH200 (results/perf_model/), and the
    scaling report that shows them.

    A clean checkout's files name it clean: each step would otherwise see the files of the steps before it as
    uncommitted changes and say 'dirty'. A tree already changed is left to say so itself, with its changes' hash."""
    from megatrain.bench.env import git_commit

    commit, dirty = git_commit()
    tree = {"MEGATRAIN_COMMIT": commit, "MEGATRAIN_DIRTY": "0"} if dirty is False else {}
    session.run(PY, "-m", "megatrain.perf_model.model_check", "validate", env=tree)
    session.run(PY, "-m", "megatrain.perf_model.model_check", "project", env=tree)
    session.run(PY, "-m", "megatrain.perf_model.deepspeed_check", env=tree)
    session.run(PY, "-m", "megatrain.perf_model.deepspeed_projection", env=tree)
    session.run(PY, "-m", "megatrain", "report", "scaling", env=tree)


@nox.session(python=False)
def bench(session):
    """Micro-benchmarks of the engine's hot paths (pytest-benchmark; the PCIe one needs CUDA)."""
    session.run(PY, "-m", "pytest", "tests/bench", "--benchmark-only", "-q", *session.posargs)
