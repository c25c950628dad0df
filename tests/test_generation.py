"""Synchronous D3D generation (modeling/generation_d3d.py: the candidate generator and the generate hook), on tiny
random float32 Llama- and Qwen3-style targets: `target.generate(..., assistant_model=drafter)` is lossless.

Greedy decoding: block sizes and depths, length limits, eos inside a drafted block, streamers, logits processors,
returned scores, state between calls; property-based (hypothesis, derandomised) losslessness with length-limit,
streamer and drafter-cache invariants (synchronous and asynchronous drafting); targets that emit the mask or filler
id; every draft rejected, every draft accepted, acceptance exactly at the budget; a bfloat16 drafter for a float32
target. Refused before any decoding work: an empty prompt, a prompt longer than the context, a drafter
without a mask token. The generate hook. Sampling keeps the target's distribution.
"""

import pytest
import torch
from _tiny import FAMILIES, chi_square_p_value, random_prompt, tiny_target
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from d3d_hf import D3DCache, D3DForDiffusionDrafting, install_generation_hook, remove_generation_hook
from d3d_hf.drafters import load_drafter

# ----------------------------------------------------------------------------------------------------------------------
# helpers


def _pair(family="llama", num_layers=None, block_size=4, seed=0, sharpen=1.0, vocab_size=97, **drafter_kwargs):
    target = tiny_target(family, seed=seed, sharpen=sharpen, vocab_size=vocab_size)
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        target, num_layers=num_layers, block_size=block_size, **drafter_kwargs
    )
    return target, drafter


def _greedy(target, ids, drafter=None, **kwargs):
    if "max_length" not in kwargs:
        kwargs.setdefault("max_new_tokens", 40)
    return target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False, **kwargs)


