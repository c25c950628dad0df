"""The autoregressive baseline drafter: D3DTrainer with the block loss off, exported as a plain causal LM that
transformers' assisted generation (`ar-assist`) uses."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
from _tiny import random_prompt, tiny_target, tiny_tokenizer
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.cli import main
from d3d_hf.convert import export_causal_lm
from d3d_hf.training import D3DDataCollator, D3DTrainer, D3DTrainingConfig, d3d_losses
from d3d_hf.training import main as train_main

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "train_ar_assistant.sh"


@pytest.fixture(scope="module")
def dataset(target):
    rows = []
    for i in range(8):
        prompt = random_prompt(4 + i % 3, seed=i)
        out = target.generate(prompt, max_new_tokens=10 + i, do_sample=False, eos_token_id=None, pad_token_id=0)
        rows.append({"prompt_ids": prompt[0].tolist(), "response_ids": out[0, prompt.shape[1] :].tolist()})
    return Dataset.from_list(rows)


def _config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        seed=7,
        anchors_per_sequence=3,
        disable_tqdm=True,
        train_mode="full",
        block_loss_weight=0.0,
        ar_loss_weight=1.0,
    )
    defaults.update(kwargs)
    return D3DTrainingConfig(**defaults)


def test_config_allows_the_ar_loss_alone_and_rejects_what_cannot_train(tmp_path):
    assert _config(tmp_path).block_loss_weight == 0.0
    with pytest.raises(ValueError, match="block adapters do not affect"):
        _config(tmp_path, train_mode="block_adapter")
    with pytest.raises(ValueError, match="both 0"):
        _config(tmp_path, ar_loss_weight=0.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        _config(tmp_path, block_loss_weight=-1.0)


def test_losses_without_blocks_skip_the_noisy_pass(target, dataset):
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    batch = D3DDataCollator(block_size=4, anchors_per_sequence=3)(list(dataset))
    full = d3d_losses(drafter, batch, block_size=4, gamma=7.0)
    ar_only = d3d_losses(drafter, batch, block_size=4, gamma=7.0, compute_block=False)
    torch.testing.assert_close(ar_only["ar_loss"], full["ar_loss"])
    assert float(ar_only["block_loss"]) == 0.0 and int(ar_only["block_tokens"]) == 0
    assert int(full["block_tokens"]) > 0


@pytest.mark.parametrize("mode", ["full", "peft"])
def test_ar_only_training_changes_every_trainable_parameter(target, dataset, tmp_path, mode):
    torch.manual_seed(0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    trainer = D3DTrainer(drafter, _config(tmp_path, train_mode=mode), train_dataset=dataset)
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and not any("mask_embedding" in n for n in trainable)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(h["block_loss"] == 0.0 and h["ar_loss"] > 0 for h in logged)
    after = dict(trainer.model.named_parameters())
    assert not [n for n, p in trainable.items() if torch.equal(p, after[n].detach())]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_export_computes_the_drafters_causal_path(family, tmp_path):
    source = tiny_target(family, seed=2)
    drafter = D3DForDiffusionDrafting.from_autoregressive(source, num_layers=2, block_size=4)
    drafter.add_block_adapter(2)  # adapters never act on committed tokens: dropped
    model = export_causal_lm(drafter, tmp_path / "lm")
    assert isinstance(model, {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[family])
    assert model.config.num_hidden_layers == 2
    ids = random_prompt(9, seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    with torch.no_grad():
        expected = drafter(input_ids=ids).logits
        torch.testing.assert_close(model(ids).logits, expected)
        torch.testing.assert_close(loaded(ids).logits, expected)


def test_export_of_a_weight_sharing_drafter_needs_its_target(target):
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, shares_target_weights=True)
    drafter._attached_target = None
    with pytest.raises(ValueError, match="pass `target=`"):
        export_causal_lm(drafter)
    model = export_causal_lm(drafter, target=target)
    ids = random_prompt(6, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, target(ids).logits)


def test_cli_export_gives_an_assistant_for_assisted_generation(tmp_path, capsys):
    source = tiny_target("llama", seed=4, sharpen=10.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(source, num_layers=3, block_size=4)
    drafter.save_pretrained(tmp_path / "drafter")
    assert main(["export-causal-lm", "--drafter", str(tmp_path / "drafter"), "--output", str(tmp_path / "lm")]) == 0
    assert "3-layer LlamaForCausalLM" in capsys.readouterr().out
    assistant = AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    ids = random_prompt(7, seed=5)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    out = source.generate(ids, assistant_model=assistant, **kwargs)
    assert torch.equal(out, source.generate(ids, **kwargs))
    assert main(["export-causal-lm", "--drafter", str(tmp_path / "drafter"), "--output", str(tmp_path / "lm")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def _recipe_command(name: str) -> list[str]:
    """The `d3d-hf NAME ...` command of the recipe, continuation lines joined, split like the shell would."""
    text = RECIPE.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith(f"d3d-hf {name} "))
    return shlex.split(line)[2:]


def _override(argv: list[str], **values: str) -> list[str]:
    out = list(argv)
    for flag, value in values.items():
        out[out.index(f"--{flag}") + 1] = value
    return out


def test_recipe_trains_and_exports_an_assistant_on_a_tiny_target(target, dataset, tmp_path):
    """examples/train_ar_assistant.sh's own train and export flags, with a tiny target, its data and 2 steps."""
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    dataset.save_to_disk(str(tmp_path / "data" / "dataset"))
    train = _recipe_command("train")
    assert "--block_loss_weight" in train and train[train.index("--block_loss_weight") + 1] == "0"
    train = _override(
        train,
        target=str(tmp_path / "target"),
        data=str(tmp_path / "data"),
        output_dir=str(tmp_path / "run"),
        max_steps="2",
        num_layers="2",
        threads="1",
    )
    assert train_main(train + ["--disable_tqdm", "true", "--report_to", "none"]) == 0
    export = _override(
        _recipe_command("export-causal-lm"), drafter=str(tmp_path / "run"), output=str(tmp_path / "assistant")
    )
    assert main(["export-causal-lm", *export]) == 0
    assistant = AutoModelForCausalLM.from_pretrained(tmp_path / "assistant")
    assert isinstance(assistant, LlamaForCausalLM) and assistant.config.num_hidden_layers == 2
    assert (tmp_path / "assistant" / "tokenizer.json").is_file()
    ids = random_prompt(7, seed=6)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=assistant, **kwargs), target.generate(ids, **kwargs))
