"""Telling complete `Trainer` checkpoints from the remainders of interrupted saves."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether a `Trainer` checkpoint folder was written to the end.

    `Trainer` writes `trainer_state.json` after the model, optimizer, scheduler and RNG state, so a folder whose
    `trainer_state.json` is missing or unreadable is the remainder of an interrupted save.
    """
    try:
        json.loads((Path(path) / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The `checkpoint-N` folder of `output_dir` with the largest `N` that `is_complete_checkpoint` accepts (`None`
    if there is none). transformers' `get_last_checkpoint` takes the largest `N` even when its save was cut short."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    steps = [
        (int(match.group(1)), child)
        for child in folder.iterdir()
        if (match := _CHECKPOINT_NAME.match(child.name)) and child.is_dir() and is_complete_checkpoint(child)
    ]
    return str(max(steps)[1]) if steps else None


__all__ = ["is_complete_checkpoint", "last_complete_checkpoint"]
