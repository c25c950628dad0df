"""`benchmarks/data_subset.py`: rows of one kind from a data folder, in shard order, as training rows or prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def subset():
    return load_benchmark("data_subset")


ROWS = [
    {"id": f"{source}/{i}", "prompt_ids": [1, i], "response_ids": [i, 2],
     "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
    for i, source in enumerate(["chat", "magpie/code", "math", "magpie/math", "stdlib", "magpie/advice"])
]  # fmt: skip


def test_picks_the_first_rows_of_a_kind_in_order_from_an_offset(subset):
    assert [r["id"] for r in subset.select_rows(ROWS, ["magpie/"], rows_wanted=2)] == ["magpie/code/1", "magpie/math/3"]
    assert [r["id"] for r in subset.select_rows(ROWS, ["magpie/"], rows_wanted=1, offset=2)] == ["magpie/math/3"]
    others = subset.select_rows(ROWS, ["magpie/"], rows_wanted=3, exclude=True)
    assert [r["id"] for r in others] == ["chat/0", "math/2", "stdlib/4"]
    with pytest.raises(ValueError, match="only 1 rows from row 4"):
        subset.select_rows(ROWS, ["magpie/"], rows_wanted=2, offset=4)


def test_writes_training_rows_or_prompts_without_the_answer(subset):
    assert subset.to_json(ROWS[1], "train") == {"id": "magpie/code/1", "prompt_ids": [1, 1], "response_ids": [1, 2]}
    assert subset.to_json(ROWS[1], "prompts") == {
        "id": "magpie/code/1",
        "messages": [{"role": "user", "content": "q1"}],
    }
