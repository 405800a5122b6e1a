#!/usr/bin/env bash
# Wheels for the offline GPU host (CPython 3.12, x86_64, torch 2.11 and most of the stack preinstalled) into .whl/:
# DeepSpeed built here as a pure-Python wheel (its ops JIT-compile where they run) plus the runtime dependencies that
# host lacks, and torchao's published wheel (cp310-abi3 manylinux, no dependencies). Neither torch nor numpy travels:
# the install below would shadow the host's own.
# On the GPU host, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
# Run after scripts/setup.sh: building DeepSpeed's wheel imports torch and needs `wheel`, both in .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import torch, setuptools, wheel" 2>/dev/null; then
    echo "wheelhouse: $PY lacks torch, setuptools or wheel: run bash scripts/setup.sh first (or set PYTHON)" >&2
    exit 1
fi
DEEPSPEED=$(sed -n 's/.*"deepspeed==\([^"]*\)".*/\1/p' pyproject.toml)
TORCHAO=$(sed -n 's/.*"torchao==\([^"]*\)".*/\1/p' pyproject.toml)
# Missing from the GPU image (its package list: einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, tqdm,
# typing-extensions are there): hjson, pydantic and pydantic's helpers. typing-extensions travels as well because
# pydantic 2.13 needs >= 4.14.1 and the image's version is not recorded (4.16.0 is the newest
# release, so the shadowing install cannot downgrade it). torchao, pinned in pyproject.toml, for the torchao system:
# its cp310-abi3 wheel (tagged manylinux_2_28) is the one pip picks for 3.12. pytest-xdist and execnet: the GPU suite
# runs as xdist workers sharing the one GPU (scripts/gpu_checks.sh); the image has pytest, not xdist.
DEPS=(hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
      typing-extensions==4.16.0 "torchao==$TORCHAO" pytest-xdist==3.8.0 execnet==2.1.2)
rm -rf .whl
mkdir -p .whl
# Without build isolation: an isolated build would download a CUDA torch just to run setup.py.
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$DEEPSPEED"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${DEPS[@]}"
ls -l .whl
du -sh .whl
