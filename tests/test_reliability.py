"""Reliability edges of decoding, loading, saving and training (issue 8), on tiny random float32 models.

Decoding: property-based (hypothesis, derandomised) losslessness, length limits, streamer and drafter-cache
invariants; targets that emit the mask or filler id; every draft rejected, every draft accepted, acceptance exactly
at the budget; a bfloat16 drafter for a float32 target. Errors raised before any decoding work: no mask token,
incomplete config, damaged weights, empty prompt, prompt longer than the context. Training: short sequences, blocks
with nothing or everything masked, batches with nothing to score. Files: interrupted saves and checkpoints, saving
into a folder that holds other files.
"""

import json
import os
import shutil

import pytest
import torch
from _tiny import FAMILIES, crash_safetensors_writer, random_prompt, tiny_target
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel
from transformers.generation.streamers import BaseStreamer

from d3d_hf import D3DCache, D3DForDiffusionDrafting
from d3d_hf.drafters import load_drafter
from d3d_hf.training import (
    D3DDataCollator,
    D3DTrainer,
    D3DTrainingConfig,
    d3d_losses,
    is_complete_checkpoint,
    last_complete_checkpoint,
)

PROPERTY_SETTINGS = settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------------------------------------------------------
# helpers


def _greedy(target, ids, drafter=None, **kwargs):
    if "max_length" not in kwargs:
        kwargs.setdefault("max_new_tokens", 24)
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

    def __init__(self, drafter):
        self.drafter = drafter
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
            assert after == cur_len if num_drafts > 0 else before <= after <= cur_len
            if after > 0:
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


# --------------------------------------------------------------------------------------------------------------------
# property-based decoding


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
        asynchronous=draw(st.booleans()),
        num_hypotheses=draw(st.integers(1, 9)),
    )


@PROPERTY_SETTINGS
@given(case=decoding_cases())
def test_property_greedy_with_drafter_is_target_alone(case):
    """Random tiny models, prompts, block sizes, lengths, eos positions, synchronous or asynchronous drafting (1..B
    hypotheses): greedy output with the drafter equals the target's own output, never exceeds `max_new_tokens` /
    `max_length`, and the streamer receives exactly the
    returned tokens (the prompt, then one chunk per verification round of `acceptance_lengths` tokens)."""
    target = tiny_target(case["family"], vocab_size=case["vocab_size"], seed=case["seed"], sharpen=case["sharpen"])
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        target, num_layers=case["num_layers"], block_size=case["block_size"], mask_token_id=case["mask_token_id"]
    )
    if case["asynchronous"]:  # packed successor drafting; the instrument checks every committed packed key
        drafter.generation_config.d3d_async = True
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
    instrumented = _Instrumented(drafter)
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


# --------------------------------------------------------------------------------------------------------------------
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
        out = _greedy(target, ids, drafter, max_new_tokens=32, eos_token_id=None, pad_token_id=1)
        assert torch.equal(out, ref)
        assert out[0, ids.shape[1] :].tolist().count(preferred) >= 4
        stats = drafter.last_generation_stats
        # the drafter's d1 is the target's next token, so every round but a budget-cut last one accepts a draft
        assert min(stats.acceptance_lengths[:-1]) >= 2
        # drafts of the id are accepted with more accepted drafts after them (drafting goes on past the id)
        for (cur_len, _), accepted in zip(instrumented.rounds, stats.acceptance_lengths, strict=True):
            accepted_inside += preferred in out[0, cur_len : cur_len + accepted - 2].tolist()
    assert accepted_inside >= 3


