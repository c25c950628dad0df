"""Re-renders the model card of the shipped drafter with recorded benchmark results.

    python examples/update_shipped_card.py benchmarks/results/full_humaneval_float32_t1.json [more results.json ...]

Keeps the card's training data and recipe (`d3d_card_data.json`), replaces its measured results by those of the
given `d3d-hf bench` result files (method `d3d`), and rewrites `README.md` and `d3d_card_data.json` in
`src/d3d_hf/pretrained/d3d-smollm2-135m-instruct/` (the weights are not touched).
"""

import argparse
import json
from pathlib import Path

from d3d_hf.drafters import KNOWN_DRAFTERS, load_drafter
from d3d_hf.hub import load_card_data, result_from_benchmark, write_model_card

NAME = "d3d-smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="`d3d-hf bench` result JSON files")
    args = parser.parse_args()
    folder = Path(KNOWN_DRAFTERS[NAME])
    card = load_card_data(folder)
    card.results = [result_from_benchmark(json.loads(Path(p).read_text())) for p in args.results]
    drafter = load_drafter(NAME)
    drafter.card_data = card
    write_model_card(drafter, folder)
    print(f"rewrote {folder / 'README.md'} with {len(card.results)} results")


if __name__ == "__main__":
    main()
