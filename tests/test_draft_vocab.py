"""A drafter with a draft vocabulary (FR-Spec, arXiv 2502.14856; `D3DConfig.draft_vocab_size`): its LM head covers a
subset of the target's ids, its logits come back over the full vocabulary with the other ids at the lowest value,
decoding stays lossless (an id outside is never drafted), and the subset saves, loads and trains."""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import random_prompt, tiny_target
from transformers import AutoModel

import d3d_hf  # noqa: F401  (the model type and the generate hook)
from d3d_hf import D3DConfig, D3DForDiffusionDrafting


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=4, sharpen=10.0)


def _subset(target, size, seed=0):
    """`size` ids: the ones the target emits for a few prompts first (so drafts can be accepted), then others."""
    seen = []
    for s in range(4):
        ids = random_prompt(6, seed=s + seed)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        seen += [t for t in dict.fromkeys(out[0].tolist()) if t not in seen]
    rest = [t for t in range(target.config.vocab_size) if t not in seen]
    return (seen + rest)[:size]


def test_logits_cover_the_draft_vocabulary_only(target):
    ids = _subset(target, 40)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, draft_vocab_ids=ids)
    assert drafter.config.draft_vocab_size == 40 and not drafter.config.tie_word_embeddings
    assert drafter.lm_head.weight.shape == (40, target.config.hidden_size)
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight[ids])
    x = random_prompt(5)
    with torch.no_grad():
        full = drafter(input_ids=x).logits
        compact = drafter(input_ids=x, draft_vocab_logits=True).logits
        reference = target(input_ids=x).logits
    assert full.shape[-1] == target.config.vocab_size and compact.shape[-1] == 40
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert (full[..., outside] == torch.finfo(full.dtype).min).all()
    torch.testing.assert_close(full[..., ids], compact)
    torch.testing.assert_close(compact, reference[..., ids], rtol=1e-4, atol=1e-4)  # same layers, subset head


def test_greedy_decoding_is_lossless_and_drafts_only_draft_ids(target):
    ids = _subset(target, 30)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, draft_vocab_ids=ids)
    for seed in (7, 2, 0):  # prompt 0's continuation is in the draft vocabulary (the first ids of `_subset`)
        x = random_prompt(6, seed=seed)
        kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False)
        want = target.generate(x, **kwargs)
        got = target.generate(x, assistant_model=drafter, d3d_num_drafts="full", d3d_prompt_lookup=False, **kwargs)
        assert torch.equal(got, want), seed
    stats = drafter.last_generation_stats
    assert stats.rounds > 0 and stats.tau > 1.5  # prompt 0: drafts were accepted


def test_saves_loads_with_automodel_and_refuses_bad_configs(target, tmp_path):
    ids = _subset(target, 25, seed=3)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=1, block_size=4, draft_vocab_ids=ids)
    drafter.save_pretrained(tmp_path)
    loaded = AutoModel.from_pretrained(tmp_path, trust_remote_code=True)
    assert loaded.draft_vocab_ids.tolist() == ids
    torch.testing.assert_close(loaded.lm_head.weight, drafter.lm_head.weight)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        D3DConfig(vocab_size=97, draft_vocab_size=98, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        D3DConfig(vocab_size=97, draft_vocab_size=20, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="shares_target_weights=False"):
        D3DConfig(vocab_size=97, draft_vocab_size=20, tie_word_embeddings=False, shares_target_weights=True)
    with pytest.raises(ValueError, match="distinct ids"):
        drafter.set_draft_vocabulary([0] * 25)
    full = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="full vocabulary"):
        full.set_draft_vocabulary(ids)


def test_draft_vocabulary_counts_answers_and_keeps_eos():
    from d3d_hf.drafters import draft_vocabulary

    rows = [[5, 5, 5, 7, 7, 9], [7, 11, 5]]
    assert draft_vocabulary(rows, 3, 20, always=[2]) == [2, 5, 7]
    assert draft_vocabulary(rows, 6, 20) == [5, 7, 9, 11, 0, 1]  # then the smallest unused ids
    with pytest.raises(ValueError, match="size"):
        draft_vocabulary(rows, 0, 20)
    with pytest.raises(ValueError, match="outside"):
        draft_vocabulary([[25]], 3, 20)


def test_standalone_drafter_with_draft_vocabulary_trains_from_the_cli(tiny_folders, tmp_path):
    """`d3d-hf train --shares_target_weights false --train_mode full --draft_vocab_size N` builds a standalone drafter
    whose head covers the N most frequent answer ids (+ eos), trains every weight of it (losses over the head's
    rows), saves the ids with the checkpoint and decodes losslessly."""
    from transformers import AutoModelForCausalLM

    from d3d_hf.cli import main
    from d3d_hf.data import generate_dataset, load_generated_rows
    from d3d_hf.drafters import load_drafter
    from d3d_hf.prompts import Prompt

    target = AutoModelForCausalLM.from_pretrained(tiny_folders / "target")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_folders / "target")
    g = torch.Generator().manual_seed(1)
    prompts = [
        Prompt(id=f"p{i}", messages=[{"role": "user", "content": " ".join(
            f"t{t}" for t in torch.randint(3, 97, (6,), generator=g).tolist())}])
        for i in range(10)
    ]  # fmt: skip
    generate_dataset(target, tok, prompts, tmp_path / "data", max_new_tokens=16, progress=False)
    argv = ["train", "--target", str(tiny_folders / "target"), "--data", str(tmp_path / "data")]
    argv += ["--output-dir", str(tmp_path / "run"), "--max_steps", "3", "--tau_holdout", "0", "--init-block-size", "4"]
    argv += ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--shares_target_weights", "false"]
    argv += ["--train_mode", "full", "--freeze_embeddings", "false", "--layer_ids", "0,2", "--draft_vocab_size", "24"]
    argv += ["--ar_loss_weight", "0.5", "--learning_rate", "1e-3", "--logging_steps", "1"]
    assert main(argv) == 0
    drafter = load_drafter(str(tmp_path / "run"))
    assert drafter.config.draft_vocab_size == 24 and drafter.config.source_layer_ids == [0, 2]
    answers = [t for r in load_generated_rows(tmp_path / "data") for t in r["response_ids"]]
    top = max(set(answers), key=answers.count)
    assert top in drafter.draft_vocab_ids.tolist() and 2 in drafter.draft_vocab_ids.tolist()
    history = json.loads((tmp_path / "run" / "trainer_state.json").read_text())["log_history"]
    assert any("block_loss" in h and h["block_loss"] > 0 for h in history)
    initial = target.lm_head.weight[drafter.draft_vocab_ids].detach()
    assert not torch.equal(drafter.lm_head.weight, initial)  # the head trained
    for seed in (1, 2):
        x = random_prompt(6, seed=seed)
        kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
        assert torch.equal(target.generate(x, assistant_model=drafter, **kwargs), target.generate(x, **kwargs))
