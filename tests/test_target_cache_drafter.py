"""A drafter over the target's cache (`D3DConfig.shares_target_cache`, d3d-hf issue 37): its layers attend to the
target's cached keys and values of the layers they were copied from. Its training objective scores exactly the rows
of the engine's draft pass, decoding with it is lossless, and the calls that cannot share the target's cache are
refused with a message."""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import random_prompt, target_cache_batch, target_cache_block_logits, tiny_target

import d3d_hf  # noqa: F401  (the model type and the generate hook)
from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.training.objective import target_cache_attention_mask, target_cache_losses

BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=4, num_layers=4, sharpen=10.0)


def _drafter(target, layer_ids=(1, 3), seed=0, **kwargs):
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        target, layer_ids=list(layer_ids), block_size=BLOCK, shares_target_cache=True, **kwargs
    )
    torch.manual_seed(seed)
    with torch.no_grad():  # a trained-looking drafter: its own layers differ from the target's
        for p in drafter.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
        drafter.model.mask_embedding.weight.normal_(0, 0.5)
    return drafter.eval()


def _batch(length=14, anchors=(5, 9), seed=0):
    return target_cache_batch(length, anchors, BLOCK, seed)


def test_attention_mask_is_the_draft_pass_layout():
    mask = target_cache_attention_mask(torch.tensor([[2, -1]]), torch.ones(1, 5), block_size=3)[0, 0]
    assert mask.shape == (6, 5 + 6)
    clean, blocks = mask[:, :5], mask[:, 5:]
    assert clean[:3].tolist() == [[True, True, False, False, False]] * 3  # positions before the anchor only
    assert not clean[3:].any()  # an unused block sees no context
    own = [[True, False, False], [True, True, True], [True, True, True]]  # anchor causal, masks see the block
    assert blocks[:3, :3].tolist() == own and blocks[3:, 3:].tolist() == own
    assert not blocks[:3, 3:].any() and not blocks[3:, :3].any()


def test_training_rows_are_the_engine_draft_pass(target):
    """The block logits the objective scores are, row for row, those of `draft_logits` over a view of the target's
    cache that holds the tokens before the anchor (what D3D's loop shares)."""
    drafter = _drafter(target)
    batch = _batch()
    block_rows = target_cache_block_logits(drafter, batch, BLOCK, target)
    ids = batch["input_ids"]
    for k, anchor in enumerate(batch["anchors"][0].tolist()):
        with torch.no_grad():
            out = target.model(input_ids=ids[:, :anchor], use_cache=True)
        view = d3d_hf.modeling.D3DCache()
        for layer_id in drafter.config.source_layer_ids:
            view.key_cache.append(out.past_key_values.layers[layer_id].keys)
            view.value_cache.append(out.past_key_values.layers[layer_id].values)
        with torch.no_grad():
            pass_logits = drafter.draft_logits(ids[:, anchor : anchor + 1], view, num_masks=BLOCK - 1)
        torch.testing.assert_close(block_rows[k], pass_logits[0], rtol=1e-4, atol=1e-4)


def test_losses_train_the_drafter_and_distil(target):
    drafter = _drafter(target).train()
    losses = target_cache_losses(drafter, _batch(), BLOCK, gamma=7.0, target=target, distill=True)
    assert losses["block_tokens"] == 2 * BLOCK and float(losses["ar_loss"]) == 0.0
    assert losses["distill_loss"] >= 0
    (losses["block_loss"] + losses["distill_loss"]).backward()
    assert drafter.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert drafter.model.mask_embedding.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in target.parameters())


@pytest.mark.parametrize("vocab", [None, "subset"])
def test_greedy_decoding_is_lossless_over_the_shared_cache(target, vocab):
    ids = list(range(60)) if vocab else None
    drafter = _drafter(target, draft_vocab_ids=ids)
    for seed in (0, 3):
        x = random_prompt(6, seed=seed)
        kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False)
        want = target.generate(x, **kwargs)
        got = target.generate(x, assistant_model=drafter, d3d_num_drafts="full", d3d_prompt_lookup=False, **kwargs)
        assert torch.equal(got, want)
        stats = drafter.last_generation_stats
        assert stats.shared_target_cache and stats.drafted_tokens > 0