class _Recorder(BaseStreamer):
    """Records every `put` (one chunk per call) and whether `end` was called."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True

    @property
    def tokens(self):
        return [t for chunk in self.chunks for t in chunk]


def _bias_lm_head(model, bias: dict[int, float]):
    """Gives `model.lm_head` a bias (same weight tensor, so tied embeddings stay tied): logits of `bias`'s ids move
    by the given amounts, whatever the context."""
    old = model.lm_head
    head = nn.Linear(old.in_features, old.out_features, bias=True)
    head.weight = old.weight
    with torch.no_grad():
        head.bias.zero_()
        for token, value in bias.items():
            head.bias[token] = value
    model.lm_head = head
    return model


class _Instrumented:
    """Wraps a drafter's candidate generator to check, after every `get_candidates` call, that the drafter's cache
    holds exactly the committed sequence (same keys as a fresh causal pass over it) and that the drafts fit the
    length budget. Records the drafts of every round."""

    def __init__(self, drafter, check_cache=True):
        self.drafter = drafter
        self.check_cache = check_cache  # the drafter's own cache (fixed plans; the adaptive engine skips passes)
        self.rounds = []  # (committed length, number of drafts)
        self.generator = None
        self._build = drafter.build_candidate_generator
        drafter.build_candidate_generator = self.build

    def build(self, **kwargs):
        self.generator = generator = self._build(**kwargs)
        get_candidates = generator.get_candidates

        def checked(input_ids, **kw):
            cache = generator.cache
            before = cache.get_seq_length()
            candidates, scores = get_candidates(input_ids, **kw)
            cur_len = input_ids.shape[1]
            num_drafts = candidates.shape[1] - cur_len
            assert torch.equal(candidates[:, :cur_len], input_ids)
            assert num_drafts <= max(min(generator.block_size - 1, generator.max_length - cur_len - 1), 0)
            assert (scores is None) == (num_drafts == 0)
            if scores is not None:
                assert scores.shape[:2] == (1, num_drafts)
            # after a draft pass the cache holds exactly the committed tokens (the masks are rolled back); a round
            # without drafts may still commit what a joined asynchronous pass verified (a prefix of them)
            after = cache.get_seq_length()
            if self.check_cache:
                assert after == cur_len if num_drafts > 0 else before <= after <= cur_len
            if after > 0 and self.check_cache:
                fresh = D3DCache()
                with torch.no_grad():
                    self.drafter(
                        input_ids=input_ids[:, :after], past_key_values=fresh, use_cache=True, logits_to_keep=1
                    )
                for got, want in zip(cache.key_cache, fresh.key_cache, strict=True):
                    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4)
            self.rounds.append((cur_len, num_drafts))
            return candidates, scores

        generator.get_candidates = checked
        return generator


# ----------------------------------------------------------------------------------------------------------------------
# greedy decoding


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("num_layers", [None, 1])
def test_greedy_is_lossless(family, block_size, num_layers):
    target, drafter = _pair(family, num_layers=num_layers, block_size=block_size)
    for seed in range(3):
        ids = random_prompt(5 + seed, seed=seed)
        ref = _greedy(target, ids)
        out = _greedy(target, ids, drafter)  # the default engine (adaptive, prompt lookup on)
        assert torch.equal(out, ref)
        stats = drafter.last_generation_stats
        assert stats.new_tokens == ref.shape[1] - ids.shape[1]
        if block_size == 1:
            assert stats.rounds == stats.new_tokens and stats.drafted_tokens == 0
        if num_layers is None and block_size > 1:
            # a full copy of the target drafts d1 exactly as the target would (the last round may be cut by eos);
            # a fixed plan, so that every round drafts
            assert torch.equal(_greedy(target, ids, drafter, d3d_num_drafts="full"), ref)
            stats = drafter.last_generation_stats
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


def test_a_batch_decodes_in_the_batched_loop_and_get_candidates_refuses_one():
    """A batch runs D3D's batched loop (tests/test_batched.py); the one-sequence round `get_candidates` refuses a
    batch with a message that says where batches go."""
    target, drafter = _pair()
    ids = torch.cat([random_prompt(), random_prompt(seed=1)])
    out = _greedy(target, ids, drafter)
    assert torch.equal(out, _greedy(target, ids))
    generator = drafter.build_candidate_generator(
        target=target, input_ids=ids, generation_config=GenerationConfig(max_length=20), logits_processor=None
    )
    with pytest.raises(ValueError, match="drafts for one sequence"):
        generator.get_candidates(ids)


# ----------------------------------------------------------------------------------------------------------------------
# property-based decoding


PROPERTY_SETTINGS = settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def decoding_cases(draw):
    vocab_size = draw(st.sampled_from([13, 31, 97]))
    return dict(
        family=draw(st.sampled_from(FAMILIES)),
        vocab_size=vocab_size,
        seed=draw(st.integers(0, 10_000)),
        sharpen=draw(st.sampled_from([1.0, 4.0, 16.0])),
        num_layers=draw(st.sampled_from([None, None, 1, 2])),
        block_size=draw(st.integers(1, 9)),
        mask_token_id=draw(st.one_of(st.none(), st.integers(0, vocab_size - 1))),
        prompt=draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=10)),
        use_max_length=draw(st.booleans()),
        new_tokens=draw(st.integers(1, 24)),
        eos=draw(st.one_of(st.sampled_from(["none", "config"]), st.integers(0, 23))),
        eos_as_list=draw(st.booleans()),
        plan=draw(st.sampled_from(["default", "full", "async"])),
        num_hypotheses=draw(st.integers(1, 9)),
    )


@PROPERTY_SETTINGS
@given(case=decoding_cases())
def test_property_greedy_with_drafter_is_target_alone(case):
    """Random tiny models, prompts, block sizes, lengths, eos positions, and plans: the default engine (adaptive,
    prompt lookup on), a full block every round, or asynchronous drafting (1..B hypotheses): greedy output with the
    drafter equals the target's own output, never exceeds `max_new_tokens` / `max_length`, and the streamer receives
    exactly the returned tokens (the prompt, then one chunk per verification round of `acceptance_lengths` tokens).
    The fixed plans pin a draft pass every round so that the instrument can check the drafter's cache after each."""
    target = tiny_target(case["family"], vocab_size=case["vocab_size"], seed=case["seed"], sharpen=case["sharpen"])
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        target, num_layers=case["num_layers"], block_size=case["block_size"], mask_token_id=case["mask_token_id"]
    )
    if case["plan"] == "full":
        drafter.generation_config.d3d_num_drafts = "full"
    elif case["plan"] == "async":  # packed successor drafting; the instrument checks every committed packed key
        drafter.generation_config.d3d_async = True
        drafter.generation_config.d3d_num_drafts = "full"
        drafter.generation_config.d3d_num_hypotheses = min(case["num_hypotheses"], case["block_size"])
    ids = torch.tensor([case["prompt"]])
    prompt_len = ids.shape[1]
    if case["use_max_length"]:
        limit = dict(max_length=prompt_len + case["new_tokens"])
    else:
        limit = dict(max_new_tokens=case["new_tokens"])
    if case["eos"] == "none":
        eos = None
    elif case["eos"] == "config":
        eos = target.generation_config.eos_token_id
    else:  # a token of the continuation, so that generation stops at a chosen position of some block
        continuation = _greedy(target, ids, eos_token_id=None, pad_token_id=0, **limit)[0, prompt_len:].tolist()
        eos = continuation[case["eos"] % len(continuation)]
    if eos is not None and case["eos_as_list"]:
        eos = [(eos + 1) % case["vocab_size"], eos]
    kwargs = dict(eos_token_id=eos, pad_token_id=0, **limit)

    ref_stream, stream = _Recorder(), _Recorder()
    ref = _greedy(target, ids, streamer=ref_stream, **kwargs)
    instrumented = _Instrumented(drafter, check_cache=case["plan"] != "default")
    out = _greedy(target, ids, drafter, streamer=stream, **kwargs)

    assert torch.equal(out, ref)
    new = out.shape[1] - prompt_len
    assert 1 <= new <= case["new_tokens"]
    assert stream.tokens == out[0].tolist() == ref_stream.tokens and stream.ended
    stats = drafter.last_generation_stats
    assert stream.chunks[0] == case["prompt"]
    assert [len(chunk) for chunk in stream.chunks[1:]] == stats.acceptance_lengths
    assert stats.new_tokens == sum(stats.acceptance_lengths) == new
    assert stats.rounds == len(instrumented.rounds) == len(stats.acceptance_lengths)
    assert stats.drafted_tokens == sum(n for _, n in instrumented.rounds)
    assert all(1 <= a <= case["block_size"] for a in stats.acceptance_lengths)
    event(f"accepted drafts: {'none' if stats.accepted_drafts == 0 else 'some'}")
    event(f"a full block accepted: {case['block_size'] > 1 and case['block_size'] in stats.acceptance_lengths}")
    event(f"stopped by: {'eos' if new < case['new_tokens'] else 'length'}")
    event(f"async packed blocks used: {stats.hits > 0}")
    event(f"round sources: {sorted(set(stats.round_sources))}")