@pytest.mark.parametrize("mask_token_id", [None, 7])
def test_committed_filler_and_mask_ids_are_real_tokens_to_the_drafter(mask_token_id):
    """Committed tokens equal to the filler id or the mask id are ordinary tokens to the drafter: the anchor's output
    (draft token d1) of a drafter with block adapters is still exactly the target's next-token prediction."""
    target = tiny_target("qwen3", seed=5)
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        target, block_size=4, mask_token_id=mask_token_id, block_lora_rank=4
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if drafter.is_drafter_specific(name):
                param.normal_()  # adapters that change the masked positions a lot
    ids = torch.tensor([[5, 0, 9, 7, 0, 7, 11, 0]])
    with torch.no_grad():
        want = target(ids).logits[:, -1]
        for end in (2, 4, 8):  # anchor = filler, mask id, filler
            got = drafter.draft_logits(ids[:, :end], D3DCache())[:, 0]
            torch.testing.assert_close(got, target(ids[:, :end]).logits[:, -1], rtol=1e-4, atol=1e-4)
        # and through an incremental cache, as during decoding
        cache = D3DCache()
        drafter.draft_logits(ids[:, :3], cache)
        torch.testing.assert_close(drafter.draft_logits(ids[:, 3:], cache)[:, 0], want, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------------------------
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
    out = _greedy(target, ids, drafter, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
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
    out = _greedy(target, ids, drafter, eos_token_id=None, pad_token_id=0, **length)
    assert out[0, ids.shape[1] :].tolist() == [9] * budget
    full, rest = divmod(budget, block_size)
    expected = [block_size] * full + ([rest] if rest else [])
    stats = drafter.last_generation_stats
    assert stats.acceptance_lengths == expected
    assert stats.drafted_tokens == stats.accepted_drafts == sum(a - 1 for a in expected)
    assert [n for _, n in instrumented.rounds] == [a - 1 for a in expected]


# --------------------------------------------------------------------------------------------------------------------
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
    for seed in range(3):
        ids = random_prompt(6, seed=seed)
        ref = _greedy(target, ids, max_new_tokens=30)
        assert torch.equal(_greedy(target, ids, same, max_new_tokens=30), ref)
        assert torch.equal(_greedy(target, ids, half, max_new_tokens=30), ref)
        assert torch.equal(_greedy(target, ids, shared_half, max_new_tokens=30), ref)
        assert shared_half.last_generation_stats.accepted_drafts > 0
    assert target.dtype == torch.float32


# --------------------------------------------------------------------------------------------------------------------
# errors before any decoding work


class _ForwardCounter:
    """Counts forward passes of the given modules."""

    def __init__(self, *modules):
        self.calls = 0
        for module in modules:
            module.register_forward_pre_hook(self._count)

    def _count(self, module, args):
        self.calls += 1


def _pair(**kwargs):
    target = tiny_target("llama", seed=0)
    return target, D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, **kwargs)


def test_empty_prompt_is_rejected_before_decoding():
    target, drafter = _pair()
    counter = _ForwardCounter(target, drafter)
    ids = torch.zeros((1, 0), dtype=torch.long)
    with pytest.raises(ValueError, match=r"prompt is empty \(0 tokens\).*at least one"):
        _greedy(target, ids, drafter)
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
        _greedy(target, random_prompt(), drafter)
    assert counter.calls == 0


@pytest.fixture
def saved(tmp_path):
    """A saved drafter folder (full copy of a tiny Qwen3 target, 2 layers, block adapters)."""
    target = tiny_target("qwen3", seed=1)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, layer_ids=[0, 2], block_size=4, block_lora_rank=2)
    path = tmp_path / "drafter"
    drafter.save_pretrained(path)
    return path


def _loaders(path):
    """The public ways to load a drafter folder."""
    return {
        "load_drafter": lambda: load_drafter(str(path)),
        "AutoModel": lambda: AutoModel.from_pretrained(path),
        "from_pretrained": lambda: D3DForDiffusionDrafting.from_pretrained(path),
    }


def test_loaders_accept_the_intact_folder(saved):
    for name, load in _loaders(saved).items():
        assert isinstance(load(), D3DForDiffusionDrafting), name


