"""Drafting (modeling/drafting_d3d.py): D3DCache, the draft attention mask, draft passes."""

import pytest
import torch
from _tiny import tiny_target

from d3d_hf import D3DCache, D3DForDiffusionDrafting


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
