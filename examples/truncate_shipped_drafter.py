"""Lowers the block-adapter rank of the shipped drafter `d3d-smollm2-135m-instruct` (src/d3d_hf/pretrained/) by
truncated SVD (`d3d_hf.pruning.truncate_block_adapters`) and rewrites its weights, config and card in place.

    python examples/truncate_shipped_drafter.py --rank 4 --overwrite
    python examples/update_shipped_card.py benchmarks/results/engine/humaneval_float32/results.json ...

Why: the adapters are the part of a draft pass the target's own forward does not have; at rank 4 they hold ~1.7% of
a layer's weight bytes instead of ~9% at rank 32, and the held-out tau barely moves (benchmarks/results/rank/). The
card keeps its training record, notes the truncation, and drops the results measured before it (they describe
other weights): re-measure and add them with `examples/update_shipped_card.py`.
"""

import argparse
import json
from pathlib import Path

from d3d_hf.drafters import KNOWN_DRAFTERS, load_drafter
from d3d_hf.hub import load_card_data, write_model_card
from d3d_hf.pruning import truncate_block_adapters

NAME = "d3d-smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True, help="the new block-adapter rank")
    parser.add_argument("--overwrite", action="store_true", help="required: the shipped files are replaced")
    args = parser.parse_args()
    folder = Path(KNOWN_DRAFTERS[NAME])
    if not args.overwrite:
        raise SystemExit(f"This rewrites {folder} (weights, config, card); pass --overwrite to do it.")
    drafter = load_drafter(NAME)
    before = drafter.config.block_lora_rank
    if args.rank == before:
        raise SystemExit(f"The shipped drafter already has rank {before}.")
    kept = truncate_block_adapters(drafter, args.rank)
    card = load_card_data(folder)
    training = dict(card.training or {})
    training["adapter_rank"] = (
        f"trained at rank {before}, truncated to rank {args.rank} by truncated SVD "
        f"(d3d_hf.pruning.truncate_block_adapters: update energy kept {min(kept.values()):.2f}-"
        f"{max(kept.values()):.2f}, mean {sum(kept.values()) / len(kept):.2f}; examples/truncate_shipped_drafter.py)"
    )
    card.training, card.results = training, []
    drafter.card_data = card
    # save_pretrained writes the weights, config and card atomically (the remote-code bundle is not shipped here)
    drafter.save_pretrained(folder)
    for extra in folder.glob("*_d3d.py"):  # shipped without the bundle, as examples/ship_smollm2_drafter.py does
        extra.unlink()
    config = json.loads((folder / "config.json").read_text())
    config.pop("auto_map", None)
    config.pop("pruned_layer_ids", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_model_card(drafter, folder)
    print(f"{folder}: rank {before} -> {args.rank}; card results cleared (re-measure, then update_shipped_card.py)")


if __name__ == "__main__":
    main()
