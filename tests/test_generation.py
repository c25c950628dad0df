"""Lossless `target.generate(..., assistant_model=drafter)` on tiny random Llama- and Qwen3-style targets."""

import pytest
import torch
from _tiny import FAMILIES, random_prompt, tiny_target
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from d3d_hf import D3DForDiffusionDrafting, install_generation_hook, remove_generation_hook


def _pair(family="llama", num_layers=None, block_size=4, seed=0, sharpen=1.0, vocab_size=97):
    target = tiny_target(family, seed=seed, sharpen=sharpen, vocab_size=vocab_size)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=num_layers, block_size=block_size)
    return target, drafter


def _greedy(target, ids, drafter=None, **kwargs):
    kwargs.setdefault("max_new_tokens", 40)
    return target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                           **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("num_layers", [None, 1])
def test_greedy_is_lossless(family, block_size, num_layers):
    target, drafter = _pair(family, num_layers=num_layers, block_size=block_size)
    for seed in range(3):
        ids = random_prompt(5 + seed, seed=seed)
        ref = _greedy(target, ids)
        out = _greedy(target, ids, drafter)
        assert torch.equal(out, ref)
        stats = drafter.last_generation_stats
        assert stats.new_tokens == ref.shape[1] - ids.shape[1]
        if block_size == 1:
            assert stats.rounds == stats.new_tokens and stats.drafted_tokens == 0
        if num_layers is None and block_size > 1:
            # a full copy of the target drafts d1 exactly as the target would (the last round may be cut by eos)
            assert min(stats.acceptance_lengths[:-1], default=2) >= 2


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5])
def test_never_more_tokens_than_asked(max_new_tokens):
    target, drafter = _pair(block_size=4)
    ids = random_prompt()
    out = _greedy(target, ids, drafter, max_new_tokens=max_new_tokens)
    assert torch.equal(out, _greedy(target, ids, max_new_tokens=max_new_tokens))
    assert out.shape[1] - ids.shape[1] <= max_new_tokens


def _eos_prone_pair(block_size=8):
    """A target whose greedy continuation hits one of several token ids soon."""
    target, drafter = _pair(block_size=block_size, seed=3)
    ids = random_prompt(6, seed=1)
    continuation = _greedy(target, ids, max_new_tokens=30)[0, ids.shape[1]:].tolist()
    return target, drafter, ids, continuation


@pytest.mark.parametrize("stop_index", [0, 1, 2, 5, 9])
def test_eos_inside_a_drafted_block_stops_exactly(stop_index):
    target, drafter, ids, continuation = _eos_prone_pair()
    eos = continuation[stop_index]
    other = (eos + 1) % 97
    for eos_ids in (eos, [other, eos]):
        ref = _greedy(target, ids, eos_token_id=eos_ids, pad_token_id=0)
        out = _greedy(target, ids, drafter, eos_token_id=eos_ids, pad_token_id=0)
        assert torch.equal(out, ref)
        assert out[0, -1].item() == eos and out.shape[1] - ids.shape[1] == continuation.index(eos) + 1