# ----------------------------------------------------------------------------------------------------------------------
# targets that emit the mask or filler id


@pytest.mark.parametrize(
    ("mask_token_id", "preferred"),
    [(None, 0), (7, 7), (7, 0)],
    ids=["filler0-mask_embedding", "mask_id7", "filler0-mask_id7"],
)
def test_target_emitting_the_mask_or_filler_id_keeps_it(mask_token_id, preferred):
    """A target (and its full-copy drafter) that often emits the filler id 0 (what `draft_logits` puts at masked
    positions) or the drafter's `mask_token_id`: the output keeps those tokens, drafts of them are accepted."""
    target = _bias_lm_head(tiny_target("qwen3", seed=2), {preferred: 2.5})
    drafter = _bias_lm_head(
        D3DForDiffusionDrafting.from_autoregressive(target, block_size=5, mask_token_id=mask_token_id),
        {preferred: 2.5},
    )
    instrumented = _Instrumented(drafter)
    accepted_inside = 0
    for seed in range(3):
        ids = random_prompt(6, seed=seed)
        ref = _greedy(target, ids, max_new_tokens=32, eos_token_id=None, pad_token_id=1)
        instrumented.rounds.clear()
        # a fixed plan: every round drafts (the adaptive engine may take plain steps or lookup rounds instead)
        out = _greedy(target, ids, drafter, max_new_tokens=32, eos_token_id=None, pad_token_id=1,
                      d3d_num_drafts="full")
        assert torch.equal(out, ref)
        assert out[0, ids.shape[1] :].tolist().count(preferred) >= 4
        stats = drafter.last_generation_stats
        # the drafter's d1 is the target's next token, so every round but a budget-cut last one accepts a draft
        assert min(stats.acceptance_lengths[:-1]) >= 2
        # drafts of the id are accepted with more accepted drafts after them (drafting goes on past the id)
        for (cur_len, _), accepted in zip(instrumented.rounds, stats.acceptance_lengths, strict=True):
            accepted_inside += preferred in out[0, cur_len : cur_len + accepted - 2].tolist()
    assert accepted_inside >= 3


# ----------------------------------------------------------------------------------------------------------------------
# rollback edges


