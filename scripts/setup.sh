#!/usr/bin/env bash
# Set up this checkout on a fresh machine without downloading CUDA wheels:
# keep an installed torch (GPU hosts), else install the CPU wheel of torch 2.13.0, then the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev]"
