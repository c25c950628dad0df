"""`d3d-hf init-drafter` (a drafter from an autoregressive model) and `d3d-hf export-causal-lm` (a drafter's layers
as a plain causal LM)."""

from __future__ import annotations

import os
from pathlib import Path

from .arguments import _add_common, _layer_ids, _positive_int


def _add_init_drafter_parser(sub) -> None:
    """Subcommand `init-drafter`."""
    p = sub.add_parser("init-drafter", help="create a D3D drafter from an autoregressive model of the same tokenizer")
    p.add_argument("--from", dest="source", required=True, help="target/source model: known name, folder or hub id")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--num-layers", type=_positive_int, default=None, help="copy the first N layers (default: all)")
    group.add_argument("--layer-ids", type=_layer_ids, default=None, help="comma-separated source layer indices")
    p.add_argument("--block-size", type=_positive_int, default=16, help="draft block size B (default 16)")
    p.add_argument("--output", required=True, help="folder to write the drafter to")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder")
    _add_common(p)


def _add_export_causal_lm_parser(sub) -> None:
    """Subcommand `export-causal-lm`."""
    p = sub.add_parser("export-causal-lm", help="save a drafter's layers as a plain causal LM (an ar-assist assistant)")
    p.add_argument("--drafter", required=True, help="drafter folder (e.g. trained with --block_loss_weight 0)")
    p.add_argument("--target", default=None, help="target to attach when the drafter shares its weights")
    p.add_argument("--output", required=True, help="folder for the causal LM (config, safetensors, tokenizer)")
    p.add_argument("--overwrite", action="store_true", help="allow writing into a non-empty folder")
    _add_common(p)


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
