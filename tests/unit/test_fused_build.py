"""The host AdamW kernel's JIT build: one directory per torch install, and no builder's death hangs the next load.

CPU with a C++ compiler and ninja; the kernel builds once per torch install (minutes on 2 cores) where setup.sh has
not built it:
pytest tests/unit/test_fused_build.py
"""

import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import is_ninja_available

from megatrain.optim import fused

LOAD = "from megatrain.optim import fused; assert fused.available()"
REPO = Path(__file__).resolve().parents[2]


def _ninja() -> bool:
    """Whether ninja runs here, from PATH or where pip put it (as the kernel's build looks for it)."""
    fused.find_ninja()
    return is_ninja_available()


def _load(timeout_s: float) -> subprocess.CompletedProcess:
    """Load the kernel in a fresh process; a hang fails the test after timeout_s instead of hanging it."""
    return subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, cwd=REPO, timeout=timeout_s)


def test_the_build_directory_is_keyed_by_torch_version_abi_python_and_install(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = fused.build_directory()
    assert here.parent == tmp_path, "TORCH_EXTENSIONS_DIR is honoured"
    assert f"-torch{torch.__version__}-cxx11abi" in here.name and f"-py{sys.version_info[0]}{sys.version_info[1]}-" \
        in here.name
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert fused.build_directory() != here, "another torch install of the same version builds apart"


@pytest.mark.subprocess
@pytest.mark.skipif(shutil.which("c++") is None or not _ninja(), reason="needs a C++ compiler and ninja")
def test_a_dead_builders_lock_file_does_not_hang_the_next_load():
    """torch's load() waits while its lock file exists, forever where its builder was killed (mid-build or after:
    the file outlives it). The next load clears it under an flock, which dies with its holder, and loads. On the
    kernel as this machine built it (scripts/setup.sh does), or built here once: a build of its own in a fresh
    directory cost ~40 s of a CI core and proved nothing more (whether load() then builds or loads is torch's)."""
    from torch.utils.cpp_extension import _jit_compile

    # the file torch waits on is the one cleared: a rename in torch would hang loads again, and fail here
    assert "FileBaton(os.path.join(build_directory, 'lock'))" in inspect.getsource(_jit_compile)
    assert fused.available(), "the kernel builds here (a C++ compiler and ninja are present)"
    build_dir = fused.build_directory()
    with fused._build_lock(build_dir):  # as no loader holds it: none is between clearing the file and load()
        (build_dir / "lock").touch()  # torch's lock file as a killed builder leaves it
    again = _load(timeout_s=60)
    assert (again.returncode, again.stderr) == (0, ""), "loaded, without waiting or rebuilding"
    assert not (build_dir / "lock").exists()


def test_loading_leaves_the_build_directory_where_it_was(tmp_path, monkeypatch):
    """torch's load() appends its libraries to the flag lists it is given; the key must not follow them (it did,
    and a process that had loaded the kernel looked for it in another directory than a fresh one)."""
    import torch.utils.cpp_extension as cpp_extension

    def load(name, sources, build_directory, extra_cflags, extra_ldflags, verbose):
        extra_cflags.append("-fPIC")
        extra_ldflags += ["-ltorch"]  # as torch does
        return object()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", load)
    fused._module.cache_clear()
    try:
        before = fused.build_directory()
        assert fused.available()
        assert fused.build_directory() == before
    finally:
        fused._module.cache_clear()


def test_a_compile_says_when_it_starts_and_what_it_took_and_a_load_says_nothing(tmp_path, monkeypatch):
    """A fresh machine's first training step waits on the compile (155-315 s on 2 cores of another machine, without
    a word): it says so as it starts and what it took, through the build's log (a run's log takes it)."""
    import torch.utils.cpp_extension as cpp_extension

    from megatrain.build_log import build_lines_to

    def load(name, sources, build_directory, **flags):
        (Path(build_directory) / f"{name}.so").touch()
        return object()

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", load)
    said = []
    try:
        for _ in range(2):  # compiled, then loaded by a process of its own
            fused._module.cache_clear()
            with build_lines_to(said.append):
                assert fused.available()
    finally:
        fused._module.cache_clear()
    assert len(said) == 2, said
    assert said[0].startswith("megatrain build: compiling the host AdamW kernel, once per machine") and \
        str(fused.build_directory()) in said[0]
    assert re.fullmatch(r"megatrain build: host AdamW kernel compiled in \d+\.\d s", said[1])


@pytest.mark.parametrize("unsafe", ["writable by others", "owned by uid"])
def test_a_build_another_user_could_plant_code_in_is_refused(tmp_path, monkeypatch, unsafe):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # shared: a /tmp, a group's scratch
    build_dir = fused.build_directory()
    build_dir.mkdir()
    if unsafe == "writable by others":
        build_dir.chmod(0o777)
    elif os.getuid() == 0:
        os.chown(build_dir, 65534, 65534)
    else:
        pytest.skip("only root can give a directory to another user")
    fused._module.cache_clear()
    try:
        with pytest.raises(ValueError, match=f"build {re.escape(str(build_dir))} is {unsafe}.*TORCH_EXTENSIONS_DIR"):
            fused.available()
        assert list(build_dir.iterdir()) == [], "nothing was built or loaded there"
    finally:
        fused._module.cache_clear()


def test_pips_ninja_is_found_where_the_environment_is_not_activated(tmp_path, monkeypatch):
    """`.venv/bin/python -m megatrain` without activating .venv: pip's ninja is in the environment's scripts
    directory, not on PATH, and torch's load() runs `ninja` from PATH."""
    scripts = tmp_path / "bin"
    scripts.mkdir()
    (scripts / "ninja").write_text("#!/bin/sh\necho 1.13.0\n")
    (scripts / "ninja").chmod(0o755)
    monkeypatch.setattr(fused.sysconfig, "get_path", lambda name: str(scripts))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no ninja on it
    fused.find_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [str(scripts), str(tmp_path / "empty")]
    assert is_ninja_available()
    fused.find_ninja()
    assert os.environ["PATH"].split(os.pathsep) == [str(scripts), str(tmp_path / "empty")], "once, not again"
