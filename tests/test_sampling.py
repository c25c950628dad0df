"""Drafter-invariant sampling (modeling/sampling_d3d.py): the noise, exactness of the committed tokens' law under
processors that change the distribution, and the same tokens for one seed whatever the engine plans."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _tiny import chi_square_p_value, perturbed_drafter, random_prompt, tiny_target
from d3d_hf.modeling.sampling_d3d import GumbelNoise
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from d3d_hf import D3DForDiffusionDrafting

TESTS = Path(__file__).resolve().parent


def test_noise_is_keyed_by_seed_and_position():
    noise = GumbelNoise(7, 50)
    assert torch.equal(noise(3), GumbelNoise(7, 50)(3))  # a fresh object, the same stream
    assert not torch.equal(noise(3), noise(4)) and not torch.equal(noise(3), GumbelNoise(8, 50)(3))
    assert noise(3).dtype == torch.float64 and noise(3).shape == (50,)
    noise.forget_before(4)
    assert torch.equal(noise(3), GumbelNoise(7, 50)(3))  # drawn again identically after being dropped
    with pytest.raises(ValueError, match="len\\(positions\\)"):
        noise.choose(torch.zeros(2, 50), [1])
    with pytest.raises(ValueError, match="vocab_size"):
        GumbelNoise(1, 0)


def test_gumbel_max_draws_the_distribution():
    """argmax(log p + G_t) over many positions is distributed as p (the Gumbel-max trick)."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    noise, n = GumbelNoise(3, 5), 4000
    choices = noise.choose(p.log().expand(n, -1), range(n))
    counts = torch.bincount(choices, minlength=5).float()
    assert counts[4] == 0
    assert chi_square_p_value(counts[:4], p[:4], n) > 1e-3


def _processors(repetition_penalty, temperature, top_k, top_p):
    return LogitsProcessorList(
        [
            RepetitionPenaltyLogitsProcessor(repetition_penalty),
            TemperatureLogitsWarper(temperature),
            TopKLogitsWarper(top_k),
            TopPLogitsWarper(top_p),
        ]
    )


def _exact_two_tokens(target, ids, processors):
    """Exact probabilities of every 2-token continuation under the target's processed sampling law."""
    vocab = target.config.vocab_size
    with torch.no_grad():
        p1 = processors(ids, target(ids).logits[:, -1]).softmax(-1)[0]
        seqs = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        logits = target(seqs).logits[:, -1]
        p2 = torch.stack([processors(seqs[i : i + 1], logits[i : i + 1])[0] for i in range(vocab)]).softmax(-1)
    return p1[:, None] * p2


@pytest.mark.parametrize(
    ("plan", "n"),
    [
        ({"d3d_num_drafts": "full"}, 1500),
        # fewer samples: the acceptance rule is the chain's (equality with the Gumbel-max token); these check the
        # positions each tree row and each pre-drafted block is verified at
        ({"d3d_tree_budget": 3, "d3d_num_drafts": "full"}, 800),
        ({"d3d_async": True, "d3d_num_drafts": "full", "d3d_num_hypotheses": 4, "d3d_reuse_on_miss": True}, 800),
    ],
    ids=["chain", "tree", "async"],
)
def test_invariant_sampling_keeps_the_target_law_under_processors(plan, n):
    """Chi-square of 2-token samples against the exact law with repetition penalty, temperature, top-k and top-p,
    with a drafter that disagrees with the target often (rejections and bonus tokens are exercised)."""
    vocab = 8
    target = tiny_target("qwen3", vocab_size=vocab, seed=11, sharpen=10.0)
    target.generation_config.eos_token_id = None
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=1, block_size=4)
    ids = torch.tensor([[3, 5, 4]])
    settings = dict(repetition_penalty=1.3, temperature=0.9, top_k=6, top_p=0.95)
    exact = _exact_two_tokens(target, ids, _processors(**settings)).flatten()
    torch.manual_seed(1234)
    counts, rejected = torch.zeros(vocab * vocab), 0
    for _ in range(n):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=True,
                              max_new_tokens=2, pad_token_id=0, **settings, **plan)
        a, b = out[0, -2:].tolist()
        counts[a * vocab + b] += 1
        stats = drafter.last_generation_stats
        assert stats.options.sampling == "invariant" and "d3d_sampling" not in stats.overrides
        rejected += stats.accepted_drafts < stats.drafted_tokens
    assert rejected > n // 10, "the drafter must disagree with the target often enough to exercise rejection"
    assert chi_square_p_value(counts, exact, n) > 1e-3


