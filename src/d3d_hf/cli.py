"""`d3d-hf` command line: `init-drafter`, `generate` and `bench`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d3d-hf", description="D3D block-diffusion drafters for speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-drafter", help="create a D3D drafter from an autoregressive model of the same tokenizer")
    p.add_argument("--from", dest="source", required=True, help="target/source model: known name, folder or hub id")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-layers", type=int, default=None, help="copy the first N layers (default: all)")
    group.add_argument("--layer-ids", default=None, help="comma-separated source layer indices to copy")
    p.add_argument("--block-size", type=int, default=16, help="draft block size B (default 16)")
    p.add_argument("--output", required=True, help="folder to write the drafter to")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder")
    _add_common(p)

    p = sub.add_parser("generate", help="generate for one prompt with a D3D drafter, streamed")
    p.add_argument("--target", default=None, help="target model (default: the drafter's recorded target)")
    p.add_argument("--drafter", required=True, help="drafter folder")
    p.add_argument("--prompt", required=True, help="user message (sent through the chat template)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="override the drafter's block size")
    p.add_argument("--do-sample", action="store_true", help="sample (lossless speculative sampling)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    _add_common(p)

    p = sub.add_parser("bench", help="benchmark methods interleaved on real prompts")
    p.add_argument("--target", default=None, help="target model (default: the drafter's recorded target)")
    p.add_argument("--drafter", default=None, help="drafter folder (needed for method d3d)")
    p.add_argument("--prompts", default="humaneval", help="'humaneval' or a JSONL file")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--methods", default="target,d3d", help="comma-separated: target,d3d")
    p.add_argument("--block-size", type=int, default=None, help="override the drafter's block size")
    p.add_argument("--output", default=None, help="write results JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    p.add_argument("--print-completions", action="store_true", help="print each completion")
    _add_common(p)
    return parser


def _init_drafter(args) -> int:
    from .drafters import D3DForDiffusionDrafting, ensure_writable_dir
    from .targets import load_target, resolve_model

    output = ensure_writable_dir(args.output, args.overwrite)
    layer_ids = [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None
    model, tokenizer = load_target(args.source, dtype=args.dtype)
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        model,
        num_layers=args.num_layers,
        layer_ids=layer_ids,
        block_size=args.block_size,
        source_model=resolve_model(args.source).display_name,
        target_model=args.source,
    )
    drafter.save_pretrained(output)
    tokenizer.save_pretrained(output)
    cfg = drafter.config
    print(
        f"Saved a {cfg.num_hidden_layers}-layer D3D drafter (block size {cfg.block_size}, source layers "
        f"{cfg.source_layer_ids}) for {args.source} to {output}"
    )
    return 0


def _load_pair(args):
    from .drafters import load_drafter
    from .targets import load_target

    drafter = load_drafter(args.drafter, dtype=args.dtype) if args.drafter else None
    target_name = args.target or (drafter.config.target_model if drafter is not None else None)
    if target_name is None:
        raise SystemExit("error: give --target (the drafter does not record its target model)")
    target, tokenizer = load_target(target_name, dtype=args.dtype)
    if drafter is not None and args.block_size is not None:
        drafter.config.block_size = args.block_size
    return target_name, target, tokenizer, drafter


def _generate(args) -> int:
    from transformers import TextStreamer

    from .prompts import Prompt, encode_prompt

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
    stats = drafter.last_generation_stats
    print(f"\n[d3d] tokens {stats.new_tokens}, target forwards {stats.rounds}, tau {stats.tau:.2f}", file=sys.stderr)
    return 0


def _bench(args) -> int:
    from .bench import environment_info, format_table, run_benchmark
    from .prompts import load_prompts

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    output = Path(args.output) if args.output else None
    if output is not None and output.exists() and not args.overwrite:
        raise SystemExit(f"error: {output} exists; choose another --output or pass --overwrite")
    target_name, target, tokenizer, drafter = _load_pair(args)
    prompts = load_prompts(args.prompts, limit=args.limit)

    def show(prompt, runs):
        if not args.print_completions:
            return
        print(f"\n=== {prompt.id} ===")
        ref = runs["target"]
        print(tokenizer.decode(ref.output_ids, skip_special_tokens=True))
        for method, run in runs.items():
            print(
                f"--- {method}: {run.new_tokens} tokens, {run.tokens_per_second:.1f} tok/s, tau {run.tau:.2f}, "
                f"identical to target: {run.matches_target}"
            )

    result = run_benchmark(
        target,
        tokenizer,
        prompts,
        methods=methods,
        drafter=drafter,
        max_new_tokens=args.max_new_tokens,
        on_prompt=show,
    )
    result["settings"] = {
        "target": target_name,
        "drafter": args.drafter,
        "drafter_layers": drafter.config.num_hidden_layers if drafter is not None else None,
        "dtype": args.dtype,
        "block_size": drafter.config.block_size if drafter is not None else None,
        "prompts": args.prompts,
        "limit": args.limit,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "prompt_template": "tokenizer chat template, one user turn, add_generation_prompt=True",
        "decoding": "greedy",
        "command": "d3d-hf " + " ".join(sys.argv[1:]),
        **environment_info(),
    }
    print()
    print(format_table(result["summary"]))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `d3d-hf` console script."""
    args = _build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import d3d_hf  # noqa: F401  (registers the model type and the generation hook)

    handlers = {"init-drafter": _init_drafter, "generate": _generate, "bench": _bench}
    try:
        return handlers[args.command](args)
    except (FileExistsError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
