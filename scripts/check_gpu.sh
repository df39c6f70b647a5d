#!/usr/bin/env bash
# What CPU CI cannot run, on one CUDA GPU: one summary line per check, exit 1 if any fails.
#
#   bash scripts/check_gpu.sh [OUT_DIR] [--record]     # --record: also benchmarks/gpu_check.json
#
# The checks (scripts/check_gpu.py says each): the attention kernels; 4 bf16 GRPO steps of the tiny default
# with the rollout engine on the GPU, the weight push and the probe every step; 3 steps of the 7B config on a
# Qwen2.5-VL-7B-shaped model (full width, 4 layers, random init) with and without activation checkpointing,
# predicted vs measured peak memory and tokens/s. vLLM (`pip install -e ".[cuda]"`) is used when it imports,
# else transformers generate; the JSON records which. On a machine with no package index, carry the wheels
# scripts/gpu_wheels.sh downloads.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/check_gpu}
shift || true
exec python scripts/check_gpu.py --out "$OUT" "$@"
