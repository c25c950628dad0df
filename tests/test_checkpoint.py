"""Checkpoints (modeling/checkpoint_d3d.py) on tiny random float32 models: save/load round trips, with and without
`trust_remote_code` (also in a process without d3d_hf, and next to d3d_hf: the installed generate hook drives a
checkpoint's bundle of the same version and refuses one of another `BUNDLE_VERSION`); atomic saves (an interrupted
save keeps the previous checkpoint and leaves no temporary folder; other files in the folder are kept; weights of an
earlier save never shadow the new ones) and the checks at load time (no mask token, missing weights, a config that
does not fit the weights or lacks required fields, damaged safetensors files and shards).
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _tiny import crash_safetensors_writer, random_prompt, tiny_target
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from d3d_hf import D3DCache, D3DForDiffusionDrafting
from d3d_hf.drafters import load_drafter

# ----------------------------------------------------------------------------------------------------------------------
# save/load round trips


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
    # matmul layouts still being timed alternate kernels between calls (last-bit differences): compare on `x W^T`
    a.model.autotune_matmuls = b.model.autotune_matmuls = False
    assert torch.equal(a.draft_logits(ids, D3DCache()), b.draft_logits(ids, D3DCache()))


def test_round_trip_is_bit_identical(drafter, tmp_path):
    path = tmp_path / "my.d3d-drafter_v0.1"
    drafter.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "d3d"
    assert config["auto_map"]["AutoModel"].endswith("modeling_d3d.D3DForDiffusionDrafting")
    assert config["source_layer_ids"] == [0, 2]
    bundle = [p.name for p in (Path(__file__).resolve().parents[1] / "modeling").glob("*_d3d.py")]
    for name in (*bundle, "model.safetensors"):
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


def _run_isolated(script: str, tmp_path: Path) -> None:
    """Runs `script` in a fresh interpreter (tests/ on its path) whose Hugging Face caches are new folders under
    `tmp_path`: `HF_MODULES_CACHE` is where transformers copies and imports remote code (`transformers_modules`), so
    no test sees another's copy of the bundle."""
    env = {
        **os.environ,
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
        "HF_HUB_OFFLINE": "1",
    }
    prelude = f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


#: how a process ends up with two copies of the bundle: a drafter loaded with `trust_remote_code=True` before `import
#: d3d_hf` is the checkpoint's own copy (afterwards transformers prefers the class d3d_hf registers), and its hook,
#: installed first, stays the process's hook; d3d_hf's hook is swapped in by hand for the other direction
_TWO_COPIES = """
    import torch
    from _tiny import random_prompt, tiny_target
    from transformers import AutoModel
    from transformers.generation import GenerationMixin

    remote = AutoModel.from_pretrained({path!r}, trust_remote_code=True)
    import d3d_hf
    from d3d_hf.modeling.configuration_d3d import BUNDLE_VERSION

    module = type(remote).__module__
    assert module.startswith("transformers_modules"), module
    remote_hooks = sys.modules[module.rsplit(".", 1)[0] + ".hooks_d3d"]

    def hook_module():
        return GenerationMixin._get_candidate_generator.__globals__["__name__"]

    def use_d3d_hf_hook():
        d3d_hf.remove_generation_hook()
        d3d_hf.install_generation_hook()
        assert hook_module() == "d3d_hf.modeling.hooks_d3d", hook_module()

    assert hook_module() == remote_hooks.__name__, hook_module()  # `import d3d_hf` kept the installed hook
    target = tiny_target("qwen3")
    ids = random_prompt(5)
    reference = target.generate(ids, max_new_tokens=20, do_sample=False)

    def decodes_as_the_target(assistant):
        out = target.generate(ids, assistant_model=assistant, max_new_tokens=20, do_sample=False)
        assert torch.equal(out, reference)
        assert assistant.last_generation_stats.rounds > 0  # the D3D candidate generator was used
"""


