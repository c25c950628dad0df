"""A drafter over the target's cache that also reads the target's last hidden state before the anchor
(`D3DConfig.reads_target_hidden_state`, EAGLE's feature): training feeds each anchor row the state the engine feeds
it, the engine keeps that state from each verification (chain, tree and batched rounds), decoding stays lossless, and
misuse is refused with a message."""

from __future__ import annotations

import pytest
import torch
from _tiny import random_prompt, target_cache_batch, target_cache_block_logits, tiny_target

import d3d_hf  # noqa: F401  (the model type and the generate hook)
from d3d_hf import D3DConfig, D3DForDiffusionDrafting
from d3d_hf.training.objective import target_cache_losses

BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=4, num_layers=4, sharpen=10.0)


def _drafter(target, seed=0, trained=True, **kwargs):
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        target, layer_ids=[1, 3], block_size=BLOCK, shares_target_cache=True, reads_target_hidden_state=True, **kwargs
    )
    if trained:  # a trained-looking drafter: the state's projection is no longer zero
        torch.manual_seed(seed)
        with torch.no_grad():
            drafter.model.hidden_state_proj.weight.normal_(0, 0.3)
            drafter.model.mask_embedding.weight.normal_(0, 0.5)
    return drafter.eval()


def _state_before(target, ids: torch.LongTensor, anchor: int) -> torch.Tensor:
    """The target's last hidden state at `anchor - 1` of `ids` (what chose the token at `anchor`)."""
    with torch.no_grad():
        return target.model(input_ids=ids[:, :anchor]).last_hidden_state[:, -1]


def _view(target, ids: torch.LongTensor, anchor: int, layer_ids) -> d3d_hf.modeling.D3DCache:
    with torch.no_grad():
        out = target.model(input_ids=ids[:, :anchor], use_cache=True)
    view = d3d_hf.modeling.D3DCache()
    for layer_id in layer_ids:
        view.key_cache.append(out.past_key_values.layers[layer_id].keys)
        view.value_cache.append(out.past_key_values.layers[layer_id].values)
    return view


def test_config_and_forward_refuse_misuse(target):
    with pytest.raises(ValueError, match="needs `shares_target_cache=True`"):
        D3DConfig(num_hidden_layers=2, reads_target_hidden_state=True)
    drafter = _drafter(target)
    ids = random_prompt(6)
    view = _view(target, ids, 5, [1, 3])
    with pytest.raises(ValueError, match="pass `target_hidden_states`"):
        drafter.draft_logits(ids[:, 5:], view, num_masks=BLOCK - 1)
    plain = D3DForDiffusionDrafting.from_autoregressive(
        target, layer_ids=[1, 3], block_size=BLOCK, shares_target_cache=True
    )
    with pytest.raises(ValueError, match="does not read the target's hidden state"):
        plain.draft_logits(ids[:, 5:], view, num_masks=BLOCK - 1, anchor_hidden_state=torch.zeros(1, 64))


def test_a_new_drafter_drafts_as_one_without_the_state(target):
    """The projection starts at zero: whatever the state, the first drafts are those of a drafter without it."""
    drafter = _drafter(target, trained=False)
    plain = D3DForDiffusionDrafting.from_autoregressive(
        target, layer_ids=[1, 3], block_size=BLOCK, shares_target_cache=True
    ).eval()
    ids = random_prompt(8)
    state = torch.randn(1, target.config.hidden_size)
    with torch.no_grad():
        got = drafter.draft_logits(ids[:, 6:7], _view(target, ids, 6, [1, 3]), BLOCK - 1, anchor_hidden_state=state)
        want = plain.draft_logits(ids[:, 6:7], _view(target, ids, 6, [1, 3]), BLOCK - 1)
    torch.testing.assert_close(got, want)


