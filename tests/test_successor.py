"""Fused successor drafting (`successor_d3d`): the next round's drafter block computed inside the verification."""

import pytest
import torch
from _tiny import random_prompt, tiny_target, weight_sharing_drafter
from d3d_hf.modeling.policy_d3d import CostCurve, DraftPolicy
from d3d_hf.modeling.successor_d3d import (
    block_rows_on_target,
    end_probabilities,
    fused_drafting_unavailable,
    successor_attention_inputs,
)
from d3d_hf.modeling.tree_d3d import DraftTree
from transformers import DynamicCache

from d3d_hf import D3DCache, D3DForDiffusionDrafting


def _chain(tokens):
    tree = DraftTree()
    for i, token in enumerate(tokens):
        tree.add(token, i - 1, 1.0)
    return tree


def test_block_rows_see_their_anchor_history_and_their_block_only():
    mask, positions = successor_attention_inputs(_chain([7, 8, 9]), 2, 5, [-1, 1], 2, torch.float32)
    allowed = mask[0, 0] == 0
    q = 2 + 3 + 4
    assert allowed.shape == (q, 5 + q)
    assert positions[0].tolist() == [5, 6, 7, 8, 9, 7, 8, 9, 10]
    verified = allowed[:5]
    assert not verified[:, 5 + 5 :].any(), "no verified row may attend to a block row"
    root_block, second_block = allowed[5:7], allowed[7:9]
    # the block after the root sees the cache and both committed rows, not the candidates; its own two rows
    assert root_block[:, :7].all() and not root_block[:, 7:10].any() and root_block[:, 10:12].all()
    assert not root_block[:, 12:].any()
    # the block after candidate 2 (node 1) sees the committed rows and candidates 1-2, not 3
    assert second_block[:, :9].all() and not second_block[:, 9:12].any() and second_block[:, 12:].all()


def test_end_probabilities():
    assert end_probabilities([]) == [1.0]
    assert end_probabilities([0.5, 1.0]) == pytest.approx([0.5, 0.0, 0.5])
    assert sum(end_probabilities([0.9, 0.3, 0.7])) == pytest.approx(1.0)


def _fused_forward(target, drafter, prompt, chain, anchors, num_masks):
    """Logits of a verification of `chain` after `prompt` with blocks, and of the same verification without."""
    past = prompt.shape[1] - 1
    new = torch.cat([prompt[:, -1:], torch.tensor([chain])], dim=1)

    def cache():
        c = DynamicCache(config=target.config)
        target(input_ids=prompt[:, :-1], cache=c, use_cache=True)
        return c

    with torch.no_grad():
        plain = target(input_ids=new, cache=cache(), use_cache=True,
                       position_ids=torch.arange(past, past + new.shape[1])[None]).logits[0]
        mask, positions = successor_attention_inputs(_chain(chain), 1, past, anchors, num_masks, torch.float32)
        rows = torch.cat([new, torch.zeros(1, len(anchors) * num_masks, dtype=torch.long)], dim=1)
        prefilled = cache()  # before the hooks: they treat every forward's rows from `start` on as block rows
        with block_rows_on_target(target, drafter, new.shape[1]):
            fused = target(input_ids=rows, attention_mask=mask, position_ids=positions, cache=prefilled,
                           use_cache=True).logits[0]
    return plain, fused


def _draft_pass(drafter, prompt, accepted, num_masks):
    """The drafter's own synchronous pass anchored after `accepted` candidates (its own cache, its own code)."""
    cache = D3DCache()
    with torch.no_grad():
        drafter(input_ids=prompt[:, :-1], past_key_values=cache, use_cache=True)
        committed = torch.cat([prompt[:, -1:], torch.tensor([accepted], dtype=torch.long)], dim=1)
        return drafter.draft_logits(committed, cache, num_masks=num_masks)[0]


