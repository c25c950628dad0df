"""The CPU fast paths of the draft pass and the target's verifications (modeling/fast_paths_d3d.py): grouped-query
SDPA without copying keys/values (`gqa_sdpa_attention_forward`, the drafter's `"sdpa"` forwards under
`apply_fast_paths`, the target under `target_gqa_attention`), and the projections' fused inference paths
(`FusedProjections`, `add_block_adapters`) with the `fused_projections` option. `MatmulLayouts` has its own file,
test_matmul_layouts.py; how the paths are applied and undone (modeling/patches_d3d.py), test_patches.py."""

import os

import d3d_hf.modeling.fast_paths_d3d as fast_paths
import d3d_hf.modeling.patches_d3d as patches_d3d
import pytest
import torch
from _tiny import random_prompt, tiny_target
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from d3d_hf import D3DCache, D3DForDiffusionDrafting


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [2, 3])
def test_gqa_sdpa_equals_transformers_sdpa_without_copying_keys(dtype, groups, monkeypatch):
    """Outside autograd on CPU, more than one query row: SDPA runs on the key/value heads (no `repeat_kv` copy) and
    gives transformers' values bit for bit; one row, autograd and float masks go to transformers' function."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, False
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append(k.shape[1]) or sdpa(q, k, v, **kw))
    g = torch.Generator().manual_seed(groups)
    for rows in (1, 2, 5, 16):
        keys = 40 + rows
        q = torch.randn(1, 2 * groups, rows, 16, generator=g).to(dtype)
        kv = torch.randn(2, 1, 2, keys + 3, 16, generator=g).to(dtype)
        k, v = kv[0, :, :, :keys], kv[1, :, :, :keys]  # views, as a cropped cache gives
        mask = torch.rand(1, 1, rows, keys, generator=g) > 0.3
        mask[..., -1] = True
        with torch.no_grad():
            seen.clear()
            got, weights = fast_paths.gqa_sdpa_attention_forward(module, q, k, v, mask, scaling=0.25, is_causal=False)
            assert seen == [2], (rows, seen)  # the key/value heads as they are (one row: transformers' `pack_gqa`)
            want, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, mask, scaling=0.25, is_causal=False)
        assert weights is None and got.shape == (1, rows, 2 * groups, 16) and got.is_contiguous()
        assert torch.equal(got, want), (rows, (got.float() - want.float()).abs().max())
    q.requires_grad_(True)  # 16 rows
    seen.clear()
    fast_paths.gqa_sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert seen == [2 * groups], "with autograd: transformers' function (`repeat_kv`)"


def test_drafter_sdpa_pass_uses_gqa_attention_and_keeps_its_bits(monkeypatch):
    """Under `apply_fast_paths` the drafter's `"sdpa"` forwards run `gqa_sdpa_attention_forward`; its draft logits
    (1 to 6 rows, cached prefix) equal those of its plain path (transformers' SDPA function) bit for bit."""
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=6)
    drafter.config._attn_implementation = "sdpa"
    drafter.model.autotune_matmuls = False
    calls = []
    ours = fast_paths.gqa_sdpa_attention_forward  # the function `switch_attention` registers
    monkeypatch.setattr(fast_paths, "gqa_sdpa_attention_forward", lambda *a, **k: calls.append(1) or ours(*a, **k))
    ids = random_prompt(9)
    cache = D3DCache()

    def passes():  # the anchor ids[:, 8] and 0-5 masks after a cached prefix of 8 tokens
        out = []
        for num_masks in range(6):
            cache.crop(8)
            out.append(drafter.draft_logits(ids[:, 8:], cache, num_masks=num_masks))
        return out

    with torch.no_grad():
        drafter.draft_logits(ids[:, :8], cache, num_masks=0)
        with patches_d3d.apply_fast_paths(drafter):
            assert drafter.config._attn_implementation == fast_paths.GQA_SDPA
            got = passes()
        assert len(calls) == 6 * drafter.config.num_hidden_layers
        assert drafter.config._attn_implementation == "sdpa"
        want = passes()
    assert len(calls) == 6 * drafter.config.num_hidden_layers, "the plain path runs transformers' function"
    for num_masks, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), num_masks


