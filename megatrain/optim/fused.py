"""Build (once, JIT, cached) and call the one-pass host AdamW kernel in csrc/fused_adamw.cpp, and the host memory
bandwidth probe built with it (csrc/host_bandwidth.cpp).

The build lives in a directory of its own per torch version and install, C++ ABI, Python version and sources (so
torch installs never share a build, and checkouts never rebuild each other's), under torch's extensions root
(TORCH_EXTENSIONS_DIR, else torch's default); it must be this user's and writable by no other. Builders take an flock
there, which the kernel drops when its holder dies: a builder killed mid-build cannot leave the next one waiting
forever on torch's own lock file. A compile says so as it starts and what it took (megatrain.build_log): a fresh
machine's first step waits minutes on it where scripts/setup.sh has not compiled it ahead.

Falls back to torch's fused AdamW (more passes over memory, same result) where no C++ compiler
is available; `available()` says which one runs.

MEGATRAIN_HOST_ADAMW_THREADS sets the kernel's OpenMP threads (default: all cores but one, left to the thread that
feeds the GPU); scripts/host_optim_bench.py measures the choices.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

from megatrain.build_log import BUILD_LOG

_SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("fused_adamw.cpp", "host_bandwidth.cpp"))
_NAME = "megatrain_fused_adamw"
# errno blocks vector sqrt; no contraction: the kernel writes its fused multiply-adds out (std::fma), so its rounding
# is the source's whatever shape the vectoriser gives a loop
_CFLAGS = ("-O3", "-fopenmp", "-march=native", "-fno-math-errno", "-ffp-contract=off")
_LDFLAGS = ("-fopenmp",)
THREADS_ENV = "MEGATRAIN_HOST_ADAMW_THREADS"


def build_directory() -> Path:
    """Where the kernel is built and cached for this torch (version and install), C++ ABI, Python and sources."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    # the install too: the build's commands name its headers, so two installs of one version sharing a build
    # would rebuild it in turn
    code = b"".join(source.read_bytes() for source in _SOURCES)
    key = hashlib.sha256(code + repr((_CFLAGS, _LDFLAGS, torch.__file__)).encode()).hexdigest()[:12]
    return Path(root) / (f"{_NAME}-torch{torch.__version__}-cxx11abi{int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
                         f"-py{sys.version_info.major}{sys.version_info.minor}-{key}")


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Sole use of build_dir, by an flock: the kernel drops it when its holder dies, so a dead builder holds none."""
    with (build_dir / "megatrain.flock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not (build_dir / f"{_NAME}.so").exists():
                BUILD_LOG.info("megatrain build: waiting for another process compiling the host AdamW kernel in "
                                   "%s", build_dir)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _check_private(build_dir: Path) -> None:
    """Refuse (ValueError) a build directory, or a built library in it, that another user owns or may write: they
    could plant the library this process loads and runs (a TORCH_EXTENSIONS_DIR shared between users)."""
    for path in (build_dir, build_dir / f"{_NAME}.so"):
        if not path.exists():
            continue
        st = path.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            who = f"owned by uid {st.st_uid}" if st.st_uid != os.getuid() else "writable by others"
            raise ValueError(f"the host AdamW kernel's build {path} is {who}, so another user could plant the code "
                             "it loads: delete it, or set TORCH_EXTENSIONS_DIR to a directory of your own")


def find_ninja() -> None:
    """torch's load() runs `ninja` from PATH; pip's ninja (this package's dependency) lands in the environment's
    scripts directory, which is on PATH only where the environment was activated, not for `.venv/bin/python -m
    megatrain` (there the kernel fell back to torch's AdamW for want of it). Put that directory on PATH if it
    holds the ninja that PATH lacks."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = os.pathsep.join(filter(None, [scripts, os.environ.get("PATH")]))


@functools.lru_cache(maxsize=1)
def _module():
    from torch.utils.cpp_extension import load

    build_dir = build_directory()
    try:
        find_ninja()
        build_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        _check_private(build_dir)
        with _build_lock(build_dir):
            # No live builder holds torch's lock file now: it is a dead builder's, on which load() would wait forever.
            (build_dir / "lock").unlink(missing_ok=True)
            compiles = not (build_dir / f"{_NAME}.so").exists()
            if compiles:  # a wait of minutes on a few cores, said (scripts/setup.sh compiles it ahead)
                BUILD_LOG.info("megatrain build: compiling the host AdamW kernel, once per machine and torch "
                                   "install (minutes on a few cores), in %s", build_dir)
            t0 = time.perf_counter()
            # Built from copies in the build directory: every checkout then gives ninja the same commands, so none
            # rebuilds another's.
            sources = []
            for original in _SOURCES:
                source, code = build_dir / original.name, original.read_bytes()
                if not source.exists() or source.read_bytes() != code:
                    source.write_bytes(code)
                sources.append(str(source))
            # copies: load() appends torch's libraries to the lists it is given, which would change the key above
            module = load(name=_NAME, sources=sources, build_directory=str(build_dir),
                          extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS), verbose=False)
            if compiles:
                BUILD_LOG.info("megatrain build: host AdamW kernel compiled in %.1f s", time.perf_counter() - t0)
            return module
    except ValueError:  # _check_private's refusal: for the user to act on, not a missing compiler
        raise
    except Exception as exc:  # no compiler or ninja: the torch path computes the same update
        warnings.warn(f"one-pass host AdamW kernel unavailable ({exc}); using torch fused AdamW", stacklevel=2)
        return None


def available() -> bool:
    """Whether the one-pass kernel runs here (building or loading it on the first call)."""
    return _module() is not None


def threads() -> int:
    """The kernel's OpenMP threads: MEGATRAIN_HOST_ADAMW_THREADS, or 0 (all cores but one)."""
    value = os.environ.get(THREADS_ENV, "0")
    if not value.isdigit():
        raise ValueError(f"{THREADS_ENV} must be a thread count (0: all cores but one), got {value!r}")
    return int(value)


def _out(weight_out: torch.Tensor | None) -> torch.Tensor:
    return weight_out if weight_out is not None else torch.empty(0, dtype=torch.bfloat16)


def fused_adamw(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                weight_out: torch.Tensor | None, step: int, clip: float, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float) -> None:
    """One AdamW step of `param` (fp32, or bf16 rounded back) with fp32 moments; a bf16 copy into weight_out."""
    _module().fused_adamw(param, grad, exp_avg, exp_avg_sq, _out(weight_out), step, clip, lr, beta1, beta2, eps,
                          weight_decay, threads())


def compact_adamw(param: torch.Tensor, grad: torch.Tensor, moments, weight_out: torch.Tensor | None,
                  decay_numel: int, index0: int, step: int, clip: float, lr: float, beta1: float, beta2: float,
                  eps: float, weight_decay: float) -> None:
    """fused_adamw with compact moments (megatrain.optim.compact.Moments, bf16 or int8; int8 starting on a block):
    weight decay on the first decay_numel elements, index0 the first element's index in the store."""
    none = torch.empty(0)
    _module().compact_adamw(param, grad, moments.exp_avg, moments.exp_avg_sq,
                            none if moments.exp_avg_scale is None else moments.exp_avg_scale,
                            none if moments.exp_avg_sq_scale is None else moments.exp_avg_sq_scale, _out(weight_out),
                            decay_numel, index0, step, clip, lr, beta1, beta2, eps, weight_decay, threads())


def host_mem_bandwidth_gbs(numel: int, thread_counts: list[int], repeats: int) -> dict[str, list[float]]:
    """STREAM's kernels in C++ (csrc/host_bandwidth.cpp) on fp32 arrays of `numel`: GB/s of read, write, write_nt
    (non-temporal stores; x86 only), copy and triad, one per thread count, each the best of `repeats`."""
    return _module().host_mem_bandwidth_gbs(numel, thread_counts, repeats)
