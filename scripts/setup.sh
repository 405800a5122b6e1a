#!/usr/bin/env bash
# Set up this checkout on a fresh machine without downloading CUDA wheels:
# keep an installed torch (GPU hosts), else install the CPU wheel of torch 2.13.0, then the package,
# then DeepSpeed (the [deepspeed] extra's pin) built against that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
# Constrain every later install to the torch now present, so no requirement can swap it for another build.
KEEP_TORCH=$(mktemp)
trap 'rm -f "$KEEP_TORCH"' EXIT
"$PY" -c "import torch; print('torch==' + torch.__version__)" >"$KEEP_TORCH"
"$PY" -m pip install -q -c "$KEEP_TORCH" -e ".[dev]"
# DeepSpeed is an sdist whose setup.py imports torch: without build isolation it builds against the torch above
# (an isolated build would first download a CUDA torch). Its C++ ops JIT-compile when first used.
"$PY" -c "import setuptools" 2>/dev/null || "$PY" -m pip install -q "setuptools>=68"
DEEPSPEED=$(sed -n 's/.*"deepspeed==\([^"]*\)".*/\1/p' pyproject.toml)
"$PY" -m pip install -q -c "$KEEP_TORCH" --no-build-isolation "deepspeed==$DEEPSPEED"
