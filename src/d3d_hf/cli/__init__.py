"""`d3d-hf` command line: `init-drafter`, `generate`, `data`, `train`, `bench`, `report`, `cost-model`,
`export-causal-lm`, `push` and `convert`."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

import torch

#: the bench methods each declared generation option applies to (the others ignore it; a flag for none of the
#: chosen methods is refused)
OPTION_METHODS = {
    "num_drafts": ("d3d", "d3d-async", "d3d-tree"),
    "prompt_lookup": ("d3d", "d3d-tree"),
    "asynchronous": (),
    "num_hypotheses": ("d3d-async",),
    "reuse_on_miss": ("d3d-async",),
    "worker_threads": ("d3d-async",),
    "tree_budget": ("d3d-tree",),
    "tree_branching": ("d3d-tree",),
}


def option_flag(field) -> str:
    """The command-line flag of a declared generation option: `d3d_num_drafts` -> `--num-drafts`."""
    return "--" + field.metadata["option"].removeprefix("d3d_").replace("_", "-")


def add_generation_option_arguments(parser) -> None:
    """One flag per user option of `D3DGenerationOptions` (the declaration's doc and default as help; booleans as
    `--flag` / `--no-flag`); the values are checked when the options are resolved. Options no bench method takes
    (`d3d_async`: the `d3d-async` method sets it) get no flag."""
    from ..modeling.options_d3d import D3DGenerationOptions, parse_option_text

    for field in D3DGenerationOptions.option_fields(internal=False):
        methods = OPTION_METHODS.get(field.name)
        if not methods:
            continue
        meta = field.metadata
        text = f"{', '.join(methods)}: {meta['doc']} Accepts {meta['accepts']} (default {meta['default_doc']})."
        text = text.replace("%", "%%")
        if field.metadata["check"].__name__ == "_boolean":
            parser.add_argument(option_flag(field), dest=field.name, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(option_flag(field), dest=field.name, type=parse_option_text, default=None, help=text)


def given_generation_options(args) -> dict[str, object]:
    """`{field name: value}` of the generation-option flags given on the command line."""
    return {name: getattr(args, name) for name in OPTION_METHODS if getattr(args, name, None) is not None}


def _int_at_least(low: int, words: str):
    """An argparse type: an integer >= `low`, described as `words` in its error."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {words}, got {value!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"expected {words}, got {number}")
        return number

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "a whole number >= 0")