def test_checkpoint_without_a_mask_token_is_rejected_at_load(saved):
    weights = load_file(saved / "model.safetensors")
    del weights["model.mask_embedding.weight"]
    save_file(weights, saved / "model.safetensors", metadata={"format": "pt"})
    for name, load in _loaders(saved).items():
        with pytest.raises(ValueError, match="no mask token.*mask_token_id.*config.json"):
            load()
        assert name


@pytest.mark.parametrize("removed", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.lora_B"])
def test_checkpoint_missing_a_weight_is_rejected_at_load(saved, removed):
    weights = load_file(saved / "model.safetensors")
    del weights[removed]
    save_file(weights, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lack 1 tensor.*{removed}.*save_pretrained"):
        load_drafter(str(saved))


@pytest.mark.parametrize(("field", "value"), [("block_lora_rank", 0), ("num_hidden_layers", 1)])
def test_config_that_does_not_fit_the_weights_is_rejected_at_load(saved, field, value):
    config = json.loads((saved / "config.json").read_text())
    config[field] = value
    config["source_layer_ids"] = config["source_layer_ids"][: config["num_hidden_layers"]]
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no place for.*config.json"):
        load_drafter(str(saved))


@pytest.mark.parametrize("field", ["block_size", "num_hidden_layers", "vocab_size", "rope_parameters", "head_dim"])
def test_config_missing_a_required_field_is_rejected_at_load(saved, field):
    config = json.loads((saved / "config.json").read_text())
    del config[field]
    (saved / "config.json").write_text(json.dumps(config))
    for name, load in _loaders(saved).items():
        with pytest.raises(ValueError, match=rf"config.json\) lacks the required field\(s\) \['{field}'\]"):
            load()
        assert name


def test_config_without_model_type_or_not_json_is_rejected_at_load(saved):
    config = json.loads((saved / "config.json").read_text())
    del config["model_type"]
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match='no `model_type`: add `"model_type": "d3d"`'):
        load_drafter(str(saved))
    (saved / "config.json").write_text(json.dumps(config)[:40])
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_drafter(str(saved))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble_header(path):
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"\x00" * 16 + data[24:])


def _empty(path):
    path.write_bytes(b"")


def _append(path):
    path.write_bytes(path.read_bytes() + b"\x00" * 10)


@pytest.mark.parametrize("damage", [_truncate, _garble_header, _empty, _append], ids=lambda f: f.__name__[1:])
def test_damaged_weights_are_rejected_at_load(saved, damage):
    damage(saved / "model.safetensors")
    for name, load in _loaders(saved).items():
        with pytest.raises(OSError, match=r"model.safetensors is (truncated|corrupt).*save the drafter again"):
            load()
        assert name


def test_missing_weights_file_is_rejected_at_load(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="(?i)no weights.*save the drafter again"):
        load_drafter(str(saved))


def test_damaged_shard_is_rejected_at_load(tmp_path):
    drafter = D3DForDiffusionDrafting.from_autoregressive(tiny_target("llama", seed=2), block_size=4)
    drafter.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    _truncate(shards[1])
    with pytest.raises(OSError, match=rf"{shards[1].name} is truncated"):
        load_drafter(str(tmp_path))


# --------------------------------------------------------------------------------------------------------------------
# training edges

BLOCK = 6


def _train_drafter(target, **kwargs):
    torch.manual_seed(0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=BLOCK, **kwargs)
    with torch.no_grad():
        drafter.model.mask_embedding.weight.normal_()
    return drafter


def _assert_finite_with_finite_grads(drafter, batch):
    drafter.train()
    drafter.zero_grad()
    losses = d3d_losses(drafter, batch, block_size=BLOCK, gamma=7.0)
    loss = losses["block_loss"] + 0.5 * losses["ar_loss"]
    assert torch.isfinite(losses["block_loss"]) and torch.isfinite(losses["ar_loss"])
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    return losses


