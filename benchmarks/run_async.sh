#!/usr/bin/env bash
# Issue-4 measurement: asynchronous D3D (packed successor drafting during verification) against synchronous D3D and
# the target alone, with the shipped drafter, on HumanEval prompts 20-29 (disjoint from the 20 of the lossless test),
# 128 new tokens, bfloat16 and float32, 2 threads, for 1, 4 and 16 hypotheses. Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/async
mkdir -p "$out"
for dtype in bfloat16 float32; do
  for h in 1 4 16; do
    [ -f "$out/humaneval_${dtype}_h${h}.json" ] && continue
    d3d-hf bench --drafter d3d-smollm2-135m-instruct --methods target,d3d,d3d-async --num-hypotheses "$h" \
      --prompts humaneval --offset 20 --limit 10 --max-new-tokens 128 --dtype "$dtype" --threads 2 \
      --output "$out/humaneval_${dtype}_h${h}.json" --overwrite
  done
done
