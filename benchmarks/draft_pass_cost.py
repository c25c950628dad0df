"""A drafter's draft pass against the target's own forward over the same number of new rows (issue 14's "at most
1.05x" criterion): the default on CPU (fused projection weights, `D3DModel.fused_projections`, with matmul layouts
chosen by timing, `D3DModel.autotune_matmuls`), the fused weights with `nn.Linear`'s layout only, the block adapters
fused on the shared weights (`add_block_adapters`, autotuned), per projection (the training path, `nn.Linear`) and
removed (the drafter's bare layers, which are the target's, with `nn.Linear`).

One process, the variants interleaved per repeat in a shuffled order, so that drift of the machine and what the
previous forward left in the caches hit all of them alike; medians.
Run it alone on the machine:

    python benchmarks/draft_pass_cost.py --dtype float32 --threads 2 [--repeats 25] [--drafter NAME_OR_FOLDER]
        [--output FILE.md]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from contextlib import nullcontext

import d3d_hf.modeling.fast_paths_d3d as fast_paths
import torch
from _common import add_timing_arguments, emit, layout_table
from d3d_hf.modeling.calibration_d3d import cpu_model
from d3d_hf.modeling.patches_d3d import apply_fast_paths, target_gqa_attention

from d3d_hf.costmodel import _prefilled_drafter_cache
from d3d_hf.drafters import load_drafter
from d3d_hf.targets import load_target

ROWS = (1, 2, 4, 8, 16)
WARMUP = 10  # untimed rounds: the matmul layouts of each row count are chosen in the first 8 passes


HEADERS = {
    "fused projections": "drafter (default on CPU: fused projections, autotuned matmul layouts)",
    "untuned": "fused projections, `nn.Linear` layout",
    "fused adapters": "fused adapters on shared weights (autotuned)",
    "per-projection": "per-projection adapters",
    "no adapters": "no adapters (the target's layers)",
    "repeat-kv attention": "default, but transformers' SDPA attention (keys/values copied per query head)",
    "target gqa": "the target on copy-free GQA attention (`target_gqa_attention`, D3D's loop)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    parser.add_argument("--drafter", default="d3d-smollm2-135m-instruct", help="shipped name or folder")
    parser.add_argument(
        "--only-default",
        action="store_true",
        help="time the target and the default draft pass only (fewer variants between them: less cache interference)",
    )
    parser.add_argument(
        "--repeat-kv-attention",
        action="store_true",
        help="also time the default pass on transformers' SDPA function, which copies the keys/values per query head "
        "(the drafter's attention before `gqa_sdpa_attention_forward`)",
    )
    parser.add_argument(
        "--target-gqa-attention",
        action="store_true",
        help="also time the target's forward under `target_gqa_attention` (what D3D's own loop verifies on); "
        "ratios stay against the target's plain forward",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target("smollm2-135m-instruct", dtype=args.dtype)
    drafter = load_drafter(args.drafter, dtype=args.dtype)
    drafter.attach_target_weights(target)
    fused_rule = fast_paths._fused_adapters_apply
    variants = ("target", "fused projections", "untuned", "fused adapters", "per-projection", "no adapters")
    if args.only_default:
        variants = variants[:2]
    if args.repeat_kv_attention:
        variants = (*variants, "repeat-kv attention")
    if args.target_gqa_attention:
        variants = (*variants, "target gqa")
    times = {(v, q): [] for v in variants for q in ROWS}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(), apply_fast_paths(drafter):  # the drafter's fast paths, as in `generate`
        gqa_attention = drafter.config._attn_implementation
        cache = _prefilled_drafter_cache(drafter, args.context, 16, g, target)
        target_cache = target(torch.randint(0, 49152, (1, args.context), generator=g), use_cache=True).cache
        for rep in range(args.repeats + WARMUP):
            for q in ROWS:
                anchor = torch.randint(0, 49152, (1, 1), generator=g)
                rows = torch.randint(0, 49152, (1, q), generator=g)
                for variant in random.Random(rep * 100 + q).sample(variants, len(variants)):  # no fixed order
                    start = time.perf_counter()
                    if variant in ("target", "target gqa"):
                        with target_gqa_attention(target) if variant == "target gqa" else nullcontext():
                            target(input_ids=rows, cache=target_cache, use_cache=True)
                        elapsed = time.perf_counter() - start
                        target_cache.crop(-q)
                    else:
                        rank = drafter.config.block_lora_rank
                        default = variant in ("fused projections", "repeat-kv attention")
                        settings = drafter.model.fast_path_settings
                        settings._fused_projections = default or variant == "untuned"  # kept built
                        drafter.model.autotune_matmuls = default or variant == "fused adapters"
                        if variant == "repeat-kv attention":
                            drafter.config._attn_implementation = "sdpa"
                        if variant == "no adapters":
                            drafter.config.block_lora_rank = 0
                        elif variant == "per-projection":
                            fast_paths._fused_adapters_apply = lambda projections, rows: False
                        try:
                            drafter.draft_logits(anchor, cache, num_masks=q - 1)  # 1 committed token + q - 1 masks
                            elapsed = time.perf_counter() - start
                        finally:
                            drafter.config.block_lora_rank = rank
                            fast_paths._fused_adapters_apply = fused_rule
                            drafter.config._attn_implementation = gqa_attention
                        cache.crop(args.context)
                    if rep >= WARMUP:
                        times[(variant, q)].append(elapsed)
    cpu = cpu_model()
    lines = [
        f"Draft pass vs target forward, SmolLM2-135M-Instruct + {args.drafter} (block adapters of rank "
        f"{drafter.config.block_lora_rank}), {args.dtype}, {args.threads} threads, {args.context} cached tokens, "
        f"median of {args.repeats}; CPU {cpu.get('model')} ({', '.join(k for k, v in cpu.items() if v is True)}). "
        f"Command: `python benchmarks/draft_pass_cost.py --dtype {args.dtype} --threads {args.threads} "
        f"--repeats {args.repeats} --drafter {args.drafter}{' --only-default' if args.only_default else ''}"
        f"{' --repeat-kv-attention' if args.repeat_kv_attention else ''}"
        f"{' --target-gqa-attention' if args.target_gqa_attention else ''}`",
        "",
        "| rows | target ms | " + " | ".join(HEADERS[v] for v in variants[1:]) + " |",
        "|---|---|" + "---|" * (len(variants) - 1),
    ]
    for q in ROWS:
        base = statistics.median(times[("target", q)])
        cells = [f"{1e3 * base:.1f}"]
        for variant in variants[1:]:
            t = statistics.median(times[(variant, q)])
            cells.append(f"{1e3 * t:.1f} ({t / base:.2f}x)")
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    lines += layout_table(fast_paths.MATMUL_LAYOUTS.choices, ROWS)
    emit(lines, args.output)


if __name__ == "__main__":
    main()