def test_remote_code_drafter_of_another_bundle_version_is_refused(drafter, tmp_path):
    """Two copies of the bundle in one process, the checkpoint's stamped with another `BUNDLE_VERSION`: each copy's
    hook drives its own drafters and refuses the other's before any forward pass, naming both versions and the fix."""
    path = tmp_path / "stamped-drafter"
    drafter.save_pretrained(path)
    source = (path / "configuration_d3d.py").read_text(encoding="utf-8")
    edited, count = re.subn(r"^BUNDLE_VERSION = .*$", "BUNDLE_VERSION = 999", source, flags=re.MULTILINE)
    assert count == 1
    (path / "configuration_d3d.py").write_text(edited, encoding="utf-8")
    script = """
    assert remote._d3d_bundle_version == 999 and BUNDLE_VERSION != 999
    forwards = []
    target.register_forward_pre_hook(lambda *args: forwards.append(1))

    def refused(assistant, found, hook_version, hook_module):
        forwards.clear()
        assistant.register_forward_pre_hook(lambda *args: forwards.append(1))
        try:
            target.generate(ids, assistant_model=assistant, max_new_tokens=8, do_sample=False)
        except ValueError as err:
            message = str(err)
        else:
            raise AssertionError("a drafter of another bundle version was not refused")
        parts = [
            f"d3d-hf bundle with version {found} (its class is in `{type(assistant).__module__}`)",
            f"hook installed in this process is bundle version {hook_version} (`{hook_module}`)",
            "d3d_hf.drafters.load_drafter(folder)",
            "instead of `trust_remote_code=True`, in a new process",
            "d3d_hf.remove_generation_hook()",
            "load_drafter(folder).save_pretrained(folder)",
        ]
        for part in parts:
            assert part in message, (part, message)
        assert not forwards, "a forward pass ran before the refusal"

    decodes_as_the_target(remote)  # the checkpoint's hook drives its own drafter
    own = d3d_hf.D3DForDiffusionDrafting.from_autoregressive(target, layer_ids=[0, 2], block_size=4)
    refused(own, BUNDLE_VERSION, 999, remote_hooks.__name__)
    use_d3d_hf_hook()
    refused(remote, 999, BUNDLE_VERSION, "d3d_hf.modeling.hooks_d3d")
    print("OK")
    """
    _run_isolated(_TWO_COPIES.format(path=str(path)) + script, tmp_path)


def test_remote_code_drafter_of_the_same_bundle_version_decodes_next_to_d3d_hf(drafter, tmp_path):
    """The normal case: two copies of a bundle of the same version in one process; whichever hook is installed drives
    both copies' drafters, and each decodes as the target alone."""
    path = tmp_path / "same-version-drafter"
    drafter.save_pretrained(path)
    script = f"""
    from d3d_hf.drafters import load_drafter

    own = load_drafter({str(path)!r})
    assert type(own).__module__.startswith("d3d_hf."), type(own).__module__
    decodes_as_the_target(remote)
    decodes_as_the_target(own)  # d3d_hf's drafter, driven by the checkpoint's hook
    use_d3d_hf_hook()
    decodes_as_the_target(remote)  # the checkpoint's drafter, driven by d3d_hf's hook
    decodes_as_the_target(own)
    print("OK")
    """
    _run_isolated(_TWO_COPIES.format(path=str(path)) + script, tmp_path)


# ----------------------------------------------------------------------------------------------------------------------
# atomic saves: interrupted saves, existing folders


