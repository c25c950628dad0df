"""Shared by the timing scripts in this folder: their common options, and printing a recorded table (appended to an
optional file)."""

from __future__ import annotations

import argparse


def emit(lines: list[str], output: str | None) -> None:
    """Prints `lines` as one markdown block and, when `output` names a file, appends it there (a blank line after)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if output:
        with open(output, "a", encoding="utf-8") as f:
            f.write(text + "\n")


def add_timing_arguments(parser: argparse.ArgumentParser, repeats: int = 25) -> None:
    """`--dtype`, `--threads`, `--repeats`, `--context` (cached tokens before each timed forward) and `--output`."""
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--context", type=int, default=256, help="cached tokens before each timed forward")
    parser.add_argument("--output", help="also write the table to this markdown file")


def layout_table(choices: dict, rows: tuple[int, ...]) -> list[str]:
    """Markdown lines: the layout `MatmulLayouts` chose (its `choices`) per weight shape (table rows, largest first)
    and row count (columns, `rows`)."""
    shapes = sorted({(key[0], key[3]) for key in choices}, key=lambda item: (-item[0][0] * item[0][1], item[1]))
    lines = ["", "Matmul layouts chosen (`MatmulLayouts`: another than `x W^T` where it was at least 10% faster):", ""]
    lines += ["| weight (out x in) | " + " | ".join(f"{q} rows" for q in rows) + " |", "|---|" + "---|" * len(rows)]
    for shape, bias in shapes:
        cells = [next((v for k, v in choices.items() if (k[0], k[1], k[3]) == (shape, q, bias)), "") for q in rows]
        name = f"{shape[0]} x {shape[1]}" + (" + bias" if bias else "")
        lines.append(f"| {name} | " + " | ".join(f"`{c}`" if c else "" for c in cells) + " |")
    return lines


def load_target_and_drafter(args: argparse.Namespace):
    """`(target, drafter, dtype)`: SmolLM2-135M-Instruct and `args.drafter` on the CPU in `args.dtype`, the drafter
    on the target's weights, torch at `args.threads` threads (the row-cost probes)."""
    import torch

    from d3d_hf.drafters import load_drafter
    from d3d_hf.targets import load_target

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target, _ = load_target("smollm2-135m-instruct", dtype=args.dtype, device="cpu")
    drafter = load_drafter(args.drafter, dtype=dtype)
    drafter.attach_target_weights(target)
    return target, drafter, dtype


def median_ms(variants: list, measure, repeats: int, warm_up: int) -> dict:
    """`{variant: median milliseconds}` of `measure(variant)` (seconds): every variant once per repeat, in an order
    shuffled per repeat (seeded), the first `warm_up` repeats not kept (matmul layouts are chosen on first sight of a
    row count)."""
    import random
    import statistics

    times = {v: [] for v in variants}
    rng = random.Random(0)
    for repeat in range(repeats + warm_up):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            seconds = measure(v)
            if repeat >= warm_up:
                times[v].append(seconds)
    return {v: 1e3 * statistics.median(t) for v, t in times.items()}


def cache_view(cache, num_layers: int | None = None):
    """A `D3DCache` over the first `num_layers` layers of a target's `DynamicCache` (its tensors, not copied), as a
    drafter on the target's cache reads it."""
    from d3d_hf.modeling.drafting_d3d import D3DCache

    view = D3DCache()
    for layer in cache.layers[:num_layers]:
        view.key_cache.append(layer.keys)
        view.value_cache.append(layer.values)
    return view
