"""Times packed successor-drafting attention on a GPU: the Triton kernel against the PyTorch references.

For every prefix length and packed shape (block size x hypotheses) it times, with CUDA events after warm-up and with
the L2 cache flushed before each call (a drafter layer reads its own, cold KV cache):

- `naive`: `packed_attention(backend="naive")`: dense mask built from the metadata, key/value heads repeated, SDPA;
- `sdpa`: SDPA with the dense mask built beforehand and `enable_gqa=True` (what a model would do: one mask per
  forward, shared by all layers), the strongest plain-PyTorch baseline;
- `triton`: `packed_attention(backend="triton")` with its default tiles and prefix splits;
- `triton_1split`: the same kernel with the prefix never split (`num_splits=1`).

It checks the Triton output against the naive backend (max absolute error) and both against a float32 reference
(relative error), and writes `packed_attention.json` and `packed_attention.md` into the output folder.

    python benchmarks/gpu/bench_packed_attention.py OUTPUT_DIR [--prefix-lengths 2048,4096,8192] [--overwrite]

The kernels are imported from this checkout (no install needed; `d3d_hf`'s own `__init__`, which patches
transformers' `generate`, is not run). `--cpu-smoke` runs tiny shapes under Triton's CPU interpreter to check the
script itself; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("naive", "sdpa", "triton", "triton_1split")
# (block size, hypotheses): packed lengths T = (block - 1) + hypotheses * block from 63 to 1023.
DEFAULT_SHAPES = "16:3,16:7,16:15,16:31,16:63,32:1,32:3,32:7,32:15,32:31"


def import_from_checkout() -> tuple[types.ModuleType, types.ModuleType]:
    """`(d3d_hf.kernels, d3d_hf.modeling.drafting_d3d)` from this checkout (`src/d3d_hf/kernels/`, `modeling/`)."""
    package = types.ModuleType("d3d_hf")
    package.__path__ = [str(ROOT / "src" / "d3d_hf")]
    sys.modules["d3d_hf"] = package
    for name, folder in (("modeling", ROOT / "modeling"), ("kernels", ROOT / "src" / "d3d_hf" / "kernels")):
        spec = importlib.util.spec_from_file_location(
            f"d3d_hf.{name}", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(package, name, module)
    return sys.modules["d3d_hf.kernels"], sys.modules["d3d_hf.modeling.drafting_d3d"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="folder for packed_attention.json and packed_attention.md")
    parser.add_argument("--prefix-lengths", default="2048,4096,8192", help="cached prefix lengths P, comma-separated")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="BLOCK:HYPOTHESES pairs, comma-separated")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50, help="timed calls per method (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace existing result files")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1 (checks the script only)"
    )
    return parser.parse_args(argv)


def packed_shape(shape: str) -> tuple[int, int]:
    block, hypotheses = (int(x) for x in shape.split(":"))
    if block < 1 or not 1 <= hypotheses <= block:
        raise SystemExit(f"error: bad shape {shape!r}: need BLOCK >= 1 and 1 <= HYPOTHESES <= BLOCK")
    return block, hypotheses


def make_timer(device: torch.device, warmup: int, iters: int):
    """`time(fn) -> (median ms, min ms)`: CUDA events around each call, L2 flushed before each (not timed)."""
    if device.type != "cuda":

        def time_cpu(fn):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times), min(times)

        return time_cpu
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)  # larger than the H200's 60 MB of L2

    def time_cuda(fn):
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize(device)
        for start, end in zip(starts, ends, strict=True):
            flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
        return statistics.median(times), min(times)

    return time_cuda


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def environment(device: torch.device) -> dict:
    import triton

    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_smoke": device.type != "cuda",
    }
    if device.type == "cuda":
        info["multiprocessors"] = torch.cuda.get_device_properties(device).multi_processor_count
    return info


def markdown(result: dict) -> str:
    env, config = result["environment"], result["config"]
    lines = [
        f"Packed attention, {config['dtype']}, batch {config['batch_size']}, {config['heads']} query / "
        f"{config['kv_heads']} key-value heads, head_dim {config['head_dim']}; {env['device']}, torch {env['torch']}, "
        f"triton {env['triton']}. Median of {config['iters']} calls after {config['warmup']} warm-up calls, L2 "
        "flushed before each; times in ms. `naive`: dense mask from the metadata + repeated KV heads + SDPA; `sdpa`: "
        "SDPA with a prebuilt mask and enable_gqa; `triton`: default prefix splits (count in `splits`). Errors: "
        "max |triton - naive|, and relative (Frobenius) error against a float32 reference.",
        "",
        "| P | block | hyps | T | naive | sdpa | triton | splits | triton 1 split | vs naive | vs sdpa | "
        "max abs err vs naive | rel err triton | rel err naive |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        ms = row["median_ms"]
        lines.append(
            f"| {row['prefix_length']} | {row['block_size']} | {row['hypotheses']} | {row['packed_length']} | "
            f"{ms['naive']:.3f} | {ms['sdpa']:.3f} | {ms['triton']:.3f} | {row['splits']} | "
            f"{ms['triton_1split']:.3f} | {ms['naive'] / ms['triton']:.2f}x | {ms['sdpa'] / ms['triton']:.2f}x | "
            f"{row['max_abs_err_vs_naive']:.2e}{'' if row['ok'] else ' (FAILED)'} | "
            f"{row['rel_err_triton_vs_fp32']:.2e} | {row['rel_err_naive_vs_fp32']:.2e} |"
        )
    return "\n".join(lines) + "\n"


def bench_shape(args, kernels, drafting, timer, gen, device, dtype, prefix_length, block, hypotheses) -> dict:
    """Times and checks one (prefix length, block size, hypotheses) shape; returns its result row."""
    # The chain is the block - 1 drafts being verified; hypothesis m assumes m of them are accepted.
    chain = block - 1
    meta = drafting.packed_metadata(chain, list(range(chain, chain - hypotheses, -1)), block, device=device)
    tokens = meta[0].shape[0]
    shape_q = (args.batch_size, args.heads, tokens, args.head_dim)
    shape_kv = (args.batch_size, args.kv_heads, prefix_length + tokens, args.head_dim)
    q = torch.randn(shape_q, generator=gen, device=device, dtype=dtype)
    k = torch.randn(shape_kv, generator=gen, device=device, dtype=dtype)
    v = torch.randn(shape_kv, generator=gen, device=device, dtype=dtype)
    mask = drafting.packed_attention_mask(*meta, prefix_length)
    gqa = args.heads != args.kv_heads
    calls = {
        "naive": lambda: kernels.packed_attention(q, k, v, *meta, backend="naive"),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
        "triton": lambda: kernels.packed_attention(q, k, v, *meta, backend="triton"),
        "triton_1split": lambda: kernels.packed_attention_triton(q, k, v, *meta, num_splits=1),
    }
    outputs = {name: call() for name, call in calls.items()}
    reference = kernels.packed_attention_naive(q.float(), k.float(), v.float(), *meta)
    errors = {name: rel_err(out, reference) for name, out in outputs.items()}
    timings = {name: timer(call) for name, call in calls.items()}
    plan = importlib.import_module("d3d_hf.kernels._packed_attention_triton").launch_config(
        args.batch_size, args.heads, args.kv_heads, tokens, prefix_length, args.head_dim, device
    )
    return {
        "prefix_length": prefix_length,
        "block_size": block,
        "hypotheses": hypotheses,
        "packed_length": tokens,
        "median_ms": {name: t[0] for name, t in timings.items()},
        "min_ms": {name: t[1] for name, t in timings.items()},
        "splits": plan["num_splits"],
        "launch_config": plan,
        "max_abs_err_vs_naive": (outputs["triton"].float() - outputs["naive"].float()).abs().max().item(),
        "rel_err_vs_fp32": errors,
        "rel_err_triton_vs_fp32": errors["triton"],
        "rel_err_naive_vs_fp32": errors["naive"],
        # Triton within a few times the naive backend's own rounding error (float32: within 1e-3).
        "ok": max(errors["triton"], errors["triton_1split"]) <= 4 * errors["naive"] + 1e-3,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first defined
        device = torch.device("cpu")
        args.prefix_lengths, args.shapes = "0,40", "4:1,4:3"
        args.heads, args.kv_heads, args.head_dim, args.warmup, args.iters = 4, 2, 64, 1, 2
    elif not torch.cuda.is_available():
        raise SystemExit(
            "error: no CUDA device (torch.cuda.is_available() is False): this benchmark times GPU kernels. Run it on "
            "a GPU machine (benchmarks/gpu/README.md), or pass --cpu-smoke to check the script under Triton's "
            "interpreter."
        )
    else:
        device = torch.device("cuda")
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("error: Triton is not installed (pip install triton, or the project's [kernels] extra).")
    json_path, md_path = args.output / "packed_attention.json", args.output / "packed_attention.md"
    if not args.overwrite and (json_path.exists() or md_path.exists()):
        raise SystemExit(f"error: {json_path} or {md_path} exists; pass --overwrite to replace them.")

    kernels, drafting = import_from_checkout()
    dtype = getattr(torch, args.dtype)
    timer = make_timer(device, args.warmup, args.iters)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    rows = []
    for prefix_length in (int(p) for p in args.prefix_lengths.split(",")):
        for block, hypotheses in (packed_shape(s) for s in args.shapes.split(",")):
            row = bench_shape(args, kernels, drafting, timer, gen, device, dtype, prefix_length, block, hypotheses)
            rows.append(row)
            ms = row["median_ms"]
            print(
                f"P={prefix_length:5d} block={block:2d} hyps={hypotheses:2d} T={row['packed_length']:4d}: naive "
                f"{ms['naive']:.3f} sdpa {ms['sdpa']:.3f} triton {ms['triton']:.3f} ({row['splits']} splits) "
                f"1-split {ms['triton_1split']:.3f} ms; max abs err {row['max_abs_err_vs_naive']:.2e}"
                + ("" if row["ok"] else "  ACCURACY CHECK FAILED"),
                flush=True,
            )
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"environment": environment(device), "config": config, "rows": rows}
    args.output.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown(result))
    print(f"wrote {json_path} and {md_path}")
    failed = [row for row in rows if not row["ok"]]
    if failed:
        raise SystemExit(f"error: the Triton kernel failed the accuracy check on {len(failed)} shape(s); see {md_path}")


if __name__ == "__main__":
    main()
