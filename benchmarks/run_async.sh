#!/usr/bin/env bash
# Issue-4 measurement: asynchronous D3D (packed successor drafting during verification) against synchronous D3D and
# the target alone, with the shipped drafter, on HumanEval prompts 20-29 (disjoint from the 20 of the lossless test),
# 128 new tokens, 2 threads: bfloat16 with 1, 4 and 16 hypotheses, float32 with 4. Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/async
mkdir -p "$out"
for run in bfloat16:1 bfloat16:4 bfloat16:16 float32:4; do
  dtype=${run%%:*}; h=${run##*:}
  {
    [ -f "$out/humaneval_${dtype}_h${h}.json" ] && continue
    d3d-hf bench --drafter d3d-smollm2-135m-instruct --methods target,d3d,d3d-async --num-hypotheses "$h" \
      --prompts humaneval --offset 20 --limit 10 --max-new-tokens 128 --dtype "$dtype" --threads 2 \
      --output "$out/humaneval_${dtype}_h${h}.json" --overwrite
  }
done
