"""d3d-async with a 1-thread vs a 2-thread packed-pass worker, interleaved prompt by prompt in one run.

This machine's speed drifts by up to ~1.5x between runs minutes apart (other tenants), so the two worker settings are
compared inside one `run_benchmark` call (each prompt runs target, d3d, d3d-async with 1 worker thread and with 2,
back to back) rather than across two `d3d-hf bench` runs. Writes
`benchmarks/results/async/worker_threads_<dtype>_h<H>.json` and prints the table.

    python benchmarks/async_worker_threads.py --dtype bfloat16 --hypotheses 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import GenerationConfig

from d3d_hf.bench import (
    METHODS,
    BenchMethod,
    d3d_round_stats,
    environment_info,
    format_table,
    register_method,
    run_benchmark,
)
from d3d_hf.drafters import load_drafter
from d3d_hf.prompts import load_prompts
from d3d_hf.targets import load_target

ROOT = Path(__file__).resolve().parents[1]


def _register(workers: int, hypotheses: int) -> str:
    name = f"d3d-async-w{workers}"

    def kwargs(resources):
        config = GenerationConfig(d3d_async=True, d3d_num_hypotheses=hypotheses, d3d_worker_threads=workers)
        return {"assistant_model": resources["drafter"], "generation_config": config}

    register_method(
        BenchMethod(
            name,
            f"d3d-async, {hypotheses} hypotheses, {workers}-thread packed-pass worker",
            kwargs,
            read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
            requires=("drafter",),
            settings=lambda r: {"hypotheses": hypotheses, "worker_threads": workers},
        ),
        overwrite=name in METHODS,
    )
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--hypotheses", type=int, default=4)
    parser.add_argument("--offset", type=int, default=20)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=args.dtype)
    drafter = load_drafter("d3d-smollm2-135m-instruct", dtype=args.dtype)
    prompts = load_prompts("humaneval", limit=args.offset + args.limit)[args.offset :]
    methods = ["target", "d3d"] + [_register(w, args.hypotheses) for w in (1, 2)]
    result = run_benchmark(
        target,
        tokenizer,
        prompts,
        methods=methods,
        drafter=drafter,
        max_new_tokens=args.max_new_tokens,
        resources={"drafter_name": "d3d-smollm2-135m-instruct"},
    )
    result["settings"] = {
        **environment_info(),
        "dtype": args.dtype,
        "prompts": "humaneval",
        "offset": args.offset,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "command": "python benchmarks/async_worker_threads.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
    }
    out = ROOT / "benchmarks" / "results" / "async" / f"worker_threads_{args.dtype}_h{args.hypotheses}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result["summary"]))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
