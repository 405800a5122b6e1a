#!/usr/bin/env bash
# Run (or resume) a suite on the GPU host and bring its results back in one tarball under $OUT.
# Usage on the device: bash scripts/gpu_suite.sh SUITE [--only REGEX] [more suite args]
# Needs the DeepSpeed wheelhouse in .whl (scripts/wheelhouse.sh) carried along.
set -uo pipefail
suite=$1; shift
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p "$O"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
python3 -m megatrain suite "$suite" --out-dir "results/$suite" --any-hardware "$@" 2>&1 | tee "$O/suite.log" | grep -v '^{'
tar czf "$O/$suite.tgz" "results/$suite"
