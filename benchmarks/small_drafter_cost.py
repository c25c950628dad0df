"""What a standalone drafter's draft pass costs by depth and LM-head size, in one-row target steps (issue 37).

For each depth L (layers copied from SmolLM2-135M-Instruct, spread evenly over its 30) and each head (the full 49,152
ids, or a draft vocabulary of N ids: FR-Spec, arXiv 2502.14856), the draft pass over `q` new rows (the committed
token(s) plus masks: 1 + 0, 1 + 7, 1 + 15) on a cache of `--context` committed tokens, against the target's one-row
forward and its 16-row verification on a cache of the same length. Untrained drafters: cost does not depend on the
weights. The draft vocabulary here is the N most frequent ids of the committed answers under `--data` (any N ids
cost the same). `--drafters` adds trained drafters (shipped names or folders) at their own depth and head, timed the
same way (the plain path, without `apply_fast_paths`; a drafter sharing its target's weights gets them attached), so
that a trained drafter's row reads against the untrained ones and the target.

One process; the variants interleaved per repeat in a shuffled order (`_common.median_ms`), medians. Run it alone:

    python benchmarks/small_drafter_cost.py --dtype bfloat16 --threads 2 --layers 2,4,6,8,30 --vocab 0,8192 \
        [--drafters d3d-smollm2-135m-instruct runs/small4-v8k] [--repeats 15] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _common import add_timing_arguments, emit, median_ms
from d3d_hf.modeling.calibration_d3d import cpu_model
from d3d_hf.modeling.drafting_d3d import timing_state

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.costmodel import _prefilled_drafter_cache, _random_ids
from d3d_hf.drafters import draft_vocabulary, load_drafter
from d3d_hf.targets import load_target


def _spread(num_layers: int, total: int) -> list[int]:
    """`num_layers` indices spread evenly over `0..total-1`, first and last included."""
    if num_layers == 1:
        return [0]
    return sorted({round(i * (total - 1) / (num_layers - 1)) for i in range(num_layers)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, repeats=15)
    parser.add_argument("--layers", default="2,4,6,8,30", help="drafter depths, comma-separated")
    parser.add_argument("--vocab", default="0,8192", help="LM-head sizes (0 = the full vocabulary), comma-separated")
    parser.add_argument("--data", default="data/smollm2-135m-instruct/answers", help="answers for the draft vocabulary")
    parser.add_argument("--drafters", nargs="*", default=[], help="trained drafters too: shipped names or folders")
    parser.add_argument("--json", help="also write the medians here: {row label: {head rows, ms and steps by rows}}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target("smollm2-135m-instruct", dtype=args.dtype, device="cpu")
    total = target.config.num_hidden_layers
    vocab = target.config.vocab_size
    try:
        from d3d_hf.data import load_generated_rows

        rows = [r["response_ids"] for r in load_generated_rows(args.data)]
    except FileNotFoundError:
        rows = []
    g = torch.Generator().manual_seed(0)
    tcache = target(_random_ids(vocab, args.context, g, target.device), use_cache=True).cache
    one, sixteen = _random_ids(vocab, 1, g, target.device), _random_ids(vocab, 16, g, target.device)

    def target_forward(ids) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            target(input_ids=ids, cache=tcache, use_cache=True)
        seconds = time.perf_counter() - start
        tcache.crop(-(tcache.get_seq_length() - args.context))  # transformers' caches crop by tokens to remove
        return seconds

    variants = {"target 1 row": lambda: target_forward(one), "target 16 rows": lambda: target_forward(sixteen)}
    drafters = {}  # (row label, head rows) -> drafter
    for layers in (int(x) for x in args.layers.split(",") if x):  # "" = trained drafters only
        for size in (int(x) for x in args.vocab.split(",")):
            ids = draft_vocabulary(rows, size, vocab, always=[2]) if size else None
            drafters[(str(layers), size or vocab)] = D3DForDiffusionDrafting.from_autoregressive(
                target, layer_ids=_spread(layers, total), block_size=16, draft_vocab_ids=ids
            ).to(target.dtype)
    for name in args.drafters:
        drafter = load_drafter(name, dtype=args.dtype)
        head = drafter.config.draft_vocab_size or vocab
        drafters[(f"{name} ({drafter.config.num_hidden_layers}, trained)", head)] = drafter
    for key, drafter in drafters.items():
        cache = _prefilled_drafter_cache(drafter, args.context, 16, g, target)  # attaches a weight-sharing one
        committed = _random_ids(vocab, 1, g, target.device)
        for masks in (0, 7, 15):

            def draft(drafter=drafter, cache=cache, committed=committed, masks=masks) -> float:
                start = time.perf_counter()
                with torch.no_grad():
                    drafter.draft_logits(committed, cache, num_masks=masks, **timing_state(drafter))
                seconds = time.perf_counter() - start
                cache.crop(args.context)
                return seconds

            variants[(*key, 1 + masks)] = draft
    ms = median_ms(list(variants), lambda name: variants[name](), args.repeats, warm_up=3)
    step = ms["target 1 row"]
    lines = [
        "Draft pass of a standalone drafter by depth and LM-head rows, in one-row target steps; "
        f"SmolLM2-135M-Instruct, {args.dtype}, {args.threads} threads, cache {args.context} tokens; "
        f"CPU: {cpu_model()}; "
        f"`python benchmarks/small_drafter_cost.py --dtype {args.dtype} --threads {args.threads} --layers "
        f"{args.layers or repr('')} --vocab {args.vocab} --repeats {args.repeats}"
        f"{' --drafters ' + ' '.join(args.drafters) if args.drafters else ''}`",
        "",
        f"Target: one row {step:.1f} ms, 16 rows {ms['target 16 rows']:.1f} ms "
        f"({ms['target 16 rows'] / step:.2f} steps).",
        "",
        "| layers | head rows | 1 row: ms (steps) | 8 rows | 16 rows |",
        "|---|---|---|---|---|",
    ]
    for layers, size in dict.fromkeys(k[:2] for k in ms if isinstance(k, tuple)):
        cells = [f"{ms[(layers, size, q)]:.1f} ({ms[(layers, size, q)] / step:.2f})" for q in (1, 8, 16)]
        lines.append(f"| {layers} | {size} | " + " | ".join(cells) + " |")
    emit(lines, args.output)
    if args.json:
        table = {
            label: {"head_rows": size, "ms": {q: ms[(label, size, q)] for q in (1, 8, 16)},
                    "steps": {q: ms[(label, size, q)] / step for q in (1, 8, 16)}}
            for label, size in dict.fromkeys(k[:2] for k in ms if isinstance(k, tuple))
        }  # fmt: skip
        record = {"command": lines[0].rsplit("`", 2)[1], "cpu": cpu_model(), "dtype": args.dtype,
                  "threads": args.threads, "target_ms": {"1": step, "16": ms["target 16 rows"]},
                  "drafters": table}  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
