#!/usr/bin/env bash
# Run-to-run stability of the adaptive engine's decisions (d3d-hf issue 14, "noticed"): RUNS processes decode the
# same prompts from the same starting calibration state (each a copy of the cache folder CACHE, e.g. the one
# benchmarks/run_engine.sh measured), so that what differs between them is what the policy learned and chose from
# its timings. Recorded in benchmarks/results/engine/stability/. Run it alone on the machine:
#   CACHE=<a D3D_HF_CACHE folder> bash benchmarks/engine_stability.sh      # RUNS=3 SET=gsm8k LIMIT=10 DTYPE=bfloat16
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CACHE:?set CACHE to a D3D_HF_CACHE folder holding the calibration to start from}"
RUNS=${RUNS:-3}
SET=${SET:-gsm8k}
LIMIT=${LIMIT:-10}
DTYPE=${DTYPE:-bfloat16}
for i in $(seq 1 "$RUNS"); do
  copy=$(mktemp -d)
  cp -r "$CACHE"/. "$copy"
  D3D_HF_CACHE=$copy d3d-hf bench --drafter d3d-smollm2-135m-instruct --methods target,pld,d3d --prompts "$SET" \
    --offset 0 --limit "$LIMIT" --max-new-tokens 128 --dtype "$DTYPE" --threads 2 \
    --output-dir "benchmarks/results/engine/stability/${SET}_${DTYPE}_run$i" --overwrite
  rm -rf "$copy"
done
