#!/usr/bin/env bash
# GPU round 1: engine correctness on CUDA, layer profile, first throughput points. Writes under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_HOST_KIND=${MEGATRAIN_HOST_KIND:-unknown}
O=${OUT:-/tmp/out}; mkdir -p "$O"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$O/gpu.txt"
free -g | tee -a "$O/gpu.txt"; nproc | tee -a "$O/gpu.txt"
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$O/gpu.txt"
timeout 200 python3 -m pytest tests/gpu/test_engine_gpu.py -q -s -p no:cacheprovider 2>&1 | tail -15 | tee "$O/gpu_tests.txt"
timeout 150 python3 -m megatrain.perf_model.layer_profile --model qwen2.5-7b --tokens 16384 2>&1 | tail -12 | tee "$O/layer_profile.txt"
R="$O/records.jsonl"
run() { timeout 170 python3 -m megatrain bench --device cuda --dtype bfloat16 --steps 7 --warmup 2 --seq 1024 --out "$R" "$@" 2>&1 | grep -v '^{' | tail -3; }
run --system native --model qwen2.5-1.5b --batch 8 --precision bf16
run --system megatrain --model qwen2.5-1.5b --batch 8
run --system megatrain --model qwen2.5-1.5b --batch 32
run --system native --model qwen2.5-3b --batch 8 --precision bf16
run --system megatrain --model qwen2.5-3b --batch 8
run --system megatrain --model qwen2.5-3b --batch 32 --micro-batch 16