def _forward_over_cache(target, ids, split):
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(ids[:, :split], past_key_values=cache, use_cache=True)
        return target(ids[:, split:], past_key_values=cache, use_cache=True).logits


def test_target_gqa_attention_keeps_the_targets_bits_and_restores_its_config(monkeypatch):
    """`target_gqa_attention`: a GQA target's multi-row forwards over a cache (verifications) run on
    `gqa_sdpa_attention_forward` and give transformers' logits bit for bit; the config is restored, also after an
    exception; eager attention, or no GQA, is left alone."""
    target = tiny_target("llama")
    assert target.config.num_key_value_heads < target.config.num_attention_heads
    ids = random_prompt(14)
    want = {rows: _forward_over_cache(target, ids, 14 - rows) for rows in (1, 2, 5)}
    calls = []
    ours = fast_paths.gqa_sdpa_attention_forward
    monkeypatch.setattr(
        fast_paths, "gqa_sdpa_attention_forward", lambda *a, **k: calls.append(a[1].shape[2]) or ours(*a, **k)
    )
    with patches_d3d.target_gqa_attention(target) as switched:
        assert switched and target.config._attn_implementation == fast_paths.GQA_SDPA
        with patches_d3d.target_gqa_attention(target) as inner:  # nested: still on, and the outer one restores
            assert inner
        assert target.config._attn_implementation == fast_paths.GQA_SDPA
        got = {rows: _forward_over_cache(target, ids, 14 - rows) for rows in (1, 2, 5)}
    assert target.config._attn_implementation == "sdpa"
    assert sorted(set(calls)) == [1, 2, 5, 9, 12, 13], "every forward ran on it"
    for rows in want:
        assert torch.equal(got[rows], want[rows]), rows
    with pytest.raises(RuntimeError, match="inside"):
        with patches_d3d.target_gqa_attention(target):
            raise RuntimeError("inside")
    assert target.config._attn_implementation == "sdpa"
    target.config._attn_implementation = "eager"
    with patches_d3d.target_gqa_attention(target) as switched:
        assert not switched and target.config._attn_implementation == "eager"
    target.config._attn_implementation, target.config.num_key_value_heads = "sdpa", target.config.num_attention_heads
    with patches_d3d.target_gqa_attention(target) as switched:
        assert not switched and target.config._attn_implementation == "sdpa"


def test_d3d_loop_verifies_on_gqa_attention_losslessly():
    """D3D's own loop opens `target_gqa_attention` around the target's forwards (greedy output is the target's own);
    transformers' assisted-generation loop does not."""
    target = tiny_target("llama", seed=3)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    ids = random_prompt(8, seed=7)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    from transformers import GenerationConfig

    for loop, switched in (("d3d", True), ("transformers", False)):
        config = GenerationConfig(do_sample=False, max_new_tokens=16, d3d_decoding_loop=loop, d3d_num_drafts=3)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                              generation_config=config)
        assert out.tolist() == ref.tolist(), loop
        assert drafter.last_generation_stats.target_gqa_attention is switched, loop
        assert target.config._attn_implementation == "sdpa"


def _adapted_drafter(modules=None, seed=0, fused_projections=False, rank=4, bias=False, full_layers=0):
    torch.manual_seed(seed)
    drafter = D3DForDiffusionDrafting.from_autoregressive(tiny_target("qwen3"), block_size=6)
    drafter.add_block_adapter(rank=rank, alpha=8.0, modules=modules, full_layers=full_layers)
    for name, param in drafter.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.2)  # a fresh adapter's B is zero: make it do something
    if bias:  # a Qwen2-style q/k/v bias (and an MLP one) on the same weights
        for layer in drafter.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj):
                proj.bias = torch.nn.Parameter(torch.randn(proj.out_features) * 0.1)
    drafter.model.fused_projections = fused_projections
    return drafter.eval()


def _forward_both_ways(drafter, ids, block_positions):
    with torch.enable_grad():  # the per-projection path (training's)
        ref = drafter(ids, block_positions=block_positions).logits.detach()
    with torch.no_grad(), patches_d3d.apply_fast_paths(drafter):  # the fused inference path
        out = drafter(ids, block_positions=block_positions).logits
    return out, ref


