"""Regenerates the README's results section from the recorded benchmark JSON files.

    python benchmarks/render_readme.py          # rewrite README.md between the results markers
    python benchmarks/render_readme.py --check  # exit 1 if README.md is out of date

Every file listed in RESULTS must exist; each becomes one table with the settings and the command that made it.
"""

import argparse
import json
import sys
from pathlib import Path

from d3d_hf.bench import format_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"
RESULTS = [
    ("benchmarks/results/shipped_humaneval_float32.json", "shipped drafter `d3d-smollm2-135m-instruct`"),
    ("benchmarks/results/shipped_humaneval_bfloat16.json", "shipped drafter `d3d-smollm2-135m-instruct`"),
    ("benchmarks/results/foundation_humaneval_float32.json", "untrained drafter from `d3d-hf init-drafter`"),
    ("benchmarks/results/foundation_humaneval_bfloat16.json", "untrained drafter from `d3d-hf init-drafter`"),
]


def render() -> str:
    parts = []
    for rel, label in RESULTS:
        data = json.loads((ROOT / rel).read_text())
        st = data["settings"]
        parts.append(
            f"**{st['target']}** with the {label} ({st['drafter_layers']} layers), "
            f"{st['dtype']}, {st['num_prompts']} {st['prompts']} prompts, {st['max_new_tokens']} new tokens, "
            f"block size {st['block_size']}, {st['torch_threads']} threads on {st['cpu_count']} CPU cores "
            f"({st['machine']}), torch {st['torch']}, transformers {st['transformers']}. "
            f"Recorded in [`{rel}`]({rel}) by `{st['command']}`."
        )
        parts.append("")
        parts.append(format_table(data["summary"]))
        parts.append("")
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = README.read_text()
    if START not in text or END not in text:
        print(f"README.md lacks the {START} / {END} markers")
        return 1
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{render()}{END}{tail}"
    if args.check:
        if new != text:
            print("README.md results are out of date: run `python benchmarks/render_readme.py`")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