def _two_drafters():
    target = tiny_target("llama", seed=3)
    first = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    second = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    with torch.no_grad():
        second.model.mask_embedding.weight.normal_()
    return first, second


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_interrupted_while_writing_weights_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    first, second = _two_drafters()
    first.save_pretrained(tmp_path / "ckpt")
    before = sorted(p.name for p in tmp_path.iterdir())
    with monkeypatch.context() as patch:
        crash_safetensors_writer(patch)
        with pytest.raises(KeyboardInterrupt):
            second.save_pretrained(tmp_path / "ckpt")
    _assert_same_weights(load_drafter(str(tmp_path / "ckpt")), first)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "no temporary folder is left behind"
    second.save_pretrained(tmp_path / "ckpt")
    _assert_same_weights(load_drafter(str(tmp_path / "ckpt")), second)


def test_save_interrupted_after_the_weights_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A crash after the weights were written (here: in the tokenizer's save) leaves the previous files in place."""
    first, second = _two_drafters()
    first.save_pretrained(tmp_path / "ckpt")

    class CrashingTokenizer:
        def save_pretrained(self, folder):
            raise KeyboardInterrupt("killed while writing the tokenizer")

    with pytest.raises(KeyboardInterrupt):
        second.save_pretrained(tmp_path / "ckpt", tokenizer=CrashingTokenizer())
    _assert_same_weights(load_drafter(str(tmp_path / "ckpt")), first)


def test_new_checkpoint_interrupted_leaves_no_half_written_weights(tmp_path, monkeypatch):
    _, second = _two_drafters()
    with monkeypatch.context() as patch:
        crash_safetensors_writer(patch)
        with pytest.raises(KeyboardInterrupt):
            second.save_pretrained(tmp_path / "new")
    assert list(tmp_path.iterdir()) == [], "neither the folder nor a temporary one is left behind"


def test_save_into_a_folder_with_other_files_keeps_them(tmp_path):
    first, second = _two_drafters()
    folder = tmp_path / "ckpt"
    (folder / "notes").mkdir(parents=True)
    (folder / "notes" / "run.txt").write_text("lr 5e-4")
    (folder / "train.log").write_text("step 1")
    (folder / "README.md").write_text("# my own card\n")
    with pytest.warns(UserWarning, match="Kept .*README.md: it was not generated by d3d-hf"):
        first.save_pretrained(folder)
        second.save_pretrained(folder)
    assert (folder / "notes" / "run.txt").read_text() == "lr 5e-4"
    assert (folder / "train.log").read_text() == "step 1"
    assert (folder / "README.md").read_text() == "# my own card\n"
    _assert_same_weights(load_drafter(str(folder)), second)


def test_save_stages_inside_the_folder_when_its_parent_is_read_only(tmp_path, monkeypatch):
    import tempfile

    first, second = _two_drafters()
    folder = tmp_path / "ckpt"
    first.save_pretrained(folder)
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):
        if os.path.realpath(str(dir)) == os.path.realpath(tmp_path):
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    second.save_pretrained(folder)
    _assert_same_weights(load_drafter(str(folder)), second)
    assert not any(p.name.endswith(".saving") for p in [*tmp_path.iterdir(), *folder.iterdir()])


@pytest.mark.parametrize("order", ["sharded_then_single", "single_then_sharded"])
def test_weights_of_an_earlier_save_never_shadow_the_new_ones(tmp_path, order):
    first, second = _two_drafters()
    shard = dict(max_shard_size="40KB")
    first.save_pretrained(tmp_path, **(shard if order == "sharded_then_single" else {}))
    second.save_pretrained(tmp_path, **({} if order == "sharded_then_single" else shard))
    _assert_same_weights(load_drafter(str(tmp_path)), second)
    names = {p.name for p in tmp_path.iterdir()}
    if order == "sharded_then_single":
        assert "model.safetensors" in names and not any(n.startswith("model-") for n in names)
    else:
        assert "model.safetensors" not in names and "model.safetensors.index.json" in names


# ----------------------------------------------------------------------------------------------------------------------
# loading checks: no mask token, weights and config that do not fit, damaged files


