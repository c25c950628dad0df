"""What a fused successor block costs: the target's verification forward with `e` drafter block rows added
(`successor_d3d`, issue 26), against the same forward without them, and against the draft pass it replaces.

Per row count: the target's forward over `q` verified rows (one committed token + `q - 1` candidates) plus `e`
block rows (mask embedding and block adapters on them: `block_rows_on_target`, which runs the target's projections
on the drafter's fused `[W; A]` weights), the same `q + e` rows as plain target rows (what making them block rows
costs), and the drafter's synchronous draft pass of one
committed token and `m` masks on the target's cache (what a hit saves). One process, variants interleaved per repeat
in a shuffled order, the target's copy-free GQA attention on as in D3D's loop; medians in milliseconds. Run it alone:

    python benchmarks/fused_rows_cost.py --dtype float32 --threads 2 [--repeats 15] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import add_timing_arguments, cache_view, emit, load_target_and_drafter, median_ms
from d3d_hf.modeling.calibration_d3d import cpu_model
from d3d_hf.modeling.patches_d3d import apply_fast_paths, block_rows_on_target
from transformers import DynamicCache

VERIFIED = (1, 4)
BLOCK_ROWS = (0, 4, 8, 12, 16, 24, 32)
MASKS = (3, 4, 7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, repeats=15)
    parser.add_argument("--drafter", default="d3d-smollm2-135m-instruct", help="shipped name or folder")
    args = parser.parse_args()
    target, drafter, dtype = load_target_and_drafter(args)
    context = torch.randint(3, 1000, (1, args.context), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=context, cache=cache, use_cache=True)

    def forward(rows: int, block_rows: int, as_blocks: bool) -> float:
        n = rows + block_rows
        ids = torch.randint(3, 1000, (1, n))
        mask = torch.zeros(1, 1, n, args.context + n, dtype=dtype)
        positions = torch.arange(args.context, args.context + n)[None]
        start = time.perf_counter()
        with torch.no_grad():
            if as_blocks and block_rows:
                with block_rows_on_target(target, drafter, rows):
                    target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            else:
                target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        seconds = time.perf_counter() - start
        cache.crop(-n)
        return seconds

    def draft_pass(masks: int) -> float:
        view = cache_view(cache)
        committed = torch.randint(3, 1000, (1, 1))
        start = time.perf_counter()
        drafter.draft_logits(committed, view, num_masks=masks)
        return time.perf_counter() - start

    variants = [("verify", q, e, True) for q in VERIFIED for e in BLOCK_ROWS]
    variants += [("plain", q, e, False) for q in VERIFIED for e in BLOCK_ROWS if e]
    variants += [("pass", m, 0, False) for m in MASKS]

    def measure(v) -> float:
        return draft_pass(v[1]) if v[0] == "pass" else forward(v[1], v[2], v[3])

    with apply_fast_paths(drafter, target):  # the drafter's and the target's, as in `generate`
        ms = median_ms(variants, measure, args.repeats, warm_up=3)
    lines = [
        f"Fused block rows: {cpu_model()}, {args.dtype}, {args.threads} threads, {args.context} cached tokens, "
        f"median of {args.repeats} (ms)",
        "",
        "| verified rows | " + " | ".join(f"+{e} block rows" for e in BLOCK_ROWS) + " | ms per block row (+16) |",
        "|---|" + "---|" * (len(BLOCK_ROWS) + 1),
    ]
    for q in VERIFIED:
        cells = [f"{ms[('verify', q, e, True)]:.1f}" for e in BLOCK_ROWS]
        per_row = (ms[("verify", q, 16, True)] - ms[("verify", q, 0, True)]) / 16
        lines.append(f"| {q} | " + " | ".join(cells) + f" | {per_row:.2f} |")
    lines += ["", "The same rows as plain target rows (the difference is what making them block rows costs):", ""]
    lines += ["| verified rows | " + " | ".join(f"+{e}" for e in BLOCK_ROWS if e) + " |", "|---|" + "---|" * 6]
    for q in VERIFIED:
        lines.append(f"| {q} | " + " | ".join(f"{ms[('plain', q, e, False)]:.1f}" for e in BLOCK_ROWS if e) + " |")
    lines += ["", "The draft pass a hit replaces (1 committed token + m masks, on the target's cache):", ""]
    lines += ["| masks | " + " | ".join(str(m) for m in MASKS) + " |", "|---|" + "---|" * len(MASKS)]
    lines.append("| ms | " + " | ".join(f"{ms[('pass', m, 0, False)]:.1f}" for m in MASKS) + " |")
    emit(lines, args.output)


if __name__ == "__main__":
    main()
