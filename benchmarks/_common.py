"""Shared by the timing scripts in this folder: their common options, and printing a recorded table (appended to an
optional file)."""

from __future__ import annotations

import argparse


def emit(lines: list[str], output: str | None) -> None:
    """Prints `lines` as one markdown block and, when `output` names a file, appends it there (a blank line after)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if output:
        with open(output, "a", encoding="utf-8") as f:
            f.write(text + "\n")


def add_timing_arguments(parser: argparse.ArgumentParser, repeats: int = 25) -> None:
    """`--dtype`, `--threads`, `--repeats`, `--context` (cached tokens before each timed forward) and `--output`."""
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--context", type=int, default=256, help="cached tokens before each timed forward")
    parser.add_argument("--output", help="also write the table to this markdown file")
