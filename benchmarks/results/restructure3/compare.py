"""Compares two `d3d-hf bench` results field by field, per method and prompt (issue 36: behaviour unchanged).

    python benchmarks/results/restructure3/compare.py benchmarks/results/restructure3/before.json \
        benchmarks/results/restructure3/after.json
"""

import json
import sys

FIELDS = ("new_tokens", "rounds", "tau", "matches_target", "output_ids", "acceptance_lengths", "drafted_tokens",
          "hits", "packed_rounds", "round_sources", "round_candidates")  # fmt: skip


def main() -> None:
    before, after = (json.load(open(path)) for path in sys.argv[1:3])
    runs = differing = 0
    for method, rows in before["runs"].items():
        for old, new in zip(rows, after["runs"][method], strict=True):
            runs += 1
            diffs = [f for f in FIELDS if old.get(f) != new.get(f)]
            differing += len(diffs)
            if diffs:
                print(f"{method} {old['prompt_id']}: {diffs}")
    print(f"{differing} differing fields over {runs} runs ({', '.join(FIELDS)})")


if __name__ == "__main__":
    main()
