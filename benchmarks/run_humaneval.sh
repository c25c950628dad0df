#!/usr/bin/env bash
# The benchmark runs whose results are recorded in benchmarks/results/ and shown in docs/RESULTS.md.
# Run on an otherwise idle machine (any concurrent CPU job distorts tokens/s badly on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
d3d-hf init-drafter --from smollm2-135m-instruct --output runs/smollm2-d3d-init --overwrite
for dtype in float32 bfloat16; do
  d3d-hf bench --target smollm2-135m-instruct --drafter runs/smollm2-d3d-init --prompts humaneval --limit 20 \
    --max-new-tokens 128 --dtype "$dtype" --threads 2 --output "benchmarks/results/foundation_humaneval_${dtype}.json" --overwrite
  d3d-hf bench --drafter d3d-smollm2-135m-instruct --prompts humaneval --limit 20 \
    --max-new-tokens 256 --dtype "$dtype" --threads 2 --output "benchmarks/results/shipped_humaneval_${dtype}.json" --overwrite
done
python benchmarks/render_readme.py
