#!/usr/bin/env bash
# Builds the committed training data of the SmolLM2-135M-Instruct drafters (issue 35): ~23,000 prompts from six
# sources, answered greedily by the target itself, in token-id shards under data/smollm2-135m-instruct/.
# Every step resumes: run the script again after an interruption (or in the next session) and it goes on.
#   THREADS=1 bash examples/build_smollm2_data.sh      # in the background while other work uses the second core
set -euo pipefail
THREADS=${THREADS:-1}
ROOT=${ROOT:-data/smollm2-135m-instruct}
MAGPIE="$ROOT/prompts/magpie.jsonl"
MAGPIE_COUNTS=${MAGPIE_COUNTS:-code=1500,math=1000,writing=700,explanation=700,advice=500,roleplay=400,extraction=400,general=800}
PROMPTS=${PROMPTS:-stdlib:6500,math:2000,math-extra:2500,chat:2000,chat-extra:4000,$MAGPIE}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-512}
export OMP_NUM_THREADS=$THREADS

# 1. Requests the target writes itself (Magpie): the chat template up to the user's text, after a domain's system
#    prompt, sampled at T=1.0, top-p 0.95; filtered, deduplicated, never close to an evaluation prompt.
d3d-hf magpie --target smollm2-135m-instruct --output "$MAGPIE" --counts "$MAGPIE_COUNTS" --batch-size 64 \
  --dtype bfloat16 --threads "$THREADS"

# 2. The target's greedy answers (up to 512 new tokens), batched in bf16, in a seeded shuffled order so that the
#    first N rows are a sample of every source (the learning curve trains on prefixes).
d3d-hf data --target smollm2-135m-instruct --prompts "$PROMPTS" --output "$ROOT/answers" \
  --max-new-tokens "$MAX_NEW_TOKENS" --temperature 0 --batch-size 64 --dtype bfloat16 --threads "$THREADS" --shuffle
