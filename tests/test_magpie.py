"""Tests for d3d_hf.prompts.magpie: requests the target writes itself (Magpie), filtered, deduplicated, guarded
against evaluation prompts, appended to a resumable JSONL file (tiny random target with a ChatML-like template)."""

from __future__ import annotations

import json

import pytest
from _tiny import tiny_target
from test_data import VOCAB, _tiny_tokenizer

from d3d_hf.prompts import load_prompt_sources, load_prompts
from d3d_hf.prompts.magpie import clean_request, magpie_requests, query_prefix


@pytest.fixture()
def tiny():
    return tiny_target("llama", vocab_size=VOCAB, sharpen=0.5), _tiny_tokenizer()


def test_query_prefix_ends_where_the_user_text_begins(tiny):
    _, tok = tiny
    expected = "<|im_start|> system w5 w6 <|im_end|> <|im_start|> user"
    assert query_prefix(tok, "w5 w6") == tok(expected, add_special_tokens=False)["input_ids"]
    assert query_prefix(tok, None) == tok("<|im_start|> user", add_special_tokens=False)["input_ids"]


def test_clean_request_reasons():
    assert clean_request("  Can you explain how tides work?  ", True) == ("Can you explain how tides work?", "kept")
    assert clean_request("Can you explain how tides work?", False) == (None, "unfinished")
    assert clean_request("Hi there", True) == (None, "too_short")
    assert clean_request("word " * 300, True) == (None, "too_long")
    assert clean_request("assistant: here is how tides work today", True) == (None, "template")
    assert clean_request("Explain <|im_start|> this to me please", True) == (None, "template")


def test_magpie_requests_resume_dedupe_and_guard(tiny, tmp_path, monkeypatch):
    model, tok = tiny
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    out = tmp_path / "magpie.jsonl"
    first = magpie_requests(model, tok, out, {"code": 3, "general": 2}, batch_size=8, max_new_tokens=12,
                            progress=False)  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [p.id for p in first]
    assert sum(r["domain"] == "code" for r in records) <= 3 and sum(r["domain"] == "general" for r in records) <= 2
    texts = [r["messages"][0]["content"] for r in records]
    assert len(set(texts)) == len(texts)
    stats = json.loads((tmp_path / "magpie.jsonl.stats.json").read_text())
    assert stats["domains"]["code"]["sampled"] == 8 * stats["domains"]["code"]["batches"]
    # a killed run's half-written last line is dropped, and a resumed run extends the file, never repeating a batch
    out.write_text(out.read_text() + '{"id": "magpie/code/9", "mess')
    batches = stats["domains"]["code"]["batches"]
    more = magpie_requests(model, tok, out, {"code": 5, "general": 2}, batch_size=8, max_new_tokens=12,
                           max_batches_per_domain=2, progress=False)  # fmt: skip
    assert [p.id for p in more[: len(first)]] == [p.id for p in first]
    assert json.loads((tmp_path / "magpie.jsonl.stats.json").read_text())["domains"]["code"]["batches"] > batches
    assert len(load_prompt_sources(str(out))) == len(more)  # the file is a prompt source as it is
    # a sampled evaluation prompt (or a near-duplicate of one) is dropped, never written
    leaked = load_prompts("gsm8k", limit=1)[0].raw
    monkeypatch.setattr("d3d_hf.prompts.magpie.clean_request", lambda text, finished: (leaked, "kept"))
    magpie_requests(model, tok, tmp_path / "leak.jsonl", {"math": 1}, batch_size=4, max_new_tokens=4,
                    max_batches_per_domain=1, progress=False)  # fmt: skip
    assert (tmp_path / "leak.jsonl").read_text() == ""
    stats = json.loads((tmp_path / "leak.jsonl.stats.json").read_text())
    assert stats["domains"]["math"]["reasons"] == {"near_evaluation": 4}


def test_magpie_refuses_bad_arguments(tiny, tmp_path):
    model, tok = tiny
    with pytest.raises(ValueError, match="Unknown Magpie domain"):
        magpie_requests(model, tok, tmp_path / "a.jsonl", {"poetry": 3}, progress=False)
    with pytest.raises(ValueError, match="positive integer"):
        magpie_requests(model, tok, tmp_path / "a.jsonl", {"code": 0}, progress=False)
    with pytest.raises(ValueError, match="plain .jsonl"):
        magpie_requests(model, tok, tmp_path / "a.jsonl.gz", {"code": 1}, progress=False)
    (tmp_path / "other.jsonl").write_text('{"prompt": "Write a haiku about rivers."}\n')
    with pytest.raises(ValueError, match="not written by magpie_requests"):
        magpie_requests(model, tok, tmp_path / "other.jsonl", {"code": 1}, progress=False)


def test_requests_the_guard_now_refuses_leave_the_file_and_ids_stay_unique(tiny, tmp_path):
    model, tok = tiny
    model.generation_config.eos_token_id = 2
    leaked = load_prompts("mt-bench", limit=1)[0].messages[0]["content"]
    out = tmp_path / "m.jsonl"
    rows = [
        {"id": "magpie/code/0", "messages": [{"role": "user", "content": "How do I sort a dict by value?"}]},
        {"id": "magpie/code/1", "messages": [{"role": "user", "content": leaked.upper()}]},
        {"id": "magpie/code/2", "messages": [{"role": "user", "content": "What is a Python generator for?"}]},
    ]
    out.write_text("".join(json.dumps({**r, "domain": "code", "system": None}) + "\n" for r in rows))
    prompts = magpie_requests(model, tok, out, {"code": 3}, batch_size=4, max_new_tokens=4,
                              max_batches_per_domain=1, progress=False)  # fmt: skip
    ids = [p.id for p in prompts]
    assert "magpie/code/1" not in ids and ids[:2] == ["magpie/code/0", "magpie/code/2"]
    assert len(set(ids)) == len(ids) and all(int(i.rsplit("/", 1)[1]) != 1 for i in ids)


def test_domains_grow_in_proportion(tiny, tmp_path, monkeypatch):
    """Each batch goes to the domain furthest behind its count, so a run stopped early (here: killed at its fourth
    batch) has sampled every domain rather than only the first."""
    from d3d_hf.prompts import magpie

    model, tok = tiny
    model.generation_config.eos_token_id = 2
    original, calls = magpie._sample, []

    def dies_at_the_fourth_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt("killed")
        return original(*args, **kwargs)

    monkeypatch.setattr(magpie, "_sample", dies_at_the_fourth_batch)
    out = tmp_path / "p.jsonl"
    with pytest.raises(KeyboardInterrupt):
        magpie_requests(model, tok, out, {"code": 50, "math": 50, "general": 50}, batch_size=4, max_new_tokens=4,
                        progress=False)  # fmt: skip
    stats = json.loads((tmp_path / "p.jsonl.stats.json").read_text())
    assert {d: e["batches"] for d, e in stats["domains"].items()} == {"code": 1, "math": 1, "general": 1}
