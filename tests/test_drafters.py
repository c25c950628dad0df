"""Drafters by name or folder (d3d_hf.drafters): `load_drafter` errors, output folders that are not overwritten
without asking, the shipped drafter (no bundle copy inside the package, the current bundle in every export, lossless
decoding on the real target)."""

import json

import pytest
import torch
from _tiny import tiny_target

from d3d_hf.drafters import ensure_writable_dir, load_drafter


def test_output_folder_is_not_overwritten_without_asking(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="--overwrite"):
        ensure_writable_dir(tmp_path)
    assert ensure_writable_dir(tmp_path, overwrite=True) == tmp_path
    assert ensure_writable_dir(tmp_path / "new") == tmp_path / "new"


def test_load_drafter_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="init-drafter"):
        load_drafter(str(tmp_path / "missing"))
    tiny_target("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="not a D3D drafter"):
        load_drafter(str(tmp_path / "llama"))


def test_a_mistyped_drafter_name_is_refused_at_once_with_the_shipped_name(tmp_path, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked for a name that cannot be a Hub id")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="Did you mean 'd3d-smollm2-135m-instruct'"):
        load_drafter("d3d-smollm2")
    with pytest.raises(FileNotFoundError, match="owner/name"):
        load_drafter("zzz")


def test_shipped_drafter_holds_no_bundle_copy_and_exports_the_current_bundle(tmp_path):
    """Inside the package the shipped checkpoint is weights, config and card (the registered model_type loads it);
    what a user downloads is an export, which must carry the current bundle, file for file."""
    from pathlib import Path

    from d3d_hf.drafters import KNOWN_DRAFTERS

    root = Path(__file__).resolve().parents[1] / "modeling"
    bundle = sorted(p.name for p in root.glob("*_d3d.py"))
    assert {"configuration_d3d.py", "modeling_d3d.py", "generation_d3d.py", "drafting_d3d.py"} <= set(bundle)
    for name, folder in KNOWN_DRAFTERS.items():
        assert not list(folder.glob("*.py")), f"{name} carries code: re-run examples/ship_smollm2_drafter.py"
        assert "auto_map" not in json.loads((folder / "config.json").read_text())
        exported = tmp_path / name
        load_drafter(name).save_pretrained(exported)
        assert sorted(p.name for p in exported.glob("*.py")) == bundle
        for source in bundle:
            assert (exported / source).read_text() == (root / source).read_text(), source
        assert json.loads((exported / "config.json").read_text())["auto_map"]["AutoModel"].startswith("modeling_d3d.")


def test_shipped_drafter_loads_and_decodes_losslessly(smollm2):
    from d3d_hf.prompts import encode_prompt, load_prompts

    model, tokenizer = smollm2
    drafter = load_drafter("d3d-smollm2-135m-instruct")
    assert drafter.config.shares_target_weights and drafter.config.block_lora_rank > 0
    ids = encode_prompt(tokenizer, load_prompts("humaneval", limit=1)[0])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    ref = model.generate(ids, **kwargs)
    out = model.generate(ids, assistant_model=drafter, **kwargs)  # the default engine
    assert torch.equal(out, ref)
    # the drafter itself (a full block every round: the engine's choices depend on this machine's timings)
    out = model.generate(ids, assistant_model=drafter, d3d_num_drafts="full", **kwargs)
    assert torch.equal(out, ref) and drafter.last_generation_stats.tau > 2.0
