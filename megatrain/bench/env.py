"""The environment a record was measured in: commit, versions, devices, host (where the package and its working files
are: megatrain.workspace)."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sys
from importlib import metadata

import torch

from megatrain.memory import host_memory_gib
from megatrain.probe import cpu_name
from megatrain.workspace import CHECKOUT


def git_commit() -> tuple[str, bool | None]:
    """(commit, dirty) of the checkout; ("unknown", None) for an installed package. MEGATRAIN_COMMIT overrides where
    the tree travels without .git (GPU host)."""
    if os.environ.get("MEGATRAIN_COMMIT"):
        return os.environ["MEGATRAIN_COMMIT"], os.environ.get("MEGATRAIN_DIRTY") == "1"
    if CHECKOUT is None:
        return "unknown", None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=CHECKOUT,
                                    capture_output=True, text=True).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def git_diff_sha256() -> str | None:
    """sha256 of the checkout's uncommitted changes to tracked files (`git diff HEAD`); None where there are none,
    or where they cannot be read (MEGATRAIN_COMMIT given, an installed package)."""
    if os.environ.get("MEGATRAIN_COMMIT") or CHECKOUT is None:
        return None
    try:
        diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=CHECKOUT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return hashlib.sha256(diff).hexdigest() if diff else None


# what a measurement's code is: the package, the suites, the scripts and checks that run it, and the build's files
CODE_PATHS = ("megatrain", "suites", "scripts", "tests", "pyproject.toml", "noxfile.py")


@functools.lru_cache(maxsize=1)
def code_sha256() -> str | None:
    """sha256 of the code as it is on disk (every file under CODE_PATHS, by its path and bytes, caches left out): the
    same on the GPU host, whose copy of the tree travels without a current .git, as here. A commit that changes only
    records (results/, docs/) keeps it, so a run resumed after its records were committed between two device calls is
    still the same code. None for an installed package."""
    if CHECKOUT is None:
        return None
    digest = hashlib.sha256()
    try:
        for name in CODE_PATHS:
            top = CHECKOUT / name
            files = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
            for path in files:
                if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
                    rel = path.relative_to(CHECKOUT).as_posix().encode()
                    digest.update(len(rel).to_bytes(8, "little") + rel)
                    data = path.read_bytes()
                    digest.update(len(data).to_bytes(8, "little") + data)
    except OSError:  # a file that cannot be read (gone while walked, no permission): no digest, the commit rule
        return None
    return digest.hexdigest()


def same_code_as(a: dict, b: dict) -> bool:
    """Whether two records' environments name the same code: their code digests where both have one (whatever commit
    holds it); else the same commit with neither tree changed, or both with the same uncommitted changes (changes
    that cannot be read match nothing)."""
    if a.get("code_sha256") and b.get("code_sha256"):
        return a["code_sha256"] == b["code_sha256"]
    if a.get("commit") != b.get("commit"):
        return False
    if not a.get("dirty") and not b.get("dirty"):
        return True
    return a.get("diff_sha256") is not None and a.get("diff_sha256") == b.get("diff_sha256")


def code_here() -> dict:
    """What same_code_as reads of the code that runs here, as a record's environment names it."""
    commit, dirty = git_commit()
    return {"commit": commit, "dirty": dirty, "diff_sha256": git_diff_sha256(), "code_sha256": code_sha256()}


def same_code(env: dict) -> bool:
    """Whether a record's environment `env` was measured on the code that runs here (same_code_as)."""
    return same_code_as(env, code_here())


def _version(pkg: str) -> str | None:
    """The version of `pkg` that runs here: the imported module's own where it is imported (a copy put first on
    PYTHONPATH shadows the installed one, whose metadata would name the other), else the installed distribution's."""
    module = sys.modules.get(pkg)
    if isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def environment() -> dict:
    commit, dirty = git_commit()
    host_total_gib, _, host_source = host_memory_gib()
    env = {
        "commit": commit,
        "dirty": dirty,
        "diff_sha256": git_diff_sha256(),  # which uncommitted changes, when dirty
        "code_sha256": code_sha256(),  # the code on disk, its uncommitted changes included (same_code)
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "hostname_kind": os.environ.get("MEGATRAIN_HOST_KIND"),
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),  # every system's, set by python -m megatrain
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "host_mem_gib": round(host_total_gib, 1),
        "host_mem_source": host_source,
        "gpu": None,
        "gpu_mem_gib": None,
        "driver": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_mem_gib=round(props.total_memory / 2**30, 1))
        try:
            import pynvml

            pynvml.nvmlInit()
            env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception:  # NVML missing in a container is not fatal to a record
            pass
    return env
