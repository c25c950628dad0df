#!/usr/bin/env bash
# A drafter for SmolLM2-135M-Instruct trained on code, math and chat answers of the target (issue 26, item 3): the
# shipped recipe (examples/train_smollm2_drafter.sh) with stdlib code instructions plus templated math word problems
# and chat requests (d3d_hf.prompts.synthetic), and more steps. Resumes like it: run it again after an interruption.
#   bash examples/train_smollm2_drafter_mixed.sh
set -euo pipefail
PROMPTS=${PROMPTS:-stdlib:400,math:400,chat:400} DATA=${DATA:-runs/data/smollm2-mixed} \
  RUN=${RUN:-runs/train/smollm2-d3d-mixed} STEPS=${STEPS:-1400} TAU_EVAL_STEPS=${TAU_EVAL_STEPS:-200} \
  bash "$(dirname "$0")/train_smollm2_drafter.sh"
