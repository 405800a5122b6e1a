#!/usr/bin/env bash
# A 7B-class model through `train` on a lent 128 GiB host (issue 14): STEPS steps from scratch in bf16 precision on
# scripts/finetune_demo.py's corpus and tokenizer, without training-state checkpoints (one of a 7B model is 71 GiB,
# beyond the host's 64 GiB disk, and train refuses it before building anything: shown first), then its Hugging Face
# export reloaded by transformers for a held-out loss and a generation. OUT/ gets refused.txt, metrics.jsonl,
# memory.json, reload.json, sizes.txt and record.json; the export is deleted after.
#   bash scripts/train_big.sh OUT DEMO_DIR [MODEL [STEPS]]      (CUDA; MODEL default qwen2.5-7b, STEPS 4)
set -euo pipefail
out=$(realpath -m "$1"); demo=$(realpath "$2"); model=${3:-qwen2.5-7b}; steps=${4:-4}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
args=(--model "$model" --tokenizer "$demo/tokenizer" --data "$demo/train.jsonl" --seq 1024 --batch 8 --steps "$steps"
      --device cuda --dtype bfloat16 --precision bf16 --lr 1e-5 --lr-schedule constant --out "$out/run")
set +e
"$PY" -m megatrain train "${args[@]}" 2>&1 | tail -n 3 | tee "$out/refused.txt"
set -e
"$PY" -m megatrain train "${args[@]}" --no-save
cp "$out/run/memory.json" "$out/run/metrics.jsonl" "$out/"
du -sh "$out/run/hf" | tee "$out/sizes.txt"
"$PY" - "$out" "$demo" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
from finetune_demo import generate, held_out_loss
out, demo = Path(sys.argv[1]), Path(sys.argv[2])
result = {"reloaded_held_out_loss": held_out_loss(out / "run" / "hf", demo / "tokenizer", demo / "eval.jsonl", docs=4),
          "generations": generate(out / "run" / "hf", new_tokens=8)}
(out / "reload.json").write_text(json.dumps(result, indent=1) + "\n")
print(result)
PY
"$PY" scripts/record_env.py "$out/record.json" "a big model through train: $steps steps from scratch in bf16 precision, \
refused first with training-state checkpoints (disk), then --no-save; the export reloaded by transformers" \
    "bash scripts/train_big.sh OUT DEMO_DIR $model $steps" system=megatrain model="$model" precision=bf16 \
    dtype=bfloat16 seq=1024 batch=8
rm -rf "$out/run"
