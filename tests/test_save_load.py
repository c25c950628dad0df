"""Save/load round trips of drafters, with and without `trust_remote_code`."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from _tiny import random_prompt, tiny_target
from transformers import AutoModel

from d3d_hf import D3DCache, D3DForDiffusionDrafting
from d3d_hf.drafters import ensure_writable_dir, load_drafter


@pytest.fixture
def drafter():
    torch.manual_seed(0)
    d = D3DForDiffusionDrafting.from_autoregressive(tiny_target("qwen3"), layer_ids=[0, 2], block_size=4)
    with torch.no_grad():
        d.model.mask_embedding.weight.normal_()
    return d


def _assert_identical(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    ids = random_prompt(6)
    assert torch.equal(a.draft_logits(ids, D3DCache()), b.draft_logits(ids, D3DCache()))


def test_round_trip_is_bit_identical(drafter, tmp_path):
    path = tmp_path / "my.d3d-drafter_v0.1"
    drafter.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "d3d"
    assert config["auto_map"]["AutoModel"].endswith("modeling_d3d.D3DForDiffusionDrafting")
    assert config["source_layer_ids"] == [0, 2]
    for name in ("configuration_d3d.py", "modeling_d3d.py", "generation_d3d.py", "model.safetensors"):
        assert (path / name).exists(), name
    _assert_identical(drafter, AutoModel.from_pretrained(path))
    _assert_identical(drafter, AutoModel.from_pretrained(path, trust_remote_code=True))
    _assert_identical(drafter, load_drafter(str(path)))


def test_remote_code_without_d3d_hf_installed(drafter, tmp_path):
    """A fresh interpreter that cannot import d3d_hf loads the folder with trust_remote_code and decodes losslessly."""
    path = tmp_path / "remote.code-drafter_1.0"
    drafter.save_pretrained(path)
    reference_logits = drafter.draft_logits(random_prompt(6), D3DCache())
    torch.save(reference_logits, tmp_path / "ref.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["d3d_hf"] = None  # make `import d3d_hf` fail
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        import torch
        from transformers import AutoModel
        from _tiny import random_prompt, tiny_target
        drafter = AutoModel.from_pretrained({str(path)!r}, trust_remote_code=True)
        assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
        mod = sys.modules[type(drafter).__module__]
        logits = drafter.draft_logits(random_prompt(6), mod.D3DCache())
        # same weights and code; bitwise equality across processes is not guaranteed (BLAS thread scheduling)
        reference = torch.load({str(tmp_path / "ref.pt")!r})
        assert torch.allclose(logits, reference, rtol=1e-5, atol=1e-5), (logits - reference).abs().max()
        target = tiny_target("qwen3")
        ids = random_prompt(5)
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False)
        assert torch.equal(ref, out)
        assert drafter.last_generation_stats.rounds > 0  # the D3D candidate generator was used
        try:
            AutoModel.from_pretrained({str(path)!r}, trust_remote_code=False)
        except ValueError as err:
            assert "trust_remote_code" in str(err)
        else:
            raise AssertionError("loading without trust_remote_code should fail")
        print("OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


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
    out = model.generate(ids, assistant_model=drafter, **kwargs)
    assert torch.equal(out, ref)
    assert drafter.last_generation_stats.tau > 2.0
