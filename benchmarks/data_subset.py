"""Rows of one kind from a `d3d-hf data` folder, for training on them alone or measuring tau on their prompts.

Picks, in shard order (the order `d3d-hf train` reads), the rows whose prompt id starts with one of `--sources`
(`magpie/` for the requests the target wrote itself, `math` for both math templates) or, with `--exclude`, every
other row; from row `--offset` on; the first `--rows` of them. Writes one JSON object a line:

- `--what train`: `{id, prompt_ids, response_ids}`, the rows `d3d-hf train --data FILE.jsonl` reads as they are;
- `--what prompts`: `{id, messages}` without the answer, a prompt set `compare_tau.py --prompts FILE.jsonl` reads.

    python benchmarks/data_subset.py data/smollm2-135m-instruct/answers --sources magpie/ --rows 504 \\
        --output runs/subsets/magpie-504.jsonl
    python benchmarks/data_subset.py data/smollm2-135m-instruct/answers --sources magpie/ --offset 21056 \\
        --rows 20 --what prompts --output runs/subsets/heldout-magpie.jsonl

Refuses to overwrite `--output`, and refuses when fewer rows than `--rows` match (the message says how many did).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from d3d_hf.data import load_generated_rows


def select_rows(
    rows: list[dict], sources: list[str], *, rows_wanted: int, offset: int = 0, exclude: bool = False
) -> list[dict]:
    """The first `rows_wanted` rows from index `offset` whose `id` starts with one of `sources` (none of them when
    `exclude`), in their order.

    Raises:
        ValueError: if fewer than `rows_wanted` rows match.
    """
    picked = [row for row in rows[offset:] if str(row["id"]).startswith(tuple(sources)) != exclude][:rows_wanted]
    if len(picked) < rows_wanted:
        raise ValueError(
            f"only {len(picked)} rows from row {offset} on {'lack' if exclude else 'have'} an id starting with "
            f"{sources}: ask for --rows {len(picked)} or fewer, or a lower --offset."
        )
    return picked


def to_json(row: dict, what: str) -> dict:
    """A training row (`prompt_ids`, `response_ids`) or a prompt (`messages` before the answer) as plain JSON."""
    if what == "train":
        return {
            "id": row["id"],
            "prompt_ids": [int(i) for i in row["prompt_ids"]],
            "response_ids": [int(i) for i in row["response_ids"]],
        }
    return {"id": row["id"], "messages": [m for m in row["messages"] if m["role"] != "assistant"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a `d3d-hf data` folder")
    parser.add_argument("--sources", nargs="+", required=True, help="prompt id prefixes, e.g. magpie/ or math")
    parser.add_argument("--exclude", action="store_true", help="keep the rows matching none of --sources")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--offset", type=int, default=0, help="skip the rows before this index (shard order)")
    parser.add_argument("--what", choices=("train", "prompts"), default="train")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    output = Path(args.output)
    if output.exists():
        parser.error(f"{output} exists: pass another --output or remove it first")
    rows = load_generated_rows(args.data)
    try:
        picked = select_rows(rows, args.sources, rows_wanted=args.rows, offset=args.offset, exclude=args.exclude)
    except ValueError as error:
        parser.error(str(error))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(json.dumps(to_json(row, args.what)) + "\n" for row in picked))
    print(f"{len(picked)} rows -> {output}")


if __name__ == "__main__":
    main()
