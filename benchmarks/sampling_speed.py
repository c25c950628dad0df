"""Sampling speed: drafter-invariant sampling (the default, `d3d_sampling="invariant"`) against standard speculative
sampling (`d3d_sampling="speculative"`) and target-only sampling, same run, interleaved per prompt.

For each prompt and temperature, in this order: the target alone (transformers' sampling), D3D with
`d3d_sampling="invariant"`, D3D with `d3d_sampling="speculative"` (both the default adaptive engine); each call after
`torch.manual_seed(seed + prompt index)`. Records tokens/s (aggregate over prompts), tau (tokens per target forward)
and the speed-up over the target, as a markdown table (printed, and appended to `--output`), plus whether the
invariant path gave the same text twice under one seed (`--check-repeat`).

    python benchmarks/sampling_speed.py --dtype float32 --threads 2 --offset 20 --limit 10 \
        --temperatures 0.7 1.0 --output benchmarks/results/sampling/speed.md
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from d3d_hf.modeling.calibration_d3d import cpu_model

from d3d_hf.drafters import load_drafter
from d3d_hf.prompts import encode_prompt, load_prompts
from d3d_hf.targets import load_target

try:
    from _common import emit
except ImportError:  # run from another folder
    from benchmarks._common import emit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafter", default="d3d-smollm2-135m-instruct")
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--offset", type=int, default=20)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-repeat", action="store_true", help="run the invariant path twice per prompt")
    parser.add_argument("--output", help="also append the table to this markdown file")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=args.dtype)
    drafter = load_drafter(args.drafter, dtype=args.dtype)
    prompts = load_prompts(args.prompts)[args.offset : args.offset + args.limit]
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    methods = {
        "target": {},
        "d3d (invariant)": {"assistant_model": drafter, "d3d_sampling": "invariant"},
        "d3d (speculative)": {"assistant_model": drafter, "d3d_sampling": "speculative"},
    }

    def sample(ids, temperature, seed, options):
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=temperature,
                              top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens, **options)
        seconds = time.perf_counter() - start
        stats = drafter.last_generation_stats if options else None
        new = out.shape[1] - ids.shape[1]
        return out[0, ids.shape[1] :].tolist(), seconds, new, stats.rounds if stats is not None else new

    for options in methods.values():  # untimed warm-up (calibration on a first use)
        sample(encoded[0], args.temperatures[0], args.seed, options)
    cpu = cpu_model()
    lines = [
        f"Sampling, SmolLM2-135M-Instruct + `{args.drafter}`, {args.dtype}, {args.prompts} "
        f"{args.offset}..{args.offset + args.limit - 1}, {args.max_new_tokens} new tokens, top-k 0, top-p 1, "
        f"{args.threads} threads ({cpu.get('model', platform.processor())}; "
        f"{' '.join(k for k, v in cpu.items() if k != 'model' and v) or 'no AVX2'}), torch {torch.__version__}. "
        "`python benchmarks/sampling_speed.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if v not in (None, False, True) and k != "output"
        ) + (" --check-repeat" if args.check_repeat else "") + "`",
        "",
        "| temperature | method | tokens/s | speed-up | tau | same text twice under one seed |",
        "|---|---|---|---|---|---|",
    ]
    for temperature in args.temperatures:
        totals = {name: [0.0, 0, 0] for name in methods}
        repeats_equal = []
        for index, ids in enumerate(encoded):
            seed = args.seed + index
            for name, options in methods.items():
                tokens, seconds, new, rounds = sample(ids, temperature, seed, options)
                totals[name][0] += seconds
                totals[name][1] += new
                totals[name][2] += rounds
                if name == "d3d (invariant)" and args.check_repeat:
                    again, *_ = sample(ids, temperature, seed, options)
                    repeats_equal.append(again == tokens)
        base = totals["target"][1] / totals["target"][0]
        for name, (seconds, new, rounds) in totals.items():
            rate = new / seconds
            same = ""
            if name == "d3d (invariant)" and repeats_equal:
                same = f"{sum(repeats_equal)}/{len(repeats_equal)}"
            lines.append(f"| {temperature} | {name} | {rate:.1f} | {rate / base:.2f}x | {new / rounds:.2f} | {same} |")
    emit(lines, args.output)


if __name__ == "__main__":
    main()