def _group_cache(drafter, group):
    """The derived weights of layer 0's projection group named by its first projection (`q_proj`, `o_proj`, ...)."""
    parent = "self_attn" if group in ("q_proj", "o_proj") else "mlp"
    return drafter.model.fast_path_settings.caches.get(f"layers.0.{parent}.{group}", {})


@pytest.mark.parametrize("fused_projections", [False, True])
@pytest.mark.parametrize("modules", [None, ["q_proj", "v_proj", "down_proj"], ["up_proj"]])
@pytest.mark.parametrize("layout", ["suffix", "scattered", "batch"])
def test_fused_block_adapters_equal_the_per_projection_adapters(modules, layout, fused_projections):
    drafter = _adapted_drafter(modules, fused_projections=fused_projections, bias=modules is None)
    ids = random_prompt(10)
    block = torch.zeros(1, 10, dtype=torch.bool)
    if layout == "suffix":  # a synchronous draft pass: committed rows, then the block
        block[:, 4:] = True
    else:  # a packed pass: blocks between unadapted rows
        block[:, [2, 3, 6, 7, 8]] = True
    if layout == "batch":
        ids, block = torch.cat([ids, ids.flip(1)]), torch.cat([block, block.flip(1)])
    out, ref = _forward_both_ways(drafter, ids, block)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    plain = drafter(ids).logits.detach()  # no block rows: no adapter
    assert not torch.allclose(out, plain, atol=1e-3), "the adapters must change the block rows"
    ran = "fused_projections" if fused_projections else "key"
    assert (ran in _group_cache(drafter, "q_proj")) == (modules is None or "q_proj" in modules), "the fused path ran"
    assert (ran in _group_cache(drafter, "down_proj")) == (modules is None or "down_proj" in modules)
    assert (ran in _group_cache(drafter, "gate_proj")) == (modules is None or "up_proj" in modules)


@pytest.mark.parametrize("fused_projections", [False, True])
@pytest.mark.parametrize("layout", ["suffix", "batch"])
def test_fused_block_adapters_with_full_rank_last_layers(layout, fused_projections):
    """`block_lora_full_layers`: the last layer's adapters have full rank, which differs by projection (q/o/gate/up/
    down min(in, out), k/v the key-value width); the fused paths stack them at their own offsets."""
    drafter = _adapted_drafter(fused_projections=fused_projections, full_layers=1)
    last, first = drafter.model.layers[-1], drafter.model.layers[0]
    attn = last.self_attn
    assert attn.q_proj.rank == min(attn.q_proj.in_features, attn.q_proj.out_features)
    assert attn.k_proj.rank == attn.k_proj.out_features < attn.q_proj.rank  # ranks differ within the q/k/v group
    assert first.self_attn.q_proj.rank == 4 and first.mlp.down_proj.rank == 4
    assert attn.q_proj.lora_scaling == first.self_attn.q_proj.lora_scaling == 8.0 / 4  # one scale for all
    ids, block = random_prompt(10), torch.zeros(1, 10, dtype=torch.bool)
    block[:, 4:] = True
    if layout == "batch":
        ids, block = torch.cat([ids, ids.flip(1)]), torch.cat([block, block.flip(1)])
    out, ref = _forward_both_ways(drafter, ids, block)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused_projections", [False, True])
def test_fused_block_adapters_follow_weight_updates(fused_projections):
    drafter = _adapted_drafter(fused_projections=fused_projections)
    ids, block = random_prompt(8), torch.zeros(1, 8, dtype=torch.bool)
    block[:, 3:] = True
    before, _ = _forward_both_ways(drafter, ids, block)
    with torch.no_grad():
        for layer in drafter.model.layers:  # in place, as an optimiser step does
            layer.self_attn.k_proj.lora_A.mul_(3.0)
            layer.mlp.gate_proj.lora_B.add_(0.1)
            layer.mlp.down_proj.weight.mul_(0.5)  # a base weight too (the fused projections copy it)
    after, ref = _forward_both_ways(drafter, ids, block)
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before, atol=1e-3)
    # a draft pass without masks has no block rows: identical to the unadapted model's last-row logits
    cache = D3DCache()
    plain = drafter(ids).logits[:, -1].detach()
    torch.testing.assert_close(drafter.draft_logits(ids, cache, num_masks=0)[:, -1], plain)


