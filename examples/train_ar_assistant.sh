#!/usr/bin/env bash
# The autoregressive baseline for `d3d-hf bench --methods ar-assist --assistant DIR`: an autoregressive drafter of
# SmolLM2-135M-Instruct trained through D3DTrainer with the block-diffusion loss off (`--block_loss_weight 0`), on the
# same data and step budget as the D3D drafter of examples/train_smollm2_drafter.sh (700 steps of 4 sequences),
# then exported as a plain causal-LM folder (LlamaForCausalLM + the target's tokenizer).
# Every step checkpoints and resumes: run the script again after an interruption and it continues.
#   bash examples/train_ar_assistant.sh            # -> runs/smollm2-ar-assistant
set -euo pipefail
THREADS=${THREADS:-2}
DATA=runs/data/smollm2-stdlib
RUN=runs/train/smollm2-ar
ASSISTANT_DIR=${ASSISTANT_DIR:-runs/smollm2-ar-assistant}
STEPS=${STEPS:-700}
LAYERS=${LAYERS:-6}

# 1. The same target-distilled data as the D3D drafter (reused when train_smollm2_drafter.sh already made it).
d3d-hf data --target smollm2-135m-instruct --prompts stdlib:400 --output "$DATA" --max-new-tokens 192 \
  --temperature 0 --batch-size 16 --dtype bfloat16 --threads "$THREADS"

# 2. The first $LAYERS of the target's 30 layers plus its final norm and LM head; every layer weight trains (embeddings
#    and LM head frozen), next-token loss only. float32: full-weight training has no float32 master copy otherwise.
d3d-hf train --target smollm2-135m-instruct --data "$DATA" --output_dir "$RUN" --dtype float32 \
  --num_layers "$LAYERS" --train_mode full --block_loss_weight 0 --ar_loss_weight 1 --learning_rate 2e-4 \
  --lr_scheduler_type cosine --warmup_steps 20 --max_steps "$STEPS" --per_device_train_batch_size 4 \
  --logging_steps 10 --save_strategy steps --save_steps 25 --save_total_limit 2 --tau_eval_steps 0 --tau_holdout 4 \
  --resume_from_checkpoint auto --use_cpu --threads "$THREADS"

# 3. Its committed-context path as a plain causal LM, usable by transformers' assisted generation.
d3d-hf export-causal-lm --drafter "$RUN" --output "$ASSISTANT_DIR" --overwrite

# 4. Optional (maintainers): ship it inside the package as `ar-smollm2-135m-instruct` (layers only, bfloat16).
if [ -n "${SHIP:-}" ]; then python examples/ship_ar_assistant.py "$ASSISTANT_DIR"; fi