PLANS = {
    "target-steps": {"d3d_num_drafts": 0},
    "k1": {"d3d_num_drafts": 1},
    "k3": {"d3d_num_drafts": 3},
    "full": {"d3d_num_drafts": "full"},
    "adaptive": {},
    "adaptive-no-lookup": {"d3d_prompt_lookup": False},
    "tree": {"d3d_tree_budget": 6},
    "tree-adaptive": {"d3d_tree_budget": "adaptive"},
    "async": {"d3d_async": True, "d3d_num_drafts": "full", "d3d_num_hypotheses": 4},
    "async-reuse": {"d3d_async": True, "d3d_num_drafts": 2, "d3d_reuse_on_miss": True},
}


def _sample(target, drafter, prompt, seed=1234, **options):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # d3d_async=True on CPU warns once
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter,
                              do_sample=True, temperature=0.8, top_k=30, repetition_penalty=1.1, max_new_tokens=40,
                              suppress_tokens=[2], **options)
    return out[0, prompt.shape[1] :].tolist()


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama", seed=4, sharpen=3.0)
    return target, perturbed_drafter(target, 4)


def test_one_seed_gives_the_same_tokens_for_every_plan(pair):
    target, drafter = pair
    prompt = random_prompt(7, seed=3)
    reference = _sample(target, drafter, prompt, **PLANS["target-steps"])
    assert len(reference) == 40
    accepted = 0
    for name, options in PLANS.items():
        assert _sample(target, drafter, prompt, **options) == reference, name
        accepted += drafter.last_generation_stats.accepted_drafts
    assert accepted > 0, "some plan must accept drafts, or the test checks nothing"
    assert _sample(target, drafter, prompt, seed=99) != reference  # the seed matters


def test_one_seed_gives_the_same_tokens_in_another_process(pair, tmp_path):
    target, drafter = pair
    prompt = random_prompt(7, seed=3)
    here = _sample(target, drafter, prompt)
    script = f"""
import json, sys, torch
sys.path.insert(0, {str(TESTS)!r})
from _tiny import perturbed_drafter, random_prompt, tiny_target
import d3d_hf
from test_sampling import _sample
target = tiny_target("llama", seed=4, sharpen=3.0)
print(json.dumps(_sample(target, perturbed_drafter(target, 4), random_prompt(7, seed=3), d3d_num_drafts=2)))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            cwd=tmp_path)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == here


def test_speculative_sampling_stays_an_option(pair):
    target, drafter = pair
    prompt = random_prompt(7, seed=3)
    _sample(target, drafter, prompt, d3d_sampling="speculative", d3d_num_drafts=3)
    stats = drafter.last_generation_stats
    assert stats.options.sampling == "speculative" and stats.accepted_drafts >= 0
    with pytest.raises(ValueError, match="'invariant' or 'speculative'"):
        _sample(target, drafter, prompt, d3d_sampling="gumbel")
    with pytest.raises(ValueError, match="needs D3D's own decoding loop"):
        _sample(target, drafter, prompt, generation_config=GenerationConfig(
            d3d_sampling="invariant", d3d_decoding_loop="transformers"))


def test_greedy_decoding_draws_no_noise(pair, monkeypatch):
    target, drafter = pair
    drawn = []
    original = GumbelNoise.__call__
    monkeypatch.setattr(GumbelNoise, "__call__", lambda self, t: drawn.append(t) or original(self, t))
    prompt = random_prompt(7, seed=3)
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, do_sample=False,
                          max_new_tokens=12)
    reference = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)
    assert torch.equal(out, reference) and drawn == []
