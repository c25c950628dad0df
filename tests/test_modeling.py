"""The D3D drafter model (modeling/modeling_d3d.py): initialisation from autoregressive models (full copies,
layer selection), the mask embedding or a spare vocabulary id, attention implementations, forward input
errors. Its CPU fast paths (modeling/fast_paths_d3d.py) are tested in test_fast_paths.py."""

import pytest
import torch
from _tiny import FAMILIES, random_prompt, tiny_target

from d3d_hf import D3DCache, D3DConfig, D3DForDiffusionDrafting


@pytest.mark.parametrize("family", FAMILIES)
def test_full_copy_matches_target_logits(family):
    target = tiny_target(family)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    ids = random_prompt()
    with torch.no_grad():
        torch.testing.assert_close(drafter(ids).logits, target(ids).logits, rtol=0, atol=1e-5)
    assert drafter.config.source_layer_ids == [0, 1, 2]
    assert drafter.config.use_qk_norm == (family == "qwen3")
    assert drafter.config.vocab_size == target.config.vocab_size


def test_layer_selection_and_errors():
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, layer_ids=[2, 0])
    assert drafter.config.num_hidden_layers == 2 and drafter.config.source_layer_ids == [2, 0]
    torch.testing.assert_close(drafter.model.layers[0].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    assert D3DForDiffusionDrafting.from_autoregressive(target, num_layers=1).config.source_layer_ids == [0]
    with pytest.raises(ValueError, match="either"):
        D3DForDiffusionDrafting.from_autoregressive(target, num_layers=1, layer_ids=[0])
    with pytest.raises(ValueError, match="num_layers"):
        D3DForDiffusionDrafting.from_autoregressive(target, num_layers=4)
    with pytest.raises(ValueError, match="layer_ids"):
        D3DForDiffusionDrafting.from_autoregressive(target, layer_ids=[3])


def test_mask_embedding_vs_spare_vocab_id():
    target = tiny_target("qwen3")
    separate = D3DForDiffusionDrafting.from_autoregressive(target)
    assert separate.model.mask_embedding is not None
    torch.testing.assert_close(separate.model.mask_token_embedding(), target.model.embed_tokens.weight.mean(0))
    spare = D3DForDiffusionDrafting.from_autoregressive(target, mask_token_id=96)
    assert spare.model.mask_embedding is None
    assert torch.equal(spare.model.mask_token_embedding(), target.model.embed_tokens.weight[96])


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_implementations_agree(impl):
    target = tiny_target("qwen3")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=6)
    drafter.config._attn_implementation = impl
    ids = random_prompt(8)
    out = drafter.draft_logits(ids, D3DCache())
    drafter.config._attn_implementation = "eager"
    ref = drafter.draft_logits(ids, D3DCache())
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_forward_input_errors():
    drafter = D3DForDiffusionDrafting(D3DConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="exactly one"):
        drafter(None)
    with pytest.raises(ValueError, match="masked_positions"):
        drafter(ids, masked_positions=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="4-D"):
        drafter(ids, attention_mask=torch.ones(1, 1, 4, 5, dtype=torch.bool))