@pytest.fixture
def saved(tmp_path):
    """A saved drafter folder (full copy of a tiny Qwen3 target, 2 layers, block adapters)."""
    target = tiny_target("qwen3", seed=1)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, layer_ids=[0, 2], block_size=4, block_lora_rank=2)
    path = tmp_path / "drafter"
    drafter.save_pretrained(path)
    return path


def _loaders(path):
    """The public ways to load a drafter folder."""
    return {
        "load_drafter": lambda: load_drafter(str(path)),
        "AutoModel": lambda: AutoModel.from_pretrained(path),
        "from_pretrained": lambda: D3DForDiffusionDrafting.from_pretrained(path),
    }


def test_loaders_accept_the_intact_folder(saved):
    for name, load in _loaders(saved).items():
        assert isinstance(load(), D3DForDiffusionDrafting), name


def test_checkpoint_without_a_mask_token_is_rejected_at_load(saved):
    weights = load_file(saved / "model.safetensors")
    del weights["model.mask_embedding.weight"]
    save_file(weights, saved / "model.safetensors", metadata={"format": "pt"})
    for name, load in _loaders(saved).items():
        with pytest.raises(ValueError, match="no mask token.*mask_token_id.*config.json"):
            load()
        assert name


@pytest.mark.parametrize("removed", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.lora_B"])
def test_checkpoint_missing_a_weight_is_rejected_at_load(saved, removed):
    weights = load_file(saved / "model.safetensors")
    del weights[removed]
    save_file(weights, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lack 1 tensor.*{removed}.*save_pretrained"):
        load_drafter(str(saved))


@pytest.mark.parametrize(("field", "value"), [("block_lora_rank", 0), ("num_hidden_layers", 1)])
def test_config_that_does_not_fit_the_weights_is_rejected_at_load(saved, field, value):
    config = json.loads((saved / "config.json").read_text())
    config[field] = value
    config["source_layer_ids"] = config["source_layer_ids"][: config["num_hidden_layers"]]
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no place for.*config.json"):
        load_drafter(str(saved))


@pytest.mark.parametrize("field", ["block_size", "num_hidden_layers", "vocab_size", "rope_parameters", "head_dim"])
def test_config_missing_a_required_field_is_rejected_at_load(saved, field):
    config = json.loads((saved / "config.json").read_text())
    del config[field]
    (saved / "config.json").write_text(json.dumps(config))
    for name, load in _loaders(saved).items():
        with pytest.raises(ValueError, match=rf"config.json\) lacks the required field\(s\) \['{field}'\]"):
            load()
        assert name


def test_config_without_model_type_or_not_json_is_rejected_at_load(saved):
    config = json.loads((saved / "config.json").read_text())
    del config["model_type"]
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match='no `model_type`: add `"model_type": "d3d"`'):
        load_drafter(str(saved))
    (saved / "config.json").write_text(json.dumps(config)[:40])
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_drafter(str(saved))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble_header(path):
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"\x00" * 16 + data[24:])


def _empty(path):
    path.write_bytes(b"")


def _append(path):
    path.write_bytes(path.read_bytes() + b"\x00" * 10)


@pytest.mark.parametrize("damage", [_truncate, _garble_header, _empty, _append], ids=lambda f: f.__name__[1:])
def test_damaged_weights_are_rejected_at_load(saved, damage):
    damage(saved / "model.safetensors")
    for name, load in _loaders(saved).items():
        with pytest.raises(OSError, match=r"model.safetensors is (truncated|corrupt).*save the drafter again"):
            load()
        assert name


def test_missing_weights_file_is_rejected_at_load(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="(?i)no weights.*save the drafter again"):
        load_drafter(str(saved))


def test_damaged_shard_is_rejected_at_load(tmp_path):
    drafter = D3DForDiffusionDrafting.from_autoregressive(tiny_target("llama", seed=2), block_size=4)
    drafter.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    _truncate(shards[1])
    with pytest.raises(OSError, match=rf"{shards[1].name} is truncated"):
        load_drafter(str(tmp_path))
