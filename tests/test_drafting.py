"""Drafting (modeling/drafting_d3d.py) on tiny random targets: the draft attention mask, draft passes through
D3DCache (the anchor's output is the target's next token, the cache keeps committed tokens only), mask positions;
packed successor drafting (the packed attention mask, a packed pass against synchronous drafts)."""

import pytest
import torch
from _tiny import perturbed_drafter, random_prompt, tiny_target
from d3d_hf.modeling.drafting_d3d import draft_attention_mask, packed_attention_mask, packed_metadata

from d3d_hf import D3DCache, D3DForDiffusionDrafting

# ----------------------------------------------------------------------------------------------------------------------
# draft passes


def test_draft_attention_mask_structure():
    mask = draft_attention_mask(num_committed=2, num_masks=3, past_len=4)[0, 0]
    assert mask.shape == (5, 9)
    # committed tokens: causal (the second committed token is the anchor)
    assert mask[0].tolist() == [True] * 5 + [False] * 4
    assert mask[1].tolist() == [True] * 6 + [False] * 3
    # masks: see everything committed and each other (bidirectional)
    assert mask[2:].all()


def test_draft_pass_is_causal_for_anchor_and_keeps_cache_committed_only():
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=5)
    ids = random_prompt(9)
    cache = D3DCache()
    logits = drafter.draft_logits(ids[:, :6], cache)
    assert logits.shape == (1, 5, 97)
    assert cache.get_seq_length() == 6
    # the anchor's output is the autoregressive next-token prediction, unaffected by the masks after it
    with torch.no_grad():
        torch.testing.assert_close(logits[:, 0], target(ids[:, :6]).logits[:, -1], rtol=0, atol=1e-5)
    # incremental: extending the cache gives the same anchor prediction as a fresh pass
    logits2 = drafter.draft_logits(ids[:, 6:], cache)
    fresh = drafter.draft_logits(ids, D3DCache())
    torch.testing.assert_close(logits2, fresh, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 9


def test_mask_positions_change_block_predictions_only():
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    with torch.no_grad():
        drafter.model.mask_embedding.weight.normal_()
    ids = random_prompt(6)
    a = drafter.draft_logits(ids, D3DCache())
    with torch.no_grad():
        drafter.model.mask_embedding.weight.normal_()
    b = drafter.draft_logits(ids, D3DCache())
    torch.testing.assert_close(a[:, 0], b[:, 0])
    assert not torch.allclose(a[:, 1:], b[:, 1:])


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


# ----------------------------------------------------------------------------------------------------------------------
# packed successor drafting


def test_packed_mask_rule_position_by_position():
    """Chain causal; each block sees the prefix, its hypothesis' chain, its own anchor (causally) and itself."""
    segment, position, chain_len = packed_metadata(3, [0, 2], 3)
    mask = packed_attention_mask(segment, position, chain_len, prefix_length=2)
    assert mask.shape == (3 + 2 * 3, 2 + 3 + 2 * 3)
    assert mask[:, :2].all()
    for t in range(mask.shape[0]):
        for s in range(3 + 6):
            seg_t, seg_s = int(segment[t]), int(segment[s])
            if seg_s == 0:
                expected = int(position[s]) < int(chain_len[t])
            else:
                expected = seg_s == seg_t and (int(position[t]) > 0 or int(position[s]) == 0)
            assert bool(mask[t, 2 + s]) == expected, (t, s)
    with pytest.raises(ValueError, match="chain length"):
        packed_metadata(3, [4], 3)


@pytest.mark.parametrize("block_size", [4, 16])
def test_packed_pass_equals_synchronous_drafts_for_each_hypothesis(block_size):
    target = tiny_target("qwen3")
    drafter = perturbed_drafter(target, block_size)
    cache = D3DCache()
    drafter.draft_logits(random_prompt(9), cache)
    chain = torch.randint(3, 97, (1, block_size - 1), generator=torch.Generator().manual_seed(0))
    lengths = sorted({0, 1, block_size // 2, block_size - 1})
    guesses = [11 + h for h in range(len(lengths))]
    packed = drafter.packed_draft_logits(chain, cache, lengths, guesses)
    assert cache.get_seq_length() == 9 and packed.logits.shape == (len(lengths), block_size, 97)
    for h, (m, g) in enumerate(zip(lengths, guesses, strict=True)):
        reference_cache, committed_cache = D3DCache(), D3DCache()
        for c in (reference_cache, committed_cache):
            c.key_cache, c.value_cache = list(cache.key_cache), list(cache.value_cache)
        reference = drafter.draft_logits(torch.cat([chain[:, :m], torch.tensor([[g]])], dim=1), reference_cache)
        torch.testing.assert_close(packed.logits[h], reference[0], atol=1e-5, rtol=1e-5)
        packed.commit(committed_cache, m, h)
        assert committed_cache.get_seq_length() == reference_cache.get_seq_length() == 9 + m + 1
        for a, b in zip(committed_cache.key_cache, reference_cache.key_cache, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
