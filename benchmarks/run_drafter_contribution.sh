#!/usr/bin/env bash
# What the D3D drafter adds to the cost-aware engine (issue 26): target, prompt lookup (pld), d3d (the default engine),
# d3d-fused (the same with drafting inside the verifications forced on; 'auto' is off on CPU)
# and engine-lookup (the same engine with its drafter never drafting: plain steps and its sized prompt-lookup rounds,
# same calibration), interleaved per prompt, 128 new tokens, 2 threads, shipped drafter; recorded in
# benchmarks/results/contribution/<set>_<dtype>/. Run on an otherwise idle machine.
#   bash benchmarks/run_drafter_contribution.sh     # SETS="gsm8k:0:10 mt-bench:0:10" DTYPES="bfloat16" to narrow
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
NEW_TOKENS=${NEW_TOKENS:-128}
OUT=${OUT:-benchmarks/results/contribution}
METHODS=${METHODS:-target,pld,d3d,d3d-fused,engine-lookup}
export D3D_HF_CACHE=${D3D_HF_CACHE:-$(mktemp -d)}
for dtype in ${DTYPES:-float32 bfloat16}; do
  for spec in ${SETS:-humaneval:20:20 gsm8k:0:10 mt-bench:0:10}; do
    IFS=: read -r set offset limit <<<"$spec"
    d3d-hf bench --drafter "${DRAFTER:-d3d-smollm2-135m-instruct}" --methods "$METHODS" --prompts "$set" \
      --offset "$offset" --limit "$limit" --max-new-tokens "$NEW_TOKENS" --dtype "$dtype" --threads "$THREADS" \
      --output-dir "$OUT/${set}_${dtype}" --overwrite
  done
done
