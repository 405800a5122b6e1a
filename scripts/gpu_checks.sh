#!/usr/bin/env bash
# The GPU correctness suite (tests/gpu: engine parity, stream stress, sanitizer, bf16 curves, baselines) with one
# record per check appended to OUT_JSONL (results/gpu_checks/records.jsonl is the committed one).
#   bash scripts/gpu_checks.sh OUT_JSONL [SRC_DIR [pytest args...]]
# SRC_DIR (default: this checkout) may be an exported older tree, to show a check failing before a fix.
set -uo pipefail
out=$(realpath -m "$1"); shift
src=${1:-.}; [ $# -gt 0 ] && shift
mkdir -p "$(dirname "$out")"
# GPU_TESTS (default tests/gpu): which test files or directories run (scripts/gpu_checks_parallel.sh gives each group's)
cd "$src" && MEGATRAIN_GPU_CHECKS=$out exec "${PYTHON:-python3}" -m pytest ${GPU_TESTS:-tests/gpu} -m gpu -q -rfE \
    -p no:cacheprovider --durations=15 "$@"