@pytest.mark.parametrize("mask_ratio", [(1.0, 1.0), (0.4, 0.6)])
def test_sequences_shorter_than_a_block(target, mask_ratio):
    drafter = _train_drafter(target)
    collator = D3DDataCollator(BLOCK, anchors_per_sequence=3, mask_ratio=mask_ratio, max_length=64)
    rows = [
        {"prompt_ids": [3], "response_ids": [4]},
        {"prompt_ids": [3, 5], "response_ids": [6, 7]},
        {"prompt_ids": [], "response_ids": [8, 9, 10]},
        {"prompt_ids": [3, 4, 5], "response_ids": []},
        {"prompt_ids": [], "response_ids": []},
    ]
    batch = collator(rows)
    losses = _assert_finite_with_finite_grads(drafter, batch)
    assert int(losses["block_tokens"]) > 0 and int(losses["ar_tokens"]) > 0


@pytest.mark.parametrize("masked", [False, True], ids=["nothing_masked", "everything_masked"])
def test_blocks_with_nothing_or_everything_masked(target, masked):
    drafter = _train_drafter(target)
    collator = D3DDataCollator(BLOCK, anchors_per_sequence=3, max_length=64)
    rows = [
        {"prompt_ids": random_prompt(4, seed=i)[0].tolist(), "response_ids": list(range(10, 13 + 4 * i))}
        for i in range(3)
    ]
    batch = collator(rows)
    batch["block_masked"] = torch.full_like(batch["block_masked"], masked)
    losses = _assert_finite_with_finite_grads(drafter, batch)
    # scored: block position j of anchor a predicts token a+j+1, when it exists and the block does not show it
    lengths = batch["attention_mask"].sum(-1).tolist()
    expected = sum(
        a + j + 1 < lengths[b] and (masked or j == BLOCK - 1)
        for b, row in enumerate(batch["anchors"].tolist())
        for a in row
        if a >= 0
        for j in range(1, BLOCK)
    )
    assert expected > 0 and int(losses["block_tokens"]) == expected


def _config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        seed=7,
        anchors_per_sequence=2,
        block_lora_rank=4,
        disable_tqdm=True,
        report_to="none",
    )
    defaults.update(kwargs)
    return D3DTrainingConfig(**defaults)


@pytest.mark.parametrize("mode", ["block_adapter", "full"])
def test_training_on_batches_with_nothing_to_score(target, tmp_path, mode):
    """Every row too short for a block or a next-token target: training steps run (zero loss) instead of failing in
    `backward`."""
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt_ids": [3 + i], "response_ids": []} for i in range(4)])
    drafter = _train_drafter(target)
    batch = D3DDataCollator(BLOCK, anchors_per_sequence=2)([rows[0], rows[1]])
    losses = d3d_losses(drafter, batch, block_size=BLOCK, gamma=7.0)
    assert float(losses["block_loss"].detach()) == float(losses["ar_loss"].detach()) == 0.0
    assert losses["block_loss"].requires_grad, "a zero loss must stay on the graph so that backward works"
    config = _config(tmp_path, train_mode=mode, logging_nan_inf_filter=False)
    trainer = D3DTrainer(drafter, config, train_dataset=rows)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(h["loss"] == 0.0 for h in logged)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# --------------------------------------------------------------------------------------------------------------------
# files: interrupted saves, checkpoints, existing folders


