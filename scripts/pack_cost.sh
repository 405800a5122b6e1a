#!/usr/bin/env bash
# What packing costs and gains: MODEL trained on documents of random length (64 to 1024 tokens, uniform) at seq 2048,
# packed (document-masked attention) and one document per padded row, 6 steps each (the first not counted); each
# run's metrics.jsonl goes to OUT/{packed,padded}/ and OUT/summary.json has the median tokens/s and target tokens/s.
#   bash scripts/pack_cost.sh OUT [MODEL]      (CUDA; MODEL default qwen2.5-0.5b)
set -euo pipefail
out=$(realpath -m "$1"); model=${2:-qwen2.5-0.5b}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
"$PY" scripts/random_rows.py "$out/docs.jsonl" "$model" 400 64 1024
for layout in packed padded; do
    flag=(); [ "$layout" = padded ] && flag=(--no-pack)
    "$PY" -m megatrain train --model "$model" --data "$out/docs.jsonl" --seq 2048 --batch 8 --steps 6 "${flag[@]}" \
        --device cuda --dtype bfloat16 --lr 1e-5 --lr-schedule constant --out "$out/run-$layout"
    mkdir -p "$out/$layout" && cp "$out/run-$layout/metrics.jsonl" "$out/$layout/"
    rm -rf "$out/run-$layout"
done
"$PY" - "$out" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
from megatrain.bench.env import environment
out = Path(sys.argv[1])
summary = {"env": environment()}
for layout in ("packed", "padded"):
    steps = [json.loads(l) for l in (out / layout / "metrics.jsonl").read_text().splitlines()][1:]
    summary[layout] = {k: statistics.median(s[k] for s in steps) for k in ("tokens_per_s", "target_tokens_per_s",
                                                                             "target_tokens", "step_s")}
summary["target_tokens_per_s_packed_over_padded"] = \
    summary["packed"]["target_tokens_per_s"] / summary["padded"]["target_tokens_per_s"]
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({k: v for k, v in summary.items() if k != "env"}, indent=1))
PYEOF
rm -f "$out/docs.jsonl"
