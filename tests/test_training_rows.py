"""D3DTrainer refuses, before any training step, the datasets it cannot learn from (issue 38): an empty dataset, rows
with nothing to learn in each format TRL reads, a `max_length` below the block size, and truncation that leaves no
row; and the `d3d-hf train` command says the same in one error line."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, IterableDataset
from test_training_trl import BLOCK, _config, _drafter, _tokenizer, _words

from d3d_hf.cli import main
from d3d_hf.training import D3DTrainer
from d3d_hf.training.rows import check_training_rows


def _chat(user: str, answer: str | None) -> dict:
    messages = [{"role": "user", "content": user}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


GOOD = _chat("t3 t4 t5", "t6 t7 t8 t9 t30")


def _trainer(target, dataset, tmp_path, **config):
    return D3DTrainer(
        _drafter(target), _config(tmp_path / "run", max_steps=1, **config), train_dataset=dataset,
        processing_class=_tokenizer(),
    )  # fmt: skip


@pytest.fixture()
def no_forward(monkeypatch):
    """Fails a test in which the drafter runs a forward pass (the checks come before any)."""
    from d3d_hf import D3DForDiffusionDrafting

    def forward(*args, **kwargs):
        raise AssertionError("a forward pass ran before the dataset was refused")

    monkeypatch.setattr(D3DForDiffusionDrafting, "forward", forward)


@pytest.mark.parametrize(
    "dataset",
    [
        Dataset.from_list([]),
        Dataset.from_dict({"messages": []}),
        Dataset.from_dict({"prompt_ids": [], "response_ids": []}),
        IterableDataset.from_generator(lambda: iter(())),
    ],
    ids=["no-columns", "messages", "d3d-data", "iterable"],
)
def test_an_empty_dataset_is_refused(target, tmp_path, dataset, no_forward):
    with pytest.raises(ValueError, match=r"`train_dataset` is empty \(0 rows\)"):
        _trainer(target, dataset, tmp_path)


def test_an_empty_eval_dataset_is_refused(target, tmp_path, no_forward):
    with pytest.raises(ValueError, match=r"`eval_dataset\['dev'\]` is empty"):
        D3DTrainer(
            _drafter(target), _config(tmp_path / "run", max_steps=1), train_dataset=Dataset.from_list([GOOD] * 4),
            eval_dataset={"dev": Dataset.from_dict({"messages": []})}, processing_class=_tokenizer(),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        # user turns only: nothing an assistant said
        ([_chat("t3 t4", None)] * 3, r"3 of 3 rows .* no assistant turn with content .*\(rows 0, 1, 2\)"),
        ([GOOD, GOOD, _chat("t3 t4", None), GOOD, _chat("t5", "  ")], r"2 of 5 rows .*\(rows 2, 4\).*dataset\.filter"),
        # prompt-completion rows with empty completions, plain and conversational
        ([{"prompt": "t3 t4", "completion": ""}] * 2, r"2 of 2 rows .* an empty `completion`"),
        (
            [{"prompt": [{"role": "user", "content": "t3"}], "completion": [{"role": "assistant", "content": ""}]}],
            r"1 of 1 rows .* an empty `completion`",
        ),
        # `d3d-hf data` rows with an empty response
        ([{"prompt_ids": [3, 4], "response_ids": [5, 6]}, {"prompt_ids": [3], "response_ids": []}], r"\(row 1\)"),
        # pre-tokenized rows with no learned token
        ([{"input_ids": [3, 4, 5], "labels": [-100, -100, -100]}], r"no token to learn"),
        ([{"input_ids": [3, 4, 5], "completion_mask": [0, 0, 0]}], r"no token to learn"),
        ([{"input_ids": [3]}], r"no token to learn"),
        ([{"input_ids": [3, 4, 5], "labels": [3, -100, -100]}], r"no token to learn"),
        # text rows
        ([{"text": "t3 t4"}, {"text": " "}], r"1 of 2 rows .* an empty `text`"),
    ],
    ids=["user-only", "some-user-only", "empty-completion", "empty-chat-completion", "empty-response", "labels",
         "completion-mask", "one-id", "first-only", "text"],
)  # fmt: skip
def test_rows_with_nothing_to_learn_are_refused(target, tmp_path, rows, match, no_forward):
    with pytest.raises(ValueError, match=match):
        _trainer(target, Dataset.from_list(rows), tmp_path)


def test_many_bad_rows_are_counted_and_the_first_named(target, tmp_path):
    rows = [GOOD] + [_chat("t3", None)] * 9
    with pytest.raises(ValueError, match=r"9 of 10 rows .*\(rows 1, 2, 3, 4, 5, \.\.\.\)"):
        check_training_rows(Dataset.from_list(rows), "train_dataset")


def test_ids_outside_the_vocabulary_are_refused(target, tmp_path, no_forward):
    """Rows tokenized by another tokenizer: named before the embedding lookup fails mid-training (ids read across
    the dataset's arrow chunks and its row order)."""
    from datasets import concatenate_datasets

    vocab = target.config.vocab_size
    good = Dataset.from_list([{"prompt_ids": [3, 4], "response_ids": [5, 6, 7]}] * 3)
    bad = Dataset.from_list(
        [{"prompt_ids": [3, 4], "response_ids": [5, vocab]}, {"prompt_ids": [-1], "response_ids": [5]}]
    )
    dataset = concatenate_datasets([good, bad])
    with pytest.raises(
        ValueError, match=rf"2 of 5 rows .* outside the drafter's vocabulary \[0, {vocab}\) \(rows 3, 4\)"
    ):
        _trainer(target, dataset, tmp_path)
    with pytest.raises(ValueError, match=r"\(rows 0, 1\)"):
        _trainer(target, dataset.select([3, 4, 0]), tmp_path)
    with pytest.raises(ValueError, match=r"1 of 1 rows .* outside"):
        _trainer(target, Dataset.from_list([{"input_ids": [3, vocab + 5]}]), tmp_path)


def test_an_assistant_turn_without_content_is_no_assistant_turn(target, tmp_path):
    rows = [GOOD, {"messages": [{"role": "user", "content": "t3"}, {"role": "assistant", "content": None}]}]
    with pytest.raises(ValueError, match=r"1 of 2 rows .*\(row 1\)"):
        check_training_rows(Dataset.from_list(rows), "train_dataset")


def test_rows_with_something_to_learn_pass(target, tmp_path):
    rows = [GOOD, {**_chat("t3", "t4"), "extra": 1}]
    check_training_rows(Dataset.from_list(rows), "train_dataset")
    check_training_rows(Dataset.from_list([{"input_ids": [3, 4], "labels": [-100, 4]}]), "train_dataset")
    check_training_rows(None, "eval_dataset")


@pytest.mark.parametrize("rows", [[GOOD] * 4, [{"prompt_ids": [3, 4], "response_ids": [5, 6, 7, 8, 9]}] * 4])
def test_max_length_below_the_block_size_is_refused(target, tmp_path, rows, no_forward):
    with pytest.raises(ValueError, match=rf"max_length={BLOCK - 1} is below the block size {BLOCK}.*max_length >= "
                                         rf"{BLOCK}"):  # fmt: skip
        _trainer(target, Dataset.from_list(rows), tmp_path, max_length=BLOCK - 1)


def test_max_length_of_one_block_trains(target, tmp_path):
    trainer = _trainer(target, Dataset.from_list([GOOD] * 4), tmp_path, max_length=BLOCK)
    trainer.train()
    assert trainer.state.global_step == 1


def test_truncation_that_leaves_no_row_is_refused(target, tmp_path, no_forward):
    """Prompts longer than max_length: TRL drops every row whose completion truncation cut off."""
    rows = [{"prompt": _words([3, 4, 5, 6, 7, 8, 9, 30, 31, 32]), "completion": "t33 t34"}] * 4
    with pytest.raises(ValueError, match=r"No row of `train_dataset` keeps a token to learn within max_length=6"):
        _trainer(target, Dataset.from_list(rows), tmp_path, max_length=6)


def test_train_command_names_the_bad_rows(tiny_folders, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    rows = [GOOD] * 6 + [_chat("t3 t4", None)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["train", "--target", str(tiny_folders / "target"), "--data", str(data), "--output_dir"]
    argv += [str(tmp_path / "out"), "--max_steps", "1", "--tau_holdout", "0", "--use_cpu", "--report_to", "none"]
    assert main(argv) != 0
    assert "error: 1 of 7 rows of `train_dataset` have no assistant turn" in capsys.readouterr().err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_checked_dataset_still_trains(target, tmp_path):
    trainer = _trainer(target, Dataset.from_list([GOOD] * 4), tmp_path)
    trainer.train()
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))


@pytest.mark.parametrize(
    "rows",
    [
        [GOOD, _chat("t3 t4", None), GOOD, _chat("t5", "  ")],
        [{"prompt": "t3", "completion": "t4"}, {"prompt": "t3", "completion": " "}],
        [
            {"prompt": [{"role": "user", "content": "t3"}], "completion": [{"role": "assistant", "content": "t4"}]},
            {"prompt": [{"role": "user", "content": "t3"}], "completion": [{"role": "assistant", "content": ""}]},
        ],
        [{"prompt_ids": [3, 4], "response_ids": [5, 6]}, {"prompt_ids": [3], "response_ids": []}],
        [{"text": "t3 t4"}, {"text": " "}],
    ],
    ids=["messages", "completion", "chat-completion", "response-ids", "text"],
)
def test_the_suggested_filter_drops_exactly_the_refused_rows(rows):
    """The `dataset.filter(...)` an error suggests, run as written, leaves a dataset the check accepts, and keeps
    every row it did not name."""
    import re

    dataset = Dataset.from_list(rows)
    with pytest.raises(ValueError) as refused:
        check_training_rows(dataset, "train_dataset")
    suggested = re.search(r"`(dataset\.filter\(.*\))`", str(refused.value)).group(1)
    filtered = eval(suggested, {"dataset": dataset})  # noqa: S307 - the message's own code, as a user would paste it
    check_training_rows(filtered, "train_dataset")
    assert len(filtered) == len(rows) - len(re.search(r"rows? ([\d, ]+)\)", str(refused.value)).group(1).split(","))


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_train_command_refuses_an_empty_data_file(tiny_folders, tmp_path, capsys, content):
    """An empty JSONL file: named, before `datasets` fails inside its JSON reader with a bare StopIteration."""
    data = tmp_path / "rows.jsonl"
    data.write_text(content)
    argv = ["train", "--target", str(tiny_folders / "target"), "--data", str(data), "--output_dir"]
    argv += [str(tmp_path / "out"), "--max_steps", "1", "--tau_holdout", "0", "--use_cpu", "--report_to", "none"]
    assert main(argv) != 0
    assert f"error: {data} holds no rows" in capsys.readouterr().err
