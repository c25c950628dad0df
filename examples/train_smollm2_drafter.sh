#!/usr/bin/env bash
# The recipe of the shipped drafter `d3d-smollm2-135m-instruct` (src/d3d_hf/pretrained/) on a CPU machine, by
# default on stdlib prompts alone for 700 steps; the shipped drafter itself is this recipe on stdlib, math and chat
# prompts for 1,400 steps: examples/train_smollm2_drafter_mixed.sh.
# Every step checkpoints and resumes: run the script again after an interruption and it continues.
#   bash examples/train_smollm2_drafter.sh
# PROMPTS, DATA, RUN, STEPS and TAU_EVAL_STEPS change the data and the run (examples/train_smollm2_drafter_mixed.sh).
set -euo pipefail
THREADS=${THREADS:-2}
PROMPTS=${PROMPTS:-stdlib:400}
DATA=${DATA:-runs/data/smollm2-stdlib}
RUN=${RUN:-runs/train/smollm2-d3d}
STEPS=${STEPS:-700}
TAU_EVAL_STEPS=${TAU_EVAL_STEPS:-100}

# 1. Target-distilled data: SmolLM2 answers instructions derived from the Python standard library (greedy).
d3d-hf data --target smollm2-135m-instruct --prompts "$PROMPTS" --output "$DATA" --max-new-tokens 192 \
  --temperature 0 --batch-size 16 --dtype bfloat16 --threads "$THREADS"

# 2. Block adapters over the target's own 30 layers (the committed-context path stays the target's, so the
#    first draft token stays exact); only the adapters and the mask embedding train and are saved.
#    `d3d-hf train` is D3DTrainer on trl.SFTTrainer (TRL's parser: these flags can also go in a --config YAML file);
#    with these flags it gives the losses of the earlier transformers.Trainer-based trainer step for step.
d3d-hf train --target smollm2-135m-instruct --data "$DATA" --output_dir "$RUN" --dtype bfloat16 \
  --train_mode block_adapter --block_lora_rank 32 --block_lora_alpha 64 --learning_rate 5e-4 \
  --lr_scheduler_type cosine --warmup_steps 20 --max_steps "$STEPS" --per_device_train_batch_size 4 \
  --anchors_per_sequence 8 --ar_loss_weight 0 --position_weight_gamma 7 --logging_steps 10 \
  --save_strategy steps --save_steps 25 --save_total_limit 2 --tau_eval_steps "$TAU_EVAL_STEPS" --tau_holdout 4 \
  --resume_from_checkpoint auto --use_cpu --threads "$THREADS"
