#!/usr/bin/env bash
# The GPU correctness suite (tests/gpu: engine parity, stream stress, sanitizer, bf16 curves, baselines, train) with
# one record per check appended to OUT_JSONL (results/gpu_checks/run-COMMIT-h200.jsonl are the committed ones).
#   bash scripts/gpu_checks.sh OUT_JSONL [SRC_DIR [pytest args...]]
# SRC_DIR (default: this checkout) may be an exported older tree, to show a check failing before a fix.
# GPU_TESTS (default tests/gpu): which test files or directories run. GPU_CHECK_WORKERS (default 8): how many pytest
# processes share the one GPU; GPU_CHECK_HEAVY_LANES (default 3): how many of them run the checks at published widths.
# The checks are small models whose steps leave the GPU mostly idle, so they run side by side (pytest-xdist): the tests
# that share a process-wide cache in one worker and the longest groups first; a check at a published width starts only
# while its engine's host state fits beside the others' within GPU_CHECK_HEAVY_HOST_GIB (default 80;
# tests/gpu/conftest.py). Measured at 4e32950: 10 workers did ~7x one worker's pace after ~75 s of start, so the whole
# (~104 min of check time) takes ~16 minutes.
# Longer than one device call (10 minutes): run it in self-contained calls that resume (below), each
#   cp results/gpu_checks/run-SHA-h200.jsonl $OUT/run.jsonl 2>/dev/null; timeout 560 bash scripts/gpu_checks.sh $OUT/run.jsonl
# with the record it brought back committed between them. (The queue, scripts/gpu_queue.sh, loses what was left when
# its machine is given back between calls: it was, with 73 of 228 checks.)
# A run resumes: the checks OUT_JSONL already records as passed on this code (its digest: a commit of records alone
# between two calls keeps it; megatrain.bench.env.same_code) are not run again
# (GPU_CHECK_FRESH=1 runs them all), so the next call goes on where a call's limit or a lost machine cut one short:
# carry the record there and name it again (cp it into $OUT first: only $OUT comes back).
# Every check compares numbers, none times anything. A MegaTrain plan that places units by the GPU memory free at its
# start can meet another worker's allocation later (an out-of-memory): run such a check again alone.
set -uo pipefail
out=$(realpath -m "$1"); shift
src=${1:-.}; [ $# -gt 0 ] && shift
mkdir -p "$(dirname "$out")"
py=${PYTHON:-python3}
workers=${GPU_CHECK_WORKERS:-8}
cd "$src" || exit 2
# groups go out in the order conftest gave them, not reordered by their count of tests (xdist >= 3.6 has the flag)
reorder=$("$py" -m pytest --help 2>/dev/null | grep -q -- --no-loadscope-reorder && echo --no-loadscope-reorder)
# one inductor compile thread per worker: the workers are the parallelism, and a pool of compile processes per worker
# (16 on the H200 host) took host memory the published-width curves needed; a worker running a compile-bound check
# (the generic path's fp32 sets) takes GPU_CHECK_COMPILE_THREADS (default 3: tests/gpu/conftest.py)
[ "$workers" -gt 1 ] && export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
# Inductor's and Triton's caches in the checkout's .compile-cache/ (git-ignored): a device machine kept warm between
# calls keeps the checkout's ignored files, so a run resumed in the next call reuses the kernels the last one compiled
# (the generic sets' first compiles took 150-460 s each at d0c54b8)
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.compile-cache/inductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.compile-cache/triton}
# ... and across sessions, whose machines start bare (scripts/compile_cache.py): the parts of an earlier run's Inductor
# cache, carried in .compile-carry/ (git-ignored; name it in the call's carry), are unpacked first, and
# GPU_CHECK_CACHE_OUT=$OUT/inductor.tar.xz packs this run's after it (its parts come back with the records)
cache_in=${GPU_CHECK_CACHE_IN:-.compile-carry/inductor.tar.xz}
[ -f "$cache_in.0" ] && "$py" scripts/compile_cache.py unpack "$cache_in" "$TORCHINDUCTOR_CACHE_DIR"
# the passed checks as the run starts: every xdist worker (a restarted one too) must leave out the same ones
if [ -s "$out" ] && [ "${GPU_CHECK_FRESH:-0}" != 1 ]; then
    passed=$(mktemp); cp "$out" "$passed"; export GPU_CHECKS_PASSED=$passed
    echo "gpu_checks: resuming $out ($(grep -c '"passed": true' "$passed") passed records)"
fi
# GPU_CHECK_TIMEOUT_S: the checks stop after this many seconds (a device call's limit less the packing's time), so the
# cache they compiled is still packed
limit=()
[ -n "${GPU_CHECK_TIMEOUT_S:-}" ] && limit=(timeout --kill-after=20 "$GPU_CHECK_TIMEOUT_S")
start=$SECONDS
MEGATRAIN_GPU_CHECKS=$out "${limit[@]}" "$py" -m pytest ${GPU_TESTS:-tests/gpu} -m gpu -q -rfE -p no:cacheprovider \
    --durations=15 -n "$workers" --dist loadgroup $reorder "$@"
rc=$?
echo "gpu_checks: $((SECONDS - start)) s wall, $workers workers, exit $rc"
if [ -n "${GPU_CHECK_CACHE_OUT:-}" ] && [ -d "$TORCHINDUCTOR_CACHE_DIR" ]; then
    "$py" scripts/compile_cache.py pack "$TORCHINDUCTOR_CACHE_DIR" "$GPU_CHECK_CACHE_OUT"
fi
exit $rc
