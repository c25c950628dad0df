"""Training prompt sources (`load_prompt_sources`): the stdlib prompts and JSONL files, never an evaluation set.

A source spec is a comma-separated list of:

* ``stdlib[:N]``: :func:`~d3d_hf.prompts.stdlib_prompts`, instructions derived from the documented functions and
  classes of the Python standard library installed with the interpreter (Python Software Foundation License
  Version 2);
* a JSONL file in the format of :func:`d3d_hf.prompts.load_prompts`, optionally ``path:N`` for its first N prompts;
* ``humaneval`` (and any prompt whose id starts with ``HumanEval/``) is refused: it is an evaluation set.
"""

from __future__ import annotations

from .benchmarks import load_prompts
from .prompt import Prompt
from .stdlib import stdlib_prompts

EVALUATION_SETS = frozenset({"humaneval"})
"""Prompt sets used for evaluation; :func:`load_prompt_sources` refuses them for training data."""

_EVALUATION_ID_PREFIXES = ("HumanEval/",)


def load_prompt_sources(spec: str, seed: int = 0) -> list[Prompt]:
    """Load training prompts from a comma-separated list of sources.

    Each item is ``stdlib`` or ``stdlib:N`` (:func:`stdlib_prompts` with ``limit=N``), or a JSONL file path,
    optionally ``path:N`` for its first N prompts (:func:`d3d_hf.prompts.load_prompts`). Example:
    ``"stdlib:600,data/extra.jsonl"``.

    Args:
        spec: The comma-separated sources.
        seed: Seed passed to :func:`stdlib_prompts`.

    Returns:
        The prompts of all sources, in the order given.

    Raises:
        ValueError: An empty spec or item, a count that is not a positive integer, an evaluation set
            (``humaneval``: evaluation prompts must never be trained on), a prompt whose id marks it as an
            evaluation prompt (``HumanEval/...``), ids repeated across sources, or whatever
            :func:`~d3d_hf.prompts.load_prompts` raises for a bad file.
        FileNotFoundError: A file that does not exist.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"Expected prompt sources such as 'stdlib:600,path/to/file.jsonl', got {spec!r}.")
    prompts: list[Prompt] = []
    origin: dict[str, str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"Empty item in prompt sources {spec!r}: separate sources with single commas.")
        source, limit = item, None
        head, sep, tail = item.rpartition(":")
        if sep and head and (tail.strip().lstrip("-").isdigit() or head.strip().lower() == "stdlib"):
            if not tail.strip().isdigit() or int(tail) < 1:
                raise ValueError(f"{item!r}: the count after ':' must be a positive integer.")
            source, limit = head.strip(), int(tail)
        name = source.lower()
        if name in EVALUATION_SETS:
            raise ValueError(
                f"{source!r} is an evaluation set: it must never be used as training data (the drafter would be "
                "measured on prompts it was trained on). Use 'stdlib[:N]' or a JSONL file of other prompts."
            )
        if name == "stdlib":
            loaded = stdlib_prompts(limit=limit, seed=seed)
        else:
            loaded = load_prompts(source, limit=limit)
        for p in loaded:
            if p.id.startswith(_EVALUATION_ID_PREFIXES):
                raise ValueError(
                    f"{source!r} holds the evaluation prompt {p.id!r}: evaluation prompts must never be used as "
                    "training data. Remove them from the file."
                )
            if p.id in origin:
                raise ValueError(
                    f"Prompt id {p.id!r} appears in both {origin[p.id]!r} and {source!r}: ids must be unique "
                    'across sources (give the file\'s prompts distinct "id" fields).'
                )
            origin[p.id] = source
        prompts.extend(loaded)
    return prompts


__all__ = ["EVALUATION_SETS", "load_prompt_sources"]
