"""`d3d-hf prune`: progressive layer pruning of a drafter by calibration tau (`d3d_hf.pruning`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .arguments import _add_common, _finite_float, _positive_int
from .common import _check_drafter_options, _load_pair


def _add_prune_parser(sub) -> None:
    """Subcommand `prune`."""
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
    tune = p.add_argument_group(
        "fine-tuning after each removal (the paper's recipe; needs the train extra): block adapters for a drafter "
        "that shares its target's weights, every weight for a standalone one"
    )
    tune.add_argument(
        "--finetune-data", default=None, help="training rows (as `d3d-hf train --data`): fine-tune after each removal"
    )
    tune.add_argument("--finetune-steps", type=_positive_int, default=50, help="optimizer steps per removal")
    tune.add_argument("--finetune-learning-rate", type=_finite_float, default=3e-4, help="peak learning rate")
    tune.add_argument("--finetune-batch-size", type=_positive_int, default=4, help="rows per step")
    tune.add_argument(
        "--finetune-distill-weight", type=_finite_float, default=1.0, help="weight of the target-logit distillation"
    )
    tune.add_argument("--finetune-max-samples", type=_positive_int, default=None, help="use the first N rows")
    p.add_argument("--output", required=True, help="folder for the pruned drafter, the path JSON/PNG and the state")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder without a state")
    _add_common(p)


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
    rows = _finetune_rows(args)  # the data is checked before any model loads
    target_name, target, tokenizer, drafter = _load_pair(args)
    prompts_ids = [encode_prompt(tokenizer, p)[0].tolist() for p in prompts]
    finetune = None if rows is None else _finetune(args, rows, drafter, target, tokenizer, output)
    pruned, steps = prune_drafter(
        drafter,
        target,
        prompts_ids,
        num_layers=args.num_layers,
        min_tau_retention=args.min_tau_retention,
        max_new_tokens=args.max_new_tokens,
        state_dir=output,
        finetune=finetune,
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
        "finetune": None
        if rows is None
        else {
            "data": args.finetune_data,
            "rows": len(rows),
            "steps": args.finetune_steps,
            "learning_rate": args.finetune_learning_rate,
            "batch_size": args.finetune_batch_size,
            "distill_weight": args.finetune_distill_weight,
        },
        "steps": [asdict(step) for step in steps],
    }
    (output / PATH_FILE).write_text(json.dumps(record, indent=2))
    plot_pruning_path(steps, output / PLOT_FILE)
    print("| layers | removed | tau | tau before fine-tuning | retention | draft ms/block |\n|---|---|---|---|---|---|")
    for step in steps:
        removed = "-" if step.removed_layer is None else step.removed_layer
        before = "-" if step.tau_before_finetune is None else f"{step.tau_before_finetune:.3f}"
        print(
            f"| {step.num_layers} | {removed} | {step.tau:.3f} | {before} | {step.tau_retention:.3f} | "
            f"{step.draft_ms:.1f} |"
        )
    print(f"Saved the {pruned.config.num_hidden_layers}-layer drafter, {PATH_FILE} and {PLOT_FILE} to {output}")
    return 0


def _finetune_rows(args):
    """The `--finetune-data` rows (first `--finetune-max-samples`), or `None` without fine-tuning.

    Raises:
        ValueError: fine-tuning options without `--finetune-data`, or fewer rows than `--finetune-max-samples`.
    """
    if args.finetune_data is None:
        if args.finetune_max_samples is not None:
            raise ValueError("--finetune-max-samples needs --finetune-data (the rows to fine-tune on)")
        return None
    from ..training.script import load_training_dataset

    rows = load_training_dataset(args.finetune_data)
    if args.finetune_max_samples is not None:
        if args.finetune_max_samples > len(rows):
            raise ValueError(
                f"--finetune-max-samples {args.finetune_max_samples} is more than the {len(rows)} rows of "
                f"{args.finetune_data}"
            )
        rows = rows.select(range(args.finetune_max_samples))
    return rows


def _finetune(args, rows, drafter, target, tokenizer, output: Path):
    """`trainer_finetune` with the `--finetune-*` options: block adapters for a drafter that shares the target's
    weights, every weight (embeddings included) of a standalone one, with its own next-token loss."""
    from ..pruning import trainer_finetune
    from ..training import D3DTrainingConfig

    shares = drafter.config.shares_target_weights
    config = D3DTrainingConfig(
        output_dir=str(output / "finetune"),
        max_steps=args.finetune_steps,
        learning_rate=args.finetune_learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=min(10, args.finetune_steps // 10),
        per_device_train_batch_size=args.finetune_batch_size,
        train_mode="block_adapter" if shares else "full",
        freeze_embeddings=shares,
        ar_loss_weight=0.0 if shares else 1.0,
        distill_weight=args.finetune_distill_weight,
        anchors_per_sequence=8,
        save_strategy="steps",
        save_steps=max(10, args.finetune_steps // 4),
        save_total_limit=1,
        logging_steps=10,
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        disable_tqdm=True,
    )
    return trainer_finetune(rows, config, target=target, processing_class=tokenizer)
