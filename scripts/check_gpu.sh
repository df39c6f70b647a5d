#!/usr/bin/env bash
# What CPU CI cannot run, on one CUDA GPU; one summary line per check, exit 1 if any fails.
#
#   bash scripts/check_gpu.sh [OUT_DIR]      # needs `pip install -e ".[cuda]"` (vLLM for CUDA)
#
# 1. attention: `flash` (PyTorch's varlen FlashAttention) bf16 vs `sdpa` fp32 log-probs and gradients,
#    the Ulysses wrapper at degree 1, and speed (scripts/check_gpu_attention.py -> OUT_DIR/attention.json);
# 2. RL: 4 GRPO steps of the tiny default in bf16 with `flash`, vLLM (CUDA) rollouts and the in-place weight
#    sync, the probe (vLLM vs trainer log-probs of the same tokens) every step;
# 3. probe: the largest |vLLM - trainer| log-prob difference those steps measured (bf16 on both sides:
#    differences of ~1e-2 are bf16 rounding; the tolerance below is what the run enforces).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/check_gpu}
mkdir -p "$OUT"
status=0

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "check_gpu: no CUDA device visible to torch"; exit 1
fi

if python scripts/check_gpu_attention.py --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1; then
    echo "attention: ok ($(grep -c . "$OUT/attention.log") lines in $OUT/attention.log)"
else
    echo "attention: FAILED (see $OUT/attention.log)"; status=1
fi

if python -m titanrl.train --config configs/tiny_cpu.toml --job.name=check_gpu --job.dump_folder="$OUT" \
        --job.steps=4 --checkpoint.enable=false --model.dtype=bfloat16 --model.attn_backend=flash \
        --rollout.probe_every=1 --rollout.probe_tolerance=0.05 --metrics.progress=line \
        > "$OUT/rl.log" 2>&1; then
    echo "rl: ok, $(grep -c '^step ' "$OUT/rl.log") bf16 steps with vLLM rollouts and in-place weight sync ($OUT/rl.log)"
else
    echo "rl: FAILED (see $OUT/rl.log and $OUT/check_gpu/logs/)"; status=1
fi

python - "$OUT/check_gpu/metrics.jsonl" <<'EOF' || status=1
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])]
except OSError:
    print("probe: FAILED (no metrics)"); sys.exit(1)
diffs = [r["probe/logprob_max_diff"] for r in rows if "probe/logprob_max_diff" in r]
print(f"probe: max |vLLM - trainer| log-prob {max(diffs):.3g} over {len(diffs)} steps (bf16 both sides)"
      if diffs else "probe: FAILED (no probe measured)")
sys.exit(0 if diffs else 1)
EOF
exit $status
