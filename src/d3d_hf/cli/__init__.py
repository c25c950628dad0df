"""`d3d-hf` command line: `init-drafter`, `generate`, `data`, `train`, `bench`, `report`, `cost-model`,
`export-causal-lm`, `push` and `convert`.

One module per subcommand or group of related ones (`drafters`: init-drafter, export-causal-lm; `generate`; `bench`:
bench, report, cost-model; `prune`; `data`: data, magpie; `hub`: push, convert), each with its parser and its
handler; `arguments` and `common` hold what they share. `train` is parsed by `d3d_hf.training` (trl.TrlParser)."""

from __future__ import annotations

import argparse
import sys

import torch

from .arguments import OPTION_METHODS as OPTION_METHODS
from .arguments import add_generation_option_arguments as add_generation_option_arguments
from .arguments import given_generation_options as given_generation_options
from .arguments import option_flag as option_flag
from .bench import _add_bench_parser, _add_cost_model_parser, _add_report_parser, _bench, _cost_model, _report
from .data import _add_data_parser, _add_magpie_parser, _data, _magpie
from .drafters import _add_export_causal_lm_parser, _add_init_drafter_parser, _export_causal_lm, _init_drafter
from .generate import _add_generate_parser, _generate
from .hub import _add_hub_commands, _convert, _push
from .prune import _add_prune_parser, _prune


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="d3d-hf", description="D3D block-diffusion drafters for speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_init_drafter_parser(sub)
    _add_generate_parser(sub)
    sub.add_parser(
        "train", help="train a drafter on `d3d-hf data` output or a TRL dataset (TRL's flags; `d3d-hf train --help`)"
    )
    _add_bench_parser(sub)
    _add_report_parser(sub)
    _add_cost_model_parser(sub)
    _add_export_causal_lm_parser(sub)
    _add_prune_parser(sub)
    _add_data_parser(sub)
    _add_magpie_parser(sub)
    _add_hub_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `d3d-hf` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "train":
        # `train` takes every D3DTrainingConfig (trl.SFTConfig) field and `--config FILE.yaml`, parsed by trl.TrlParser
        import d3d_hf  # noqa: F401

        try:
            from ..training import main as train_main
        except ModuleNotFoundError as err:  # the training extras (trl, datasets) are not installed
            print(
                f"error: `d3d-hf train` needs the training extras ({err}): pip install -e '.[train]' in the "
                "repository (the README's test install includes them; its main-job install does not)",
                file=sys.stderr,
            )
            return 2
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
    except (OSError, ValueError, ModuleNotFoundError) as err:  # missing files or packages, bad values: one line
        print(f"error: {err}", file=sys.stderr)
        return 2
