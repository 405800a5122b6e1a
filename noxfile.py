"""Sessions: tests, smoke, lint. Every session runs in the current environment (python=False):
a per-session virtualenv would download a fresh (CUDA) torch. Set up first with scripts/setup.sh."""

import nox

nox.options.sessions = ["tests"]


@nox.session(python=False)
def tests(session):
    """Unit tests on CPU (GPU tests skip without CUDA)."""
    session.run("python", "-m", "pytest", "tests", "-q", *session.posargs)


@nox.session(python=False)
def lint(session):
    session.run("ruff", "check", "megatrain", "baselines", "tests", "noxfile.py")


@nox.session(python=False)
def smoke(session):
    """The main job on a fresh machine: tiny CPU benchmark cases, records under results/smoke-local/."""
    for system in ("native",):
        session.run("python", "-m", "megatrain", "bench", "--system", system, "--model", "tiny", "--batch", "4",
                    "--seq", "64", "--steps", "6", "--out", "results/smoke-local/records.jsonl")