def _check_fused_forward(target, drafter, prompt, chain, anchors, num_masks, atol):
    plain, fused = _fused_forward(target, drafter, prompt, chain, anchors, num_masks)
    verified = len(chain) + 1
    torch.testing.assert_close(fused[:verified], plain, atol=atol, rtol=0)
    for b, anchor in enumerate(anchors):
        expected = _draft_pass(drafter, prompt, chain[: anchor + 1], num_masks)
        got = fused[verified + b * num_masks : verified + (b + 1) * num_masks]
        torch.testing.assert_close(got, expected[1:], atol=atol, rtol=0)  # row 0 of a pass is the anchor's own
        torch.testing.assert_close(fused[anchor + 1], expected[0], atol=atol, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_verified_rows_are_the_targets_and_block_rows_are_the_drafters_pass(family):
    target = tiny_target(family, seed=5)
    drafter = weight_sharing_drafter(target, block_size=4)
    assert fused_drafting_unavailable(drafter, target) is None
    prompt = random_prompt(9, seed=2)
    _, fused = _fused_forward(target, drafter, prompt, [11, 12, 13], [-1, 2], 3)
    plain_rows = _fused_forward(target, drafter, prompt, [11, 12, 13], [], 1)[0]
    assert not torch.allclose(fused[4:7], plain_rows[:3], atol=1e-3), "block rows must differ from plain rows"
    _check_fused_forward(target, drafter, prompt, [11, 12, 13], [-1, 0, 2], 3, atol=1e-5)


def test_block_rows_on_target_routes_projection_groups_and_restores_the_modules():
    """The target's projections run the drafter's grouped path only while open: a projection called on an input
    other than its group's computes its own output (same values as the drafter's D3DLinear on those rows), and a
    forward the module had before (`target_matmul_layouts`) is restored on exit."""
    from d3d_hf.experiments import target_matmul_layouts

    target = tiny_target("llama", seed=7)
    drafter = weight_sharing_drafter(target, block_size=4)
    attention = target.model.layers[0].self_attn
    own = drafter.model.layers[0].self_attn
    x = torch.randn(1, 5, target.config.hidden_size)
    gate = torch.zeros(1, 5, 1)
    gate[:, 3:] = 1
    with torch.no_grad(), target_matmul_layouts(target) as routed:
        layouts_forward = attention.k_proj.forward
        with block_rows_on_target(target, drafter, 3):
            q = attention.q_proj(x)
            torch.testing.assert_close(q, own.q_proj(x, gate, x * gate), atol=1e-5, rtol=0)
            other = torch.randn(1, 5, target.config.hidden_size)  # not q_proj's input: computed on its own
            torch.testing.assert_close(attention.k_proj(other), own.k_proj(other, gate, other * gate), atol=1e-5,
                                       rtol=0)
            torch.testing.assert_close(attention.v_proj(x), own.v_proj(x, gate, x * gate), atol=1e-5, rtol=0)
            assert not torch.allclose(q[:, 3:], torch.nn.functional.linear(x, attention.q_proj.weight)[:, 3:])
        assert attention.k_proj.forward == layouts_forward and attention.k_proj in routed
    assert all("forward" not in m.__dict__ for m in target.modules())
    torch.testing.assert_close(attention.q_proj(x), torch.nn.functional.linear(x, attention.q_proj.weight))


def test_fused_forward_on_smollm2_and_the_shipped_drafter(smollm2):
    from d3d_hf.drafters import load_drafter
    from d3d_hf.prompts import encode_prompt, load_prompts

    target, tokenizer = smollm2
    drafter = load_drafter("d3d-smollm2-135m-instruct")
    drafter.attach_target_weights(target)
    assert fused_drafting_unavailable(drafter, target) is None
    prompt = encode_prompt(tokenizer, load_prompts("mt-bench", limit=1)[0])
    chain = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                            do_sample=False)[0, prompt.shape[1] :].tolist()
    _check_fused_forward(target, drafter, prompt, chain, [-1, 1, 3], 4, atol=2e-4)


