"""Block-row-only full weights in the last layers (`D3DConfig.block_lora_full_layers`, issue 35's third capacity
option): full-rank block adapters on the drafter's last layers, low-rank ones elsewhere. The config refuses what
cannot be built, the shapes survive saving, pruning and rank truncation, the trainer creates and trains them, and
decoding with them stays lossless. The fused inference paths: tests/test_fast_paths.py."""

import pytest
import torch
from _tiny import tiny_target
from datasets import Dataset
from test_training_trl import _assert_lossless, _assert_trains, _config, _drafter, _tokenizer, answers, conversations  # noqa: F401

from d3d_hf import D3DConfig, D3DForDiffusionDrafting
from d3d_hf.pruning import expand_block_adapters, pruned_drafter, truncate_block_adapters
from d3d_hf.training import D3DTrainer


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=4, sharpen=10.0)


def _full_drafter(target, full_layers=1, rank=2):
    drafter = _drafter(target)
    drafter.add_block_adapter(rank, alpha=4.0, full_layers=full_layers)
    with torch.no_grad():  # a fresh adapter's B is zero: make every adapter change the block rows
        for name, param in drafter.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return drafter.eval()


def _ranks(drafter) -> list[dict[str, int]]:
    return [
        {name: module.rank for name, module in layer.named_modules() if hasattr(module, "lora_A")}
        for layer in drafter.model.layers
    ]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"block_lora_full_layers": 1}, r"needs block adapters \(`block_lora_rank` >= 1, got 0\)"),
        ({"block_lora_full_layers": 3, "block_lora_rank": 4}, r"at most `num_hidden_layers` \(2\)"),
        ({"block_lora_full_layers": -1, "block_lora_rank": 4}, r"`block_lora_full_layers` .* >= 0"),
        ({"block_lora_full_layers": 1.0, "block_lora_rank": 4}, r"`block_lora_full_layers` .* whole number"),
    ],
)
def test_the_config_refuses_full_layers_it_cannot_build(fields, match):
    with pytest.raises(ValueError, match=match):
        D3DConfig(num_hidden_layers=2, **fields)


def test_the_last_layers_get_full_rank_adapters_of_one_scale(target):
    drafter = _full_drafter(target, full_layers=1, rank=2)
    *others, last = _ranks(drafter)
    assert others and all(set(layer.values()) == {2} for layer in others)
    attn = drafter.model.layers[-1].self_attn
    assert last["self_attn.q_proj"] == min(attn.q_proj.in_features, attn.q_proj.out_features)
    assert last["self_attn.k_proj"] == attn.k_proj.out_features
    assert {m.lora_scaling for m in drafter.modules() if hasattr(m, "lora_A")} == {2.0}  # alpha / rank = 4 / 2
    assert drafter.config.block_lora_full_layers == 1
    layers = len(drafter.model.layers)
    with pytest.raises(ValueError, match=rf"`full_layers` must be a whole number in \[0, {layers}\]"):
        _drafter(target).add_block_adapter(2, full_layers=layers + 1)


def test_full_layers_save_load_and_decode_losslessly(target, tmp_path):
    drafter = _full_drafter(target)
    drafter.save_pretrained(tmp_path / "d")
    loaded = D3DForDiffusionDrafting.from_pretrained(tmp_path / "d").eval()
    assert _ranks(loaded) == _ranks(drafter)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    block = torch.zeros_like(ids, dtype=torch.bool)
    block[:, 3:] = True
    torch.testing.assert_close(loaded(ids, block_positions=block).logits, drafter(ids, block_positions=block).logits)
    assert not torch.allclose(drafter(ids, block_positions=block).logits, drafter(ids).logits, atol=1e-4)
    _assert_lossless(target, loaded)


def test_pruning_and_rank_truncation_keep_the_shapes_loadable(target, tmp_path):
    drafter = _full_drafter(target, full_layers=2)
    last = len(drafter.model.layers) - 1
    kept = pruned_drafter(drafter, [0, last])  # one full-rank layer stays, and is the last
    assert kept.config.block_lora_full_layers == 1 and _ranks(kept) == [_ranks(drafter)[i] for i in (0, last)]
    kept = pruned_drafter(drafter, [0, last - 1])  # the other one stays, now the last
    assert kept.config.block_lora_full_layers == 1 and _ranks(kept) == [_ranks(drafter)[i] for i in (0, last - 1)]
    kept = pruned_drafter(drafter, [0])  # both go
    assert kept.config.block_lora_full_layers == 0 and _ranks(kept) == _ranks(drafter)[:1]
    truncate_block_adapters(drafter, 1)
    assert drafter.config.block_lora_full_layers == 0
    assert {r for layer in _ranks(drafter) for r in layer.values()} == {1}
    drafter.save_pretrained(tmp_path / "t")
    assert _ranks(D3DForDiffusionDrafting.from_pretrained(tmp_path / "t")) == _ranks(drafter)