def test_pass_reads_the_named_target_layers(target, monkeypatch):
    """The draft pass's cache view holds the target's layers `source_layer_ids`, not its first ones."""
    from transformers import DynamicCache

    drafter = _drafter(target, layer_ids=(3, 1))
    cache = DynamicCache(config=target.config)
    seen = []
    original = drafter.draft_logits

    def spy(committed, view, num_masks=None, anchor_hidden_state=None):
        seen.append([[torch.equal(view.key_cache[i], layer.keys) for layer in cache.layers] for i in range(2)])
        return original(committed, view, num_masks, anchor_hidden_state)

    monkeypatch.setattr(drafter, "draft_logits", spy)
    x = random_prompt(6, seed=1)
    target.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False, assistant_model=drafter,
        d3d_num_drafts="full", d3d_prompt_lookup=False, cache=cache,
    )  # fmt: skip
    assert seen, "no draft pass ran"
    for matches in seen:
        assert matches == [[False, False, False, True], [False, True, False, False]]


def test_calls_without_the_shared_cache_are_refused(target):
    drafter = _drafter(target)
    x = random_prompt(6)
    kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False, assistant_model=drafter)
    with pytest.raises(ValueError, match="shares_target_cache"):
        target.generate(x, d3d_async=True, **kwargs)
    with pytest.raises(ValueError, match="shares_target_cache"):
        target.generate(x, d3d_decoding_loop="transformers", **kwargs)


def test_a_batch_drafts_over_the_shared_cache(target):
    drafter = _drafter(target)
    batch = torch.cat([random_prompt(6), random_prompt(6, seed=5)])
    kwargs = dict(attention_mask=torch.ones_like(batch), max_new_tokens=12, do_sample=False)
    want = target.generate(batch, **kwargs)
    got = target.generate(batch, assistant_model=drafter, d3d_num_drafts="full", d3d_prompt_lookup=False, **kwargs)
    assert torch.equal(got, want)
    assert drafter.last_generation_stats.shared_target_cache and drafter.last_generation_stats.drafted_tokens > 0


def test_trainer_runs_the_target_and_refuses_an_ar_loss(target, tmp_path):
    from _tiny import tiny_tokenizer
    from datasets import Dataset

    from d3d_hf.training import D3DTrainer, D3DTrainingConfig

    rows = [
        {"prompt_ids": random_prompt(5, seed=s)[0].tolist(), "response_ids": random_prompt(12, seed=s + 50)[0].tolist()}
        for s in range(8)
    ]

    args = dict(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, train_mode="full",
                report_to="none", use_cpu=True, learning_rate=1e-3, save_strategy="no", logging_steps=1,
                anchors_per_sequence=2)  # fmt: skip
    drafter = _drafter(target)
    with pytest.raises(ValueError, match="ar_loss_weight=0"):
        D3DTrainer(drafter, D3DTrainingConfig(ar_loss_weight=1.0, **args), train_dataset=Dataset.from_list(rows),
                   processing_class=tiny_tokenizer(), target=target)  # fmt: skip
    with pytest.raises(ValueError, match="target="):
        D3DTrainer(drafter, D3DTrainingConfig(ar_loss_weight=0.0, **args), train_dataset=Dataset.from_list(rows),
                   processing_class=tiny_tokenizer())  # fmt: skip
    before = drafter.model.layers[0].mlp.up_proj.weight.detach().clone()
    config = D3DTrainingConfig(ar_loss_weight=0.0, distill_weight=1.0, **args)
    trainer = D3DTrainer(
        drafter, config, train_dataset=Dataset.from_list(rows), processing_class=tiny_tokenizer(), target=target
    )
    trainer.train()
    assert not torch.equal(before, drafter.model.layers[0].mlp.up_proj.weight)
    logged = [entry for entry in trainer.state.log_history if "block_loss" in entry]
    assert logged and all(entry["ar_loss"] == 0 for entry in logged) and "distill_loss" in logged[0]


