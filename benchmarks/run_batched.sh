#!/usr/bin/env bash
# Batched D3D decoding (issue 28): target-only batched decoding (`target`) and D3D's batched loop (`d3d`, the default
# engine) on the same left-padded batches, tokens/s of whole batches, batch sizes 1, 4 and 8, 128 new tokens,
# 2 threads, shipped drafter; recorded in benchmarks/results/batched/<set>_<dtype>_b<batch>/. Run on an otherwise
# idle machine.
#   bash benchmarks/run_batched.sh     # SETS="mt-bench:0:16" DTYPES="bfloat16" BATCHES="4 8" to narrow
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
NEW_TOKENS=${NEW_TOKENS:-128}
OUT=${OUT:-benchmarks/results/batched}
export D3D_HF_CACHE=${D3D_HF_CACHE:-$(mktemp -d)}
for dtype in ${DTYPES:-float32 bfloat16}; do
  for spec in ${SETS:-humaneval:20:16 mt-bench:0:16}; do
    IFS=: read -r set offset limit <<<"$spec"
    for batch in ${BATCHES:-1 4 8}; do
      d3d-hf bench --drafter d3d-smollm2-135m-instruct --methods target,d3d --prompts "$set" --offset "$offset" \
        --limit "$limit" --max-new-tokens "$NEW_TOKENS" --dtype "$dtype" --threads "$THREADS" --batch-size "$batch" \
        --output-dir "$OUT/${set}_${dtype}_b${batch}" --overwrite
    done
  done
done
