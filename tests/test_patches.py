"""How the fast paths are applied from outside (modeling/patches_d3d.py): `Patches`, the one patch helper, and
`apply_fast_paths`, whose handle restores the plain path exactly and which is idempotent; and the experiments of the
generation options, which a bundle without d3d-hf refuses (`options_d3d.experiment`)."""

import importlib.metadata

import d3d_hf.modeling.fast_paths_d3d as fast_paths
import d3d_hf.modeling.options_d3d as options_d3d
import pytest
import torch
from _tiny import random_prompt, tiny_target
from d3d_hf.modeling.options_d3d import D3DGenerationOptions
from d3d_hf.modeling.patches_d3d import Patches, apply_fast_paths

from d3d_hf import D3DCache, D3DForDiffusionDrafting


def _drafter():
    torch.manual_seed(0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(tiny_target("llama"), block_size=6)
    drafter.add_block_adapter(rank=4, alpha=8.0)
    for name, param in drafter.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.2)
    drafter.config._attn_implementation = "sdpa"
    return drafter.eval()


def _instance_state(drafter, target):
    """What a patch could leave behind: every module's own attributes, and both configs' attention."""
    state = {name: dict(vars(module)) for name, module in drafter.named_modules()}
    state.update({f"target.{name}": dict(vars(module)) for name, module in target.named_modules()})
    return state, drafter.config._attn_implementation, target.config._attn_implementation


def _pass(drafter, ids):
    with torch.no_grad():
        return drafter.draft_logits(ids, D3DCache(), num_masks=4)


def test_apply_fast_paths_routes_the_drafter_and_undo_restores_the_plain_path_exactly():
    drafter, target = _drafter(), tiny_target("llama", seed=1)
    ids = random_prompt(9)
    plain = _pass(drafter, ids)
    before = _instance_state(drafter, target)
    handle = apply_fast_paths(drafter, target)
    attention = drafter.model.layers[0].self_attn
    assert "forward" in vars(attention.q_proj) and "forward" in vars(drafter.lm_head), "routed from outside"
    assert drafter.config._attn_implementation == target.config._attn_implementation == fast_paths.GQA_SDPA
    fast = _pass(drafter, ids)
    assert "fused_projections" in drafter.model.fast_path_settings.caches["layers.0.self_attn.q_proj"]
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    handle.undo()
    assert _instance_state(drafter, target) == before, "no attribute of a module or config is left behind"
    assert torch.equal(_pass(drafter, ids), plain), "the plain path again, bit for bit"
    handle.undo()  # idempotent


def test_apply_fast_paths_twice_is_idempotent_and_the_first_handle_restores():
    drafter, target = _drafter(), tiny_target("llama", seed=1)
    before = _instance_state(drafter, target)
    with apply_fast_paths(drafter, target) as first:
        routed = dict(vars(drafter.model.layers[0].mlp.gate_proj))
        with apply_fast_paths(drafter, target) as second:
            assert second is not first
            assert dict(vars(drafter.model.layers[0].mlp.gate_proj)) == routed, "not routed a second time"
        assert "forward" in vars(drafter.model.layers[0].mlp.gate_proj), "the inner handle undid nothing"
        assert target.config._attn_implementation == fast_paths.GQA_SDPA
    assert _instance_state(drafter, target) == before
    with pytest.raises(RuntimeError, match="inside"), apply_fast_paths(drafter, target):
        raise RuntimeError("inside")
    assert _instance_state(drafter, target) == before, "undone after an exception too"


def test_patches_restore_own_values_class_attributes_and_properties():
    module = torch.nn.Linear(2, 2)
    own = lambda x: x  # noqa: E731
    module.forward = own
    config = tiny_target("llama").config
    config._attn_implementation = "eager"
    with Patches() as patches:
        patches.set(module, "forward", lambda x: 2 * x)
        patches.set(module, "flag", True)
        patches.set(config, "_attn_implementation", "sdpa")
        assert config._attn_implementation == "sdpa" and module.flag
    assert module.forward is own and "flag" not in vars(module) and config._attn_implementation == "eager"


def test_generate_leaves_no_patch_behind():
    target = tiny_target("llama", seed=3)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    before = _instance_state(drafter, target)
    ids = random_prompt(8, seed=7)
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                    max_new_tokens=8, d3d_num_drafts=3)  # fmt: skip
    after = _instance_state(drafter, target)
    assert after[1:] == before[1:]
    assert all("forward" not in a for a in after[0].values()) and "fast_paths_applied" not in vars(drafter.model)


EXPERIMENTS = [
    {"d3d_target_matmul_layouts": True},
    {"d3d_draft_passes": False},
    {"d3d_share_target_cache": False},
    {"d3d_decoding_loop": "transformers"},
    {"d3d_worker_threads": 1},
]


@pytest.mark.parametrize("option", EXPERIMENTS, ids=lambda o: next(iter(o)))
def test_an_experiment_without_the_library_is_refused_saying_to_install_it(monkeypatch, option):
    D3DGenerationOptions.resolve(**option)  # d3d-hf is installed: offered through its entry points
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        options_d3d,
        "entry_points",
        lambda group=None, **kw: [] if group == options_d3d.EXPERIMENTS_GROUP else real(group=group, **kw),
    )
    with pytest.raises(ValueError, match="install the d3d-hf library") as error:
        D3DGenerationOptions.resolve(**option)
    assert next(iter(option)) in str(error.value)
    default = {"d3d_target_matmul_layouts": False, "d3d_draft_passes": True, "d3d_share_target_cache": True,
               "d3d_decoding_loop": "d3d"}  # fmt: skip
    name = next(iter(option))
    if name in default:  # the default value asks for no experiment
        D3DGenerationOptions.resolve(**{name: default[name]})


def test_asynchronous_drafting_on_cpu_without_the_library_is_refused(monkeypatch):
    """The CPU worker thread of `d3d_async=True` is the library's (`d3d_hf.experiments.cpu_worker`)."""
    real = importlib.metadata.entry_points
    monkeypatch.setattr(
        options_d3d,
        "entry_points",
        lambda group=None, **kw: [] if group == options_d3d.EXPERIMENTS_GROUP else real(group=group, **kw),
    )
    from d3d_hf.modeling import generation_d3d

    monkeypatch.setattr(generation_d3d, "_WARNED", set())  # the CPU warning is given once per process
    target = tiny_target("llama", seed=3)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    ids = random_prompt(6)
    with (
        pytest.warns(UserWarning, match="d3d_async=True on CPU"),
        pytest.raises(ValueError, match="install the d3d-hf library"),
    ):
        target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                        max_new_tokens=4, d3d_async=True, d3d_num_drafts=3)  # fmt: skip
