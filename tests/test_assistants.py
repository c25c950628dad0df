"""Autoregressive assistants (src/d3d_hf/assistants.py): the layers-only format that takes its target's embeddings,
the shipped `ar-smollm2-135m-instruct`, and `ar-assist` decoding with them."""

import json

import pytest
import torch
from _tiny import random_prompt
from transformers import LlamaConfig, LlamaForCausalLM

from d3d_hf.assistants import ASSISTANT_FILE, KNOWN_ASSISTANTS, is_layers_only, load_assistant, save_layers_only


def _tied(num_layers: int, seed: int, hidden_size: int = 64, tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def _assistant_of(target: LlamaForCausalLM) -> LlamaForCausalLM:
    """A 1-layer assistant whose embeddings are the target's (as training with frozen embeddings leaves them)."""
    assistant = _tied(1, seed=1)
    with torch.no_grad():
        assistant.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
    return assistant


def test_layers_only_round_trip_takes_the_targets_embeddings(tmp_path):
    target = _tied(2, seed=0)
    assistant = _assistant_of(target)
    folder = save_layers_only(assistant, tmp_path / "a", "my-target", target, dtype=torch.float32)
    assert is_layers_only(folder)
    assert json.loads((folder / ASSISTANT_FILE).read_text())["embeddings_from"] == "my-target"
    from safetensors.torch import load_file

    stored = load_file(str(folder / "model.safetensors"))
    assert "model.embed_tokens.weight" not in stored and "lm_head.weight" not in stored
    loaded = load_assistant(str(folder), target=target)
    ids = random_prompt(9)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, assistant(ids).logits, rtol=0, atol=0)
    # the embeddings and the tied LM head are the target's own tensor (no copy)
    assert loaded.get_input_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert loaded.get_output_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    # bf16 storage: close, not equal, and loaded in the dtype asked for
    folder16 = save_layers_only(assistant, tmp_path / "b", "my-target", target)
    loaded16 = load_assistant(str(folder16), target=target)
    assert next(loaded16.model.layers.parameters()).dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(loaded16(ids).logits, assistant(ids).logits, rtol=0.05, atol=0.05)


def test_layers_only_refuses_what_it_cannot_rebuild(tmp_path):
    target = _tied(2, seed=0)
    with pytest.raises(ValueError, match="not my-target's"):
        save_layers_only(_tied(1, seed=1), tmp_path / "a", "my-target", target)  # its own embeddings
    untied = _tied(1, seed=1, tie=False)
    with pytest.raises(ValueError, match="tied"):
        save_layers_only(untied, tmp_path / "b", "my-target", target)
    folder = save_layers_only(_assistant_of(target), tmp_path / "c", "my-target", target)
    with pytest.raises(FileExistsError):
        save_layers_only(_assistant_of(target), folder, "my-target", target)
    wider = _tied(1, seed=1, hidden_size=32)
    with pytest.raises(ValueError, match="expects"):
        load_assistant(str(folder), target=wider)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        load_assistant(str(folder), target=target)


def test_layers_only_assistant_decodes_losslessly_with_assisted_generation(tmp_path):
    target = _tied(2, seed=0)
    folder = save_layers_only(_assistant_of(target), tmp_path / "a", "my-target", target)
    assistant = load_assistant(str(folder), target=target)
    ids = random_prompt(6)
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    assisted = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant)
    assert torch.equal(plain, assisted)


@pytest.mark.slow
def test_shipped_assistant_loads_from_the_target_and_drafts(smollm2):
    model, tokenizer = smollm2
    assert (KNOWN_ASSISTANTS["ar-smollm2-135m-instruct"] / ASSISTANT_FILE).is_file()
    assistant = load_assistant("ar-smollm2-135m-instruct", target=model)
    assert assistant.config.num_hidden_layers == 6
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    plain = model.generate(ids, max_new_tokens=24, do_sample=False)
    assisted = model.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=assistant)
    assert torch.equal(plain, assisted)