def _finite_float(value: str) -> float:
    """argparse type: a finite number (no nan or inf)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {value!r}")
    return number


def _layer_ids(value: str) -> list[int]:
    """argparse type for --layer-ids: comma-separated, distinct, non-negative integers."""
    try:
        ids = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices like 0,5,9, got {value!r}") from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct non-negative layer indices, got {value!r}")
    return ids


def _float_list(value: str) -> list[float]:
    """argparse type: comma-separated finite numbers, at least one."""
    try:
        numbers = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 2,3.5, got {value!r}") from None
    if not numbers or not all(math.isfinite(x) for x in numbers):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite numbers like 2,3.5, got {value!r}")
    return numbers


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weight dtype")
    parser.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d3d-hf", description="D3D block-diffusion drafters for speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-drafter", help="create a D3D drafter from an autoregressive model of the same tokenizer")
    p.add_argument("--from", dest="source", required=True, help="target/source model: known name, folder or hub id")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-layers", type=_positive_int, default=None, help="copy the first N layers (default: all)")
    group.add_argument("--layer-ids", type=_layer_ids, default=None, help="comma-separated source layer indices")
    p.add_argument("--block-size", type=_positive_int, default=16, help="draft block size B (default 16)")
    p.add_argument("--output", required=True, help="folder to write the drafter to")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder")
    _add_common(p)

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

    sub.add_parser(
        "train", help="train a drafter on `d3d-hf data` output or a TRL dataset (TRL's flags; `d3d-hf train --help`)"
    )

    p = sub.add_parser("bench", help="benchmark methods interleaved on real prompts")
    p.add_argument("--target", default=None, help="target model (default: the drafter's recorded target)")
    p.add_argument("--drafter", default=None, help="drafter folder (needed for method d3d)")
    p.add_argument(
        "--assistant",
        default=None,
        help="autoregressive assistant for method ar-assist: a shipped one (ar-smollm2-135m-instruct, the "
        "equal-budget counterpart of the shipped drafter) or a causal LM folder with the target's tokenizer",
    )
    p.add_argument("--prompts", default="humaneval", help="humaneval, gsm8k, mt-bench, vicuna-bench or a JSONL file")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts (after --offset)")
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts (to run a long set in shards)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=1,
        help="prompts per generate call, left-padded (target and d3d decode a batch at once; pld, ar-assist, "
        "d3d-async and d3d-tree run its prompts one at a time); tokens/s is then of the whole batch",
    )
    p.add_argument("--methods", default="target,d3d", help="comma-separated: target,pld,ar-assist,d3d,d3d-async")
    p.add_argument("--block-size", type=_positive_int, default=None, help="override the drafter's block size")
    add_generation_option_arguments(p)
    p.add_argument("--prompt-lookup-num-tokens", type=_positive_int, default=10, help="pld: tokens per draft")
    p.add_argument("--max-matching-ngram-size", type=_positive_int, default=2, help="pld: longest n-gram matched")
    p.add_argument(
        "--cost-model",
        action="store_true",
        help="also measure the cost model (d3d_hf.costmodel) and show its predicted speed-up next to the measured one",
    )
    p.add_argument("--cost-prefix-length", type=_positive_int, default=256, help="KV-cache prefix of the cost model")
    p.add_argument("--output", default=None, help="write results JSON here")
    p.add_argument("--output-dir", default=None, help="write results.json, report.md and PNG plots into this folder")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file / --output-dir")
    p.add_argument("--print-completions", action="store_true", help="print each completion")
    _add_common(p)

    p = sub.add_parser("report", help="Markdown table and plots over several `d3d-hf bench` results")
    p.add_argument("results", nargs="+", help="results JSON files of `d3d-hf bench`")
    p.add_argument("--output-dir", required=True, help="folder for report.md and the PNG plots")
    p.add_argument("--title", default="Benchmark", help="title of report.md")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder")

    p = sub.add_parser("cost-model", help="measure target/drafter forward times and the speed-up they imply")
    p.add_argument("--target", default=None, help="target model (default: the drafter's recorded target)")
    p.add_argument("--drafter", default=None, help="drafter folder (without it only the target is timed)")
    p.add_argument("--block-size", type=_positive_int, default=None, help="override the drafter's block size")
    p.add_argument("--prefix-length", type=_positive_int, default=256, help="tokens in the KV cache before each pass")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed calls per point (median)")
    p.add_argument("--tau", type=_float_list, default=[2.0, 3.0, 4.0], help="comma-separated tau values")
    p.add_argument("--hit-rate", type=_float_list, default=[0.5, 0.9], help="comma-separated async hit rates")
    p.add_argument("--output", default=None, help="write the measurements as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    _add_common(p)

    p = sub.add_parser("export-causal-lm", help="save a drafter's layers as a plain causal LM (an ar-assist assistant)")
    p.add_argument("--drafter", required=True, help="drafter folder (e.g. trained with --block_loss_weight 0)")
    p.add_argument("--target", default=None, help="target to attach when the drafter shares its weights")
    p.add_argument("--output", required=True, help="folder for the causal LM (config, safetensors, tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder")
    _add_common(p)

    p = sub.add_parser("prune", help="progressive layer pruning of a drafter by calibration tau (resumable)")
    p.add_argument("--target", default=None, help="target model (default: the drafter's recorded target)")
    p.add_argument("--drafter", required=True, help="drafter to prune: shipped name or folder")
    p.add_argument(
        "--prompts",
        required=True,
        help="calibration prompts: stdlib, stdlib:N or a JSONL file (evaluation sets such as humaneval are refused)",
    )
    p.add_argument("--offset", type=int, default=0, help="skip the first N prompts (e.g. those the drafter trained on)")
    p.add_argument("--limit", type=_positive_int, default=8, help="calibration prompts to use (default 8)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="calibration continuation length")
    rule = p.add_mutually_exclusive_group(required=True)
    rule.add_argument("--num-layers", type=_positive_int, default=None, help="prune down to this many layers")
    rule.add_argument(
        "--min-tau-retention",
        type=_finite_float,
        default=None,
        help="stop before tau falls below this fraction (e.g. 0.99)",
    )
    p.add_argument("--output", required=True, help="folder for the pruned drafter, the path JSON/PNG and the state")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder without a state")
    _add_common(p)

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
    _add_hub_commands(sub)
    return parser


def _domain_counts(text: str) -> dict[str, int]:
    """`code=1500,math=1000` -> {"code": 1500, "math": 1000}."""
    out = {}
    for item in text.split(","):
        name, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"expected DOMAIN=COUNT items such as code=1500, got {item!r}")
        out[name.strip()] = int(count)
    return out


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


def _init_drafter(args) -> int:
    from ..drafters import D3DForDiffusionDrafting
    from ..targets import load_target, resolve_model
    from ..utils import ensure_writable_dir

    output = ensure_writable_dir(args.output, args.overwrite)
    layer_ids = args.layer_ids
    model, tokenizer = load_target(args.source, dtype=args.dtype)
    # a local target path is recorded absolute, so the drafter finds its target from any working directory
    source = os.path.abspath(args.source) if os.path.exists(args.source) else args.source
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        model,
        num_layers=args.num_layers,
        layer_ids=layer_ids,
        block_size=args.block_size,
        source_model=resolve_model(args.source).display_name,
        target_model=source,
    )
    drafter.save_pretrained(output, tokenizer=tokenizer)
    cfg = drafter.config
    print(
        f"Saved a {cfg.num_hidden_layers}-layer D3D drafter (block size {cfg.block_size}, source layers "
        f"{cfg.source_layer_ids}) for {args.source} to {output}"
    )
    return 0


def _check_option_values(args) -> None:
    """Checks the generation-option flags' values that do not depend on the drafter (types, words, lower bounds),
    by the declaration's own checks, with a block as large as any drafter's context could hold.

    Raises:
        ValueError: naming the flag and what it accepts.
    """
    from ..modeling.options_d3d import D3DGenerationOptions

    fields = {f.name: f for f in D3DGenerationOptions.option_fields()}
    for name, value in given_generation_options(args).items():
        field = fields[name]
        try:
            D3DGenerationOptions.resolve(block_size=2**31 - 1, **{field.metadata["option"]: value})
        except ValueError:
            accepts = field.metadata["accepts"]
            raise ValueError(f"{option_flag(field)} must be {accepts}, got {value!r}") from None


def _check_drafter_options(args) -> None:
    """Checks the options that depend on the drafter (its block size, its layers) against its config alone, before
    any model loads: `--block-size` (against the drafter's context), `--num-drafts`, `--num-hypotheses`,
    `--worker-threads` (bench) and `--num-layers` (prune).

    Raises:
        ValueError: naming the flag and the values it may take.
    """
    num_drafts = getattr(args, "num_drafts", None)
    hypotheses = getattr(args, "num_hypotheses", None)
    workers = getattr(args, "worker_threads", None)
    if args.command == "bench":
        _check_option_values(args)
    if workers is not None:
        most = max(os.cpu_count() or 1, torch.get_num_threads())
        if workers > most:
            raise ValueError(
                f"--worker-threads {workers} is more than this machine's {most} CPU threads: pass at most {most}"
            )
    prune_layers = getattr(args, "num_layers", None) if args.command == "prune" else None
    given_block = getattr(args, "block_size", None)
    needs_config = num_drafts not in (None, "adaptive", "full") or hypotheses is not None or prune_layers is not None
    needs_config = needs_config or given_block is not None
    if not getattr(args, "drafter", None) or not needs_config:
        return
    from ..drafters import load_drafter_config

    config = load_drafter_config(args.drafter)
    if given_block is not None and given_block > config.max_position_embeddings:
        raise ValueError(
            f"--block-size {given_block} is longer than the drafter's context ({config.max_position_embeddings} "
            "tokens, `max_position_embeddings`): pass a smaller --block-size (the drafter's own is "
            f"{config.block_size})"
        )
    block_size = given_block or config.block_size
    origin = "--block-size" if getattr(args, "block_size", None) else f"the drafter's block size ({args.drafter})"
    if num_drafts not in (None, "adaptive", "full") and int(num_drafts) > block_size - 1:
        raise ValueError(
            f"--num-drafts {num_drafts} is more than a block of {block_size} tokens ({origin}) drafts: pass a number "
            f"in 0..{block_size - 1}, 'full' or 'adaptive'"
            + (", or a larger --block-size" if getattr(args, "block_size", None) else "")
        )
    if hypotheses is not None and hypotheses > block_size:
        raise ValueError(
            f"--num-hypotheses {hypotheses} is more than the block size {block_size} ({origin}): pass a number in "
            f"1..{block_size}"
        )
    if prune_layers is not None and prune_layers >= config.num_hidden_layers:
        raise ValueError(
            f"--num-layers {prune_layers} must be below the drafter's {config.num_hidden_layers} layers: pass a "
            f"number in 1..{config.num_hidden_layers - 1}"
        )


def _load_pair(args):
    from ..drafters import load_drafter
    from ..targets import load_target

    drafter = load_drafter(args.drafter, dtype=args.dtype) if args.drafter else None
    target_name = args.target or (drafter.config.target_model if drafter is not None else None)
    if target_name is None:
        raise ValueError("give --target (the drafter does not record its target model)")
    try:
        target, tokenizer = load_target(target_name, dtype=args.dtype)
    except (OSError, ValueError) as err:
        origin = "--target" if args.target else f"the target recorded in the drafter's config ({args.drafter})"
        raise ValueError(f"cannot load {origin} {target_name!r}: {err}. Pass --target NAME_OR_PATH.") from err
    if drafter is not None and getattr(args, "block_size", None) is not None:
        drafter.config.block_size = args.block_size
    return target_name, target, tokenizer, drafter


def _generate(args) -> int:
    from transformers import TextStreamer

    from ..prompts import Prompt, encode_prompt

    sampling = {"--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p}
    given = [flag for flag, value in sampling.items() if value is not None]
    if given and not args.do_sample:
        raise ValueError(
            f"{', '.join(given)} only apply when sampling: add --do-sample, or drop them for greedy decoding"
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
    stats = drafter.last_generation_stats
    print(f"\n[d3d] tokens {stats.new_tokens}, target forwards {stats.rounds}, tau {stats.tau:.2f}", file=sys.stderr)
    return 0


def _check_output_file(output: Path | None, overwrite: bool, flag: str = "--output") -> None:
    if output is None:
        return
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists; choose another {flag} or pass --overwrite")
    if any(p.exists() and not p.is_dir() for p in output.parents):
        raise ValueError(f"{flag} {output}: a parent of it is a file, not a folder")


def _load_assistant(name: str, dtype: str, tokenizer, target):
    """Loads an autoregressive assistant (`assistants.load_assistant`: a shipped name, a layers-only folder that takes
    the target's embeddings, or any causal LM) and checks that it shares the target's tokenizer."""
    from ..assistants import is_layers_only, load_assistant, resolve_assistant
    from ..targets import load_target

    try:
        folder = resolve_assistant(name)
        if is_layers_only(folder):  # built around the target's own embeddings: its tokenizer is the target's
            assistant, assistant_tokenizer = load_assistant(folder, target=target, dtype=dtype), tokenizer
        else:
            assistant, assistant_tokenizer = load_target(folder, dtype=dtype)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load --assistant {name!r}: {err}") from err
    vocab = assistant.config.get_text_config().vocab_size
    target_vocab = target.config.get_text_config().vocab_size
    if vocab != target_vocab or assistant_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"--assistant {name!r} does not use the target's tokenizer (vocabulary {vocab} vs {target_vocab} "
            "entries or different tokens); method ar-assist needs an assistant of the same tokenizer"
        )
    return assistant


def _bench(args) -> int:
    from ..bench import (
        METHODS,
        environment_info,
        format_round_plans,
        format_table,
        missing_resource,
        run_benchmark,
        unknown_methods,
    )
    from ..prompts import load_prompts

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = unknown_methods(methods)
    if unknown:
        raise ValueError(f"unknown --methods {unknown}; choose from {list(METHODS)}")
    from ..modeling.options_d3d import D3DGenerationOptions

    fields = {f.name: f for f in D3DGenerationOptions.option_fields()}
    unused = {}
    for name in given_generation_options(args):
        if not set(OPTION_METHODS[name]) & set(methods):
            unused.setdefault(OPTION_METHODS[name], []).append(option_flag(fields[name]))
    for applies, flags in unused.items():
        which = "method " + applies[0] if len(applies) == 1 else "methods " + ", ".join(applies)
        raise ValueError(f"{', '.join(flags)} only apply to {which}: add it to --methods or drop them")
    given = {"drafter": args.drafter or None, "assistant": args.assistant or None}  # what the flags can give
    missing = missing_resource(methods, given)
    if missing is not None:
        m, needed = missing
        if needed not in given:
            raise ValueError(f"method {m} needs a {needed}, which the command line cannot give")
        hint = " (the shipped one: --assistant ar-smollm2-135m-instruct)" if needed == "assistant" else ""
        raise ValueError(f"method {m} needs --{needed}{hint}")
    output = Path(args.output) if args.output else None
    _check_output_file(output, args.overwrite)
    output_dir = Path(args.output_dir) if args.output_dir else None
    if output_dir is not None:
        from ..utils import ensure_writable_dir

        ensure_writable_dir(output_dir, args.overwrite)
        _check_output_file(output_dir / "results.json", True, "--output-dir")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.offset < 0:
        raise ValueError(f"--offset must be >= 0, got {args.offset}")
    if args.batch_size > 1 and args.cost_model:
        raise ValueError("--cost-model predicts one sequence at a time: drop --cost-model or --batch-size")
    prompts = load_prompts(args.prompts)[args.offset :]  # checked before the (slow) model loads
    if not prompts:
        raise ValueError(f"--offset {args.offset} skips every prompt of {args.prompts}")
    prompts = prompts[: args.limit] if args.limit is not None else prompts
    if not args.drafter and not args.target:
        raise ValueError("give --target (or --drafter, whose recorded target is used)")
    _check_drafter_options(args)
    target_name, target, tokenizer, drafter = _load_pair(args)
    assistant = _load_assistant(args.assistant, args.dtype, tokenizer, target) if args.assistant else None

    def show(prompt, runs):
        if not args.print_completions:
            return
        print(f"\n=== {prompt.id} ===")
        ref = runs["target"]
        if ref.sequences is not None:  # a batch: the whole batch's runs, once per prompt of it
            index = ref.prompt_id.split("+").index(prompt.id)
            print(tokenizer.decode(ref.sequences[index], skip_special_tokens=True))
            return
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
        assistant=assistant,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        max_matching_ngram_size=args.max_matching_ngram_size,
        resources={
            "drafter_name": args.drafter,
            "assistant_name": args.assistant,
            **given_generation_options(args),
        },
        batch_size=args.batch_size,
    )
    result["settings"] = {
        "target": target_name,
        "drafter": args.drafter,
        "drafter_layers": drafter.config.num_hidden_layers if drafter is not None else None,
        "assistant": args.assistant,
        "methods": list(result["summary"]),
        "dtype": args.dtype,
        "block_size": drafter.config.block_size if drafter is not None else None,
        "prompts": args.prompts,
        "limit": args.limit,
        "offset": args.offset,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "prompt_template": "tokenizer chat template, one user turn, add_generation_prompt=True",
        "decoding": "greedy",
        "command": "d3d-hf " + " ".join(sys.argv[1:]),
        **environment_info(),
    }
    if args.cost_model:
        from ..costmodel import format_cost_model, measure_cost_model, predict_speedups

        uses_drafter = drafter is not None and any(METHODS[m].cost_model in ("sync", "async") for m in methods)
        cost = measure_cost_model(target, drafter if uses_drafter else None, prefix_length=args.cost_prefix_length)
        kinds = {m: METHODS[m].cost_model for m in result["summary"]}
        for m, predicted in predict_speedups(cost, result["summary"], kinds, result["method_settings"]).items():
            result["summary"][m]["predicted_speedup"] = predicted
        result["cost_model"] = cost.to_dict()
        print()
        print(format_cost_model(cost))
    print()
    print(format_table(result["summary"]))
    plans = format_round_plans(result["summary"])
    if plans:
        print()
        print(plans)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {output}")
    if output_dir is not None:
        from ..report import write_report

        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "results.json").write_text(json.dumps(result, indent=2))
        write_report([result], output_dir, title=f"{target_name} on {args.prompts} ({args.dtype})")
        print(f"\nwrote results.json, report.md and plots to {output_dir}")
    return 0


def _report(args) -> int:
    from ..report import write_report
    from ..utils import ensure_writable_dir

    results = []
    for path in args.results:
        if not Path(path).is_file():
            raise FileNotFoundError(f"No results file at {path}; write one with `d3d-hf bench --output FILE`.")
        results.append(json.loads(Path(path).read_text()))
    output_dir = ensure_writable_dir(args.output_dir, args.overwrite)
    written = write_report(results, output_dir, title=args.title)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _cost_model(args) -> int:
    from ..costmodel import format_cost_model, measure_cost_model

    output = Path(args.output) if args.output else None
    _check_output_file(output, args.overwrite)
    if not args.drafter and not args.target:
        raise ValueError("give --target and/or --drafter")
    if any(not 0 <= h <= 1 for h in args.hit_rate):
        raise ValueError(f"--hit-rate values must be in [0, 1], got {args.hit_rate}")
    if any(t < 1 for t in args.tau):
        raise ValueError(f"--tau values must be >= 1 (tokens committed per target forward), got {args.tau}")
    _check_drafter_options(args)
    target_name, target, _, drafter = _load_pair(args)
    cost = measure_cost_model(target, drafter, prefix_length=args.prefix_length, repeats=args.repeats)
    cost.settings.update(target=target_name, drafter=args.drafter)
    print(format_cost_model(cost, taus=args.tau, hit_rates=args.hit_rate))
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(cost.to_dict(), indent=2))
        print(f"\nwrote {output}")
    return 0


def _export_causal_lm(args) -> int:
    from ..convert import export_causal_lm
    from ..drafters import load_drafter
    from ..utils import ensure_writable_dir

    output = ensure_writable_dir(args.output, args.overwrite)
    drafter = load_drafter(args.drafter, dtype=args.dtype)
    tokenizer = None
    target = None
    if drafter.config.shares_target_weights:
        from ..targets import load_target

        target_name = args.target or drafter.config.target_model
        if not target_name:
            raise ValueError("this drafter shares its target's weights: give --target")
        target, tokenizer = load_target(target_name, dtype=args.dtype)
    folder = Path(args.drafter)
    if (
        tokenizer is None
        and folder.is_dir()
        and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    ):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    model = export_causal_lm(drafter, output, tokenizer=tokenizer, target=target)
    print(f"Saved a {model.config.num_hidden_layers}-layer {type(model).__name__} to {output}")
    return 0


def _data(args) -> int:
    from ..data import generate_dataset, load_prompt_sources
    from ..targets import load_target

    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
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


def _add_hub_commands(sub) -> None:
    """Subcommands `push` and `convert` (Hub-ready checkpoints)."""
    p = sub.add_parser("push", help="upload a drafter folder to the Hugging Face Hub (weights, code, tokenizer, card)")
    p.add_argument("--drafter", required=True, help="drafter folder written by save_pretrained / init-drafter")
    p.add_argument("--repo-id", required=True, help="Hub repository, e.g. me/d3d-qwen3-8b")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the token of `hf auth login`)")
    p.add_argument("--commit-message", default=None)
    p.add_argument("--revision", default=None, help="branch to push to")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--results", action="append", default=[], help="`d3d-hf bench --output` JSON to show (repeatable)")
    p.add_argument("--hardware", default=None, help="hardware description for --results (default: from the file)")
    p.add_argument("--target-model", default=None, help="Hub id of the target shown in the card")
    p.add_argument("--base-model", default=None, help="Hub id of the source model (card `base_model`)")
    p.add_argument("--dataset", action="append", default=[], help="training dataset id (repeatable)")
    p.add_argument("--tag", action="append", default=[], help="extra card tag (repeatable)")
    p.add_argument("--license", default=None, help="license id for the card")
    p.add_argument("--overwrite-card", action="store_true", help="replace a README.md not generated by d3d-hf")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")

    p = sub.add_parser("convert", help="make a D3D drafter from a Llama/Qwen3 checkpoint folder or a published D3D one")
    p.add_argument("--from", dest="source", required=True, help="local checkpoint folder (config.json + safetensors)")
    p.add_argument("--output", required=True, help="folder to write the drafter to")
    p.add_argument("--published-d3d", action="store_true", help="the folder is a published D3D checkpoint")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-layers", type=_positive_int, default=None, help="copy the first N layers (default: all)")
    group.add_argument("--layer-ids", type=_layer_ids, default=None, help="comma-separated source layer indices")
    p.add_argument(
        "--block-size", type=_positive_int, default=None, help="draft block size B (default 16, or the checkpoint's)"
    )
    mask = p.add_mutually_exclusive_group()
    mask.add_argument(
        "--mask-token-id", type=_non_negative_int, default=None, help="spare vocabulary id to use as the mask token"
    )
    mask.add_argument("--mask-embedding", action="store_true", help="use a separate mask embedding, not a spare id")
    p.add_argument("--source-name", default=None, help="name/Hub id recorded as the source (default: the folder)")
    p.add_argument("--target", default=None, help="name/Hub id recorded as the target (default: the source)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weight dtype")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's choice)")


def _push(args) -> int:
    from transformers import AutoConfig

    from ..drafters import load_drafter
    from ..hub import DrafterCardData, is_generated_card, load_card_data, result_from_benchmark
    from ..modeling import D3DConfig

    folder = Path(args.drafter)
    if not folder.is_dir():
        raise FileNotFoundError(f"No drafter folder at {folder}.")
    config = AutoConfig.from_pretrained(folder)
    if not isinstance(config, D3DConfig):
        raise ValueError(f"{folder} holds a `{config.model_type}` model, not a D3D drafter.")
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    results = []  # read (and their files checked) before the drafter loads
    for path in args.results:
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"No results file at --results {path}; write one with `d3d-hf bench --output FILE`."
            )
        results.append(result_from_benchmark(json.loads(Path(path).read_text()), hardware=args.hardware))
    drafter = load_drafter(str(folder), dtype=dtype)
    card = load_card_data(folder) or DrafterCardData()
    card.results.extend(results)
    card.target_model = args.target_model or card.target_model
    card.base_model = args.base_model or card.base_model
    card.datasets = card.datasets + [d for d in args.dataset if d not in card.datasets]
    card.tags = card.tags + [t for t in args.tag if t not in card.tags]
    card.license = args.license or card.license
    drafter.card_data = card
    tokenizer = None
    if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    readme = folder / "README.md"
    user_readme = readme if readme.is_file() and not is_generated_card(readme) and not args.overwrite_card else None
    commit = drafter.push_to_hub(
        args.repo_id,
        tokenizer=tokenizer,
        private=args.private or None,
        token=args.token,
        commit_message=args.commit_message,
        revision=args.revision,
        create_pr=args.create_pr,
        overwrite_card=args.overwrite_card,
        readme=user_readme,
    )
    print(f"Pushed {folder} to {getattr(commit, 'commit_url', None) or args.repo_id}")
    return 0


def _convert(args) -> int:
    from ..convert import convert_autoregressive_checkpoint, load_published_d3d_checkpoint
    from ..utils import ensure_writable_dir

    layer_ids = args.layer_ids
    if args.published_d3d:
        if args.num_layers is not None or layer_ids is not None or args.mask_embedding:
            raise ValueError("--num-layers, --layer-ids and --mask-embedding apply to autoregressive checkpoints only.")
        output = ensure_writable_dir(args.output, args.overwrite)
        drafter = load_published_d3d_checkpoint(
            args.source,
            block_size=args.block_size,
            mask_token_id=args.mask_token_id,
            dtype=None if args.dtype == "auto" else args.dtype,
            source_model=args.source_name,
            target_model=args.target,
        )
        tokenizer = None
        if (Path(args.source) / "tokenizer_config.json").is_file() or (Path(args.source) / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.source)
        drafter.save_pretrained(output, tokenizer=tokenizer)
    else:
        drafter = convert_autoregressive_checkpoint(
            args.source,
            args.output,
            num_layers=args.num_layers,
            layer_ids=layer_ids,
            block_size=args.block_size or 16,
            mask_token_id=args.mask_token_id,
            reuse_spare_id=not args.mask_embedding,
            dtype=args.dtype,
            source_model=args.source_name,
            target_model=args.target,
            overwrite=args.overwrite,
        )
    cfg = drafter.config
    mask = f"spare id {cfg.mask_token_id}" if cfg.mask_token_id is not None else "separate mask embedding"
    print(
        f"Saved a {cfg.num_hidden_layers}-layer D3D drafter (block size {cfg.block_size}, mask: {mask}, source layers "
        f"{cfg.source_layer_ids}) to {args.output}"
    )
    return 0


def _prune(args) -> int:
    from dataclasses import asdict

    from ..data import load_prompt_sources
    from ..prompts import encode_prompt
    from ..pruning import PATH_FILE, PLOT_FILE, STATE_FILE, plot_pruning_path, prune_drafter
    from ..utils import ensure_writable_dir

    output = Path(args.output)
    if not (output / STATE_FILE).exists():  # a folder with a state is resumed; anything else needs --overwrite
        ensure_writable_dir(output, args.overwrite)
    if args.offset < 0:
        raise ValueError(f"--offset must be >= 0, got {args.offset}")
    if args.min_tau_retention is not None and not 0.0 < args.min_tau_retention <= 1.0:
        raise ValueError(f"--min-tau-retention must be in (0, 1], got {args.min_tau_retention}")
    prompts = load_prompt_sources(args.prompts)[args.offset : args.offset + args.limit]
    if not prompts:
        raise ValueError(f"--prompts {args.prompts} with --offset {args.offset} leaves no prompt")
    _check_drafter_options(args)
    target_name, target, tokenizer, drafter = _load_pair(args)
    prompts_ids = [encode_prompt(tokenizer, p)[0].tolist() for p in prompts]
    pruned, steps = prune_drafter(
        drafter,
        target,
        prompts_ids,
        num_layers=args.num_layers,
        min_tau_retention=args.min_tau_retention,
        max_new_tokens=args.max_new_tokens,
        state_dir=output,
    )
    pruned.save_pretrained(output, tokenizer=tokenizer)
    record = {
        "command": "d3d-hf " + " ".join(sys.argv[1:]),
        "target": target_name,
        "drafter": args.drafter,
        "prompts": args.prompts,
        "prompt_ids": [p.id for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "steps": [asdict(step) for step in steps],
    }
    (output / PATH_FILE).write_text(json.dumps(record, indent=2))
    plot_pruning_path(steps, output / PLOT_FILE)
    print("| layers | removed | tau | retention | draft ms/block |\n|---|---|---|---|---|")
    for step in steps:
        removed = "-" if step.removed_layer is None else step.removed_layer
        print(f"| {step.num_layers} | {removed} | {step.tau:.3f} | {step.tau_retention:.3f} | {step.draft_ms:.1f} |")
    print(f"Saved the {pruned.config.num_hidden_layers}-layer drafter, {PATH_FILE} and {PLOT_FILE} to {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `d3d-hf` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train":
        # `train` takes every D3DTrainingConfig (trl.SFTConfig) field and `--config FILE.yaml`, parsed by trl.TrlParser
        import d3d_hf  # noqa: F401

        from ..training import main as train_main

        try:
            return train_main(argv[1:])
        except (FileExistsError, FileNotFoundError, ValueError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    args = _build_parser().parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    import d3d_hf  # noqa: F401  (registers the model type and the generation hook)

    handlers = {"init-drafter": _init_drafter, "generate": _generate, "bench": _bench, "data": _data}
    handlers.update({"report": _report, "cost-model": _cost_model, "export-causal-lm": _export_causal_lm})
    handlers.update({"push": _push, "convert": _convert, "prune": _prune, "magpie": _magpie})
    try:
        return handlers[args.command](args)
    except (OSError, ValueError) as err:  # missing/corrupt files, bad values: one line saying what to change
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