def test_fused_drafting_is_unavailable_for_drafters_off_the_targets_weights():
    target = tiny_target("llama", seed=5)
    own = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    assert "shares_target_weights" in fused_drafting_unavailable(own, target)
    shallow = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, num_layers=2,
                                                          shares_target_weights=True)
    shallow.attach_target_weights(target)
    assert "2 of the target's 3 layers" in fused_drafting_unavailable(shallow, target)


def _policy(verify_ms, draft_ms):
    return DraftPolicy(CostCurve({q: ms / 1e3 for q, ms in verify_ms.items()}),
                       CostCurve({q: ms / 1e3 for q, ms in draft_ms.items()}), max_drafts=7)


def test_successor_plan_places_blocks_where_the_path_likely_ends_when_rows_are_cheap():
    flat = _policy({1: 50, 2: 52, 4: 54, 8: 56, 16: 60, 32: 70}, {1: 50, 2: 50, 4: 52, 8: 54, 16: 58})
    lengths, m = flat.successor_plan([0.05, 0.5, 0.05, 0.4], verify_rows=4)
    assert m >= 1 and lengths and set(lengths) <= {0, 1, 2, 3}
    assert 1 in lengths and 3 in lengths, "the likeliest ends come first"
    # a plain step (no candidates): the path ends at the root for sure
    assert flat.successor_plan([1.0], verify_rows=1)[0] == [0]
    dear = _policy({1: 50, 2: 100, 4: 200, 8: 400, 16: 800}, {1: 50, 2: 50, 4: 52, 8: 54, 16: 58})
    assert dear.successor_plan([0.05, 0.5, 0.05, 0.4], verify_rows=4) == ([], 0)
    fixed = DraftPolicy(max_drafts=7, mode=3)
    assert fixed.successor_plan([0.2, 0.3, 0.5], verify_rows=3) == ([0, 1, 2], 3)


def _greedy(target, prompt, drafter=None, **options):
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, do_sample=False,
                          max_new_tokens=40, **options)
    return out[0, prompt.shape[1] :].tolist()


@pytest.fixture(scope="module")
def shared_pair():
    target = tiny_target("llama", seed=4, sharpen=3.0)
    return target, weight_sharing_drafter(target, block_size=4, scale=0.05)


def test_adaptive_engine_drafts_inside_verifications_and_stays_lossless(shared_pair):
    target, drafter = shared_pair
    ready = 0
    for seed in range(3):
        prompt = random_prompt(7, seed=seed)
        assert _greedy(target, prompt, drafter) == _greedy(target, prompt), seed
        assert "cpu" in drafter.last_generation_stats.overrides["d3d_fused_drafting"]  # 'auto' is off on CPU
        assert _greedy(target, prompt, drafter, d3d_fused_drafting=True) == _greedy(target, prompt), seed
        stats = drafter.last_generation_stats
        assert stats.fused_drafting and "d3d_fused_drafting" not in stats.overrides
        ready += stats.ready_rounds
    assert ready > 0, "the default engine must take some round's drafts from a block of the last verification"


def test_fixed_plan_with_fused_drafting_drafts_every_block_in_the_verification(shared_pair):
    target, drafter = shared_pair
    prompt = random_prompt(7, seed=1)
    expected = _greedy(target, prompt)
    assert _greedy(target, prompt, drafter, d3d_num_drafts=3, d3d_fused_drafting=True) == expected
    stats = drafter.last_generation_stats
    # a block after every acceptance length: every verification but the last ones (no room left) is a hit
    assert set(stats.successor_hit_rates.values()) == {1.0}
    assert stats.ready_rounds >= stats.rounds - 2 and stats.accepted_drafts > 0
    assert stats.round_sources.count("drafter") >= stats.rounds - 2
    assert len(stats.ready_round_flags) == stats.rounds and sum(stats.ready_round_flags) == stats.ready_rounds
    assert set(stats.acceptance_by_drafting) == {"pass", "ready"}  # the first round ran a pass
    ready_lengths = [n for n, r in zip(stats.acceptance_lengths, stats.ready_round_flags, strict=True) if r]
    assert stats.acceptance_by_drafting["ready"] == pytest.approx(sum(ready_lengths) / len(ready_lengths))
    assert _greedy(target, prompt, drafter, d3d_num_drafts=3) == expected
    assert drafter.last_generation_stats.ready_rounds == 0  # 'auto' keeps a fixed plan's draft pass per round (and CPU)
    assert drafter.last_generation_stats.overrides["d3d_fused_drafting"].startswith("auto -> False")


