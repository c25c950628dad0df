"""Batched D3D decoding (modeling/batched_decoding_d3d.py): a left-padded batch in D3D's own loop gives every sequence
exactly its target-only output (float32), stops each sequence where it stops alone, keeps drafter-invariant sampling
per sequence, and leaves a batch of one unpadded prompt on the one-sequence path."""

from __future__ import annotations

import pytest
import torch
from _tiny import perturbed_drafter, random_prompt, tiny_target, tiny_tokenizer
from d3d_hf.modeling import batched_decoding_d3d
from d3d_hf.modeling.batched_decoding_d3d import BatchedRounds, RaggedSlots

from d3d_hf import D3DForDiffusionDrafting


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` of 1-D prompts, left-padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask


def generated(row: torch.Tensor, width: int, eos: int | None) -> list[int]:
    """The generated tokens of an output row (after the padded prompt), up to and including the first eos."""
    tokens = row[width:].tolist()
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


@pytest.fixture(scope="module")
def tiny():
    """A sharpened tiny target, a full-copy drafter of it with its own cache and one that shares the target's cache,
    and four prompts of different lengths."""
    target = tiny_target("llama", seed=4, sharpen=10.0)
    own = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    shared = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, shares_target_weights=True)
    prompts = [random_prompt(n, seed=s)[0] for n, s in ((7, 1), (3, 2), (11, 3), (5, 4))]
    return target, own, shared, prompts


class Spy:
    """Records every round's verification results (per cache row: committed tokens before the eos / length cut) and
    the sequences of its rows."""

    def __init__(self, monkeypatch):
        self.rounds = []
        original = BatchedRounds.verify

        def verify(rounds, *args, **kwargs):
            results = original(rounds, *args, **kwargs)
            self.rounds.append((list(rounds.active), [r[0][0].tolist() for r in results]))
            return results

        monkeypatch.setattr(BatchedRounds, "verify", verify)


def _stop_tokens(target, prompts, max_new_tokens):
    """Tokens that the target emits mid-way (position 3 or later) in one prompt's continuation, not earlier in it and
    never in the other prompts' continuations: with one as eos that sequence stops early and the longest runs on."""
    free = [
        target.generate(
            p[None],
            attention_mask=torch.ones_like(p[None]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    found = []
    for k, tokens in enumerate(free):
        others = {t for j, other in enumerate(free) if j != k for t in other}
        found += [t for i, t in enumerate(tokens[3:-3], 3) if t not in tokens[:i] and t not in others and t != 0]
    assert found, "no usable stop token"
    return found, free


def _cut(tokens: list[int], eos: int) -> list[int]:
    """A greedy continuation as it is with `eos` as the end-of-sequence token."""
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("drafter_kind", ["own", "shared"])
@pytest.mark.parametrize("plan", [{}, {"d3d_num_drafts": 3}], ids=["adaptive", "k3"])
def test_batch_equals_target_alone_with_eos_mid_round(tiny, drafter_kind, plan, monkeypatch):
    target, own, shared, prompts = tiny
    drafter = own if drafter_kind == "own" else shared
    max_new = 20
    ids, mask = left_pad(prompts)
    mid_round = False
    stops, free = _stop_tokens(target, prompts, max_new)
    for eos in stops[:4]:
        kw = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0)
        reference = target.generate(ids, attention_mask=mask, **kw)
        spy = Spy(monkeypatch)
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **kw, **plan)
        assert torch.equal(out, reference)
        lengths = []
        for i in range(len(prompts)):
            assert generated(out[i], ids.shape[1], eos) == _cut(free[i], eos), i
            lengths.append(len(_cut(free[i], eos)))
        assert min(lengths) < max_new and max(lengths) == max_new, "sequences must stop at different points"
        stats = drafter.last_generation_stats
        assert stats.decoding_loop == "d3d" and stats.batch_size == 4
        assert stats.shared_target_cache == (drafter_kind == "shared")
        if drafter_kind == "shared":  # the prefill round drafts nothing: the pass would recompute the prompts
            assert stats.round_sources[0] != "drafter" and (not plan or stats.round_sources[1] == "drafter")
        assert stats.accepted_drafts > 0
        # finished sequences stop costing rows: the last rounds verify fewer sequences
        assert len(spy.rounds[-1][0]) < len(prompts)
        # an eos accepted as a draft: the round committed tokens after it, which the loop cut, while others continued
        cut = [active for active, rows in spy.rounds for row in rows if eos in row[:-1]]
        mid_round |= any(len(active) > 1 for active in cut)
    if plan:  # a draft pass every round
        assert mid_round


def test_batch_of_one_unpadded_keeps_the_one_sequence_path(tiny, monkeypatch):
    target, own, _, prompts = tiny
    calls = []
    original = batched_decoding_d3d.BatchedRounds.__init__
    monkeypatch.setattr(
        batched_decoding_d3d.BatchedRounds, "__init__", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    p = prompts[0][None]
    kw = dict(do_sample=False, max_new_tokens=12, pad_token_id=0)
    out = target.generate(p, attention_mask=torch.ones_like(p), assistant_model=own, **kw)
    assert calls == [] and own.last_generation_stats.batch_size == 1
    assert torch.equal(out, target.generate(p, attention_mask=torch.ones_like(p), **kw))
    # one padded prompt is a batch: the batched loop, the tokens of the prompt alone
    ids, mask = left_pad([prompts[1], prompts[0]])
    padded = target.generate(ids[:1], attention_mask=mask[:1], assistant_model=own, **kw)
    short = prompts[1][None]
    alone = target.generate(short, attention_mask=torch.ones_like(short), **kw)
    assert calls == [1] and torch.equal(padded[0, ids.shape[1] :], alone[0, short.shape[1] :])


def test_compaction_changes_no_token(tiny, monkeypatch):
    """Holes are compacted away (forced after every round here) without changing a token, with the drafter's own
    cache and the shared one; rounds near `max_new_tokens` send fewer drafts."""
    target, own, shared, prompts = tiny
    monkeypatch.setattr(RaggedSlots, "compaction_index", _always_compact)
    ids, mask = left_pad(prompts)
    kw = dict(do_sample=False, max_new_tokens=13, eos_token_id=None, pad_token_id=0)
    reference = target.generate(ids, attention_mask=mask, **kw)
    for drafter in (own, shared):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, d3d_num_drafts=3, **kw)
        assert torch.equal(out, reference)


_original_compaction = RaggedSlots.compaction_index


def _always_compact(self, min_waste=16):
    return _original_compaction(self, min_waste=0)


def test_ragged_slots_masks_and_positions():
    slots = RaggedSlots(2, torch.device("cpu"))
    allowed, positions, real = slots.inputs([3, 1], 3)
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert real.tolist() == [[True, True, True], [False, False, True]]
    assert allowed[1, 0, 0].tolist() == [True, False, False]  # a pad row sees itself only
    assert allowed[0, 0, 1].tolist() == [True, True, False]  # causal
    slots.append([3, 1], 3, kept=[2, 1])
    assert slots.valid.tolist() == [[True, True, False], [False, False, True]] and slots.lengths == [2, 1]
    allowed, positions, _ = slots.inputs([2, 2], 2, tail=1)
    assert positions.tolist() == [[2, 3], [1, 2]]
    assert allowed[0, 0, 0].tolist() == [True, True, False, True, False]
    assert allowed[0, 0, 1].tolist() == [True, True, False, True, True]
    index = slots.compaction_index(min_waste=0)
    assert index.tolist() == [[0, 1], [2, 0]] and slots.valid.tolist() == [[True, True], [True, False]]


@pytest.fixture(scope="module")
def sampling_pair():
    target = tiny_target("llama", seed=4, sharpen=3.0)
    return target, perturbed_drafter(target, 4)


def _sample(target, drafter, ids, mask, seed=1234, **options):
    torch.manual_seed(seed)
    return target.generate(
        ids,
        attention_mask=mask,
        assistant_model=drafter,
        do_sample=True,
        temperature=0.8,
        top_k=30,
        max_new_tokens=24,
        pad_token_id=0,
        **options,
    )


def test_sampling_is_invariant_per_sequence(sampling_pair):
    """One seed: the same tokens per sequence whatever the plan; the first sequence samples what it samples alone;
    two copies of a prompt get their own noise."""
    target, drafter = sampling_pair
    prompts = [random_prompt(9, seed=3)[0], random_prompt(4, seed=5)[0], random_prompt(9, seed=3)[0]]
    ids, mask = left_pad(prompts)
    reference = _sample(target, drafter, ids, mask, d3d_num_drafts=0)
    accepted = 0
    for plan in ({"d3d_num_drafts": 1}, {"d3d_num_drafts": 3}, {}):
        assert torch.equal(_sample(target, drafter, ids, mask, **plan), reference), plan
        accepted += drafter.last_generation_stats.accepted_drafts
    assert accepted > 0
    alone = _sample(target, drafter, ids[:1], mask[:1], d3d_num_drafts=2)
    assert drafter.last_generation_stats.batch_size == 1  # the one-sequence path
    n = alone.shape[1]
    assert torch.equal(alone[0], reference[0, :n]) and set(reference[0, n:].tolist()) <= {0}
    # a padded first sequence too: its noise is read at its own positions, not its padded row's
    short = prompts[1][None]
    alone = _sample(target, drafter, short, torch.ones_like(short))[0, short.shape[1] :].tolist()
    swapped, swapped_mask = left_pad([prompts[1], prompts[0]])
    first = _sample(target, drafter, swapped, swapped_mask)[0, swapped.shape[1] :].tolist()
    assert first[: len(alone)] == alone and set(first[len(alone) :]) <= {0}
    assert reference[0].tolist() != reference[2].tolist()  # same prompt, other index: other noise
    assert not torch.equal(_sample(target, drafter, ids, mask, seed=7), reference)


def test_trees_async_and_right_padding_are_refused(tiny):
    target, own, _, prompts = tiny
    ids, mask = left_pad(prompts[:2])
    kw = dict(do_sample=False, max_new_tokens=4, pad_token_id=0)
    with pytest.raises(ValueError, match="d3d_tree_budget=None"):
        target.generate(ids, attention_mask=mask, assistant_model=own, d3d_tree_budget=4, **kw)
    with pytest.raises(ValueError, match="Drop `d3d_async=True`"):
        target.generate(ids, attention_mask=mask, assistant_model=own, d3d_async=True, **kw)
    with pytest.raises(ValueError, match="d3d_tree_budget=None"):  # one padded prompt is decoded as a batch
        target.generate(ids[1:], attention_mask=mask[1:], assistant_model=own, d3d_tree_budget=4, **kw)
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        target.generate(ids, attention_mask=mask.flip(1), assistant_model=own, **kw)
    with pytest.raises(ValueError, match="Drop the option"):
        target.generate(ids, attention_mask=mask, assistant_model=own, d3d_fused_drafting=True, **kw)
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] of the batch are all padding"):
        target.generate(ids, attention_mask=mask * torch.tensor([[1], [0]]), assistant_model=own, **kw)


def test_pipeline_with_batch_size(tiny):
    from transformers import pipeline

    target, own, _, _ = tiny
    tokenizer = tiny_tokenizer()
    tokenizer.padding_side = "left"
    texts = ["t5 t9 t33 t41 t7", "t12 t3", "t60 t61 t62 t63 t64 t65 t66 t67", "t20 t21 t22"]
    kw = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=4)(texts, **kw)
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=own, batch_size=4)
    out = assisted(texts, **kw)
    assert out == plain
    assert own.last_generation_stats.batch_size == 4


def _smollm2_batch(tokenizer):
    """The shipped drafter and four HumanEval prompts cut to different lengths."""
    from d3d_hf.drafters import load_drafter
    from d3d_hf.prompts import encode_prompt, load_prompts

    encoded = [encode_prompt(tokenizer, p)[0] for p in load_prompts("humaneval", limit=4)]
    prompts = [e[-n:] for e, n in zip(encoded, (40, 25, 52, 33), strict=True)]
    return load_drafter("d3d-smollm2-135m-instruct"), prompts


def test_smollm2_batch_with_the_shipped_drafter(smollm2):
    """The real target and the shipped drafter (shares the target's cache): four prompts of different lengths, an
    eos that one sequence emits mid-way, the default engine and a fixed plan: each sequence is its target-only
    output."""
    model, tokenizer = smollm2
    drafter, prompts = _smollm2_batch(tokenizer)
    max_new = 20
    stops, free = _stop_tokens(model, prompts, max_new)
    eos = stops[0]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    kw = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    reference = model.generate(ids, attention_mask=mask, **kw)
    alone = [_cut(tokens, eos) for tokens in free]
    assert min(len(a) for a in alone) < max_new and max(len(a) for a in alone) == max_new
    for plan in ({}, {"d3d_num_drafts": 3}):
        out = model.generate(ids, attention_mask=mask, assistant_model=drafter, **kw, **plan)
        assert torch.equal(out, reference), plan
        for i in range(len(prompts)):
            assert generated(out[i], ids.shape[1], eos) == alone[i], (plan, i)
        stats = drafter.last_generation_stats
        assert stats.shared_target_cache
        if plan:  # the adaptive engine may, on a loaded machine, find no draft worth its pass: a fixed plan drafts
            assert stats.accepted_drafts > 0


@pytest.mark.slow
def test_smollm2_batch_stop_strings(smollm2):
    """A stop string that one sequence reaches mid-way: every sequence ends where target-only batched decoding ends
    it (the drafter's drafts never complete it; the loop cuts at it)."""
    model, tokenizer = smollm2
    drafter, prompts = _smollm2_batch(tokenizer)
    stops, _ = _stop_tokens(model, prompts, 20)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    kw = dict(
        do_sample=False,
        max_new_tokens=20,
        pad_token_id=tokenizer.pad_token_id,
        stop_strings=[tokenizer.decode([stops[0]])],
        tokenizer=tokenizer,
    )
    reference = model.generate(ids, attention_mask=mask, **kw)
    assert (reference[:, -1] == tokenizer.pad_token_id).any()
    out = model.generate(ids, attention_mask=mask, assistant_model=drafter, d3d_num_drafts=3, **kw)
    assert torch.equal(out, reference)


def test_bench_batch_size(tiny_folders, tmp_path, capsys):
    """`d3d-hf bench --batch-size 3`: target and d3d decode each batch in one call, pld runs its prompts one at a time
    (the table says so); a run is one batch, lossless per sequence."""
    import json

    from d3d_hf.cli import main

    lines = [
        json.dumps({"prompt": " ".join(f"t{5 + (7 * i + 3 * j) % 90}" for j in range(n))})
        for i, n in enumerate((9, 4, 12, 6, 3))
    ]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "r.json"
    argv = [
        "bench",
        "--drafter",
        str(tiny_folders / "drafter"),
        "--methods",
        "target,pld,d3d",
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--max-new-tokens",
        "10",
        "--threads",
        "1",
        "--batch-size",
        "3",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| target (batch of 3) |" in printed and "| pld (one at a time) |" in printed
    assert "| d3d (batch of 3) |" in printed
    result = json.loads(out.read_text())
    assert result["settings"]["batch_size"] == 3
    for method, summary in result["summary"].items():
        assert summary["lossless_match"] == 1.0 and summary["prompts"] == 2, method  # batches of 3 and 2
        assert summary["one_at_a_time"] == (method == "pld")
    target_runs, d3d_runs = result["runs"]["target"], result["runs"]["d3d"]
    assert [len(s) for s in d3d_runs[0]["sequences"]] == [len(s) for s in target_runs[0]["sequences"]]
    assert d3d_runs[0]["new_tokens"] == target_runs[0]["new_tokens"] and d3d_runs[0]["prompt_id"].count("+") == 2
    assert d3d_runs[1]["rounds"] < d3d_runs[1]["new_tokens"]  # the batch of two: several tokens per forward


def test_processors_eos_lists_and_scores_follow_target_only_batching(tiny):
    """Logits processors see each sequence's own padded row, a list of eos ids ends each sequence where it ends
    alone, and `output_scores` gives per step the scores of target-only batched decoding for the sequences still
    running."""
    target, own, shared, prompts = tiny
    ids, mask = left_pad(prompts)
    kw = dict(
        do_sample=False,
        max_new_tokens=16,
        pad_token_id=0,
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        return_dict_in_generate=True,
        output_scores=True,
    )
    free = target.generate(ids, attention_mask=mask, eos_token_id=None, **kw).sequences[:, ids.shape[1] :]
    eos = [int(free[1, 5]), int(free[3, 9])]
    reference = target.generate(ids, attention_mask=mask, eos_token_id=eos, **kw)
    for drafter, plan in ((own, {"d3d_num_drafts": 3}), (shared, {})):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, eos_token_id=eos, **kw, **plan)
        assert torch.equal(out.sequences, reference.sequences)
        lengths = [
            next((i + 1 for i, t in enumerate(row[ids.shape[1] :].tolist()) if t in eos), 16) for row in out.sequences
        ]
        assert min(lengths) < 16 and len(out.scores) == max(lengths) == 16
        for t, step in enumerate(out.scores):
            running = [a for a, n in enumerate(lengths) if t < n]
            torch.testing.assert_close(step[running], reference.scores[t][running])


def test_speculative_sampling_in_a_batch(tiny):
    """`d3d_sampling="speculative"` runs transformers' chain rule per sequence; with `top_k=1` every distribution is
    a point mass, so the result is the greedy batch."""
    target, drafter, _, prompts = tiny
    ids, mask = left_pad(prompts)
    kw = dict(attention_mask=mask, do_sample=True, top_k=1, max_new_tokens=16, pad_token_id=0)
    out = target.generate(ids, assistant_model=drafter, d3d_sampling="speculative", d3d_num_drafts=3, **kw)
    stats = drafter.last_generation_stats
    assert stats.options.sampling == "speculative" and stats.accepted_drafts > 0
    greedy = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    assert torch.equal(out, greedy)


def test_prefix_allowed_tokens_fn_gets_each_sequence_batch_id(tiny):
    target, own, _, prompts = tiny
    ids, mask = left_pad(prompts)

    def allowed(batch_id, sent):  # each sequence its own band of the vocabulary
        return list(range(3 + 20 * batch_id, 23 + 20 * batch_id))

    kw = dict(do_sample=False, max_new_tokens=10, pad_token_id=0, prefix_allowed_tokens_fn=allowed)
    reference = target.generate(ids, attention_mask=mask, **kw)
    out = target.generate(ids, attention_mask=mask, assistant_model=own, d3d_num_drafts=3, **kw)
    assert torch.equal(out, reference)
    for a in range(len(prompts)):
        assert all(3 + 20 * a <= t < 23 + 20 * a for t in out[a, ids.shape[1] :].tolist())


@pytest.mark.parametrize(
    ("verify_ms", "expected"), [({1: 10.0, 64: 10.0}, "drafter"), ({1: 10.0, 4: 10.0, 8: 80.0, 64: 640.0}, "target")]
)
def test_the_batch_plan_reads_the_curves_at_the_batch_rows(tiny, verify_ms, expected):
    """The adaptive plan of a batch: with verification as cheap for 64 rows as for one (and cheap passes), every
    round after the warm-up drafts the most masks. With verification flat up to 4 rows and steep beyond, one sequence
    would draft (2-4 rows cost a plain step), but the batch of 4 verifies 4 x (1 + m) >= 8 rows: plain steps win."""
    from d3d_hf.modeling.estimates_d3d import CostCurve
    from d3d_hf.modeling.policy_d3d import DraftPolicy

    target, _, _, prompts = tiny
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    draft_ms = {1: 0.1, 64: 0.1}
    drafter.draft_policy = DraftPolicy(
        verify_curve=CostCurve({q: ms / 1e3 for q, ms in verify_ms.items()}),
        draft_curve=CostCurve({q: ms / 1e3 for q, ms in draft_ms.items()}),
        max_drafts=3,
    )
    ids, mask = left_pad(prompts)
    kw = dict(do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=None)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, d3d_prompt_lookup=False, **kw)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **kw))
    stats = drafter.last_generation_stats
    assert stats.round_sources[0] == "drafter"  # the warm-up
    later = stats.round_sources[1:-1]
    assert later and all(source == expected for source in later), stats.round_sources
    if expected == "drafter":
        assert max(stats.round_candidates) == 3 * len(prompts)


def _own_policy(drafter, verify_ms: dict, draft_ms: dict):
    from d3d_hf.modeling.estimates_d3d import CostCurve
    from d3d_hf.modeling.policy_d3d import DraftPolicy

    drafter.draft_policy = DraftPolicy(
        verify_curve=CostCurve({q: ms / 1e3 for q, ms in verify_ms.items()}),
        draft_curve=CostCurve({q: ms / 1e3 for q, ms in draft_ms.items()}),
        max_drafts=3,
    )
    return drafter.draft_policy


def test_the_batch_plan_reads_learned_batched_costs(tiny, monkeypatch):
    """Single-sequence curves that make drafting pay at the batch's rows, but batched verification learned 8x dearer
    beyond one row per sequence: every round after the warm-up is a plain step (learning held still)."""
    from d3d_hf.modeling.estimates_d3d import BatchedCosts

    target, _, _, prompts = tiny
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    policy = _own_policy(drafter, {1: 10.0, 64: 10.0}, {1: 0.1, 64: 0.1})
    assert policy.batched_costs is policy.batched_costs  # one per policy, kept for the process
    dear = {b: {1: 1.0, 2: 8.0, 16: 8.0} for b in range(1, len(prompts) + 1)}
    policy.batched_costs = BatchedCosts.from_dict({"verify": dear})
    monkeypatch.setattr(BatchedCosts, "observe", lambda *args, **kwargs: None)
    ids, mask = left_pad(prompts)
    kw = dict(do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=None)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, d3d_prompt_lookup=False, **kw)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **kw))
    later = drafter.last_generation_stats.round_sources[1:]
    assert later and all(source == "target" for source in later), later


def test_batched_rounds_learn_their_costs(tiny):
    """An adaptive batched call learns the ratio of its verifications (per batch size and width, the prefill left out)
    and of its draft passes to the single-sequence curves; a fixed plan learns nothing."""
    target, _, _, prompts = tiny
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    policy = _own_policy(drafter, {1: 10.0, 64: 10.0}, {1: 0.1, 64: 0.1})
    ids, mask = left_pad(prompts)
    kw = dict(do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None, assistant_model=drafter)
    target.generate(ids, attention_mask=mask, d3d_num_drafts=3, **kw)
    assert policy.batched_costs.to_dict() == {}
    target.generate(ids, attention_mask=mask, d3d_prompt_lookup=False, **kw)
    learned = policy.batched_costs.to_dict()
    assert set(learned) == {"verify", "draft"}
    assert len(prompts) in learned["verify"] and len(prompts) in learned["draft"]
    assert max(rows for by_rows in learned["verify"].values() for rows in by_rows) < ids.shape[1]  # no prefill
    assert all(0 < r for by_rows in learned["verify"].values() for r in by_rows.values())


def test_one_padded_prompt_in_transformers_loop_stays_there(tiny):
    """`d3d_decoding_loop="transformers"` (the ablation) keeps running one padded prompt in transformers' loop; a
    batch there is refused with what to change."""
    target, own, _, prompts = tiny
    ids, mask = left_pad(prompts[:2])
    kw = dict(do_sample=False, max_new_tokens=8, pad_token_id=0)
    out = target.generate(ids[1:], attention_mask=mask[1:], assistant_model=own, d3d_decoding_loop="transformers",
                          **kw)
    assert own.last_generation_stats.decoding_loop == "transformers"
    assert torch.equal(out, target.generate(ids[1:], attention_mask=mask[1:], **kw))
    with pytest.raises(ValueError, match="Drop `d3d_decoding_loop='transformers'`"):
        target.generate(ids, attention_mask=mask, assistant_model=own, d3d_decoding_loop="transformers", **kw)


def _with_holes(prompt: torch.Tensor, where: tuple[int, ...], pad_id: int = 0) -> torch.Tensor:
    """`prompt` (1-D) with the pad id at the positions `where`."""
    holed = prompt.clone()
    holed[list(where)] = pad_id
    return holed


def test_pad_id_inside_a_prompt_without_attention_mask_decodes_as_target_only(tiny, sampling_pair):
    """A prompt that holds the pad id, passed without `attention_mask` and with an eos that is not the pad id:
    transformers infers `input_ids != pad_token_id`, a mask with holes inside the prompt, and target-only decoding
    never attends to those tokens. D3D decodes exactly that (one prompt and a left-padded batch, both drafters, both
    plans), and refuses a prompt that ends with the pad id, naming the inferred mask and the fix."""
    target, own, shared, prompts = tiny
    holed = [_with_holes(prompts[0], (1, 3)), prompts[1], _with_holes(prompts[2], (2, 4)), prompts[3]]
    kw = dict(do_sample=False, max_new_tokens=16, eos_token_id=2)  # the tiny target's pad id is 0
    one = holed[2][None]
    reference = target.generate(one, **kw)
    ones = target.generate(one, attention_mask=torch.ones_like(one), **kw)
    assert not torch.equal(reference, ones)  # the holes change what the target decodes
    ids, _ = left_pad(holed)  # pads with 0 too: the inferred mask is left padding plus the holes
    batch_reference = target.generate(ids, **kw)
    for drafter in (own, shared):
        for plan in ({}, {"d3d_num_drafts": 3}):
            assert torch.equal(target.generate(one, assistant_model=drafter, **kw, **plan), reference), plan
            assert torch.equal(target.generate(ids, assistant_model=drafter, **kw, **plan), batch_reference), plan
            assert drafter.last_generation_stats.batch_size == 4
    # invariant sampling: the holes are no tokens of the sequence, so it samples what its real tokens sample when
    # left-padded to the same row (the noise is read at each token's index among the real ones)
    sampler, drafter = sampling_pair
    real = holed[2][holed[2] != 0]
    compact = torch.cat([torch.zeros(one.shape[1] - len(real), dtype=torch.long), real])[None]
    compact_mask = (compact != 0).long()
    sampled = _sample(sampler, drafter, one, None, eos_token_id=2, d3d_num_drafts=3)
    assert torch.equal(sampled[0, one.shape[1] :], _sample(sampler, drafter, compact, compact_mask)[0, one.shape[1] :])
    ending = torch.cat([prompts[1], torch.tensor([0])])[None]
    with pytest.raises(ValueError, match=r"end with the pad token id 0.*attention_mask=torch\.ones_like\(input_ids\)"):
        target.generate(ending, assistant_model=own, **kw)


def test_a_masked_last_token_is_named_by_the_masks_shape():
    """A right-padded batch with its tokenizer's mask (which equals `input_ids != pad_id` whenever the prompts hold no
    pad id) is named as right padding first, with the left-padding fix; a mask with holes inside the prompt that hides
    the last token is named as transformers' inferred mask, with the `attention_mask` fix."""
    from d3d_hf.modeling.prompt_masks_d3d import check_prompt_mask

    right = torch.tensor([[5, 6, 7], [5, 6, 0]])
    with pytest.raises(ValueError) as refused:
        check_prompt_mask(right, (right != 0).long(), pad_token_id=0)
    message = str(refused.value)
    assert message.startswith("Batched D3D decoding needs every prompt's last token to be real"), message
    assert message.index("padding_side = 'left'") < message.index("attention_mask=torch.ones_like(input_ids)")
    holed = torch.tensor([[5, 0, 7, 0]])
    with pytest.raises(ValueError, match=r"^Prompt row\(s\) \[0\] end with the pad token id 0"):
        check_prompt_mask(holed, (holed != 0).long(), pad_token_id=0)


def test_smollm2_prompt_with_its_pad_id_without_attention_mask(smollm2):
    """SmolLM2's pad id is `<|im_end|>`, which its chat template puts inside every prompt: without `attention_mask`
    and with an eos other than the pad id, the shipped drafter decodes token for token what target-only `generate`
    decodes with the mask transformers infers (which hides the prompt's `<|im_end|>` tokens)."""
    from d3d_hf.drafters import load_drafter
    from d3d_hf.prompts import encode_prompt, load_prompts

    model, tokenizer = smollm2
    pad = tokenizer.pad_token_id
    assert pad == model.generation_config.pad_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode_prompt(tokenizer, load_prompts("humaneval", limit=1)[0])
    assert (ids[0, :-1] == pad).any() and ids[0, -1] != pad
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert eos != pad
    kw = dict(do_sample=False, max_new_tokens=32, eos_token_id=eos)
    reference = model.generate(ids, **kw)
    assert not torch.equal(reference, model.generate(ids, attention_mask=torch.ones_like(ids), **kw))
    drafter = load_drafter("d3d-smollm2-135m-instruct")
    assert torch.equal(model.generate(ids, assistant_model=drafter, **kw), reference)
    # a fixed plan drafts every round (the adaptive engine's choice depends on the machine's load)
    assert torch.equal(model.generate(ids, assistant_model=drafter, d3d_num_drafts=3, **kw), reference)
    assert drafter.last_generation_stats.accepted_drafts > 0
