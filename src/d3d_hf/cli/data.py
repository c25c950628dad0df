"""The training-data subcommands: `d3d-hf data` (the target answers prompts, `d3d_hf.data`) and `d3d-hf magpie`
(requests sampled from the target itself, `d3d_hf.prompts.magpie`)."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from .arguments import _add_common, _finite_float, _positive_int


def _add_data_parser(sub) -> None:
    """Subcommand `data`."""
    p = sub.add_parser("data", help="generate target-distilled training data (the target answers real prompts)")
    p.add_argument("--target", required=True, help="target model: known name, folder, .gguf file or hub id")
    p.add_argument(
        "--prompts",
        default="stdlib",
        help="comma-separated sources: stdlib[:N], math[:N], chat[:N], math-extra[:N], chat-extra[:N], JSONL file[:N] "
        "(never an evaluation set: humaneval, gsm8k, ...)",
    )
    p.add_argument("--output", required=True, help="folder for shards, settings and the dataset (resumed if re-run)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=192)
    p.add_argument("--temperature", type=_finite_float, default=0.0, help="0 = greedy (default), else sampling")
    p.add_argument("--batch-size", type=_positive_int, default=8)
    p.add_argument("--seed", type=int, default=0, help="stdlib prompt shuffle and sampling seed")
    p.add_argument("--overwrite", action="store_true", help="delete an earlier run in --output and start over")
    p.add_argument("--shuffle", action="store_true",
                   help="answer the prompts in a seeded random order, so a run stopped early holds a sample of every "
                   "source (what a learning curve over the first N rows needs)")  # fmt: skip
    p.add_argument("--shard-format", choices=["tokens", "jsonl"], default="tokens",
                   help="token-id shards (2 bytes a token, default) or JSON lines with the text")  # fmt: skip
    _add_common(p)


def _add_magpie_parser(sub) -> None:
    """Subcommand `magpie`."""
    p = sub.add_parser("magpie", help="sample training requests from the target itself (Magpie) into a JSONL file")
    p.add_argument("--target", required=True, help="target model: known name, folder, .gguf file or hub id")
    p.add_argument("--output", required=True, help="JSONL prompt file (resumed and extended if it exists)")
    p.add_argument("--counts", type=_domain_counts, default=None,
                   help="requests per domain, e.g. code=1500,math=1000,general=800 (default: 6,000 over 8 domains)")
    p.add_argument("--batch-size", type=_positive_int, default=64)
    p.add_argument("--max-new-tokens", type=_positive_int, default=48, help="longest request in tokens")
    p.add_argument("--temperature", type=_finite_float, default=1.0)
    p.add_argument("--top-p", type=_finite_float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    _add_common(p)


def _domain_counts(text: str) -> dict[str, int]:
    """`code=1500,math=1000` -> {"code": 1500, "math": 1000}."""
    out = {}
    for item in text.split(","):
        name, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"expected DOMAIN=COUNT items such as code=1500, got {item!r}")
        out[name.strip()] = int(count)
    return out


def _data(args) -> int:
    from ..data import check_output_folder, generate_dataset, load_prompt_sources
    from ..targets import load_target

    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    check_output_folder(args.output, args.overwrite)  # before the (slow) target loads
    prompts = load_prompt_sources(args.prompts, seed=args.seed)
    if args.shuffle:
        prompts = random.Random(args.seed).sample(prompts, len(prompts))
    target, tokenizer = load_target(args.target, dtype=args.dtype)
    print(f"[data] {len(prompts)} prompts from {args.prompts!r}; writing to {args.output}", file=sys.stderr)
    dataset = generate_dataset(
        target,
        tokenizer,
        prompts,
        args.output,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        batch_size=args.batch_size,
        overwrite=args.overwrite,
        seed=args.seed,
        target_name=args.target,
        prompt_sources=args.prompts + (" (shuffled)" if args.shuffle else ""),
        shard_format=args.shard_format,
    )
    tokens = sum(len(r) for r in dataset["response_ids"])
    print(f"Saved {len(dataset)} rows ({tokens} response tokens) to {Path(args.output) / 'dataset'}")
    return 0


def _magpie(args) -> int:
    from ..prompts.magpie import magpie_requests
    from ..targets import load_target

    target, tokenizer = load_target(args.target, dtype=args.dtype)
    prompts = magpie_requests(
        target, tokenizer, args.output, args.counts, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed,
    )  # fmt: skip
    print(f"{args.output} holds {len(prompts)} requests (what was dropped and why: {args.output}.stats.json)")
    return 0