def test_eos_inside_a_round_with_fused_drafting(shared_pair):
    target, drafter = shared_pair
    prompt = random_prompt(7, seed=2)
    free = _greedy(target, prompt)
    eos = free[9]  # a token the target emits mid-way: generation must stop right there
    expected = _greedy(target, prompt, eos_token_id=eos)
    assert len(expected) < len(free)
    for options in ({"d3d_fused_drafting": True}, {"d3d_num_drafts": 3, "d3d_fused_drafting": True}):
        assert _greedy(target, prompt, drafter, eos_token_id=eos, **options) == expected, options


def test_sampling_gives_the_same_tokens_with_and_without_fused_drafting(shared_pair):
    target, drafter = shared_pair
    prompt = random_prompt(7, seed=3)

    def sample(**options):
        torch.manual_seed(7)
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter,
                              do_sample=True, temperature=0.8, top_k=30, max_new_tokens=30, suppress_tokens=[2],
                              **options)
        return out[0, prompt.shape[1] :].tolist()

    reference = sample(d3d_num_drafts=0)
    assert sample(d3d_num_drafts=3, d3d_fused_drafting=True) == reference
    assert drafter.last_generation_stats.ready_rounds > 0
    assert sample(d3d_fused_drafting=True) == reference


def test_fused_drafting_true_is_refused_where_it_cannot_run(shared_pair):
    target, _ = shared_pair
    own = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    prompt = random_prompt(7, seed=0)
    with pytest.raises(ValueError, match="shares_target_weights"):
        _greedy(target, prompt, own, d3d_fused_drafting=True)
    with pytest.raises(ValueError, match="d3d_tree_budget"):
        _greedy(target, prompt, own, d3d_fused_drafting=True, d3d_tree_budget=4)
    with pytest.raises(ValueError, match="d3d_draft_passes"):
        _greedy(target, prompt, own, d3d_fused_drafting=True, d3d_draft_passes=False)


def test_shipped_drafter_fused_drafting_is_lossless_on_smollm2(smollm2):
    from d3d_hf.drafters import load_drafter
    from d3d_hf.prompts import encode_prompt, load_prompts

    target, tokenizer = smollm2
    drafter = load_drafter("d3d-smollm2-135m-instruct")
    adaptive = {"d3d_fused_drafting": True}
    for name, plans in (("humaneval", (adaptive, {"d3d_num_drafts": 3, **adaptive})), ("mt-bench", (adaptive,))):
        prompt = encode_prompt(tokenizer, load_prompts(name, limit=1)[0])
        expected = _greedy(target, prompt)
        for options in plans:
            assert _greedy(target, prompt, drafter, **options) == expected, (name, options)
            stats = drafter.last_generation_stats
            assert stats.fused_drafting
            if "d3d_num_drafts" in options:  # a block after every length: every later round drafts in one
                assert stats.ready_rounds >= stats.rounds - 2 > 0


def test_fused_drafting_true_is_refused_for_a_call_only_transformers_loop_runs(shared_pair):
    target, drafter = shared_pair
    prompt = random_prompt(7, seed=0)
    with pytest.raises(ValueError, match="output_hidden_states"):
        target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, max_new_tokens=5,
                        d3d_fused_drafting=True, return_dict_in_generate=True, output_hidden_states=True)
    # a padded prompt is decoded by the batched loop, which drafts with one pass per round
    padded = torch.ones_like(prompt)
    padded[0, 0] = 0
    with pytest.raises(ValueError, match="a padded prompt"):
        target.generate(prompt, attention_mask=padded, assistant_model=drafter, max_new_tokens=5,
                        d3d_fused_drafting=True)
