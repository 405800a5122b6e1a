#!/usr/bin/env bash
# Set up this checkout on a fresh machine without downloading CUDA wheels, into the environment .venv names:
# - run inside a virtualenv, .venv becomes a link to it and everything installs there;
# - otherwise .venv is a new virtualenv over $PYTHON (default python3) that sees its installed packages
#   (--system-site-packages), so a GPU host keeps its torch and a Debian python that refuses pip (PEP 668,
#   externally-managed-environment) is never written to.
# Then: keep an installed torch, else install the CPU wheel of torch 2.13.0; the package with its dev tools;
# DeepSpeed (the [deepspeed] extra's pin) built against that torch; the host AdamW kernel built ahead.
# Afterwards: .venv/bin/python -m nox -s tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    ACTIVE=$("$PY" -c 'import sys; print(sys.prefix)')
    if [ "$(readlink -f .venv 2>/dev/null)" != "$(readlink -f "$ACTIVE")" ]; then
        rm -rf .venv
        ln -s "$ACTIVE" .venv
    fi
elif [ ! -x .venv/bin/python ]; then
    rm -rf .venv
    # without ensurepip (Debian's python3 lacks it unless python3-venv is installed), pip comes from the base python
    "$PY" -m venv --system-site-packages .venv 2>/dev/null || "$PY" -m venv --system-site-packages --without-pip .venv
fi
PY=.venv/bin/python
if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "setup: no pip for $("$PY" -c 'import sys; print(sys.base_prefix)'): install python3-pip (Debian) and rerun" >&2
    exit 1
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
# Constrain every later install to the torch now present, so no requirement can swap it for another build.
KEEP_TORCH=$(mktemp)
IMPORTED=$(mktemp -u)
trap 'rm -f "$KEEP_TORCH" "$IMPORTED"' EXIT
"$PY" -c "import torch; print('torch==' + torch.__version__)" >"$KEEP_TORCH"
# ninja first (the package's pin): the host AdamW kernel builds (minutes of g++ on 2 cores, once per torch install,
# saying so as it starts and ends) while the rest installs, instead of in the first training step. pip starts once the
# builder has imported what it needs, so that it never imports a package pip is writing.
"$PY" -m pip install -q "$(sed -n 's/^ *"\(ninja[^"]*\)".*/\1/p' pyproject.toml)"
"$PY" -c "import pathlib, sys, torch.utils.cpp_extension
from megatrain.optim import fused
pathlib.Path(sys.argv[1]).touch()
fused.available()" "$IMPORTED" &
KERNEL=$!
while [ ! -e "$IMPORTED" ] && kill -0 "$KERNEL" 2>/dev/null; do sleep 0.2; done
"$PY" -m pip install -q -c "$KEEP_TORCH" -e ".[dev]"
# DeepSpeed is an sdist whose setup.py imports torch: without build isolation it builds against the torch above
# (an isolated build would first download a CUDA torch). Its C++ ops JIT-compile when first used.
"$PY" -c "import setuptools, wheel" 2>/dev/null || "$PY" -m pip install -q "setuptools>=68" wheel
DEEPSPEED=$(sed -n 's/.*"deepspeed==\([^"]*\)".*/\1/p' pyproject.toml)
"$PY" -m pip install -q -c "$KEEP_TORCH" --no-build-isolation "deepspeed==$DEEPSPEED"
# The host AdamW kernel built now, not in the first training run
wait "$KERNEL"
echo "setup: done; the environment is .venv ($("$PY" -c 'import sys, torch; print(sys.prefix, "torch", torch.__version__)'))"
