#!/usr/bin/env bash
# The GPU correctness suite (scripts/gpu_checks.sh) as three groups run side by side on one GPU, in about half the
# wall time: the checks are small models whose steps leave the GPU mostly idle (stream delays, the sanitizer's
# host-side bookkeeping), and every check compares numbers, none times anything, so sharing the GPU changes no
# outcome. A lent machine's device time is what this saves.
#   bash scripts/gpu_checks_parallel.sh OUT_DIR NAME [SRC_DIR]
# Group K writes OUT_DIR/NAME.gK.jsonl (a record per check) and OUT_DIR/NAME.gK.log; when all end their records are
# joined into OUT_DIR/NAME.jsonl. The exit status is the worst group's.
set -uo pipefail
dir=$(realpath -m "$1"); name=$2; src=${3:-.}
here=$(dirname "$(realpath "$0")")
mkdir -p "$dir"
g1=(tests/gpu/test_engine_gpu.py -k "sanitizer or curve")
g2=(tests/gpu/test_engine_gpu.py -k "not (sanitizer or curve)")
g3=(tests/gpu/test_baselines_gpu.py tests/gpu/test_train_gpu.py tests/gpu/test_moe_gpu.py)
[ -e "$src/tests/gpu/test_distributed_gpu.py" ] && g3+=(tests/gpu/test_distributed_gpu.py)
bash "$here/gpu_checks.sh" "$dir/$name.g1.jsonl" "$src" "${g1[@]}" > "$dir/$name.g1.log" 2>&1 & p1=$!
bash "$here/gpu_checks.sh" "$dir/$name.g2.jsonl" "$src" "${g2[@]}" > "$dir/$name.g2.log" 2>&1 & p2=$!
bash "$here/gpu_checks.sh" "$dir/$name.g3.jsonl" "$src" "${g3[@]}" > "$dir/$name.g3.log" 2>&1 & p3=$!
rc=0
for p in $p1 $p2 $p3; do wait "$p" || rc=$?; done
cat "$dir/$name".g[123].jsonl > "$dir/$name.jsonl" 2>/dev/null
for k in 1 2 3; do echo "group $k: $(tail -n 1 "$dir/$name.g$k.log")"; done
exit "$rc"