def _two_drafters():
    target = tiny_target("llama", seed=3)
    first = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    second = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    with torch.no_grad():
        second.model.mask_embedding.weight.normal_()
    return first, second


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_interrupted_while_writing_weights_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first, second = _two_drafters()
    first.save_pretrained(tmp_path / "ckpt")
    before = sorted(p.name for p in tmp_path.iterdir())
    with monkeypatch.context() as patch:
        crash_safetensors_writer(patch)
        with pytest.raises(KeyboardInterrupt):
            second.save_pretrained(tmp_path / "ckpt")
    _assert_same_weights(load_drafter(str(tmp_path / "ckpt")), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "no temporary folder is left behind"
    second.save_pretrained(tmp_path / "ckpt")
    _assert_same_weights(load_drafter(str(tmp_path / "ckpt")), second)


def test_save_interrupted_after_the_weights_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A crash after the weights were written (here: in the tokenizer's save) leaves the previous files in place."""
    first, second = _two_drafters()
    first.save_pretrained(tmp_path / "ckpt")

    class CrashingTokenizer:
        def save_pretrained(self, folder):
            raise KeyboardInterrupt("killed while writing the tokenizer")

    with pytest.raises(KeyboardInterrupt):
        second.save_pretrained(tmp_path / "ckpt", tokenizer=CrashingTokenizer())
    _assert_same_weights(load_drafter(str(tmp_path / "ckpt")), first)


def test_new_checkpoint_interrupted_leaves_no_half_written_weights(tmp_path, monkeypatch):
    _, second = _two_drafters()
    with monkeypatch.context() as patch:
        crash_safetensors_writer(patch)
        with pytest.raises(KeyboardInterrupt):
            second.save_pretrained(tmp_path / "new")
    assert list(tmp_path.iterdir()) == [], "neither the folder nor a temporary one is left behind"


def test_save_into_a_folder_with_other_files_keeps_them(tmp_path):
    first, second = _two_drafters()
    folder = tmp_path / "ckpt"
    (folder / "notes").mkdir(parents=True)
    (folder / "notes" / "run.txt").write_text("lr 5e-4")
    (folder / "train.log").write_text("step 1")
    (folder / "README.md").write_text("# my own card\n")
    with pytest.warns(UserWarning, match="Kept .*README.md: it was not generated by d3d-hf"):
        first.save_pretrained(folder)
        second.save_pretrained(folder)
    assert (folder / "notes" / "run.txt").read_text() == "lr 5e-4"
    assert (folder / "train.log").read_text() == "step 1"
    assert (folder / "README.md").read_text() == "# my own card\n"
    _assert_same_weights(load_drafter(str(folder)), second)


def test_save_stages_inside_the_folder_when_its_parent_is_read_only(tmp_path, monkeypatch):
    import tempfile

    first, second = _two_drafters()
    folder = tmp_path / "ckpt"
    first.save_pretrained(folder)
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if os.path.realpath(str(dir)) == os.path.realpath(tmp_path):
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    second.save_pretrained(folder)
    _assert_same_weights(load_drafter(str(folder)), second)
    assert not any(p.name.endswith(".saving") for p in [*tmp_path.iterdir(), *folder.iterdir()])


@pytest.mark.parametrize("order", ["sharded_then_single", "single_then_sharded"])
def test_weights_of_an_earlier_save_never_shadow_the_new_ones(tmp_path, order):
    first, second = _two_drafters()
    shard = dict(max_shard_size="40KB")
    first.save_pretrained(tmp_path, **(shard if order == "sharded_then_single" else {}))
    second.save_pretrained(tmp_path, **({} if order == "sharded_then_single" else shard))
    _assert_same_weights(load_drafter(str(tmp_path)), second)
    names = {p.name for p in tmp_path.iterdir()}
    if order == "sharded_then_single":
        assert "model.safetensors" in names and not any(n.startswith("model-") for n in names)
    else:
        assert "model.safetensors" not in names and "model.safetensors.index.json" in names


def _tiny_dataset(target):
    from datasets import Dataset

    rows = []
    for i in range(6):
        prompt = random_prompt(4, seed=i)
        out = target.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        rows.append({"prompt_ids": prompt[0].tolist(), "response_ids": out[0, prompt.shape[1] :].tolist()})
    return Dataset.from_list(rows)


@pytest.mark.parametrize("crash_in", ["weights", "optimizer", "trainer_state"])
def test_resume_never_picks_a_half_written_checkpoint(target, tmp_path, monkeypatch, crash_in):
    """A run killed while writing checkpoint-4 (in the weights, the optimizer state, or the trainer state written
    last): `resume_from_checkpoint=True` resumes from checkpoint-2 and ends exactly where an uninterrupted run ends."""
    import transformers.trainer

    dataset = _tiny_dataset(target)
    full = D3DTrainer(_train_drafter(target), _config(tmp_path / "full", max_steps=4), train_dataset=dataset)
    full.train()

    run = tmp_path / "run"
    saves = _config(run, max_steps=4, save_strategy="steps", save_steps=2)
    crashed = D3DTrainer(_train_drafter(target), saves, train_dataset=dataset)
    with monkeypatch.context() as patch:
        if crash_in == "weights":
            real_save = D3DForDiffusionDrafting.save_pretrained

            def save(self, folder, *args, **kwargs):
                if str(folder).endswith("checkpoint-4"):
                    crash_safetensors_writer(patch)
                return real_save(self, folder, *args, **kwargs)

            patch.setattr(D3DForDiffusionDrafting, "save_pretrained", save)
        elif crash_in == "optimizer":
            real_torch_save = torch.save

            def torch_save(obj, f, *args, **kwargs):
                if "checkpoint-4" in str(f) and str(f).endswith("optimizer.pt"):
                    raise KeyboardInterrupt("killed while writing the optimizer state")
                return real_torch_save(obj, f, *args, **kwargs)

            patch.setattr(torch, "save", torch_save)
        else:
            real_state_save = transformers.trainer.TrainerState.save_to_json

            def state_save(self, path):
                if "checkpoint-4" in str(path):
                    with open(path, "w") as f:
                        f.write('{"global_step": 4, "log_hi')
                    raise KeyboardInterrupt("killed while writing the trainer state")
                return real_state_save(self, path)

            patch.setattr(transformers.trainer.TrainerState, "save_to_json", state_save)
        with pytest.raises(KeyboardInterrupt):
            crashed.train()
    assert (run / "checkpoint-4").is_dir() and not is_complete_checkpoint(run / "checkpoint-4")
    assert last_complete_checkpoint(run) == str(run / "checkpoint-2")

    resumed = D3DTrainer(_train_drafter(target), _config(run, max_steps=4), train_dataset=dataset)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    want = dict(full.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, want[name], rtol=1e-5, atol=1e-6, msg=name)

    again = D3DTrainer(_train_drafter(target), _config(run, max_steps=4), train_dataset=dataset)
    shutil.rmtree(run / "checkpoint-4")
    (run / "checkpoint-4").mkdir()
    with pytest.raises(ValueError, match="checkpoint-4 is not a complete checkpoint.*checkpoint-2"):
        again.train(resume_from_checkpoint=str(run / "checkpoint-4"))


def test_train_command_resumes_from_the_last_complete_checkpoint(target, tmp_path, monkeypatch):
    """`d3d-hf train --resume_from_checkpoint auto` after a run killed while writing checkpoint-4 resumes from
    checkpoint-2 and saves the drafter an uninterrupted run saves."""
    import d3d_hf.targets
    from d3d_hf.training import D3DTrainScriptArguments, train_drafter

    _tiny_dataset(target).save_to_disk(str(tmp_path / "data"))
    monkeypatch.setattr(d3d_hf.targets, "load_target", lambda name, dtype="float32": (target, None))
    script = D3DTrainScriptArguments(target="tiny", data=str(tmp_path / "data"), tau_holdout=1, init_block_size=BLOCK)

    def run(output, **kwargs):
        config = _config(output, max_steps=4, save_strategy="steps", save_steps=2, **kwargs)
        return train_drafter(script, config)

    want = run(tmp_path / "full").drafter_state_dict()
    real_torch_save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        if "checkpoint-4" in str(f) and str(f).endswith("optimizer.pt"):
            raise KeyboardInterrupt("killed while writing the optimizer state")
        return real_torch_save(obj, f, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", torch_save)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path / "run")
    got = run(tmp_path / "run", resume_from_checkpoint="auto").drafter_state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
