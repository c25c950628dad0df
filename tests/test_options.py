"""The one declaration of the generation options (modeling/options_d3d.py): checks, keyword arguments of `generate`,
misspelt and foreign options refused, explicit values honoured (never silently replaced), overrides of defaults
recorded, the README table generated from it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from _tiny import random_prompt, tiny_target
from d3d_hf.modeling import generation_d3d
from d3d_hf.modeling.options_d3d import CALL_OPTIONS_ATTRIBUTE, D3DGenerationOptions, options_markdown_table
from transformers import GenerationConfig

from d3d_hf import D3DForDiffusionDrafting

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama", seed=4)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4).eval()
    return target, drafter


def _generate(pair, max_new_tokens=12, **kwargs):
    target, drafter = pair
    prompt = random_prompt(7, seed=3)
    out = target.generate(
        prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, do_sample=False,
        max_new_tokens=max_new_tokens, **kwargs,
    )
    reference = target.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=max_new_tokens
    )
    assert out.tolist() == reference.tolist()  # lossless whatever the options
    return drafter.last_generation_stats


def test_defaults_and_ranges():
    options = D3DGenerationOptions.resolve(block_size=8)
    assert options.num_drafts == "adaptive" and options.prompt_lookup and options.asynchronous == "auto"
    assert options.num_hypotheses == 4 and options.explicit == frozenset()
    assert D3DGenerationOptions.resolve(block_size=2).num_hypotheses == 2
    assert D3DGenerationOptions.resolve(block_size=8, d3d_num_drafts=7.0).num_drafts == 7
    # numpy and 0-d torch scalars are the numbers and booleans they hold (kept as Python values, JSON-safe)
    import numpy as np

    scalars = D3DGenerationOptions.resolve(
        block_size=8, d3d_num_drafts=np.int64(3), d3d_tree_budget=torch.tensor(5), d3d_prompt_lookup=np.bool_(False)
    )
    assert (scalars.num_drafts, scalars.tree_budget, scalars.prompt_lookup) == (3, 5, False)
    assert type(scalars.num_drafts) is int and type(scalars.prompt_lookup) is bool
    for name, value, words in [
        ("d3d_num_drafts", 8, "[0, block_size - 1 = 7]"),
        ("d3d_num_drafts", True, "'adaptive', 'full'"),
        ("d3d_async", "yes", "'auto', True or False"),
        ("d3d_num_hypotheses", 0, "[1, block_size = 8]"),
        ("d3d_tree_budget", 0, "nodes >= 1"),
        ("d3d_prompt_lookup", 1, "True or False"),
        ("d3d_num_drafts", np.bool_(True), "'adaptive', 'full'"),
        ("d3d_tree_budget", torch.tensor(2.5), "nodes >= 1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            D3DGenerationOptions.resolve(block_size=8, **{name: value})


def test_unknown_option_names_the_nearest():
    with pytest.raises(ValueError, match="Did you mean `d3d_tree_budget`"):
        D3DGenerationOptions.resolve(GenerationConfig(d3d_tree_budgt=16), block_size=8)


def test_options_as_generate_keyword_arguments(pair):
    stats = _generate(pair, d3d_num_drafts=2)
    assert stats.policy == "2" and stats.options.is_explicit("num_drafts")
    assert max(stats.round_candidates) == 2
    stats = _generate(pair, d3d_tree_budget=3)
    assert stats.tree_budget == 3 and stats.decoding_loop == "d3d"
    with pytest.raises(ValueError, match="Did you mean `d3d_num_drafts`"):
        _generate(pair, d3d_num_draft=2)


def test_keyword_options_need_a_d3d_assistant(pair):
    target, _ = pair
    prompt = random_prompt(7, seed=3)
    with pytest.raises(ValueError, match="options of a D3D drafter"):
        target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, d3d_num_drafts=2)


def test_transformers_assisted_options_are_mapped_or_refused(pair):
    stats = _generate(pair, num_assistant_tokens=2)
    assert stats.policy == "2"
    with pytest.raises(ValueError, match="d3d_prompt_lookup"):
        _generate(pair, prompt_lookup_num_tokens=5)
    with pytest.raises(ValueError, match="d3d_num_drafts"):
        _generate(pair, assistant_confidence_threshold=0.2)
    with pytest.raises(ValueError, match="both set the drafts per round"):
        _generate(pair, num_assistant_tokens=2, d3d_num_drafts=3)


def test_explicit_values_are_honoured_or_refused(pair, monkeypatch):
    monkeypatch.setattr(generation_d3d, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = _generate(pair, max_new_tokens=16, d3d_async=True, d3d_num_drafts="full")
        _generate(pair, max_new_tokens=16, d3d_async=True, d3d_num_drafts="full")
    on_cpu = [w for w in caught if "d3d_async=True on CPU" in str(w.message)]
    assert len(on_cpu) == 1, "one warning per process"
    assert stats.asynchronous and stats.hits + stats.reused + stats.misses > 0  # the packed pass ran on CPU
    stats = _generate(pair, d3d_num_drafts="full")
    assert not stats.asynchronous and stats.overrides["d3d_async"].startswith("auto -> False: cpu")
    assert stats.overrides["d3d_prompt_lookup"].startswith("True -> False")  # a default replaced, and said so
    with pytest.raises(ValueError, match="d3d_prompt_lookup=True"):
        _generate(pair, d3d_num_drafts=2, d3d_prompt_lookup=True)
    with pytest.raises(ValueError, match="d3d_num_drafts='adaptive'"):
        _generate(pair, d3d_async=True, d3d_num_drafts="adaptive")


def test_asynchronous_rounds_honour_a_fixed_number_of_drafts(pair):
    stats = _generate(pair, max_new_tokens=16, d3d_async=True, d3d_num_drafts=2)
    assert stats.asynchronous and stats.policy == "2" and max(stats.round_candidates) == 2


def test_readme_options_table_is_the_declaration():
    text = README.read_text()
    match = re.search(r"<!-- options:start -->\n(.*?)\n<!-- options:end -->", text, re.S)
    assert match, "README.md needs the options block (<!-- options:start --> ... <!-- options:end -->)"
    assert match.group(1).strip() == options_markdown_table().strip(), (
        "README's options table differs from the declaration: run `python benchmarks/render_readme.py`"
    )


def test_a_mode_that_skips_the_assistant_is_refused(pair):
    """transformers runs beam search without the assistant: with a D3D drafter that is refused, not silently done."""
    target, drafter = pair
    prompt = random_prompt(7, seed=3)
    _generate(pair, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_beams"):
        target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, num_beams=2,
                        max_new_tokens=4)
    assert drafter.last_generation_stats is None  # no stale statistics of the previous call


def test_the_worker_threads_bound_is_named():
    with pytest.raises(ValueError, match=r"torch threads\) = \d+\]"):
        D3DGenerationOptions.resolve(block_size=8, d3d_worker_threads=10**6)


@pytest.mark.parametrize(
    "case", ["one prompt", "one prompt, transformers' loop", "a tree", "a left-padded batch", "one padded prompt"]
)
def test_options_are_resolved_once_per_call(pair, monkeypatch, case):
    """A `generate` call resolves its options once, at its first check of the assistant; the loops, the candidate
    generator and the batch checks read that result (issue 36 item 2)."""
    target, drafter = pair
    resolve = D3DGenerationOptions.resolve.__func__
    calls = []

    def counting(cls, *args, **kwargs):
        calls.append(args)
        return resolve(cls, *args, **kwargs)

    monkeypatch.setattr(D3DGenerationOptions, "resolve", classmethod(counting))
    prompts = [random_prompt(7, seed=3)[0], random_prompt(4, seed=5)[0]]
    if case in ("a left-padded batch", "one padded prompt"):
        rows = prompts if case == "a left-padded batch" else prompts[1:]
        width = 7
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(rows):
            ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    else:
        ids = prompts[0][None]
        mask = torch.ones_like(ids)
    kwargs = {"one prompt, transformers' loop": {"d3d_decoding_loop": "transformers"}, "a tree": {"d3d_tree_budget": 6}}
    options = kwargs.get(case, {})
    target.generate(
        ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=6, pad_token_id=0, **options
    )
    assert drafter.last_generation_stats.rounds > 0
    assert len(calls) == 1, f"{len(calls)} resolutions in one call"


def test_a_reused_generation_config_keeps_no_options_of_an_earlier_call(pair):
    """The resolved options stay with the call's own copy of the config: a config the caller passes again, changed,
    is resolved afresh."""
    target, drafter = pair
    prompt = random_prompt(7, seed=3)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, d3d_num_drafts=2)
    for drafts in (2, 1):
        config.d3d_num_drafts = drafts
        mask = torch.ones_like(prompt)
        target.generate(prompt, attention_mask=mask, assistant_model=drafter, generation_config=config)
        assert drafter.last_generation_stats.options.num_drafts == drafts
        assert not hasattr(config, CALL_OPTIONS_ATTRIBUTE)