def test_training_rows_read_the_state_the_engine_gives(target):
    """The objective's block logits are, row for row, `draft_logits` with the target's last hidden state at
    `anchor - 1`; and the state matters (a zero state gives other logits)."""
    drafter = _drafter(target)
    anchors = (5, 9)
    batch = target_cache_batch(14, anchors, BLOCK)
    ids = batch["input_ids"]
    rows = target_cache_block_logits(drafter, batch, BLOCK, target)
    for k, anchor in enumerate(anchors):
        state = _state_before(target, ids, anchor)
        with torch.no_grad():
            anchor_ids = ids[:, anchor : anchor + 1]
            want = drafter.draft_logits(anchor_ids, _view(target, ids, anchor, [1, 3]), BLOCK - 1, state)
            zero = drafter.draft_logits(anchor_ids, _view(target, ids, anchor, [1, 3]), BLOCK - 1, 0 * state)
        torch.testing.assert_close(rows[k], want[0], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(rows[k], zero[0], atol=1e-3)


def test_losses_train_the_projection(target):
    drafter = _drafter(target, trained=False).train()
    losses = target_cache_losses(drafter, target_cache_batch(14, (5, 9), BLOCK), BLOCK, gamma=7.0, target=target,
                                 distill=True)  # fmt: skip
    (losses["block_loss"] + losses["distill_loss"]).backward()
    assert drafter.model.hidden_state_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("tree", [False, True])
def test_the_engine_passes_the_state_that_chose_the_anchor_and_stays_lossless(target, monkeypatch, tree):
    """Every draft pass of a chain (or tree) call gets the target's last hidden state at the position before its
    anchor, as a fresh target forward over the committed tokens computes it; greedy output equals the target's."""
    drafter = _drafter(target)
    seen = []
    original = drafter.draft_logits

    def spy(committed, cache, num_masks=None, anchor_hidden_state=None):
        seen.append((cache.get_seq_length(), anchor_hidden_state))
        return original(committed, cache, num_masks, anchor_hidden_state)

    monkeypatch.setattr(drafter, "draft_logits", spy)
    options = {"d3d_num_drafts": "full", **({"d3d_tree_budget": 6} if tree else {})}
    for seed in (0, 3):
        x = random_prompt(6, seed=seed)
        kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False)
        want = target.generate(x, **kwargs)
        seen.clear()
        got = target.generate(x, assistant_model=drafter, d3d_prompt_lookup=False, **options, **kwargs)
        assert torch.equal(got, want)
        assert seen, "no draft pass ran"
        assert drafter.last_generation_stats.tree_budget == (6 if tree else None)
        for cached, state in seen:  # the anchor is token `cached` of the output
            torch.testing.assert_close(state, _state_before(target, got, cached), rtol=1e-4, atol=1e-4)


def test_a_batch_passes_each_sequence_its_state(target, monkeypatch):
    drafter = _drafter(target)
    batch = torch.cat([random_prompt(6), random_prompt(6, seed=5)])
    kwargs = dict(attention_mask=torch.ones_like(batch), max_new_tokens=12, do_sample=False)
    want = target.generate(batch, **kwargs)
    seen = []
    original = drafter.forward

    def spy(*args, **kw):
        if kw.get("target_hidden_states") is not None:
            seen.append((kw["past_key_values"].get_seq_length(), kw["target_hidden_states"].clone(), kw["input_ids"]))
        return original(*args, **kw)

    monkeypatch.setattr(drafter, "forward", spy)
    got = target.generate(batch, assistant_model=drafter, d3d_num_drafts="full", d3d_prompt_lookup=False, **kwargs)
    assert torch.equal(got, want)
    assert seen, "no draft pass ran"
    prompt = batch.shape[1]
    for _, states, ids in seen:
        width = ids.shape[1] - (BLOCK - 1)
        assert torch.count_nonzero(states[:, width:]) == 0 and torch.count_nonzero(states[:, : width - 1]) == 0
        for r in range(2):  # the anchor is the sequence's last committed token: find where it sits in the output
            anchors = [
                p for p in range(prompt, got.shape[1])
                if torch.allclose(states[r, width - 1], _state_before(target, got[r : r + 1], p)[0], atol=1e-4)
            ]  # fmt: skip
            assert anchors, f"sequence {r}: the state is no target state of its committed tokens"


def test_save_and_load_keep_the_projection(target, tmp_path):
    drafter = _drafter(target)
    drafter.config.source_model = "tiny"
    drafter.save_pretrained(tmp_path / "drafter")
    assert "`reads_target_hidden_state`" in (tmp_path / "drafter" / "README.md").read_text()
    loaded = D3DForDiffusionDrafting.from_pretrained(tmp_path / "drafter")
    assert loaded.config.reads_target_hidden_state
    torch.testing.assert_close(loaded.model.hidden_state_proj.weight, drafter.model.hidden_state_proj.weight)


def test_identity_init_brings_the_state_in_at_the_embeddings_scale(target):
    drafter = _drafter(target, trained=False, hidden_state_init="identity")
    weight = drafter.model.hidden_state_proj.weight
    embeddings = target.model.embed_tokens.weight
    scale = embeddings.norm(dim=-1).mean() / embeddings.shape[1] ** 0.5
    torch.testing.assert_close(weight, torch.eye(weight.shape[0]) * scale)
    state = 5 * torch.randn(1, weight.shape[0])  # any state comes in at the embeddings' mean norm
    projected = drafter.model.hidden_state_proj(drafter.model.hidden_state_norm(state))
    torch.testing.assert_close(projected.norm(), embeddings.norm(dim=-1).mean(), rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="'zeros' or 'identity'"):
        _drafter(target, trained=False, hidden_state_init="eye")


def test_timed_passes_and_calibration_run_with_a_zero_state(target):
    """Cost timing and the adaptive engine's calibration time passes of such a drafter with a zero state
    (`drafting_d3d.timing_state`), and the adaptive call stays lossless."""
    from d3d_hf.costmodel import measure_drafter

    drafter = _drafter(target)
    timed = measure_drafter(drafter, prefix_length=8, extra_tokens=[0], block_size=BLOCK, repeats=1, warmup=0)
    assert list(timed) == [BLOCK] and timed[BLOCK] > 0
    x = random_prompt(6, seed=2)
    kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
    got = target.generate(x, assistant_model=drafter, d3d_num_drafts="adaptive", **kwargs)
    assert torch.equal(got, target.generate(x, **kwargs))
