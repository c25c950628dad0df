"""Training prompt sources (`load_prompt_sources`): the stdlib prompts and JSONL files, never an evaluation set.

A source spec is a comma-separated list of:

* ``stdlib[:N]``: :func:`~d3d_hf.prompts.stdlib_prompts`, instructions derived from the documented functions and
  classes of the Python standard library installed with the interpreter (Python Software Foundation License
  Version 2);
* ``math[:N]`` and ``chat[:N]``: :func:`~d3d_hf.prompts.math_word_problems` and
  :func:`~d3d_hf.prompts.chat_instructions`, templated math word problems and chat requests written by this
  project (:mod:`d3d_hf.prompts.synthetic`); ``math-extra[:N]`` and ``chat-extra[:N]``: more kinds of both
  (:mod:`d3d_hf.prompts.synthetic_extra`);
* a JSONL file in the format of :func:`d3d_hf.prompts.load_prompts`, optionally ``path:N`` for its first N prompts;
* every evaluation set the bench knows (``humaneval``, ``gsm8k``, ``mt-bench``, ``vicuna-bench``: the keys of
  :data:`~d3d_hf.prompts.PROMPT_SETS`) is refused, and so is any prompt whose id is an evaluation id
  (``HumanEval/3``, ``gsm8k/12``, ...), whose user turn is, word for word, a prompt of one of those sets, or whose
  user turn nearly duplicates one (:func:`near_evaluation_match`: half of the shorter text's word n-grams shared).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from .benchmarks import PROMPT_SETS, load_prompts
from .prompt import Prompt
from .stdlib import stdlib_prompts
from .synthetic_extra import SYNTHETIC_SOURCES

EVALUATION_SETS = frozenset(PROMPT_SETS)
"""Prompt sets used for evaluation (every set the bench knows); :func:`load_prompt_sources` refuses them for
training data, and :func:`refuse_evaluation_rows` refuses datasets that hold their prompts."""

_NAMED_SOURCES = frozenset({"stdlib", *SYNTHETIC_SOURCES})
"""Source names that are not file paths (a file named like one needs a path, e.g. ``./math``)."""

_EVALUATION_ID = re.compile(r"^(HumanEval|gsm8k|mt-bench|vicuna-bench)/\d+$")
"""The ids `load_prompts` gives the prompts of the evaluation sets."""


@functools.lru_cache(maxsize=1)
def evaluation_texts() -> dict[str, str]:
    """The prompt texts of the evaluation sets, stripped: each user turn and raw prompt -> the id of its prompt.

    Sets whose PyPI package is not installed are left out (their prompts cannot be recognised; the refusal of the
    set names does not need them).
    """
    texts: dict[str, str] = {}
    for name in sorted(EVALUATION_SETS):
        try:
            prompts = load_prompts(name)
        except (ModuleNotFoundError, FileNotFoundError):
            continue
        for p in prompts:
            for text in [m["content"] for m in p.messages if m.get("role") == "user"] + [p.raw or ""]:
                if text.strip():
                    texts.setdefault(text.strip(), p.id)
    return texts


NEAR_DUPLICATE_NGRAMS = ((16, 3), (40, 5), (None, 8))
"""Word n-gram length of the near-duplicate check by the candidate's length: under 16 words 3-grams, under 40 words
5-grams, else 8-grams (:func:`near_evaluation_match`)."""
NEAR_DUPLICATE_THRESHOLD = 0.5
"""Share of the shorter text's word n-grams that, found in the other text, makes two texts near-duplicates."""

_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _ngram_length(num_words: int) -> int:
    return next(n for most, n in NEAR_DUPLICATE_NGRAMS if most is None or num_words < most)