def test_fused_projections_option_memory_and_errors(monkeypatch):
    drafter = _adapted_drafter(fused_projections="auto")  # the default: on CPU, fused
    assert D3DForDiffusionDrafting(drafter.config).model.fused_projections == "auto"
    ids, block = random_prompt(8), torch.zeros(1, 8, dtype=torch.bool)
    block[:, 3:] = True
    with torch.no_grad(), patches_d3d.apply_fast_paths(drafter):
        fused = drafter(ids, block_positions=block).logits
        layer_bytes = sum(p.numel() * p.element_size() for n, p in drafter.model.layers.named_parameters())
        held = drafter.model.fast_path_settings.fused_projections_bytes()
        assert layer_bytes - 1024 < held < 2 * layer_bytes, "one more copy of the layers' weights (plus B blocks)"
        drafter.model.fused_projections = False  # frees the copy, same values by the other path
        assert drafter.model.fast_path_settings.fused_projections_bytes() == 0
        torch.testing.assert_close(drafter(ids, block_positions=block).logits, fused, rtol=1e-5, atol=1e-5)
        assert drafter.model.fast_path_settings.fused_projections_bytes() == 0
        drafter(ids)  # a forward without block rows never builds them
        drafter.model.fused_projections = True
        drafter(ids)
        assert drafter.model.fast_path_settings.fused_projections_bytes() == 0
    monkeypatch.setattr(os, "sysconf", lambda name: 1000 if name == "SC_PHYS_PAGES" else 4096)  # a 4 MB machine
    drafter.model.fused_projections, drafter.model.fast_path_settings._auto_fused_decision = "auto", None
    with torch.no_grad(), patches_d3d.apply_fast_paths(drafter):
        drafter(ids, block_positions=block)
    assert drafter.model.fast_path_settings.fused_projections_bytes() == 0, "'auto' keeps off a copy that would not fit"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="'auto', True or False"):
            drafter.model.fused_projections = bad
    with torch.enable_grad(), patches_d3d.apply_fast_paths(drafter):  # training never uses them
        drafter(ids, block_positions=block).logits.sum().backward()
    assert drafter.model.fast_path_settings.fused_projections_bytes() == 0


def test_auto_fused_projections_count_the_packed_copy_in_half_precision(monkeypatch):
    model = _adapted_drafter(fused_projections="auto").model
    layer_bytes = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    page = 4096
    # 10% of this machine's memory holds 1.5 copies of the layers' weights
    monkeypatch.setattr(os, "sysconf", lambda name: int(15 * layer_bytes / page) if name == "SC_PHYS_PAGES" else page)
    cpu = torch.device("cpu")
    settings = model.fast_path_settings
    assert settings.auto_fused(model, cpu), "float32: one copy, it fits"
    layouts = fast_paths.MatmulLayouts
    monkeypatch.setattr(layouts, "candidates", staticmethod(lambda dtype: (*layouts.LAYOUTS, "packed")))
    model.to(torch.bfloat16)  # bfloat16 halves the layers' bytes: make 10% hold 1.5 bfloat16 copies again
    monkeypatch.setattr(os, "sysconf", lambda name: int(7.5 * layer_bytes / page) if name == "SC_PHYS_PAGES" else page)
    assert not settings.auto_fused(model, cpu), "fused copy + its packed copy do not fit"
    model.autotune_matmuls = False
    assert settings.auto_fused(model, cpu), "no layouts, no packed copy: the fused copy fits"


def test_drafter_made_under_inference_mode_drafts():
    """Inference tensors keep no version counter: the derived-weight caches must not need one."""
    with torch.inference_mode():
        drafter = _adapted_drafter(fused_projections=True)
        patches_d3d.apply_fast_paths(drafter)  # left applied: the drafter is this test's own
        cache = D3DCache()
        fused = drafter.draft_logits(random_prompt(6), cache, num_masks=3)
        drafter.model.fused_projections = False
        cache = D3DCache()
        torch.testing.assert_close(drafter.draft_logits(random_prompt(6), cache, num_masks=3), fused)
