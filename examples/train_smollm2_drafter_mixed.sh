#!/usr/bin/env bash
# A drafter for SmolLM2-135M-Instruct trained on code, math and chat answers of the target (issue 26, item 3):
# the shipped recipe (examples/train_smollm2_drafter.sh) saw only stdlib code instructions, so its masks draft
# prose and arithmetic poorly. Same trainer and flags; more varied data and more steps. Every step checkpoints and
# resumes: run the script again after an interruption and it continues.
#   bash examples/train_smollm2_drafter_mixed.sh
set -euo pipefail
THREADS=${THREADS:-2}
DATA=${DATA:-runs/data/smollm2-mixed}
RUN=${RUN:-runs/train/smollm2-d3d-mixed}
STEPS=${STEPS:-1400}
PROMPTS=${PROMPTS:-stdlib:400,math:400,chat:400}

# 1. Target-distilled data (greedy, bfloat16): stdlib code instructions, templated math word problems and chat
#    requests (d3d_hf.prompts.synthetic); never an evaluation prompt (the data command refuses them).
d3d-hf data --target smollm2-135m-instruct --prompts "$PROMPTS" --output "$DATA" --max-new-tokens 192 \
  --temperature 0 --batch-size 16 --dtype bfloat16 --threads "$THREADS"

# 2. Block adapters over the target's own 30 layers, as the shipped recipe; the rows are shuffled by the trainer.
d3d-hf train --target smollm2-135m-instruct --data "$DATA" --output_dir "$RUN" --dtype bfloat16 \
  --train_mode block_adapter --block_lora_rank 32 --block_lora_alpha 64 --learning_rate 5e-4 \
  --lr_scheduler_type cosine --warmup_steps 20 --max_steps "$STEPS" --per_device_train_batch_size 4 \
  --anchors_per_sequence 8 --ar_loss_weight 0 --position_weight_gamma 7 --logging_steps 10 \
  --save_strategy steps --save_steps 25 --save_total_limit 2 --tau_eval_steps 200 --tau_holdout 4 \
  --resume_from_checkpoint auto --use_cpu --threads "$THREADS"
