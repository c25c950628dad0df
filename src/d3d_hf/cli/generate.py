"""`d3d-hf generate`: one prompt, streamed, with a D3D drafter."""

from __future__ import annotations

import sys
from collections import Counter

import torch

from .arguments import _add_common, _finite_float, _non_negative_int, _positive_int
from .common import _check_drafter_options, _load_pair


def _add_generate_parser(sub) -> None:
    """Subcommand `generate`."""
    p = sub.add_parser("generate", help="generate for one prompt with a D3D drafter, streamed")
    p.add_argument("--target", default=None, help="target model (default: the drafter's recorded target)")
    p.add_argument("--drafter", required=True, help="drafter folder")
    p.add_argument("--prompt", required=True, help="user message (sent through the chat template)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=256)
    p.add_argument("--block-size", type=_positive_int, default=None, help="override the drafter's block size")
    p.add_argument("--do-sample", action="store_true", help="sample (lossless speculative sampling)")
    p.add_argument("--temperature", type=_finite_float, default=None, help="sampling temperature > 0 (--do-sample)")
    p.add_argument("--top-k", type=_non_negative_int, default=None, help="top-k sampling, 0 = off (--do-sample)")
    p.add_argument("--top-p", type=_finite_float, default=None, help="nucleus sampling, in (0, 1] (--do-sample)")
    p.add_argument("--seed", type=int, default=0)
    _add_common(p)


def _generate(args) -> int:
    from transformers import TextStreamer

    from ..prompts import Prompt, encode_prompt

    sampling = {"--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p}
    given = [flag for flag, value in sampling.items() if value is not None]
    if given and not args.do_sample:
        raise ValueError(
            f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} when sampling: add --do-sample, "
            "or drop them for greedy decoding"
        )
    if args.temperature is not None and args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature} (for greedy decoding drop --do-sample)")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    _check_drafter_options(args)
    _, target, tokenizer, drafter = _load_pair(args)
    torch.manual_seed(args.seed)
    input_ids = encode_prompt(tokenizer, Prompt(id="cli", messages=[{"role": "user", "content": args.prompt}]))
    kwargs = {"do_sample": args.do_sample}
    for name in ("temperature", "top_k", "top_p"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        assistant_model=drafter,
        max_new_tokens=args.max_new_tokens,
        streamer=streamer,
        **kwargs,
    )
    print(round_report(drafter.last_generation_stats), file=sys.stderr)
    return 0


def round_report(stats) -> str:
    """The lines `d3d-hf generate` prints after the text: tokens, target forwards, tau, and the rounds by where their
    candidates came from (`D3DGenerationStats.round_sources`); when no round drafted, why, and how to draft anyway."""
    sources = Counter(stats.round_sources)
    by_source = ", ".join(f"{name} {sources[name]}" for name in ("drafter", "lookup", "target"))
    head = f"\n[d3d] tokens {stats.new_tokens}, target forwards {stats.rounds}, tau {stats.tau:.2f}"
    lines = [f"{head}; rounds: {by_source}"]
    if stats.rounds and not sources["drafter"]:
        lines.append(
            "[d3d] no round drafted: the cost-aware engine rated a draft pass not worth its cost on this machine for "
            "this text (prompt lookup or plain target steps were cheaper per token). In Python, "
            '`target.generate(..., assistant_model=drafter, d3d_num_drafts="full", d3d_prompt_lookup=False)` drafts '
            "every round."
        )
    return "\n".join(lines)
