#!/usr/bin/env bash
# The prepared GPU check (issue 4): run from the repository root on the lent H200 through the `device` tool, e.g.
#   run(command="bash benchmarks/gpu/run_device.sh", carry=[".whl"], timeout_s=540)
# after building the wheels here (the device image has torch/triton but transformers 5.17 and no d3d_hf):
#   echo /.whl/ >> .git/info/exclude && pip wheel --no-deps -w .whl . && python3 -m pip download --no-deps \
#     --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl transformers==5.24.0
# Writes tests.log, packed_attention.{json,md}, async_engine.{json,md} under $OUT (copy them to benchmarks/results/gpu/).
set -uo pipefail
OUT="${OUT:-results/gpu}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
# 1. kernel tests compiled on CUDA + the async engine tests (tiny models, CPU/GPU)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_async.py 2>&1 | tee "$OUT/tests.log"
# 2. Triton packed attention vs the PyTorch references, packed lengths 63..1023, prefixes 2k-8k
timeout 150 python3 benchmarks/gpu/bench_packed_attention.py "$OUT" --overwrite 2>&1 | tee "$OUT/packed_attention.log"
# 3. async vs sync engine on a random ~1.1B target with forced acceptance patterns
timeout 200 python3 benchmarks/gpu/bench_async_engine.py "$OUT" --overwrite --repeats 3 2>&1 | tee "$OUT/async_engine.log"
