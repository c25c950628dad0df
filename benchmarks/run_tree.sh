#!/usr/bin/env bash
# Tree verification in D3D's own loop (issue 15's done-when run), recorded in benchmarks/results/tree/:
#  1. speed: target, prompt lookup (pld), d3d (the cost-aware engine, chain rounds) and d3d-tree (the same engine,
#     drafter rounds verify a best-first tree of at most 16 nodes, lookup matches as branches) on HumanEval prompts
#     20-39, 128 new tokens, bfloat16 and float32;
#  2. acceptance: d3d-tree with a drafter round every round (`--num-drafts full`) at 16 nodes, float32, on
#     HumanEval 20-39, GSM8K and MT-Bench (10 each): tau and losslessness of the trees themselves.
# 2 threads, shipped drafter. Run on an otherwise idle machine.
#   bash benchmarks/run_tree.sh            # FORCE=1 reruns recorded cells
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
NEW_TOKENS=${NEW_TOKENS:-128}
OUT=benchmarks/results/tree
export D3D_HF_CACHE=${D3D_HF_CACHE:-$(mktemp -d)}
run() {  # run NAME ARGS...: one bench cell into $OUT/NAME, kept unless FORCE=1
  local name=$1
  shift
  if [ -f "$OUT/$name/report.md" ] && [ -z "${FORCE:-}" ]; then
    echo "kept $OUT/$name (FORCE=1 to rerun)"
    return
  fi
  d3d-hf bench --drafter d3d-smollm2-135m-instruct --max-new-tokens "$NEW_TOKENS" --threads "$THREADS" \
    --output-dir "$OUT/$name" --overwrite "$@"
}
for dtype in ${DTYPES:-bfloat16 float32}; do
  run "speed_humaneval_${dtype}" --methods target,pld,d3d,d3d-tree --prompts humaneval --offset 20 --limit 20 \
    --dtype "$dtype" --tree-budget 16
done
for spec in "humaneval 20 20" "gsm8k 0 10" "mt-bench 0 10"; do
  read -r set offset limit <<<"$spec"
  run "tau_${set}_float32" --methods target,d3d-tree --num-drafts full --tree-budget 16 --prompts "$set" \
    --offset "$offset" --limit "$limit" --dtype float32
done
# 3. the shared target cache: d3d (the drafter attends to the target's cache) against d3d-own-cache (its own cache,
#    re-running the committed tokens), HumanEval 20-39, both dtypes
for dtype in ${DTYPES:-bfloat16 float32}; do
  run "cache_humaneval_${dtype}" --methods target,d3d,d3d-own-cache --prompts humaneval --offset 20 --limit 20 \
    --dtype "$dtype"
done
