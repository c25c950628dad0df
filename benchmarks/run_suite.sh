#!/usr/bin/env bash
# The benchmark suite recorded in benchmarks/results/suite/ and shown in docs/RESULTS.md: every method (target, pld,
# ar-assist, d3d, d3d-async with 4 hypotheses) on every prompt set (humaneval, gsm8k, mt-bench) for SmolLM2-135M-Instruct with the shipped drafter
# d3d-smollm2-135m-instruct, in float32 and bfloat16, with the cost model; then the combined report (plots) and the
# tables of docs/RESULTS.md. Run on an otherwise idle machine (a concurrent CPU job distorts tokens/s badly on 2 cores).
# Resumable: a finished (prompt set, dtype) folder is kept; FORCE=1 reruns everything.
#   bash benchmarks/run_suite.sh
# Trains the autoregressive assistant first (examples/train_ar_assistant.sh) when ASSISTANT does not exist yet.
# METHODS=target,pld,d3d,d3d-async leaves out ar-assist (and its training).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
LIMIT=${LIMIT:-5}
NEW_TOKENS=${NEW_TOKENS:-96}
SETS=${SETS:-"humaneval gsm8k mt-bench"}
ASSISTANT=${ASSISTANT:-runs/smollm2-ar-assistant}
OUT=benchmarks/results/suite

METHODS=${METHODS:-target,pld,ar-assist,d3d,d3d-async}
ASSISTANT_ARGS=()
if [[ ",$METHODS," == *",ar-assist,"* ]]; then ASSISTANT_ARGS=(--assistant "$ASSISTANT"); fi
if [ ${#ASSISTANT_ARGS[@]} -gt 0 ] && [ ! -f "$ASSISTANT/config.json" ]; then
  echo "No autoregressive assistant at $ASSISTANT: training it with examples/train_ar_assistant.sh"
  ASSISTANT_DIR="$ASSISTANT" THREADS="$THREADS" bash examples/train_ar_assistant.sh
fi
for dtype in float32 bfloat16; do
  for set in $SETS; do
    dir="$OUT/${set}_${dtype}"
    if [ -f "$dir/report.md" ] && [ -z "${FORCE:-}" ]; then
      echo "kept $dir (FORCE=1 to rerun)"
      continue
    fi
    d3d-hf bench --drafter d3d-smollm2-135m-instruct "${ASSISTANT_ARGS[@]}" --methods "$METHODS" \
      --prompts "$set" --limit "$LIMIT" --max-new-tokens "$NEW_TOKENS" --dtype "$dtype" --threads "$THREADS" \
      --cost-model --output-dir "$dir" --overwrite
  done
done
results=()
for dtype in float32 bfloat16; do
  for set in $SETS; do results+=("$OUT/${set}_${dtype}/results.json"); done
done
d3d-hf report "${results[@]}" --output-dir "$OUT/report" --title "SmolLM2-135M-Instruct: every method on every prompt set" \
  --overwrite
python benchmarks/render_readme.py
