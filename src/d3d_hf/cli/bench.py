"""The measuring subcommands: `d3d-hf bench` (methods interleaved on real prompts, `d3d_hf.bench`), `d3d-hf report`
(tables and plots over bench results) and `d3d-hf cost-model` (forward times and the speed-ups they imply)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .arguments import (
    OPTION_METHODS,
    _add_common,
    _float_list,
    _positive_int,
    add_generation_option_arguments,
    given_generation_options,
    option_flag,
)
from .common import _check_drafter_options, _check_output_file, _load_pair


def _add_bench_parser(sub) -> None:
    """Subcommand `bench`."""
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
    from ..bench.methods import METHODS  # the registry, so that the help lists every registered method

    p.add_argument("--methods", default="target,d3d", help=f"comma-separated, of: {','.join(METHODS)}")
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


def _add_report_parser(sub) -> None:
    """Subcommand `report`."""
    p = sub.add_parser("report", help="Markdown table and plots over several `d3d-hf bench` results")
    p.add_argument("results", nargs="+", help="results JSON files of `d3d-hf bench`")
    p.add_argument("--output-dir", required=True, help="folder for report.md and the PNG plots")
    p.add_argument("--title", default="Benchmark", help="title of report.md")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder")


def _add_cost_model_parser(sub) -> None:
    """Subcommand `cost-model`."""
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


def idle_drafter_notes(summary: dict) -> list[str]:
    """One line for each of `d3d`, `d3d-tree` in a bench `summary` whose rounds never drafted: the cost-aware engine
    rated every draft pass not worth its cost on this machine (its `round_sources` hold only lookup and target
    rounds), so that method's numbers say nothing about the drafter, and how to make it draft every round."""
    notes = []
    for method in ("d3d", "d3d-tree"):
        sources = (summary.get(method) or {}).get("round_sources") or {}
        if sum(sources.values()) and not sources.get("drafter"):
            notes.append(
                f"note: {method} drafted no round: the cost-aware engine found prompt lookup or plain target steps "
                "cheaper per token than a draft pass on this machine for these prompts, so its row measures the "
                "engine without the drafter. Add --num-drafts full --no-prompt-lookup to draft every round."
            )
    return notes


def _check_assistant_name(name: str) -> None:
    """Refuses, before any model loads, an `--assistant` that names a local path that does not exist."""
    from ..assistants import KNOWN_ASSISTANTS
    from ..targets import _looks_like_path

    if name not in KNOWN_ASSISTANTS and _looks_like_path(name) and not Path(name).expanduser().exists():
        raise FileNotFoundError(
            f"--assistant {name!r}: no such file or folder. Pass a shipped assistant "
            f"({', '.join(sorted(KNOWN_ASSISTANTS))}), an existing folder, or a Hub id this machine can reach."
        )


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
        verb, them = ("applies", "it") if len(flags) == 1 else ("apply", "them")
        add = which if len(applies) == 1 else "one of them"
        raise ValueError(f"{', '.join(flags)} only {verb} to {which}: add {add} to --methods or drop {them}")
    given = {"drafter": args.drafter or None, "assistant": args.assistant or None}  # what the flags can give
    missing = missing_resource(methods, given)
    if missing is not None:
        m, needed = missing
        if needed not in given:
            raise ValueError(f"method {m} needs a {needed}, which the command line cannot give")
        hint = " (the shipped one: --assistant ar-smollm2-135m-instruct)" if needed == "assistant" else ""
        raise ValueError(f"method {m} needs --{needed}{hint}")
    if args.assistant:
        _check_assistant_name(args.assistant)
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
    for note in idle_drafter_notes(result["summary"]):
        print("\n" + note)
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
    from ..report import load_bench_results, write_report
    from ..utils import ensure_writable_dir

    results = load_bench_results(args.results)  # every file checked before the folder is made
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