def test_every_draft_rejected():
    """A drafter that drafts only a token the target never emits: every round commits exactly one token, the output
    is the target's."""
    garbage = 11
    target = _bias_lm_head(tiny_target("llama", seed=6), {garbage: -100.0})
    drafter = _bias_lm_head(D3DForDiffusionDrafting.from_autoregressive(target, block_size=6), {garbage: 100.0})
    ids = random_prompt(5, seed=3)
    ref = _greedy(target, ids, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    instrumented = _Instrumented(drafter)
    # a fixed plan: the adaptive engine would soon stop drafting for a drafter that is never accepted
    out = _greedy(target, ids, drafter, max_new_tokens=20, eos_token_id=None, pad_token_id=0, d3d_num_drafts="full")
    assert torch.equal(out, ref)
    stats = drafter.last_generation_stats
    assert stats.accepted_drafts == 0 and stats.acceptance_lengths == [1] * 20
    assert stats.drafted_tokens == sum(n for _, n in instrumented.rounds) > 0
    assert garbage not in out[0, ids.shape[1] :].tolist()


def _always(token: int, block_size: int):
    """A target that emits `token` whatever the context, and a drafter that drafts it: every draft is accepted."""
    target = _bias_lm_head(tiny_target("qwen3", seed=8), {token: 100.0})
    drafter = _bias_lm_head(D3DForDiffusionDrafting.from_autoregressive(target, block_size=block_size), {token: 100.0})
    return target, drafter


@pytest.mark.parametrize("block_size", [2, 4])
@pytest.mark.parametrize("budget", range(1, 10))
@pytest.mark.parametrize("limit", ["max_new_tokens", "max_length"])
def test_every_draft_accepted_up_to_exactly_the_budget(block_size, budget, limit):
    """Every draft accepted: full blocks of `block_size` tokens, then a last round that drafts exactly what fits, so
    the output ends exactly at the budget; nothing is drafted past it."""
    target, drafter = _always(9, block_size)
    ids = random_prompt(4, seed=1)
    length = dict(max_new_tokens=budget) if limit == "max_new_tokens" else dict(max_length=ids.shape[1] + budget)
    instrumented = _Instrumented(drafter)
    # a fixed plan: full blocks every round, so the expected round structure is known
    out = _greedy(target, ids, drafter, eos_token_id=None, pad_token_id=0, d3d_num_drafts="full", **length)
    assert out[0, ids.shape[1] :].tolist() == [9] * budget
    full, rest = divmod(budget, block_size)
    expected = [block_size] * full + ([rest] if rest else [])
    stats = drafter.last_generation_stats
    assert stats.acceptance_lengths == expected
    assert stats.drafted_tokens == stats.accepted_drafts == sum(a - 1 for a in expected)
    assert [n for _, n in instrumented.rounds] == [a - 1 for a in expected]


# ----------------------------------------------------------------------------------------------------------------------
# mixed dtypes


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_drafter_for_a_float32_target(family, tmp_path):
    """A bfloat16 drafter (a copy, and a weight-sharing one loaded in bfloat16 whose shared layers are the float32
    target's) decodes exactly what the float32 drafter and the target alone decode."""
    target = tiny_target(family, seed=9, sharpen=3.0)
    same = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=5)
    half = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=5).to(torch.bfloat16)
    shared = D3DForDiffusionDrafting.from_autoregressive(
        target, block_size=5, shares_target_weights=True, block_lora_rank=4
    )
    with torch.no_grad():
        for name, param in shared.named_parameters():
            if shared.is_drafter_specific(name):
                param.normal_(std=0.05)
    shared.save_pretrained(tmp_path / "shared")
    shared_half = load_drafter(str(tmp_path / "shared"), dtype="bfloat16")
    assert shared_half.model.mask_embedding.weight.dtype == torch.bfloat16
    # a fixed plan (a full block every round, no lookup): the cost-aware engine's choice depends on timings, and on a
    # loaded machine it may not draft at all, which would leave the bf16 drafts unchecked
    plan = dict(max_new_tokens=30, d3d_num_drafts="full", d3d_prompt_lookup=False)
    for seed in range(3):
        ids = random_prompt(6, seed=seed)
        ref = _greedy(target, ids, max_new_tokens=30)
        assert torch.equal(_greedy(target, ids, same, **plan), ref)
        assert torch.equal(_greedy(target, ids, half, **plan), ref)
        assert torch.equal(_greedy(target, ids, shared_half, **plan), ref)
        assert shared_half.last_generation_stats.accepted_drafts > 0
    assert target.dtype == torch.float32


