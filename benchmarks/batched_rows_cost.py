"""What a batched round costs (issue 28): the target's forward over a batch of `b` sequences with `w` new rows each,
and the drafter's pass over the batch, against what the single-sequence cost curves say at the same total rows
(`b x w`, what the batched policy read before it learned batched timings).

One process; the batch's caches hold `--context` committed tokens per sequence (`RaggedSlots`, the masks and
positions of D3D's batched loop); variants interleaved per repeat in a shuffled order; the target's copy-free GQA
attention on as in D3D's loop; medians in milliseconds. Run it alone:

    python benchmarks/batched_rows_cost.py --dtype bfloat16 --threads 2 [--repeats 9] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import add_timing_arguments, cache_view, emit, load_target_and_drafter, median_ms
from d3d_hf.modeling.batched_decoding_d3d import RaggedSlots
from d3d_hf.modeling.calibration_d3d import cpu_model
from d3d_hf.modeling.fast_paths_d3d import GQA_SDPA
from d3d_hf.modeling.patches_d3d import apply_fast_paths, target_gqa_attention
from transformers import DynamicCache

BATCHES = (1, 4, 8)
WIDTHS = (1, 2, 3, 5, 8, 12, 16)
MASKS = (3, 7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser, repeats=9)
    parser.add_argument("--drafter", default="d3d-smollm2-135m-instruct", help="shipped name or folder")
    args = parser.parse_args()
    target, drafter, dtype = load_target_and_drafter(args)
    generator = torch.Generator().manual_seed(0)
    caches, slots = {}, {}
    with target_gqa_attention(target), torch.no_grad():
        for b in BATCHES:
            caches[b] = DynamicCache(config=target.config)
            slots[b] = RaggedSlots(b, torch.device("cpu"))
            allowed, positions, _ = slots[b].inputs([args.context] * b, args.context)
            target(
                input_ids=torch.randint(3, 1000, (b, args.context), generator=generator),
                attention_mask=_mask(allowed, target, dtype),
                position_ids=positions,
                cache=caches[b],
                use_cache=True,
            )
            slots[b].append([args.context] * b, args.context, [args.context] * b)

    def verify(b: int, w: int) -> float:
        allowed, positions, _ = slots[b].inputs([w] * b, w)
        ids = torch.randint(3, 1000, (b, w))
        mask = _mask(allowed, target, dtype)
        start = time.perf_counter()
        with torch.no_grad():
            target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=caches[b], use_cache=True)
        seconds = time.perf_counter() - start
        caches[b].crop(-w)
        return seconds

    def draft(b: int, masks: int) -> float:
        view = cache_view(caches[b], drafter.config.num_hidden_layers)
        allowed, positions, _ = slots[b].inputs([1 + masks] * b, 1 + masks, tail=masks)
        ids = torch.randint(3, 1000, (b, 1 + masks))
        masked = torch.zeros_like(ids, dtype=torch.bool)
        masked[:, 1:] = True
        start = time.perf_counter()
        with torch.no_grad():
            drafter(
                input_ids=ids,
                masked_positions=masked,
                attention_mask=allowed,
                position_ids=positions,
                past_key_values=view,
                use_cache=True,
                logits_to_keep=masks + 1,
            )
        return time.perf_counter() - start

    variants = [("verify", b, w) for b in BATCHES for w in WIDTHS]
    variants += [("single", 1, q) for q in sorted({b * w for b in BATCHES for w in WIDTHS} - set(WIDTHS))]
    variants += [("draft", b, m) for b in BATCHES for m in MASKS]

    def measure(v) -> float:
        return draft(v[1], v[2]) if v[0] == "draft" else verify(1 if v[0] == "single" else v[1], v[2])

    with apply_fast_paths(drafter, target):  # the drafter's and the target's, as in `generate`
        ms = median_ms(variants, measure, args.repeats, warm_up=2)

    def single(q: int) -> float:
        return ms[("verify", 1, q)] if ("verify", 1, q) in ms else ms[("single", 1, q)]

    lines = [
        f"Batched forwards: {cpu_model()}, {args.dtype}, {args.threads} threads, {args.context} cached tokens per "
        f"sequence, median of {args.repeats} (ms); in brackets what one sequence's forward of `b x w` rows costs",
        "",
        "| batch b | " + " | ".join(f"w={w}" for w in WIDTHS) + " |",
        "|---|" + "---|" * len(WIDTHS),
    ]
    for b in BATCHES:
        cells = [f"{ms[('verify', b, w)]:.1f} ({single(b * w):.1f})" for w in WIDTHS]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines += ["", "Draft pass over the batch (1 committed token + m masks per sequence, on the target's cache):", ""]
    lines += ["| batch b | " + " | ".join(f"m={m}" for m in MASKS) + " |", "|---|" + "---|" * len(MASKS)]
    for b in BATCHES:
        lines.append(f"| {b} | " + " | ".join(f"{ms[('draft', b, m)]:.1f}" for m in MASKS) + " |")
    emit(lines, args.output)


def _mask(allowed: torch.Tensor, target, dtype: torch.dtype) -> torch.Tensor:
    """The batched loop's attention mask: boolean for SDPA, additive otherwise (`BatchedRounds.verify`)."""
    if getattr(target.config, "_attn_implementation", None) in ("sdpa", GQA_SDPA):
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


if __name__ == "__main__":
    main()
