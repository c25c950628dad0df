"""The checks `D3DTrainer` makes on its datasets before TRL prepares them: an empty dataset, rows with nothing to
learn, and a `max_length` too short to hold one block. Without them these end deep inside TRL or torch (a bare
`StopIteration`, a sampler asking for a positive `num_samples`) or, worse, train on rows that teach nothing."""

from __future__ import annotations

from collections.abc import Callable

SHOWN = 5  # row indices named in an error


def _is_empty(dataset) -> bool:
    """Whether a dataset holds no row (an `IterableDataset` is peeked at, not consumed)."""
    try:
        return len(dataset) == 0
    except TypeError:  # an IterableDataset has no length
        return next(iter(dataset), None) is None


def _learned(content) -> bool:
    """Whether a message content or completion holds text to learn: a non-blank string, or a non-empty list of parts
    or of messages whose contents do."""
    if isinstance(content, str):
        return bool(content.strip())
    if isinstance(content, dict):
        return _learned(content.get("content", content.get("text")))
    if isinstance(content, (list, tuple)):
        return any(_learned(part) for part in content)
    return content is not None


def _has_assistant_turn(messages) -> bool:
    if not isinstance(messages, (list, tuple)):
        return False
    return any(isinstance(m, dict) and m.get("role") == "assistant" and _learned(m.get("content")) for m in messages)


def _any_learned_id(row: dict) -> bool:
    """A pre-tokenized row (`input_ids` with optional `labels` / `completion_mask` / `assistant_masks`, as TRL reads
    them) has a token to learn."""
    if len(row["input_ids"]) < 2:  # the first token is never a target: nothing comes before it
        return False
    if row.get("labels") is not None:
        return any(int(x) != -100 for x in row["labels"][1:])
    masks = [row[k] for k in ("completion_mask", "assistant_masks") if row.get(k) is not None]
    return all(any(int(x) for x in mask[1:]) for mask in masks)


def _rule(columns: set[str], text_field: str) -> tuple[Callable[[dict], bool], list[str], str, str] | None:
    """For the dataset's format (the first TRL would take): whether a row has something to learn, the columns that
    tells from, what is missing from a row that has not, and the change to make."""
    if {"prompt_ids", "response_ids"} <= columns:
        return (
            lambda row: len(row["response_ids"]) > 0,
            ["response_ids"],
            "an empty `response_ids`",
            "drop them: `dataset.filter(lambda row: len(row['response_ids']) > 0)`",
        )
    if "messages" in columns:
        return (
            lambda row: _has_assistant_turn(row["messages"]),
            ["messages"],
            "no assistant turn with content (only an assistant's tokens are learned)",
            "add the assistant's answers, or drop them: `dataset.filter(lambda row: any(m['role'] == 'assistant' "
            "and (m['content'] or '').strip() for m in row['messages']))`",
        )
    if {"prompt", "completion"} <= columns:
        return (
            lambda row: _learned(row["completion"]),
            ["completion"],
            "an empty `completion` (only the completion's tokens are learned)",
            "give each prompt its completion, or drop them: `dataset.filter(lambda row: (row['completion'] if "
            "isinstance(row['completion'], str) else ''.join(m['content'] or '' for m in row['completion'])).strip())`",
        )
    if "input_ids" in columns:
        return (
            _any_learned_id,
            sorted(columns & {"input_ids", "labels", "completion_mask", "assistant_masks"}),
            "no token to learn after their first (`labels` all -100 / a `completion_mask` or `assistant_masks` all "
            "0 there, or fewer than 2 `input_ids`)",
            "drop them, or mark the tokens to learn",
        )
    if text_field in columns:
        return (
            lambda row: _learned(row[text_field]),
            [text_field],
            f"an empty `{text_field}`",
            f"drop them: `dataset.filter(lambda row: row['{text_field}'].strip() != '')`",
        )
    return None  # a format TRL names in its own error


ID_COLUMNS = ("prompt_ids", "response_ids", "input_ids")


