"""Per-position draft accuracy of drafters on held-out answer rows: where in the block a drafter loses the target.

For each drafter and each sampled anchor `a` of rows `--offset .. --offset + --rows` of a `d3d-hf data` folder (rows
no drafter trained on: e.g. answered after its run started), one synchronous draft pass of a full block is run from
the committed prefix `x[:a+1]`, as D3D's loop runs it: over the drafter's own cache of the prefix, or for a drafter
over the target's cache (`shares_target_cache`) over the target's cache of `x[:a]` (and, for one that reads the
target's hidden state, the target's last hidden state at `a - 1`). Draft `d_k` (block row `k-1`) is
correct when it is the row's next token `x[a+k]`, which is the target's greedy choice (the rows are its greedy
answers). Prints and optionally writes, per drafter, the accuracy of `d_1 .. d_B-1` and the mean accepted prefix
(chain acceptance), float32:

    python benchmarks/draft_position_accuracy.py --drafters runs/small4-v8k-cpu runs/qo4-v8k-cpu \
        --data data/smollm2-135m-instruct/answers --offset 20096 --rows 32 --anchors 4 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random

import torch


def accuracies(drafter, target, rows, anchors_per_row: int, seed: int = 0) -> dict:
    """`{"accuracy": [acc of d_1, ...], "accepted": mean accepted prefix, "anchors": n}` over `rows` (dicts with
    `prompt_ids` and `response_ids`), `anchors_per_row` anchors drawn per row inside its response."""
    from d3d_hf.modeling import D3DCache

    block = drafter.config.block_size
    reads_target = bool(getattr(drafter.config, "shares_target_cache", False))
    reads_state = bool(getattr(drafter.config, "reads_target_hidden_state", False))
    state = {}
    layer_ids = list(drafter.config.source_layer_ids or range(drafter.config.num_hidden_layers))
    rng = random.Random(seed)
    correct = torch.zeros(block - 1)
    accepted, count = 0, 0
    for row in rows:
        ids = list(row["prompt_ids"]) + list(row["response_ids"])
        start = len(row["prompt_ids"]) - 1
        candidates = list(range(start, len(ids) - block))
        for anchor in sorted(rng.sample(candidates, min(anchors_per_row, len(candidates)))):
            prefix = torch.tensor([ids[:anchor]])
            cache = D3DCache()
            with torch.no_grad():
                if reads_target:
                    out = target.model(input_ids=prefix, use_cache=True)
                    for i in layer_ids:
                        cache.key_cache.append(out.past_key_values.layers[i].keys)
                        cache.value_cache.append(out.past_key_values.layers[i].values)
                    committed = torch.tensor([[ids[anchor]]])
                    if reads_state:  # the state whose scores chose the anchor, as the verification keeps it
                        state = {"anchor_hidden_state": out.last_hidden_state[:, -1]}
                else:
                    committed = torch.tensor([ids[: anchor + 1]])
                logits = drafter.draft_logits(committed, cache, num_masks=block - 1, **state)[0]
            drafts = logits[: block - 1].argmax(-1)
            truth = torch.tensor(ids[anchor + 1 : anchor + block])
            hits = drafts == truth
            correct += hits.float()
            accepted += int(hits.long().cumprod(0).sum())
            count += 1
    return {"accuracy": [round(float(c) / count, 4) for c in correct], "accepted": accepted / count, "anchors": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", nargs="+", required=True, help="shipped names or folders")
    parser.add_argument("--data", default="data/smollm2-135m-instruct/answers")
    parser.add_argument("--offset", type=int, required=True, help="first row (rows the drafters did not train on)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--anchors", type=int, default=4, help="anchors per row")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from d3d_hf.modeling.calibration_d3d import cpu_model

    from d3d_hf.drafters import load_drafter
    from d3d_hf.targets import load_target
    from d3d_hf.training.script import load_training_dataset

    dataset = load_training_dataset(args.data)
    if args.offset + args.rows > len(dataset):
        parser.error(f"the data holds {len(dataset)} rows: --offset + --rows must not exceed it")
    rows = [dataset[i] for i in range(args.offset, args.offset + args.rows)]
    target, _ = load_target("smollm2-135m-instruct", dtype="float32", device="cpu")
    results = {
        "cpu": cpu_model(),
        "command": "python benchmarks/draft_position_accuracy.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items() if v
        ),
    }
    for name in args.drafters:
        drafter = load_drafter(name, dtype="float32").eval()
        if drafter.config.shares_target_weights:
            drafter.attach_target_weights(target)
        found = accuracies(drafter, target, rows, args.anchors)
        results[name] = found
        shown = " ".join(f"{a:.2f}" for a in found["accuracy"][:6])
        accepted, anchors = found["accepted"], found["anchors"]
        print(f"{name}: d1..d6 accuracy {shown} ...; mean accepted {accepted:.2f} over {anchors} anchors")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
