"""What the target's verification forward costs under `d3d_target_matmul_layouts` (opt-in): SmolLM2-135M-Instruct's
forward over q new rows (256 cached tokens) with `nn.Linear` as shipped, and inside
`d3d_hf.experiments.target_matmul_layouts` (every plain `nn.Linear` of the model, the LM head included, on
`MatmulLayouts` for 2-32 rows), with how often the two agree on the argmax of random rows.

One process, the two variants interleaved in a shuffled order per repeat, medians. Run it alone on the machine:

    python benchmarks/target_matmul_layouts.py --dtype float32 --threads 2 [--repeats 25] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch
from _common import add_timing_arguments, emit, layout_table
from d3d_hf.modeling.calibration_d3d import cpu_model
from d3d_hf.modeling.fast_paths_d3d import MATMUL_LAYOUTS
from transformers import DynamicCache

from d3d_hf.experiments import target_matmul_layouts
from d3d_hf.targets import load_target

ROWS = (1, 2, 4, 8, 16)
WARMUP = 10  # untimed rounds: the layouts of each row count are chosen in the first 8 forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, _ = load_target("smollm2-135m-instruct", dtype=args.dtype)

    variants = ("nn.Linear", "MatmulLayouts")
    times = {(v, q): [] for v in variants for q in ROWS}
    agree = {q: [] for q in ROWS}
    identical = {q: [] for q in ROWS}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=torch.randint(0, 49152, (1, args.context), generator=g), cache=cache, use_cache=True)
        for rep in range(args.repeats + WARMUP):
            for q in ROWS:
                rows = torch.randint(0, 49152, (1, q), generator=g)
                logits = {}
                for variant in random.Random(rep * 100 + q).sample(variants, len(variants)):
                    routed = target_matmul_layouts(target) if variant == "MatmulLayouts" else contextlib.nullcontext()
                    with routed:
                        start = time.perf_counter()
                        logits[variant] = target(input_ids=rows, cache=cache, use_cache=True).logits
                        elapsed = time.perf_counter() - start
                    cache.crop(-q)
                    if rep >= WARMUP:
                        times[(variant, q)].append(elapsed)
                same = (logits["nn.Linear"].argmax(-1) == logits["MatmulLayouts"].argmax(-1)).float().mean()
                agree[q].append(float(same))
                identical[q].append(float(torch.equal(logits["nn.Linear"], logits["MatmulLayouts"])))
    cpu = cpu_model()
    lines = [
        f"SmolLM2-135M-Instruct forward over q new rows, {args.dtype}, {args.threads} threads, {args.context} cached "
        f"tokens, median of {args.repeats}; CPU {cpu.get('model')} "
        f"({', '.join(k for k, v in cpu.items() if v is True)}). Command: `python benchmarks/target_matmul_layouts.py "
        f"--dtype {args.dtype} --threads {args.threads} --repeats {args.repeats}`",
        "",
        "| rows | `nn.Linear` ms | `MatmulLayouts` ms | ratio | same argmax (random rows) | bit-identical logits |",
        "|---|---|---|---|---|---|",
    ]
    for q in ROWS:
        plain, tuned = (statistics.median(times[(v, q)]) for v in variants)
        lines.append(
            f"| {q} | {1e3 * plain:.1f} | {1e3 * tuned:.1f} | {tuned / plain:.2f}x | "
            f"{100 * statistics.mean(agree[q]):.1f}% | {100 * statistics.mean(identical[q]):.0f}% of forwards |"
        )
    lines += layout_table(MATMUL_LAYOUTS.choices, ROWS)
    emit(lines, args.output)


if __name__ == "__main__":
    main()
