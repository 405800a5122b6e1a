#!/usr/bin/env bash
# Host memory of saving, exporting and resuming against training's own peak (issue: saving and resuming stream
# tile by tile). Trains MODEL from scratch on random pre-tokenized rows for 4 steps with a checkpoint at the end
# and a Hugging Face export, then resumes that run for 4 more; each run's memory.json (host peak RSS after
# building, [loading,] training, saving, exporting) and metrics.jsonl land in OUT/{first,resumed}/, sizes.txt and
# record.json (command, settings, environment) in OUT/.
#   bash scripts/train_memory.sh OUT [MODEL [PRECISION [SYSTEM]]]
# (CUDA; MODEL default qwen2.5-1.5b, PRECISION mixed, SYSTEM megatrain)
set -euo pipefail
out=$(realpath -m "$1"); model=${2:-qwen2.5-1.5b}; precision=${3:-mixed}; system=${4:-megatrain}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
"$PY" scripts/random_rows.py "$out/data.jsonl" "$model" 64 1025 1025
run="$out/run"
rm -rf "$run"
"$PY" -m megatrain train --system "$system" --model "$model" --data "$out/data.jsonl" --seq 1024 --batch 8 --steps 4 \
    --keep 1 --device cuda --dtype bfloat16 --precision "$precision" --lr 1e-4 --lr-schedule constant --out "$run"
mkdir -p "$out/first" && cp "$run/memory.json" "$run/metrics.jsonl" "$out/first/"
"$PY" -m megatrain train --resume "$run" --steps 8
mkdir -p "$out/resumed" && cp "$run/memory.json" "$run/metrics.jsonl" "$out/resumed/"
du -sh "$run/checkpoints"/* "$run/hf" | tee "$out/sizes.txt"
"$PY" scripts/record_env.py "$out/record.json" "host peak RSS of train: after building, [loading a checkpoint,] 4 \
steps, saving the full state (the system's own checkpoint API), exporting a Hugging Face checkpoint; then resumed for \
4 more" "bash scripts/train_memory.sh OUT $model $precision $system" system="$system" model="$model" \
    precision="$precision" dtype=bfloat16 seq=1024 batch=8
rm -rf "$run" "$out/data.jsonl"
