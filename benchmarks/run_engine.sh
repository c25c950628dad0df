#!/usr/bin/env bash
# The cost-aware engine against the baselines (issue 14's done-when run), recorded in benchmarks/results/engine/:
# target, prompt lookup (pld), d3d (adaptive engine: plain steps, prompt-lookup rounds or draft passes, whichever the
# measured cost curves say pays), engine-lookup (the same engine never drafting: what d3d adds is the drafter's) and
# d3d-async (d3d_async=True: the packed pass on every device), on HumanEval
# prompts 20-39, GSM8K and MT-Bench (10 each), 128 new tokens, float32 and bfloat16, 2 threads, shipped drafter.
# Run on an otherwise idle machine. The adaptive engine calibrates on first use: the bench's warm-up call does it
# (cached under $D3D_HF_CACHE, here a fresh folder per run so that the recorded run starts from a measurement).
#   bash benchmarks/run_engine.sh            # FORCE=1 reruns recorded cells; DTYPES=bfloat16 runs one dtype
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
NEW_TOKENS=${NEW_TOKENS:-128}
OUT=benchmarks/results/engine
export D3D_HF_CACHE=${D3D_HF_CACHE:-$(mktemp -d)}
for dtype in ${DTYPES:-float32 bfloat16}; do
  for spec in "humaneval 20 20" "gsm8k 0 10" "mt-bench 0 10"; do
    read -r set offset limit <<<"$spec"
    dir="$OUT/${set}_${dtype}"
    if [ -f "$dir/report.md" ] && [ -z "${FORCE:-}" ]; then
      echo "kept $dir (FORCE=1 to rerun)"
      continue
    fi
    d3d-hf bench --drafter d3d-smollm2-135m-instruct --methods target,pld,d3d,engine-lookup,d3d-async --prompts "$set" \
      --offset "$offset" --limit "$limit" --max-new-tokens "$NEW_TOKENS" --dtype "$dtype" --threads "$THREADS" \
      --output-dir "$dir" --overwrite
  done
done
results=()
for dtype in float32 bfloat16; do
  for set in humaneval gsm8k mt-bench; do results+=("$OUT/${set}_${dtype}/results.json"); done
done
d3d-hf report "${results[@]}" --output-dir "$OUT/report" --overwrite \
  --title "SmolLM2-135M-Instruct: the cost-aware D3D engine against target and prompt lookup"
