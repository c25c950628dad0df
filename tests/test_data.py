"""Tests for d3d_hf.data: target-answered (distilled) datasets, generated in batches with resume, and the
`d3d-hf data` command (the stdlib prompts and prompt-source specs are tested in test_prompts.py)."""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import tiny_target

from d3d_hf.data import SETTINGS_FILE, generate_dataset, stdlib_prompts
from d3d_hf.prompts import Prompt, encode_prompt

datasets = pytest.importorskip("datasets", reason="pip install 'd3d-hf[train]'")

VOCAB = 97


def _tiny_tokenizer():
    """A word-level tokenizer over ``w0 .. w92`` with ChatML-like specials (ids 0 pad, 1 im_start, 2 im_end)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return fast


def _prompts(n: int, start: int = 0) -> list[Prompt]:
    """``n`` prompts of different lengths (so batches need padding)."""
    return [
        Prompt(
            id=f"p{i}",
            messages=[{"role": "user", "content": " ".join(f"w{(7 * i + j) % (VOCAB - 4)}" for j in range(2 + i % 5))}],
        )
        for i in range(start, start + n)
    ]


@pytest.fixture()
def tiny():
    return tiny_target("llama", vocab_size=VOCAB, sharpen=4.0), _tiny_tokenizer()


def _count_generated(model):
    """Wrap ``model.generate`` to count the prompts it is called with; returns the list of batch sizes."""
    calls: list[int] = []
    original = model.generate

    def counting(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return original(*args, **kwargs)

    model.generate = counting
    return calls


# ---------------------------------------------------------------------------------------------------------------
# generation (tiny random target)


def test_generate_dataset_rows_and_load_from_disk(tiny, tmp_path):
    model, tok = tiny
    prompts = _prompts(5)
    ds = generate_dataset(
        model, tok, prompts, tmp_path / "out", max_new_tokens=6, batch_size=2, progress=False, target_name="tiny"
    )
    loaded = datasets.load_from_disk(str(tmp_path / "out" / "dataset"))
    assert loaded.column_names == ["id", "messages", "prompt_ids", "response_ids", "response"]
    assert loaded["id"] == [p.id for p in prompts] == ds["id"]
    for row, p in zip(loaded, prompts, strict=True):
        assert row["messages"] == p.messages
        assert row["prompt_ids"] == encode_prompt(tok, p)[0].tolist()
        assert 1 <= len(row["response_ids"]) <= 6
        assert 2 not in row["response_ids"][:-1]  # nothing after the eos
        assert row["response"] == tok.decode(row["response_ids"], skip_special_tokens=True)
    settings = json.loads((tmp_path / "out" / SETTINGS_FILE).read_text())
    assert settings["target"] == "tiny" and settings["dtype"] == "float32"
    assert settings["max_new_tokens"] == 6 and settings["temperature"] == 0.0 and settings["batch_size"] == 2
    assert settings["num_prompts"] == 5 and settings["versions"]["datasets"]
    assert settings["runs"][0]["generated"] == 5
    assert len(list((tmp_path / "out" / "shards").glob("shard-*.safetensors"))) == 3


def test_batched_greedy_equals_unbatched_tiny(tiny, tmp_path):
    model, tok = tiny
    prompts = _prompts(4)
    ds = generate_dataset(model, tok, prompts, tmp_path, max_new_tokens=8, batch_size=4, progress=False)
    for row, p in zip(ds, prompts, strict=True):
        ids = encode_prompt(tok, p)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
        ref = out[0, ids.shape[1] :].tolist()
        ref = ref[: ref.index(2) + 1] if 2 in ref else ref
        assert row["response_ids"] == ref, p.id


def test_resume_generates_only_missing_prompts(tiny, tmp_path):
    model, tok = tiny
    calls = _count_generated(model)
    first = generate_dataset(model, tok, _prompts(4), tmp_path, max_new_tokens=5, batch_size=3, progress=False)
    assert sum(calls) == 4
    calls.clear()
    second = generate_dataset(model, tok, _prompts(7), tmp_path, max_new_tokens=5, batch_size=3, progress=False)
    assert sum(calls) == 3  # only the 3 new prompts
    assert second["response_ids"][:4] == first["response_ids"]
    settings = json.loads((tmp_path / SETTINGS_FILE).read_text())
    assert [r["generated"] for r in settings["runs"]] == [4, 3]
    assert [r["already_done"] for r in settings["runs"]] == [0, 4]


def test_killed_run_resumes_where_it_stopped(tiny, tmp_path):
    model, tok = tiny
    original = model.generate
    seen: list[int] = []

    def dies_on_second_batch(*args, **kwargs):
        seen.append(kwargs["input_ids"].shape[0])
        if len(seen) == 2:
            raise KeyboardInterrupt("killed")
        return original(*args, **kwargs)

    model.generate = dies_on_second_batch
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(model, tok, _prompts(6), tmp_path, max_new_tokens=5, batch_size=2, progress=False)
    assert len(list((tmp_path / "shards").glob("shard-*.safetensors"))) == 1
    assert not (tmp_path / "dataset").exists()
    model.generate = original
    calls = _count_generated(model)
    ds = generate_dataset(model, tok, _prompts(6), tmp_path, max_new_tokens=5, batch_size=2, progress=False)
    assert sum(calls) == 4 and len(ds) == 6
    # a resumed run gives the same data as an uninterrupted one
    fresh = generate_dataset(
        model, tok, _prompts(6), tmp_path / "fresh", max_new_tokens=5, batch_size=2, progress=False
    )
    assert ds["response_ids"] == fresh["response_ids"]


def test_folder_protection_and_settings_mismatch(tiny, tmp_path):
    model, tok = tiny
    kw = dict(batch_size=2, progress=False)
    generate_dataset(model, tok, _prompts(2), tmp_path / "run", max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_dataset(model, tok, _prompts(2), tmp_path / "run", max_new_tokens=5, **kw)
    with pytest.raises(ValueError, match="temperature"):
        generate_dataset(model, tok, _prompts(2), tmp_path / "run", max_new_tokens=4, temperature=0.7, **kw)
    with pytest.raises(FileExistsError, match="earlier generation run"):
        generate_dataset(model, tok, _prompts(2), tmp_path / "run", max_new_tokens=4, resume=False, **kw)
    changed = [Prompt(id="p0", messages=[{"role": "user", "content": "w1 w2 w3"}])]
    with pytest.raises(ValueError, match="different messages"):
        generate_dataset(model, tok, changed, tmp_path / "run", max_new_tokens=4, **kw)
    calls = _count_generated(model)
    ds = generate_dataset(model, tok, _prompts(2), tmp_path / "run", max_new_tokens=5, overwrite=True, **kw)
    assert sum(calls) == 2 and len(ds) == 2

    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        generate_dataset(model, tok, _prompts(2), user, max_new_tokens=4, **kw)
    generate_dataset(model, tok, _prompts(2), user, max_new_tokens=4, overwrite=True, **kw)
    assert (user / "notes.txt").read_text() == "mine"


def test_sampling_is_seeded(tiny, tmp_path):
    model, tok = tiny
    kw = dict(max_new_tokens=6, temperature=1.0, batch_size=3, progress=False)
    a = generate_dataset(model, tok, _prompts(3), tmp_path / "a", seed=1, **kw)
    b = generate_dataset(model, tok, _prompts(3), tmp_path / "b", seed=1, **kw)
    assert a["response_ids"] == b["response_ids"]


def test_cli_data(tiny, tmp_path, capsys):
    from d3d_hf.cli import main

    model, tok = tiny
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p.messages[0]["content"]}) + "\n" for p in _prompts(3)))
    argv = ["data", "--target", str(tmp_path / "target"), "--prompts", f"{prompts}:2", "--output", str(tmp_path / "o")]
    argv += ["--max-new-tokens", "4", "--batch-size", "2"]
    assert main(argv) == 0
    assert len(datasets.load_from_disk(str(tmp_path / "o" / "dataset"))) == 2
    assert main([*argv, "--temperature", "0.5"]) == 2  # settings differ from the folder's
    assert "Cannot resume" in capsys.readouterr().err
    assert main(["data", "--target", str(tmp_path / "target"), "--prompts", "humaneval", "--output", "x"]) == 2


# ---------------------------------------------------------------------------------------------------------------
# real target


def test_smollm2_batched_greedy_equals_unbatched(smollm2, tmp_path):
    model, tok = smollm2
    prompts = stdlib_prompts(limit=2, seed=0)
    ds = generate_dataset(model, tok, prompts, tmp_path, max_new_tokens=24, batch_size=2, progress=False)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    for row, p in zip(ds, prompts, strict=True):
        ids = encode_prompt(tok, p)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24)
        ref = out[0, ids.shape[1] :].tolist()
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert row["response_ids"] == ref[:cut], p.id


# ---------------------------------------------------------------------------------------------------------------
# token shards and shards-only data


def test_token_shard_round_trip_and_size(tmp_path):
    from d3d_hf.shards import read_token_shard, write_token_shard

    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "hé"}], "prompt_ids": [1, 2, 65535], "response_ids": []},
        {"id": "b", "messages": [{"role": "user", "content": "x"}], "prompt_ids": [0], "response_ids": [5] * 300},
    ]
    write_token_shard(tmp_path / "s.safetensors", rows)
    assert read_token_shard(tmp_path / "s.safetensors") == rows
    assert (tmp_path / "s.safetensors").stat().st_size < 2 * 304 + 600  # 2 bytes a token plus the header
    big = [{**rows[0], "prompt_ids": [70000]}]
    write_token_shard(tmp_path / "big.safetensors", big)  # over uint16: stored as int32
    assert read_token_shard(tmp_path / "big.safetensors") == big
    with pytest.raises(ValueError, match="at least one row"):
        write_token_shard(tmp_path / "e.safetensors", [])
    with pytest.raises(ValueError, match="outside"):
        write_token_shard(tmp_path / "n.safetensors", [{**rows[0], "prompt_ids": [-1]}])
    (tmp_path / "other.safetensors").write_bytes((tmp_path / "s.safetensors").read_bytes().replace(b"v1", b"v9"))
    with pytest.raises(ValueError, match="not a d3d-hf token shard"):
        read_token_shard(tmp_path / "other.safetensors")


def test_partial_run_trains_from_shards_and_keeps_the_given_order(tiny, tmp_path):
    """A run stopped early has answered a prefix of the prompts in their given order (length-sorted only within
    windows of 8 batches); its shards load as training rows without the final dataset, and a JSONL-shard run and a
    token-shard run hold the same ids."""
    from d3d_hf.data import load_generated_rows
    from d3d_hf.training.script import load_training_dataset

    model, tok = tiny
    original = model.generate
    calls: list[int] = []

    def dies_after_eight_batches(*args, **kwargs):
        calls.append(1)
        if len(calls) > 8:
            raise KeyboardInterrupt("killed")
        return original(*args, **kwargs)

    model.generate = dies_after_eight_batches
    prompts = _prompts(40)
    with pytest.raises(KeyboardInterrupt):
        generate_dataset(model, tok, prompts, tmp_path / "t", max_new_tokens=4, batch_size=2, progress=False)
    model.generate = original
    rows = load_generated_rows(tmp_path / "t", tokenizer=tok)
    assert sorted(r["id"] for r in rows) == sorted(p.id for p in prompts[:16])  # the first window of 8 batches
    assert all(r["response"] == tok.decode(r["response_ids"], skip_special_tokens=True) for r in rows)
    loaded = load_training_dataset(str(tmp_path / "t"))
    assert len(loaded) == 16 and {"prompt_ids", "response_ids", "messages"} <= set(loaded.column_names)
    ds = generate_dataset(model, tok, prompts[:4], tmp_path / "j", max_new_tokens=4, progress=False,
                          shard_format="jsonl")  # fmt: skip
    assert [r["id"] for r in load_generated_rows(tmp_path / "j")] == [p.id for p in sorted(
        prompts[:4], key=lambda p: len(encode_prompt(tok, p)[0]))]  # fmt: skip
    assert len(ds) == 4
    with pytest.raises(ValueError, match="shard_format"):
        generate_dataset(model, tok, prompts[:4], tmp_path / "x", progress=False, shard_format="parquet")
    with pytest.raises(FileNotFoundError, match="no shards"):
        load_generated_rows(tmp_path / "empty")


def test_settings_count_prompts_by_source(tiny, tmp_path):
    model, tok = tiny
    ids = ["stdlib/os.path/join/explain", "math-extra/0", "chat/1", "magpie/code/0", "mine-3"]
    prompts = [Prompt(id=i, messages=p.messages) for i, p in zip(ids, _prompts(5), strict=True)]
    generate_dataset(model, tok, prompts, tmp_path, max_new_tokens=2, progress=False)
    counts = json.loads((tmp_path / SETTINGS_FILE).read_text())["prompt_counts"]
    assert counts == {"chat": 1, "file": 1, "magpie": 1, "math-extra": 1, "stdlib": 1, "stdlib_kinds": {"explain": 1}}


def test_training_reads_a_data_folder_in_shard_order_finished_or_not(tiny, tmp_path):
    """`d3d-hf train --data FOLDER` reads the same rows in the same order before and after the run writes `dataset/`
    (prompt order, which length-sorted batches change): the shards' order, which is what is committed, so
    `--max_samples N` prefixes and held-out rows do not depend on whether a machine finished the run."""
    import shutil

    from d3d_hf.data import load_generated_rows
    from d3d_hf.training import load_training_dataset

    model, tok = tiny
    prompts = _prompts(8)
    generate_dataset(model, tok, prompts, tmp_path / "out", max_new_tokens=4, batch_size=2, progress=False)
    in_shards = [row["id"] for row in load_generated_rows(tmp_path / "out")]
    assert sorted(in_shards) == sorted(p.id for p in prompts) and in_shards != [p.id for p in prompts]
    finished = load_training_dataset(str(tmp_path / "out"))["id"]
    shutil.rmtree(tmp_path / "out" / "dataset")
    assert finished == load_training_dataset(str(tmp_path / "out"))["id"] == in_shards
