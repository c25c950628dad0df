"""Argument types and flags shared by the subcommands: the generation-option flags (one per declared
`D3DGenerationOptions` field that a bench method takes), argparse types that say what they expect, and
`--dtype` / `--threads`."""

from __future__ import annotations

import argparse
import math

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
