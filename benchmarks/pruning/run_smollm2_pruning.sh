#!/usr/bin/env bash
# Issue-5 run: progressive layer pruning of the shipped drafter d3d-smollm2-135m-instruct (30 layers, block
# adapters over the target's own layers) on 4 held-out standard-library prompts (stdlib prompts 400-403; the
# drafter trained on the first 400), 64-token calibration continuations, bfloat16, 1 thread. Resumable: re-running
# continues from runs/pruning/smollm2/pruning_state.json. Then copies the path JSON and plot here.
set -euo pipefail
cd "$(dirname "$0")/../.."
layers="${1:-24}"
d3d-hf prune --drafter d3d-smollm2-135m-instruct --prompts stdlib:404 --offset 400 --limit 4 --max-new-tokens 64 \
  --num-layers "$layers" --dtype bfloat16 --threads 1 --output runs/pruning/smollm2
cp runs/pruning/smollm2/pruning_path.json runs/pruning/smollm2/pruning_curve.png benchmarks/pruning/