def _word_ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    """The word n-grams of `words`; fewer than `n` words are one n-gram."""
    if not words:
        return set()
    if len(words) <= n:
        return {tuple(words)}
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@functools.lru_cache(maxsize=1)
def _evaluation_ngram_index() -> dict[int, tuple[dict[tuple[str, ...], list[str]], dict[str, int]]]:
    """For each n-gram length: word n-gram -> the evaluation prompt ids that hold it, and each id's n-gram count."""
    out = {}
    for _, n in NEAR_DUPLICATE_NGRAMS:
        index: dict[tuple[str, ...], list[str]] = {}
        sizes: dict[str, int] = {}
        for text, pid in evaluation_texts().items():
            grams = _word_ngrams(_words(text), n)
            sizes[pid] = max(sizes.get(pid, 0), len(grams))
            for gram in grams:
                ids = index.setdefault(gram, [])
                if pid not in ids:
                    ids.append(pid)
        out[n] = (index, sizes)
    return out


def near_evaluation_match(text: str, threshold: float = NEAR_DUPLICATE_THRESHOLD) -> str | None:
    """The evaluation prompt that `text` nearly duplicates, by word n-gram overlap, else `None`.

    Two texts are near-duplicates when at least `threshold` of the word n-grams (lowercased alphanumeric words;
    punctuation, case and spacing ignored) of the *shorter* of them occur in the other. Containment of the shorter
    text catches both a reworded copy of an evaluation prompt and a training prompt that embeds one inside other
    text. The n-gram length follows the candidate's length (:data:`NEAR_DUPLICATE_NGRAMS`: 3 words under 16 words, 5
    under 40, else 8), so that one changed word in a short prompt does not hide it, and common phrases ("write a
    Python function that returns") do not match long prompts on their own. This is the n-gram overlap test of
    data-contamination studies (GPT-3, arXiv 2005.14165, appendix C, used 13-grams on long documents), scaled to
    prompts.

    Args:
        text (`str`): a candidate training prompt (a user turn).
        threshold (`float`, default 0.5): the overlap share, in (0, 1].

    Returns:
        `str | None`: the id of the matched evaluation prompt (e.g. ``"gsm8k/12"``), or `None`. Evaluation sets whose
        PyPI package is not installed cannot be matched (:func:`evaluation_texts`).

    Raises:
        ValueError: `threshold` outside (0, 1].
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}.")
    words = _words(text)
    n = _ngram_length(len(words))
    grams = _word_ngrams(words, n)
    if not grams:
        return None
    index, sizes = _evaluation_ngram_index()[n]
    shared: dict[str, int] = {}
    for gram in grams:
        for pid in index.get(gram, ()):
            shared[pid] = shared.get(pid, 0) + 1
    for pid, count in sorted(shared.items(), key=lambda item: -item[1]):
        if count >= threshold * min(len(grams), sizes[pid]):
            return pid
    return None


def _evaluation_match(prompt_id: str | None, texts: Iterable[str]) -> str | None:
    """The evaluation prompt id that `prompt_id` or one of `texts` is, else `None`."""
    if prompt_id is not None and _EVALUATION_ID.match(str(prompt_id)):
        return str(prompt_id)
    known = evaluation_texts()
    texts = [t for t in texts if isinstance(t, str)]
    for text in texts:
        if text.strip() in known:
            return known[text.strip()]
    for text in texts:
        found = near_evaluation_match(text)
        if found is not None:
            return found
    return None


def _user_texts(value) -> list[str]:
    """The user-turn strings of a `prompt` / `messages` value (a string, or a list of chat messages)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [m["content"] for m in value if isinstance(m, dict) and m.get("role") == "user" and "content" in m]
    return []