# ----------------------------------------------------------------------------------------------------------------------
# errors before any decoding work


class _ForwardCounter:
    """Counts forward passes of the given modules."""

    def __init__(self, *modules):
        self.calls = 0
        for module in modules:
            module.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


def test_empty_prompt_is_rejected_before_decoding():
    target, drafter = _pair()
    counter = _ForwardCounter(target, drafter)
    ids = torch.zeros((1, 0), dtype=torch.long)
    with pytest.raises(ValueError, match=r"prompt is empty \(0 tokens\).*at least one"):
        _greedy(target, ids, drafter, max_new_tokens=24)
    assert counter.calls == 0


def test_prompt_longer_than_the_target_context_is_rejected_before_decoding():
    target, drafter = _pair()
    context = target.config.max_position_embeddings
    counter = _ForwardCounter(target, drafter)
    with pytest.raises(ValueError, match=rf"{context + 1} tokens.*target's context is {context}.*shorten"):
        _greedy(target, random_prompt(context + 1), drafter, max_new_tokens=2)
    assert counter.calls == 0
    drafter.config.max_position_embeddings = 16
    with pytest.raises(ValueError, match=r"17 tokens.*drafter's context is 16"):
        _greedy(target, random_prompt(17), drafter, max_new_tokens=2)
    assert counter.calls == 0
    # a prompt that fills the context exactly is accepted (target alone decodes it too)
    ids = random_prompt(16)
    assert torch.equal(_greedy(target, ids, drafter, max_new_tokens=3), _greedy(target, ids, max_new_tokens=3))


def test_drafter_without_a_mask_token_is_rejected_before_decoding():
    target, drafter = _pair(mask_token_id=5)
    drafter.config.mask_token_id = None  # no mask id, and no separate mask embedding either
    counter = _ForwardCounter(target, drafter)
    with pytest.raises(ValueError, match="no mask token.*mask_token_id"):
        _greedy(target, random_prompt(), drafter, max_new_tokens=24)
    assert counter.calls == 0


# ----------------------------------------------------------------------------------------------------------------------
# the generate hook


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


# ----------------------------------------------------------------------------------------------------------------------
# sampling


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


@pytest.mark.parametrize(
    "options",
    [
        {"d3d_num_drafts": "full"},
        {"d3d_async": True, "d3d_num_drafts": "full", "d3d_num_hypotheses": 4, "d3d_reuse_on_miss": True},
    ],
    ids=["sync", "async"],
)
def test_speculative_sampling_preserves_the_target_distribution(options):
    """`d3d_sampling="speculative"` (the default is drafter-invariant sampling: tests/test_sampling.py): chi-square
    goodness of fit of 2-token samples drawn with the drafter against the exact target law (in async mode the second
    token's draft, after a rejected first draft, comes from the packed successor pass). A fixed plan, so that every
    round drafts and rejections are exercised."""
    options = {**options, "d3d_sampling": "speculative"}
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
    assert stats.options.sampling == "speculative"
    if options.get("d3d_async"):
        assert packed_used > n // 10, "the packed successor blocks must be used often enough to be tested"
    p_value = chi_square_p_value(counts, exact, n)
    assert p_value > 1e-3, f"p={p_value:.2e}"


def test_d3d_loops_build_the_call_state_without_transformers_factory(monkeypatch):
    """Issue 36 item 2: D3D's own loop and its batched loop build the call's generator directly
    (`generation_d3d.d3d_candidate_generator`), not through the patched `GenerationMixin._get_candidate_generator`;
    transformers' loop (the `d3d_decoding_loop="transformers"` ablation) still gets it through the factory."""
    from transformers.generation import GenerationMixin

    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    asked = []
    factory = GenerationMixin._get_candidate_generator

    def counting(self, *args, **kwargs):
        asked.append(1)
        return factory(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", counting)
    ids = random_prompt(7)
    batch = torch.cat([random_prompt(7, seed=1), random_prompt(7, seed=2)])
    kw = dict(assistant_model=drafter, do_sample=False, max_new_tokens=6, d3d_num_drafts=3)
    assert torch.equal(target.generate(ids, **kw), target.generate(ids, do_sample=False, max_new_tokens=6))
    target.generate(batch, attention_mask=torch.ones_like(batch), pad_token_id=0, **kw)
    assert asked == [] and drafter.last_generation_stats.decoding_loop == "d3d"
    target.generate(ids, d3d_decoding_loop="transformers", **kw)
    assert asked == [1]
