"""Shared by the timing scripts in this folder: print a recorded table and append it to an optional file."""

from __future__ import annotations


def emit(lines: list[str], output: str | None) -> None:
    """Prints `lines` as one markdown block and, when `output` names a file, appends it there (a blank line after)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if output:
        with open(output, "a", encoding="utf-8") as f:
            f.write(text + "\n")
