"""The mix of the committed training data: prompts and answers by source, and how diverse each source's prompts are.

For the prompt spec of a `d3d-hf data` folder (its `generation_settings.json`, as `examples/build_smollm2_data.sh`
wrote it) and the answers in its shards: per source, prompts in the set, prompts answered so far, answer tokens,
and the distinct-n ratios of the prompts (distinct word n-grams over all word n-grams, n = 1, 2, 3, over the source's
prompts: 1.0 when no n-gram repeats; templated sources score low, text written by the target or taken from code
higher). Writes a Markdown table:

    python benchmarks/data_mix.py data/smollm2-135m-instruct/answers --output data/smollm2-135m-instruct/MIX.md
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

from d3d_hf.data import SETTINGS_FILE, load_generated_rows
from d3d_hf.prompts import load_prompt_sources

_WORD = re.compile(r"[a-z0-9]+")


def _source(prompt_id: str) -> str:
    """`stdlib/...` -> stdlib, `magpie/code/3` -> magpie/code, `math-extra/5` -> math-extra."""
    parts = prompt_id.split("/")
    return "/".join(parts[:2]) if parts[0] == "magpie" else parts[0]


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct word n-grams over all word n-grams of `texts` (0 when there are none)."""
    grams: Counter = Counter()
    for text in texts:
        words = _WORD.findall(text.lower())
        grams.update(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
    total = sum(grams.values())
    return len(grams) / total if total else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a `d3d-hf data` output folder")
    parser.add_argument("--output", help="also write the table to this Markdown file")
    args = parser.parse_args()
    settings = json.loads((Path(args.folder) / SETTINGS_FILE).read_text())
    spec = settings["prompt_sources"].removesuffix(" (shuffled)")
    prompts = load_prompt_sources(spec, seed=settings.get("seed", 0))
    rows = load_generated_rows(args.folder)
    texts, answered, tokens = defaultdict(list), Counter(), Counter()
    for p in prompts:
        texts[_source(p.id)].append(" ".join(m["content"] for m in p.messages if m["role"] == "user"))
    for row in rows:
        answered[_source(row["id"])] += 1
        tokens[_source(row["id"])] += len(row["response_ids"])
    lines = [
        f"Training data mix of `{args.folder}` (prompt sources `{spec}`; target {settings['target']}, greedy, up to "
        f"{settings['max_new_tokens']} new tokens, {settings['dtype']}); `python benchmarks/data_mix.py {args.folder}`",
        "",
        "| source | prompts | share | answered | answer tokens | mean answer | distinct-1 | distinct-2 | distinct-3 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    total = sum(len(t) for t in texts.values())
    for source in sorted(texts):
        n = answered[source]
        mean = f"{tokens[source] / n:.0f}" if n else "-"
        ratios = " | ".join(f"{distinct_n(texts[source], k):.3f}" for k in (1, 2, 3))
        lines.append(
            f"| {source} | {len(texts[source])} | {len(texts[source]) / total:.1%} | {n} | {tokens[source]} | {mean} "
            f"| {ratios} |"
        )
    everything = [t for ts in texts.values() for t in ts]
    ratios = " | ".join(f"{distinct_n(everything, k):.3f}" for k in (1, 2, 3))
    n_all, t_all = sum(answered.values()), sum(tokens.values())
    lines.append(f"| all | {total} | 100% | {n_all} | {t_all} | {t_all / max(n_all, 1):.0f} | {ratios} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
