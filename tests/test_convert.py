"""Conversion (d3d_hf.convert) of real checkpoint layouts: Llama/Qwen3 autoregressive folders and the published D3D
layout; export of a drafter as a plain causal LM (the autoregressive baseline assistant)."""

import json

import pytest
import torch
from _tiny import random_prompt, tiny_target, word_tokenizer
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, Qwen3ForCausalLM

from d3d_hf import D3DCache, D3DForDiffusionDrafting
from d3d_hf.cli import main
from d3d_hf.convert import (
    convert_autoregressive_checkpoint,
    export_causal_lm,
    load_published_d3d_checkpoint,
    spare_mask_token_id,
)
from d3d_hf.drafters import load_drafter

VOCAB = 97
TOKENIZER_SIZE = 90  # word_tokenizer(): fewer tokens than embedding rows, as Qwen3 (151669 tokens, 151936 rows)


def causal_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "Qwen3-tiny"
    source = tiny_target("qwen3", vocab_size=VOCAB)
    source.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder, source


def test_spare_mask_token_id():
    tok = word_tokenizer()
    assert spare_mask_token_id(VOCAB, tok) == TOKENIZER_SIZE
    assert spare_mask_token_id(TOKENIZER_SIZE, tok) is None  # the tokenizer fills the vocabulary
    assert spare_mask_token_id(VOCAB, None) is None


def test_convert_qwen3_folder_reuses_a_spare_id(qwen3_folder, tmp_path):
    folder, source = qwen3_folder
    out = tmp_path / "qwen3.d3d-drafter"
    drafter = convert_autoregressive_checkpoint(folder, out, block_size=4, source_model="Qwen/Qwen3-tiny")
    cfg = drafter.config
    assert cfg.mask_token_id == TOKENIZER_SIZE and cfg.vocab_size == VOCAB
    assert cfg.use_qk_norm and cfg.block_size == 4 and cfg.source_layer_ids == [0, 1, 2]
    ids = random_prompt(9, vocab_size=TOKENIZER_SIZE)
    torch.testing.assert_close(causal_logits(drafter, ids), causal_logits(source, ids), rtol=0, atol=1e-5)
    # the folder is complete: weights, tokenizer, card; it loads back identically
    for name in ("model.safetensors", "config.json", "modeling_d3d.py", "tokenizer.json", "README.md"):
        assert (out / name).is_file(), name
    assert "base_model: Qwen/Qwen3-tiny" in (out / "README.md").read_text()
    loaded = load_drafter(str(out))
    torch.testing.assert_close(loaded.draft_logits(ids, D3DCache()), drafter.draft_logits(ids, D3DCache()))


def test_convert_llama_without_tokenizer_uses_a_mask_embedding(tmp_path):
    folder = tmp_path / "llama"
    source = tiny_target("llama", vocab_size=VOCAB)
    source.save_pretrained(folder)
    drafter = convert_autoregressive_checkpoint(folder, layer_ids=[0, 2], block_size=4)
    assert drafter.config.mask_token_id is None and drafter.model.mask_embedding is not None
    assert not drafter.config.use_qk_norm and drafter.config.source_layer_ids == [0, 2]
    reference = D3DForDiffusionDrafting.from_autoregressive(source, layer_ids=[0, 2], block_size=4)
    ids = random_prompt(7)
    torch.testing.assert_close(causal_logits(drafter, ids), causal_logits(reference, ids), rtol=0, atol=1e-5)
    full = convert_autoregressive_checkpoint(folder, block_size=4, reuse_spare_id=False)
    torch.testing.assert_close(causal_logits(full, ids), causal_logits(source, ids), rtol=0, atol=1e-5)


def test_convert_errors(qwen3_folder, tmp_path):
    folder, _ = qwen3_folder
    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB, n_positions=32)).save_pretrained(gpt2)
    with pytest.raises(ValueError, match=r"`gpt2` model.*supported model types \['llama', 'mistral', 'qwen3'\]"):
        convert_autoregressive_checkpoint(gpt2)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        convert_autoregressive_checkpoint(no_weights)
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_autoregressive_checkpoint(tmp_path)
    drafter_dir = tmp_path / "drafter"
    convert_autoregressive_checkpoint(folder, drafter_dir, num_layers=1, block_size=4)
    with pytest.raises(ValueError, match="already holds a D3D drafter"):
        convert_autoregressive_checkpoint(drafter_dir)
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_autoregressive_checkpoint(folder, drafter_dir, num_layers=1)
    with pytest.raises(ValueError, match="num_layers"):
        convert_autoregressive_checkpoint(folder, num_layers=9)