def _check_ids(dataset, where: str, vocab_size: int) -> None:
    """Refuses token ids outside `[0, vocab_size)` (rows tokenized by another tokenizer), before an embedding lookup
    fails on them in the middle of training."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = [c for c in ID_COLUMNS if c in dataset.column_names]
    if not columns:
        return
    table = dataset.with_format("arrow")[:]
    bad: set[int] = set()
    for column in columns:
        values = table.column(column)
        if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
            continue  # not a list column: TRL or the collator names it
        flat = pc.list_flatten(values)
        if not len(flat):
            continue
        parents = pc.list_parent_indices(values)
        outside = pc.or_(pc.less(flat, 0), pc.greater_equal(flat, vocab_size))
        bad.update(pc.filter(parents, outside).to_pylist())
    if bad:
        rows = sorted(bad)
        shown = ", ".join(str(i) for i in rows[:SHOWN]) + (", ..." if len(rows) > SHOWN else "")
        raise ValueError(
            f"{len(rows)} of {len(dataset)} rows of `{where}` hold token ids outside the drafter's vocabulary "
            f"[0, {vocab_size}) ({'row' if len(rows) == 1 else 'rows'} {shown}): they were tokenized with another "
            "tokenizer. Tokenize them with the target's tokenizer (or regenerate them with `d3d-hf data`)."
        )


def check_training_rows(dataset, where: str, text_field: str = "text", vocab_size: int | None = None) -> None:
    """Refuses a dataset with no row, or with rows that hold nothing to learn.

    Args:
        dataset (`datasets.Dataset`, `datasets.IterableDataset` or `dict` of them): what `D3DTrainer` was given;
            `None` is accepted (no dataset). An `IterableDataset` is only checked for being empty (scanning it would
            consume a stream).
        where (`str`): the argument's name in the error (`"train_dataset"`, `"eval_dataset"`).
        text_field (`str`, defaults to `"text"`): `dataset_text_field` of the config.
        vocab_size (`int`, *optional*): the drafter's vocabulary size; given, pre-tokenized rows (`prompt_ids`,
            `response_ids`, `input_ids`) must hold ids in `[0, vocab_size)`.

    Raises:
        ValueError: naming `where`, if the dataset has no row; or naming how many and which rows (the first five
            indices) have nothing to learn, for the format TRL reads: `prompt_ids` / `response_ids` with an empty
            response, `messages` without an assistant turn that has content, `prompt` / `completion` with an empty
            completion, `input_ids` with no learned token after the first, or an empty text; or which rows hold
            token ids outside `[0, vocab_size)`. The message says what to change.
    """
    if dataset is None:
        return
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            check_training_rows(part, f"{where}[{name!r}]", text_field, vocab_size)
        return
    if _is_empty(dataset):
        raise ValueError(
            f"`{where}` is empty (0 rows): there is nothing to train on. Pass a dataset with rows (e.g. the folder "
            "`d3d-hf data` writes, or rows with `messages`), and check any filter or split that made it."
        )
    if not hasattr(dataset, "__len__") or not getattr(dataset, "column_names", None):
        return
    if vocab_size is not None:
        _check_ids(dataset, where, vocab_size)
    rule = _rule(set(dataset.column_names), text_field)
    if rule is None:
        return
    has_target, columns, missing, change = rule
    bad = [i for i, row in enumerate(dataset.select_columns(columns)) if not has_target(row)]
    if bad:
        shown = ", ".join(str(i) for i in bad[:SHOWN]) + (", ..." if len(bad) > SHOWN else "")
        raise ValueError(
            f"{len(bad)} of {len(dataset)} rows of `{where}` have {missing}, so no token of theirs is a training "
            f"target ({'row' if len(bad) == 1 else 'rows'} {shown}): {change}."
        )


def check_max_length(max_length: int | None, block_size: int) -> None:
    """Refuses a `max_length` that no block fits in: a block is an anchor token and the `block_size - 1` tokens drafted
    after it (D3D's blockwise denoising objective), so a sequence holds one only from `block_size` tokens on.

    Raises:
        ValueError: `max_length < block_size`, naming the smallest workable `max_length`.
    """
    if max_length is not None and max_length < block_size:
        raise ValueError(
            f"max_length={max_length} is below the block size {block_size}: a block is an anchor token and the "
            f"{block_size - 1} tokens drafted after it, so no sequence cut to {max_length} tokens can hold one. Pass "
            f"max_length >= {block_size} (the smallest that holds one block; a few hundred tokens is usual), or "
            "None for no limit."
        )


__all__ = ["check_max_length", "check_training_rows"]
