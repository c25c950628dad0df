#!/bin/bash
# $1 = venv bin dir, $2 = output prefix
set -e
export OMP_NUM_THREADS=1
$1/d3d-hf bench --drafter d3d-smollm2-135m-instruct --prompts humaneval --limit 5 --max-new-tokens 128 --dtype float32 --threads 1 --methods target,d3d,d3d-tree --num-drafts full --output $2-chain.json
$1/d3d-hf bench --drafter d3d-smollm2-135m-instruct --prompts humaneval --limit 4 --max-new-tokens 64 --dtype float32 --threads 1 --methods target,d3d --num-drafts full --batch-size 4 --output $2-batch.json