class _Recorder(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.extend(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_exactly_the_output():
    target, drafter, ids, continuation = _eos_prone_pair()
    eos = continuation[4]
    ref, got = _Recorder(), _Recorder()
    _greedy(target, ids, streamer=ref, eos_token_id=eos, pad_token_id=0)
    out = _greedy(target, ids, drafter, streamer=got, eos_token_id=eos, pad_token_id=0)
    assert got.tokens == ref.tokens and got.ended
    assert got.tokens == out[0].tolist()


class _CharTokenizerStub:
    """Not needed: stop strings are tested with the real tokenizer in the SmolLM2 tests."""


class _BanToken(LogitsProcessor):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.token] = -float("inf")
        return scores


def test_logits_processors_keep_their_meaning():
    target, drafter = _pair(block_size=6)
    ids = random_prompt()
    banned = _greedy(target, ids, max_new_tokens=10)[0, ids.shape[1] + 2].item()
    kwargs = dict(max_new_tokens=30, logits_processor=LogitsProcessorList([_BanToken(banned)]),
                  repetition_penalty=1.3, no_repeat_ngram_size=3)
    ref = _greedy(target, ids, **kwargs)
    out = _greedy(target, ids, drafter, **kwargs)
    assert torch.equal(out, ref)
    assert banned not in out[0, ids.shape[1]:].tolist()


def test_return_dict_in_generate_scores():
    target, drafter = _pair(block_size=4)
    ids = random_prompt()
    ref = _greedy(target, ids, return_dict_in_generate=True, output_scores=True, max_new_tokens=12)
    out = _greedy(target, ids, drafter, return_dict_in_generate=True, output_scores=True, max_new_tokens=12)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in zip(out.scores, ref.scores, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_state_is_reset_between_calls():
    target, drafter = _pair(block_size=4)
    a, b = random_prompt(7, seed=1), random_prompt(4, seed=2)
    ref_b = _greedy(target, b)
    _greedy(target, a, drafter)
    first_stats = drafter.last_generation_stats
    assert torch.equal(_greedy(target, b, drafter), ref_b)
    assert drafter.last_generation_stats is not first_stats


def test_batch_larger_than_one_is_rejected_clearly():
    target, drafter = _pair()
    ids = torch.cat([random_prompt(), random_prompt(seed=1)])
    with pytest.raises(ValueError, match="batch"):
        _greedy(target, ids, drafter)


def test_hook_is_idempotent_and_reversible():
    from transformers.generation import GenerationMixin

    install_generation_hook()
    hooked = GenerationMixin._get_candidate_generator
    install_generation_hook()
    assert GenerationMixin._get_candidate_generator is hooked
    remove_generation_hook()
    try:
        assert not getattr(GenerationMixin._get_candidate_generator, "_d3d_generation_hook", False)
        # other assistants still work through transformers' own factory with the hook installed
    finally:
        install_generation_hook()
    target, _ = _pair()
    small = tiny_target("llama", seed=5, num_layers=1)
    ids = random_prompt()
    assert torch.equal(_greedy(target, ids, small), _greedy(target, ids))


def _exact_two_token_distribution(target, ids, temperature, top_k):
    """Exact probabilities of every 2-token continuation under the target's processed sampling distribution."""
    def processed(logits):
        logits = logits / temperature
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, -float("inf")).softmax(-1)

    vocab = target.config.vocab_size
    with torch.no_grad():
        p1 = processed(target(ids).logits[0, -1])
        seqs = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p2 = processed(target(seqs).logits[:, -1])
    return p1[:, None] * p2


@pytest.mark.parametrize("options", [{}, {"d3d_async": True, "d3d_num_hypotheses": 4, "d3d_reuse_on_miss": True}],
                         ids=["sync", "async"])
def test_sampling_preserves_the_target_distribution(options):
    """Chi-square goodness of fit of 2-token samples drawn with the drafter against the exact target law (in async
    mode the second token's draft, after a rejected first draft, comes from the packed successor pass)."""
    vocab = 8
    target = tiny_target("qwen3", vocab_size=vocab, seed=11, sharpen=10.0)
    target.generation_config.eos_token_id = None
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=1, block_size=4)
    for name, value in options.items():
        setattr(drafter.generation_config, name, value)
    ids = torch.tensor([[3, 5, 4]])
    temperature, top_k = 0.9, 6
    exact = _exact_two_token_distribution(target, ids, temperature, top_k).flatten()
    torch.manual_seed(1234)
    n = 1500
    counts = torch.zeros(vocab * vocab)
    rejected = packed_used = 0
    for _ in range(n):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=True,
                              temperature=temperature, top_k=top_k, top_p=1.0, max_new_tokens=2, pad_token_id=0)
        a, b = out[0, -2:].tolist()
        counts[a * vocab + b] += 1
        stats = drafter.last_generation_stats
        rejected += stats.accepted_drafts < stats.drafted_tokens
        packed_used += stats.hits + stats.reused
    assert rejected > n // 10, "the drafter must disagree with the target often enough to exercise rejection"
    if options:
        assert packed_used > n // 10, "the packed successor blocks must be used often enough to be tested"
    expected = exact * n
    keep = expected >= 5
    other_obs, other_exp = counts[~keep].sum(), expected[~keep].sum()
    obs = torch.cat([counts[keep], other_obs[None]])
    exp = torch.cat([expected[keep], other_exp[None]])
    if other_exp < 5:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    p_value = 1 - torch.special.gammainc(torch.tensor(dof / 2.0), chi2 / 2.0)
    assert p_value > 1e-3, f"chi2={chi2:.1f}, dof={dof}, p={p_value:.2e}"