def test_tools_without_the_target_refuse_it_and_the_card_says_so(target, tmp_path):
    from d3d_hf.convert import export_causal_lm
    from d3d_hf.pruning import offline_acceptance

    drafter = _drafter(target)
    with pytest.raises(ValueError, match="shares_target_cache"):
        export_causal_lm(drafter)
    with pytest.raises(ValueError, match="compare_tau"):
        offline_acceptance(drafter, [1, 2, 3], [4, 5], max_new_tokens=4)
    drafter.config.source_model = "tiny"
    drafter.save_pretrained(tmp_path / "drafter")
    assert "`shares_target_cache`" in (tmp_path / "drafter" / "README.md").read_text()
    loaded = D3DForDiffusionDrafting.from_pretrained(tmp_path / "drafter")
    assert loaded.config.shares_target_cache and loaded.config.source_layer_ids == [1, 3]


def test_train_command_runs_the_target_forward_in_target_dtype(tmp_path, monkeypatch):
    """`--target_dtype bfloat16`: the drafter is made from the float32 target and trains in float32 (its weights and
    the cache it reads), while the target's no-grad forward of every batch runs in bfloat16; a drafter on the
    target's own weights refuses it."""
    from _tiny import tiny_tokenizer
    from datasets import Dataset

    import d3d_hf.targets
    from d3d_hf.training import D3DTrainingConfig, D3DTrainScriptArguments, train_drafter, trainer

    own = tiny_target("llama", seed=4, num_layers=4, sharpen=10.0)
    rows = [
        {"prompt_ids": random_prompt(5, seed=s)[0].tolist(), "response_ids": random_prompt(12, seed=s + 50)[0].tolist()}
        for s in range(6)
    ]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))
    monkeypatch.setattr(d3d_hf.targets, "load_target", lambda name, dtype="float32": (own, tiny_tokenizer()))
    forwards = []
    real = trainer.target_cache_losses

    def recording(drafter, inputs, **kwargs):
        forwards.append((next(kwargs["target"].parameters()).dtype, next(drafter.parameters()).dtype))
        return real(drafter, inputs, **kwargs)

    monkeypatch.setattr(trainer, "target_cache_losses", recording)
    config = D3DTrainingConfig(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                               train_mode="full", report_to="none", use_cpu=True, learning_rate=1e-3,
                               save_strategy="no", anchors_per_sequence=2, ar_loss_weight=0.0, distill_weight=1.0,
                               tau_eval_steps=2, tau_eval_max_new_tokens=6)  # fmt: skip
    script = D3DTrainScriptArguments(target="tiny", data=str(tmp_path / "data"), tau_holdout=1, layer_ids="1,3",
                                     init_block_size=BLOCK, shares_target_weights=False, shares_target_cache=True,
                                     target_dtype="bfloat16")  # fmt: skip
    drafter = train_drafter(script, config)
    assert forwards == [(torch.bfloat16, torch.float32)] * 2
    assert all(p.dtype == torch.float32 for p in drafter.parameters())
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert [entry["tau"] >= 1 for entry in state["log_history"] if "tau" in entry] == [True]  # the engine mixes dtypes
    with pytest.raises(ValueError, match="--target_dtype"):
        D3DTrainScriptArguments(target="tiny", data="x", target_dtype="int8")
    own.to(torch.float32)
    shared = D3DTrainScriptArguments(target="tiny", data=str(tmp_path / "data"), tau_holdout=1,
                                     init_block_size=BLOCK, target_dtype="bfloat16")  # fmt: skip
    with pytest.raises(ValueError, match="shares the target's weights"):
        train_drafter(shared, D3DTrainingConfig(output_dir=str(tmp_path / "shared"), max_steps=1, use_cpu=True,
                                                report_to="none"))  # fmt: skip
