#!/usr/bin/env bash
# Issue-5 curve on HumanEval: the shipped drafter and its pruned versions (28 and 24 layers, from
# run_smollm2_pruning.sh and `d3d-hf prune --num-layers N` resumed from its state), synchronous and asynchronous
# (4 hypotheses) against the target, HumanEval prompts 20-24, 128 new tokens, bfloat16, 2 threads. Idle machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=benchmarks/results/pruning
mkdir -p "$out"
for n in 30 28 24; do
  if [ "$n" = 30 ]; then drafter=d3d-smollm2-135m-instruct; else drafter=runs/pruning/smollm2-$n; fi
  if [ "$n" != 30 ] && [ ! -f "$drafter/config.json" ]; then
    mkdir -p "$drafter" && cp runs/pruning/smollm2/pruning_state.json "$drafter/"
    d3d-hf prune --drafter d3d-smollm2-135m-instruct --prompts stdlib:404 --offset 400 --limit 4 --max-new-tokens 64 \
      --num-layers "$n" --dtype bfloat16 --threads 1 --output "$drafter"
  fi
  [ -f "$out/humaneval_bfloat16_${n}layers.json" ] && continue
  d3d-hf bench --drafter "$drafter" --target smollm2-135m-instruct --methods target,d3d,d3d-async --num-hypotheses 4 \
    --prompts humaneval --offset 20 --limit 5 --max-new-tokens 128 --dtype bfloat16 --threads 2 \
    --output "$out/humaneval_bfloat16_${n}layers.json" --overwrite
done
