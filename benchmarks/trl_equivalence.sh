#!/usr/bin/env bash
# The TRL-based trainer against the transformers.Trainer-based one it replaced (git ref OLD, default 71b3072, the
# last commit before the move to TRL): the same seed, data and steps must give the same losses step by step.
#   bash benchmarks/trl_equivalence.sh            # tiny target (seconds) + SmolLM2 with the recipe's flags (minutes)
#   SMOLLM2=0 bash benchmarks/trl_equivalence.sh  # tiny target only
# Run from the repository root with the project's venv active. Writes into ${WORK:-/tmp/d3d_trl_equivalence}.
set -euo pipefail
OLD=${OLD:-71b3072}
WORK=${WORK:-/tmp/d3d_trl_equivalence}
ROOT=$(pwd)
rm -rf "$WORK" && mkdir -p "$WORK/old"
git archive "$OLD" | tar -x -C "$WORK/old"
for pkg in modeling kernels hub_cards; do ln -s "$WORK/old/$pkg" "$WORK/old/src/d3d_hf/$pkg"; done
export OMP_NUM_THREADS=${THREADS:-2} HF_HUB_DISABLE_TELEMETRY=1
old() { (cd "$WORK" && PYTHONPATH="$WORK/old/src" "$@"); }
new() { (cd "$WORK" && "$@"); }

# 1. tiny target, train_mode full, 5 steps (tests/scripts/train_tiny.py)
for impl in old new; do
  $impl python "$ROOT/tests/scripts/train_tiny.py" --per-device 2 --accum 1 --out "$WORK/tiny_$impl.json" \
    --output-dir "$WORK/tiny_$impl" > "$WORK/tiny_$impl.log" 2>&1
done
python - "$WORK" <<'PY'
import json, sys
w = sys.argv[1]
a, b = (json.load(open(f"{w}/tiny_{i}.json")) for i in ("old", "new"))
print("tiny old:", a["loss"]); print("tiny new:", b["loss"])
print("tiny: losses identical", a["loss"] == b["loss"], "| trained parameter sums identical", a["param_sums"] == b["param_sums"])
PY
[ "${SMOLLM2:-1}" = 1 ] || exit 0

# 2. SmolLM2-135M-Instruct: 24 target-answered stdlib prompts, the recipe's train flags, 6 steps
new d3d-hf data --target smollm2-135m-instruct --prompts stdlib:24 --output "$WORK/data" --max-new-tokens 64 \
  --batch-size 8 --dtype bfloat16 --threads "$OMP_NUM_THREADS" > "$WORK/data.log" 2>&1
for impl in old new; do
  $impl python -c "import sys; from d3d_hf.cli import main; sys.exit(main())" train --target smollm2-135m-instruct \
    --data "$WORK/data" --output_dir "$WORK/smol_$impl" --dtype bfloat16 \
    --train_mode block_adapter --block_lora_rank 32 --block_lora_alpha 64 --learning_rate 5e-4 \
    --lr_scheduler_type cosine --warmup_steps 20 --max_steps 6 --per_device_train_batch_size 4 \
    --anchors_per_sequence 8 --ar_loss_weight 0 --position_weight_gamma 7 --logging_steps 1 \
    --save_strategy no --tau_holdout 4 --use_cpu --threads "$OMP_NUM_THREADS" --report_to none --disable_tqdm true \
    > "$WORK/smol_$impl.log" 2>&1
done
python - "$WORK" <<'PY'
import json, sys
import torch
from safetensors.torch import load_file
w = sys.argv[1]
logs = [[h for h in json.load(open(f"{w}/smol_{i}/trainer_state.json"))["log_history"] if "loss" in h] for i in ("old", "new")]
for name, log in zip(("old", "new"), logs):
    print(f"smollm2 {name}:", [h["loss"] for h in log])
wa, wb = (load_file(f"{w}/smol_{i}/model.safetensors") for i in ("old", "new"))
print("smollm2: losses identical", [h["loss"] for h in logs[0]] == [h["loss"] for h in logs[1]],
      "| grad norms identical", [h["grad_norm"] for h in logs[0]] == [h["grad_norm"] for h in logs[1]],
      f"| saved tensors identical ({len(wa)})", wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa))
PY
