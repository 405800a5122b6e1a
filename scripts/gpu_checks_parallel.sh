#!/usr/bin/env bash
# The GPU correctness suite (scripts/gpu_checks.sh) as four groups run side by side on one GPU, in about a third of
# the wall time: the checks are small models whose steps leave the GPU mostly idle (stream delays, the sanitizer's
# host-side bookkeeping), and every check compares numbers, none times anything. One thing sharing does change: a
# MegaTrain plan that places units by the GPU memory free at its start can meet an allocation of the other groups
# later (an out-of-memory or CUBLAS_STATUS_ALLOC_FAILED); run such a check again alone. Torchrun checks take a free
# port. A lent machine's device time is what this saves.
#   [GPU_CHECKS_K='generic or sanitizer'] bash scripts/gpu_checks_parallel.sh OUT_DIR NAME [SRC_DIR]
# Group K (1-4) writes OUT_DIR/NAME.gK.jsonl (a record per check) and OUT_DIR/NAME.gK.log; when all end, their records
# are joined into OUT_DIR/NAME.jsonl. The exit status is the worst group's.
set -uo pipefail
dir=$(realpath -m "$1"); name=$2; src=${3:-.}
mkdir -p "$dir"
here=$(dirname "$(realpath "$0")")
# groups 3 and 4: every other file, the peers and mixtures in one (DeepSpeed's compiles are the longest checks), the
# rest in the other (train, API, distributed; the multi-GPU file skips on one GPU)
others=$(cd "$src" && ls tests/gpu/test_*.py | grep -v '/test_engine_gpu.py$')
g3=$(echo "$others" | grep -E '/test_(baselines|moe)_gpu.py$' | tr '\n' ' ')
g4=$(echo "$others" | grep -vE '/test_(baselines|moe)_gpu.py$' | tr '\n' ' ')
group() {  # K TESTS [PYTEST ARGS...]: scripts/gpu_checks.sh over the group's tests only
    local k=$1 tests=$2; shift 2
    GPU_TESTS=$tests bash "$here/gpu_checks.sh" "$dir/$name.g$k.jsonl" "$src" "$@" > "$dir/$name.g$k.log" 2>&1
}
# GPU_CHECKS_K (a pytest -k expression) runs a subset: each group's checks that match it as well
k=${GPU_CHECKS_K:+ and ($GPU_CHECKS_K)}
group 1 tests/gpu/test_engine_gpu.py -k "(sanitizer or curve)$k" & p1=$!
group 2 tests/gpu/test_engine_gpu.py -k "not (sanitizer or curve)$k" & p2=$!
group 3 "$g3" ${GPU_CHECKS_K:+-k "$GPU_CHECKS_K"} & p3=$!
group 4 "$g4" ${GPU_CHECKS_K:+-k "$GPU_CHECKS_K"} & p4=$!
rc=0
for p in $p1 $p2 $p3 $p4; do wait "$p" || rc=$?; done
cat "$dir/$name".g[1234].jsonl > "$dir/$name.jsonl" 2>/dev/null
for k in 1 2 3 4; do echo "group $k: $(tail -n 1 "$dir/$name.g$k.log")"; done
exit "$rc"