def test_the_trainer_creates_and_trains_full_layers(target, conversations, tmp_path):  # noqa: F811
    trainer = D3DTrainer(
        _drafter(target), _config(tmp_path / "run", max_steps=2, block_lora_full_layers=1),
        train_dataset=conversations, processing_class=_tokenizer(),
    )  # fmt: skip
    trained = _assert_trains(trainer)
    last = trainer.model.model.layers[-1].mlp.down_proj
    assert trainer.model.config.block_lora_full_layers == 1 and last.rank == last.out_features
    assert any(f".layers.{len(trainer.model.model.layers) - 1}.mlp.down_proj.lora_A" in name for name in trained)
    with pytest.raises(ValueError, match=r"`block_lora_full_layers=2` asks for new adapters"):
        D3DTrainer(
            trainer.model, _config(tmp_path / "again", block_lora_full_layers=2),
            train_dataset=Dataset.from_list(list(conversations)[:8]), processing_class=_tokenizer(),
        )  # fmt: skip


def test_truncating_to_a_rank_above_a_projections_width_keeps_it_exact(target, tmp_path):
    """A projection narrower than the new rank (k/v here) keeps its whole update, padded with zeros to the rank."""
    drafter = _drafter(target)
    k_proj = drafter.model.layers[0].self_attn.k_proj
    width = min(k_proj.in_features, k_proj.out_features)
    drafter.add_block_adapter(width + 8, alpha=4.0)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    update = (k_proj.lora_B @ k_proj.lora_A * k_proj.lora_scaling).detach().clone()
    truncate_block_adapters(drafter, width + 4)
    assert k_proj.lora_A.shape[0] == width + 4
    torch.testing.assert_close(k_proj.lora_B @ k_proj.lora_A * k_proj.lora_scaling, update, rtol=1e-4, atol=1e-5)
    drafter.save_pretrained(tmp_path / "t")
    _assert_lossless(target, D3DForDiffusionDrafting.from_pretrained(tmp_path / "t").eval())


def test_the_trainer_refuses_full_layers_it_cannot_use(target, conversations, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match=r"`block_lora_full_layers=2` shapes block adapters, which only"):
        _config(tmp_path / "full", train_mode="full", block_lora_full_layers=2)
    layers = len(_drafter(target).model.layers)
    with pytest.raises(ValueError, match=rf"`block_lora_full_layers={layers + 1}` is more than the drafter's"):
        D3DTrainer(
            _drafter(target), _config(tmp_path / "many", block_lora_full_layers=layers + 1),
            train_dataset=conversations, processing_class=_tokenizer(),
        )  # fmt: skip


def test_resuming_with_other_adapter_shapes_is_refused_before_any_step(target, conversations, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    first = D3DTrainer(
        _drafter(target), _config(run, max_steps=1, save_strategy="steps", save_steps=1, block_lora_full_layers=1),
        train_dataset=conversations, processing_class=_tokenizer(),
    )  # fmt: skip
    first.train()
    again = D3DTrainer(
        _drafter(target), _config(run, max_steps=2), train_dataset=conversations, processing_class=_tokenizer()
    )
    with pytest.raises(ValueError, match=r"block_lora_full_layers=1 there, 0 here.*resume with the flags"):
        again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 0
    same = D3DTrainer(
        _drafter(target), _config(run, max_steps=2, block_lora_full_layers=1),
        train_dataset=conversations, processing_class=_tokenizer(),
    )  # fmt: skip
    same.train(resume_from_checkpoint=True)
    assert same.state.global_step == 2


def test_full_rank_layers_cannot_grow(target):
    drafter = _full_drafter(target, full_layers=1, rank=2)
    with pytest.raises(ValueError, match=r"last 1 layers have full-rank block adapters, whose rank cannot grow"):
        expand_block_adapters(drafter, 4)
    assert {r for layer in _ranks(drafter)[:-1] for r in layer.values()} == {2}