def _published_folder(tmp_path, source, keep=(0, 2), prefix="drafter.model.", mask=True, extra_config=None):
    """Writes `source` in a plausible published-D3D layout: another weight prefix, pruned layers that keep their
    source indices, the LM head under its own prefix, a separate mask vector."""
    folder = tmp_path / "published"
    folder.mkdir()
    state = {}
    for key, value in source.state_dict().items():
        if key.startswith("model.layers."):
            idx = int(key.split(".")[2])
            if idx not in keep:
                continue
        new_key = "drafter.lm_head.weight" if key == "lm_head.weight" else prefix + key[len("model.") :]
        state[new_key] = value.clone().contiguous()
    if mask:
        state["drafter.mask_embedding"] = torch.randn(source.config.hidden_size)
    save_file(state, str(folder / "model.safetensors"))
    raw = source.config.to_dict()
    raw.update({"block_size": 4, "num_hidden_layers": len(keep), **(extra_config or {})})
    (folder / "config.json").write_text(json.dumps(raw))
    return folder, state


def test_load_published_d3d_layout(tmp_path):
    source = tiny_target("qwen3", vocab_size=VOCAB)
    folder, state = _published_folder(tmp_path, source)
    drafter = load_published_d3d_checkpoint(folder)
    cfg = drafter.config
    assert cfg.use_qk_norm and cfg.block_size == 4 and cfg.num_hidden_layers == 2
    assert cfg.source_layer_ids == [0, 2] and cfg.mask_token_id is None
    assert torch.equal(drafter.model.mask_token_embedding().reshape(-1), state["drafter.mask_embedding"])
    reference = D3DForDiffusionDrafting.from_autoregressive(source, layer_ids=[0, 2], block_size=4)
    ids = random_prompt(8)
    torch.testing.assert_close(causal_logits(drafter, ids), causal_logits(reference, ids), rtol=0, atol=1e-5)

    # a mask id in the config (spare row of a padded vocabulary) and a block size given explicitly
    folder2 = tmp_path / "with-mask-id"
    folder2.mkdir()
    (folder / "model.safetensors").rename(folder2 / "model.safetensors")
    raw = json.loads((folder / "config.json").read_text())
    (folder2 / "config.json").write_text(json.dumps({**raw, "model_type": "qwen3_d3d", "mask_token_id": 95}))
    with pytest.raises(ValueError, match="no place in a D3D drafter"):
        load_published_d3d_checkpoint(folder2)  # the mask vector has no place when a mask id is recorded
    with pytest.warns(UserWarning, match="Dropped"):
        drafter2 = load_published_d3d_checkpoint(folder2, block_size=8, strict=False)
    assert drafter2.config.mask_token_id == 95 and drafter2.config.block_size == 8


def test_load_published_errors(tmp_path):
    llama = tmp_path / "llama"
    tiny_target("llama", vocab_size=VOCAB).save_pretrained(llama)
    with pytest.raises(ValueError, match="Qwen3-derived"):
        load_published_d3d_checkpoint(llama)
    source = tiny_target("qwen3", vocab_size=VOCAB)
    folder, _ = _published_folder(tmp_path, source, extra_config={"hidden_size": 128})
    with pytest.raises(ValueError, match="shape mismatches"):
        load_published_d3d_checkpoint(folder)  # the mask vector is checked first
    raw = {**source.config.to_dict(), "num_hidden_layers": 2, "intermediate_size": 256, "block_size": 4}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"shape mismatches \['model.layers.0.mlp"):
        with pytest.warns(UserWarning, match="Dropped"):  # the mask vector: a mask id is given
            load_published_d3d_checkpoint(folder, mask_token_id=95, strict=False)


def test_cli_convert(qwen3_folder, tmp_path, capsys):
    folder, _ = qwen3_folder
    out = tmp_path / "cli-drafter"
    rc = main(["convert", "--from", str(folder), "--output", str(out), "--layer-ids", "0,2", "--block-size", "4"])
    assert rc == 0, capsys.readouterr().err
    assert "spare id 90" in capsys.readouterr().out
    assert load_drafter(str(out)).config.source_layer_ids == [0, 2]
    rc = main(["convert", "--from", str(tmp_path), "--output", str(tmp_path / "x")])
    assert rc == 2 and "config.json" in capsys.readouterr().err


def test_cli_convert_published(tmp_path, capsys):
    folder, _ = _published_folder(tmp_path, tiny_target("qwen3", vocab_size=VOCAB))
    out = tmp_path / "from-published"
    assert main(["convert", "--from", str(folder), "--output", str(out), "--published-d3d"]) == 0
    assert "separate mask embedding, source layers [0, 2]" in capsys.readouterr().out
    assert load_drafter(str(out)).config.block_size == 4
    assert main(["convert", "--from", str(folder), "--output", str(tmp_path / "y"), "--published-d3d",
                 "--num-layers", "1"]) == 2  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# export as a plain causal LM: the assistant of transformers' assisted generation (ar-assist)


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