def refuse_evaluation_rows(dataset, where: str = "the dataset") -> None:
    """Raises if a training dataset holds an evaluation prompt (never train on what the bench measures).

    A row is an evaluation prompt when its `id` is one `load_prompts` gives an evaluation set (`HumanEval/3`,
    `gsm8k/12`, `mt-bench/81`, `vicuna-bench/5`) or a user turn of its `messages` or `prompt` (a string or chat
    messages) equals, after stripping, a prompt of an evaluation set (:func:`evaluation_texts`) or nearly duplicates
    one (:func:`near_evaluation_match`). Plain text fields
    are not searched. A `datasets.IterableDataset` is checked on its first 1000 rows.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or a sequence of dicts): the training rows.
        where (`str`): how the error names the dataset.

    Raises:
        ValueError: naming the first evaluation prompt found and what to do.
    """
    from itertools import islice

    columns = getattr(dataset, "column_names", None)
    if columns is not None and not ({"id", "messages", "prompt"} & set(columns)):
        return
    rows = dataset
    if columns is not None and hasattr(dataset, "select_columns"):
        rows = dataset.select_columns([c for c in ("id", "messages", "prompt") if c in columns])
    if not hasattr(rows, "__len__"):
        rows = islice(rows, 1000)
    for index, row in enumerate(rows):
        texts = _user_texts(row.get("messages")) + _user_texts(row.get("prompt"))
        found = _evaluation_match(row.get("id"), texts)
        if found is not None:
            raise ValueError(
                f"Row {index} of {where} is the evaluation prompt {found!r} ({', '.join(sorted(EVALUATION_SETS))} "
                "are what `d3d-hf bench` measures): never train a drafter on them. Remove those rows, e.g. "
                "generate data from 'stdlib[:N]' or your own prompts."
            )


def load_prompt_sources(spec: str, seed: int = 0) -> list[Prompt]:
    """Load training prompts from a comma-separated list of sources.

    Each item is ``stdlib`` or ``stdlib:N`` (:func:`stdlib_prompts` with ``limit=N``), ``math[:N]``,
    ``chat[:N]``, ``math-extra[:N]`` or ``chat-extra[:N]`` (the templated sources of :mod:`d3d_hf.prompts.synthetic`
    and :mod:`d3d_hf.prompts.synthetic_extra`, 400 prompts without ``:N``), or a JSONL file path, optionally
    ``path:N`` for its first N prompts (:func:`d3d_hf.prompts.load_prompts`). Example:
    ``"stdlib:600,math:300,chat:300,data/extra.jsonl"``.

    Args:
        spec: The comma-separated sources.
        seed: Seed passed to :func:`stdlib_prompts` and the templated sources.

    Returns:
        The prompts of all sources, in the order given.

    Raises:
        ValueError: An empty spec or item, a count that is not a positive integer, an evaluation set
            (:data:`EVALUATION_SETS`: evaluation prompts must never be trained on), a prompt that is an evaluation
            prompt (its id, its user turn word for word, or a near-duplicate of one), ids repeated across sources, or
            whatever :func:`~d3d_hf.prompts.load_prompts` raises for a bad file.
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
        if sep and head and (tail.strip().lstrip("-").isdigit() or head.strip().lower() in _NAMED_SOURCES):
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
        elif name in SYNTHETIC_SOURCES:
            loaded = SYNTHETIC_SOURCES[name](limit=400 if limit is None else limit, seed=seed)
        else:
            loaded = load_prompts(source, limit=limit)
        for p in loaded:
            found = _evaluation_match(p.id, [*_user_texts(list(p.messages)), p.raw or ""])
            if found is not None:
                raise ValueError(
                    f"{source!r} holds the evaluation prompt {found!r} (prompt {p.id!r}): evaluation prompts must "
                    "never be used as training data. Remove them from the file."
                )
            if p.id in origin:
                raise ValueError(
                    f"Prompt id {p.id!r} appears in both {origin[p.id]!r} and {source!r}: ids must be unique "
                    'across sources (give the file\'s prompts distinct "id" fields).'
                )
            origin[p.id] = source
        prompts.extend(loaded)
    return prompts


__all__ = [
    "EVALUATION_SETS",
    "NEAR_DUPLICATE_NGRAMS",
    "NEAR_DUPLICATE_THRESHOLD",
    "evaluation_texts",
    "load_prompt_sources",
    "near_evaluation_match",
    "refuse_evaluation_rows",
]
