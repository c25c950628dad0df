#!/usr/bin/env bash
# Issue-3 measurement of the shipped drafter: all 164 HumanEval prompts, 256 new tokens, greedy, B=16.
# Runs in shards of 21 prompts (resumable: a finished shard is kept), then merges them into one results file.
# Usage: bash benchmarks/run_humaneval_full.sh DTYPE THREADS   (e.g. float32 1)
set -euo pipefail
cd "$(dirname "$0")/.."
dtype="${1:-float32}"
threads="${2:-2}"
shards="benchmarks/results/shards/full_humaneval_${dtype}_t${threads}"
mkdir -p "$shards"
for offset in 0 21 42 63 84 105 126 147; do
  out="$shards/offset_${offset}.json"
  [ -f "$out" ] && continue
  d3d-hf bench --drafter d3d-smollm2-135m-instruct --prompts humaneval --offset "$offset" --limit 21 \
    --max-new-tokens 256 --dtype "$dtype" --threads "$threads" --output "$out.partial" --overwrite
  mv "$out.partial" "$out"
done
python - "$shards" "benchmarks/results/full_humaneval_${dtype}_t${threads}.json" <<'PY'
import json, sys
from pathlib import Path
from d3d_hf.bench import format_table, merge_results
shards = sorted(Path(sys.argv[1]).glob("offset_*.json"), key=lambda p: int(p.stem.split("_")[1]))
merged = merge_results([json.loads(p.read_text()) for p in shards])
Path(sys.argv[2]).write_text(json.dumps(merged, indent=2))
print(format_table(merged["summary"]))
PY
