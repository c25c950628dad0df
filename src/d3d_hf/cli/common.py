"""What several subcommands share: the checks of the options before any model loads, loading the target and the
drafter (`--target`, `--drafter`), and the check of an output file."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .arguments import given_generation_options, option_flag


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
        from ..targets import KNOWN_TARGETS

        origin = "--target" if args.target else f"the target recorded in the drafter's config ({args.drafter})"
        reason = str(err).rstrip(". ")
        advice = (
            ""
            if "known names" in reason.lower()  # load_target's own message already lists them
            else f" Pass --target with a known name ({', '.join(sorted(KNOWN_TARGETS))}), a local folder or .gguf "
            "file, or a Hub id this machine can reach."
        )
        raise ValueError(f"cannot load {origin} {target_name!r}: {reason}.{advice}") from err
    if drafter is not None and getattr(args, "block_size", None) is not None:
        drafter.config.block_size = args.block_size
    return target_name, target, tokenizer, drafter


def _check_output_file(output: Path | None, overwrite: bool, flag: str = "--output") -> None:
    if output is None:
        return
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists; choose another {flag} or pass --overwrite")
    if any(p.exists() and not p.is_dir() for p in output.parents):
        raise ValueError(f"{flag} {output}: a parent of it is a file, not a folder")
