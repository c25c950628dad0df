#!/usr/bin/env bash
# Issue-4 measurement: asynchronous D3D (packed successor drafting during verification) against synchronous D3D and
# the target alone, with the shipped drafter, on HumanEval prompts 20-29 (disjoint from the 20 of the lossless test),
# 128 new tokens, 2 threads: bfloat16 with 1, 4 and 16 hypotheses, float32 with 4, each with the default packed-pass
# worker (1 thread: half of 2), and bfloat16 with 4 hypotheses and a 2-thread worker (the behaviour before
# d3d_worker_threads, kept in before_worker_threads/). Run on an otherwise idle machine. Resumable: existing results
# are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
out=benchmarks/results/async
mkdir -p "$out"
for run in bfloat16:1: bfloat16:4: bfloat16:16: float32:4: bfloat16:4:2; do
  IFS=: read -r dtype h workers <<< "$run"
  name="humaneval_${dtype}_h${h}${workers:+_w$workers}"
  [ -f "$out/$name.json" ] && continue
  d3d-hf bench --drafter d3d-smollm2-135m-instruct --methods target,d3d,d3d-async --num-hypotheses "$h" \
    ${workers:+--worker-threads "$workers"} \
    --prompts humaneval --offset 20 --limit 10 --max-new-tokens 128 --dtype "$dtype" --threads 2 \
    --output "$out/$name.json"
done
