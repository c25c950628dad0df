"""The two layouts `MatmulLayouts` chooses between (`nn.Linear`'s `x W^T` and `(W x^T)^T`), timed alone on the
weight shapes of the shipped drafter's draft pass (SmolLM2-135M: fused q/k/v, o, gate/up and down projections with
the rank-8 adapters' A rows, and the tied LM head), for the row counts of draft passes.

Each shape gets as many distinct random weights as the model has layers (one for the LM head), called in turn, so
that the weights come from memory as in a forward rather than from cache; layouts interleaved per repeat, medians.
Run it alone on the machine:

    python benchmarks/matmul_layouts.py --dtype float32 --threads 2 [--repeats 15] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import emit
from d3d_hf.modeling.calibration_d3d import cpu_model
from d3d_hf.modeling.fast_paths_d3d import MatmulLayouts

# (name, out_features, in_features, weights): SmolLM2-135M (hidden 576, 9 heads of 64, 3 kv heads, MLP 1536, 30
# layers, vocabulary 49152) with rank-8 block adapters, in the fused layout of `FusedProjections`
SHAPES = (
    ("q/k/v + 3 A", 576 + 2 * 192 + 3 * 8, 576, 30),
    ("o + A", 576 + 8, 576, 30),
    ("gate/up + 2 A", 2 * 1536 + 2 * 8, 576, 30),
    ("down + A", 576 + 8, 1536, 30),
    ("LM head", 49152, 576, 1),
)
ROWS = (2, 3, 4, 6, 8, 12, 16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", help="also write the table to this markdown file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    cpu = cpu_model()
    lines = [
        f"`x W^T` / `W x^T`, microseconds per call (median of {args.repeats}), {args.dtype}, {args.threads} threads; "
        f"CPU {cpu.get('model')} ({', '.join(k for k, v in cpu.items() if v is True)}), torch {torch.__version__}. "
        f"Command: `python benchmarks/matmul_layouts.py --dtype {args.dtype} --threads {args.threads} "
        f"--repeats {args.repeats}`",
        "",
        "| weight (out x in) | " + " | ".join(f"{q} rows" for q in ROWS) + " |",
        "|---|" + "---|" * len(ROWS),
    ]
    with torch.inference_mode():
        for name, out_features, in_features, count in SHAPES:
            weights = [torch.randn(out_features, in_features, generator=generator).to(dtype) for _ in range(count)]
            cells = []
            for q in ROWS:
                x = torch.randn(q, in_features, generator=generator).to(dtype)
                times = {layout: [] for layout in MatmulLayouts.LAYOUTS}
                for rep in range(args.repeats + 2):
                    for layout in MatmulLayouts.LAYOUTS:
                        start = time.perf_counter()
                        for weight in weights:
                            MatmulLayouts._run(layout, x, weight, None)
                        if rep >= 2:
                            times[layout].append((time.perf_counter() - start) / count)
                plain, swapped = (statistics.median(times[layout]) * 1e6 for layout in MatmulLayouts.LAYOUTS)
                cells.append(f"{plain:.0f} / {swapped:.0f}" + (" **" if swapped < 0.9 * plain else ""))
            lines.append(f"| {name} ({out_features} x {in_features}) | " + " | ".join(cells) + " |")
    lines += ["", "`**`: `W x^T` at least 10% faster."]
    emit(lines, args.output)


if __name__ == "__main__":
    main()
