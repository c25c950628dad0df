"""Matmul layouts chosen by timing (`MatmulLayouts`, `D3DModel.autotune_matmuls`; d3d-hf issue 14): both layouts
give `nn.functional.linear`'s values, the faster one (by the clock) is kept per key, and draft passes (under
`apply_fast_paths`), the LM head and the cost calibration use it only where they should."""

import d3d_hf.modeling.calibration_d3d as calibration_d3d
import d3d_hf.modeling.fast_paths_d3d as fast_paths
import pytest
import torch
from _tiny import random_prompt, tiny_target
from d3d_hf.modeling.fast_paths_d3d import MatmulLayouts
from d3d_hf.modeling.patches_d3d import apply_fast_paths

from d3d_hf import D3DCache, D3DForDiffusionDrafting
from d3d_hf.experiments import target_matmul_layouts


class ScriptedLayouts(MatmulLayouts):
    """A `MatmulLayouts` whose clock advances by a fixed cost per layout run (no real timing)."""

    def __init__(self, costs, **kwargs):
        super().__init__(clock=lambda: self.now, **kwargs)
        self.now, self.costs, self.ran = 0.0, costs, []

    def _run(self, layout, x, weight, bias):
        self.now += self.costs[layout]
        self.ran.append(layout)
        return super()._run(layout, x, weight, bias)


@pytest.mark.parametrize("layout", MatmulLayouts.LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_both_layouts_give_linear_values(layout, bias):
    torch.manual_seed(0)
    x, weight = torch.randn(5, 16), torch.randn(24, 16)
    b = torch.randn(24) if bias else None
    out = MatmulLayouts()._run(layout, x, weight, b)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b))
    assert out.is_contiguous(), "what reads the result next may need contiguous rows (SDPA's flash kernel)"


@pytest.mark.parametrize("faster", MatmulLayouts.LAYOUTS)
def test_the_faster_layout_is_chosen_per_key_and_kept(faster):
    slower = next(layout for layout in MatmulLayouts.LAYOUTS if layout != faster)
    layouts = ScriptedLayouts({faster: 1.0, slower: 3.0}, samples=2)
    weight, bias = torch.randn(8, 6), torch.randn(8)
    x = torch.randn(1, 3, 6)  # 3 rows in a 3-D input
    with torch.no_grad():
        for _ in range(6):  # 1 + 2 timed calls of each layout, alternating (the first of each is not counted)
            out = layouts.linear(x, weight, bias)
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
            assert out.shape == (1, 3, 8)
        assert sorted(layouts.ran) == sorted([faster, slower] * 3) and layouts.settled()
        key = ((8, 6), 3, torch.float32, True, torch.get_num_threads())
        assert layouts.choices == {key: faster}
        layouts.ran.clear()
        for _ in range(3):
            layouts.linear(x, weight, bias)
        assert slower not in layouts.ran, "once chosen, only the faster layout runs"
        if faster == "W x^T":  # (a chosen `x W^T` calls `nn.functional.linear` directly)
            assert layouts.ran == [faster] * 3
        layouts.linear(torch.randn(2, 6), weight, bias)  # another row count is another key, timed afresh
        assert not layouts.settled() and len(layouts.choices) == 1


@pytest.mark.parametrize("disturbed_call", [0, 2, 4])
def test_medians_decide_not_a_single_slow_call(disturbed_call):
    layouts = ScriptedLayouts({"x W^T": 1.0, "W x^T": 2.0}, samples=3)
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    with torch.no_grad():
        for call in range(8):  # x W^T runs at the even calls
            layouts.costs["x W^T"] = 50.0 if call == disturbed_call else 1.0  # e.g. a page fault, a kernel build
            layouts.linear(x, weight)
    assert set(layouts.choices.values()) == {"x W^T"}


def test_first_call_of_each_layout_is_not_counted():
    layouts = ScriptedLayouts({"x W^T": 1.0, "W x^T": 2.0}, samples=1)
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    with torch.no_grad():
        layouts.costs["x W^T"] = 9.0  # its first call pays a one-time cost
        layouts.linear(x, weight)
        layouts.costs["x W^T"] = 1.0
        for _ in range(3):
            layouts.linear(x, weight)
    assert set(layouts.choices.values()) == {"x W^T"}


@pytest.mark.parametrize(("swapped_cost", "chosen"), [(0.95, "x W^T"), (0.85, "W x^T")])
def test_nn_linear_layout_is_kept_unless_the_other_is_clearly_faster(swapped_cost, chosen):
    layouts = ScriptedLayouts({"x W^T": 1.0, "W x^T": swapped_cost}, samples=2)  # margin 0.1 by default
    weight, x = torch.randn(4, 4), torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(6):
            layouts.linear(x, weight)
    assert set(layouts.choices.values()) == {chosen}


def test_layouts_are_not_timed_under_autograd_or_for_many_rows():
    layouts = ScriptedLayouts({"x W^T": 1.0, "W x^T": 1.0}, max_rows=4)
    weight = torch.randn(3, 5, requires_grad=True)
    out = layouts.linear(torch.randn(2, 5), weight)  # grad enabled: training runs nn.functional.linear
    assert out.requires_grad
    with torch.no_grad():
        layouts.linear(torch.randn(5, 5), weight)  # more than max_rows rows
    assert layouts.ran == [] and layouts.choices == {} and layouts.settled()


def _drafter():
    torch.manual_seed(0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(tiny_target("qwen3"), block_size=6)
    drafter.add_block_adapter(rank=4, alpha=8.0)
    for name, param in drafter.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.2)
    return drafter.eval()


@pytest.mark.parametrize("fused_projections", [False, True])
def test_draft_passes_run_on_the_chosen_layouts_and_the_option_turns_them_off(monkeypatch, fused_projections):
    drafter = _drafter()
    drafter.model.fused_projections = fused_projections
    assert drafter.model.autotune_matmuls is True, "on by default"
    ids = random_prompt(7)
    monkeypatch.setattr(fast_paths, "MATMUL_LAYOUTS", MatmulLayouts())
    drafter.model.autotune_matmuls = False
    reference = drafter.draft_logits(ids, D3DCache(), num_masks=3)
    assert fast_paths.MATMUL_LAYOUTS.choices == {} and fast_paths.MATMUL_LAYOUTS.settled()
    drafter.model.autotune_matmuls = True
    with apply_fast_paths(drafter):
        for _ in range(8):
            out = drafter.draft_logits(ids, D3DCache(), num_masks=3)
            torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
        mark = fast_paths.layout_mark()
        drafter.draft_logits(ids, D3DCache(), num_masks=3)
    assert not mark.timed() and fast_paths.MATMUL_LAYOUTS.settled()
    shapes = {key[0] for key in fast_paths.MATMUL_LAYOUTS.choices}
    config = drafter.config
    assert (config.vocab_size, config.hidden_size) in shapes, "the LM head's matmul"
    if fused_projections:  # q/k/v in one weight with the adapters' A rows below
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        assert (q + 2 * kv + 3 * 4, config.hidden_size) in shapes
    else:
        assert (config.intermediate_size, config.hidden_size) in shapes, "gate/up on the shared weights"
    assert {key[1] for key in fast_paths.MATMUL_LAYOUTS.choices} == {7 + 3, 3 + 1}, "the pass's rows, the logits' rows"
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="autotune_matmuls"):
            drafter.model.autotune_matmuls = bad


def test_cost_calibration_times_draft_passes_after_the_layouts_are_chosen(monkeypatch):
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    monkeypatch.setattr(fast_paths, "MATMUL_LAYOUTS", MatmulLayouts(samples=3))
    calibration_d3d.measure_cost_curves(target, drafter, rows=(2, 3), context_length=8, repeats=1)
    pending = {key[1] for key in fast_paths.MATMUL_LAYOUTS._trials}
    assert not pending & {2, 3}, "the timed passes (1 + 1 or 1 + 2 rows, as many logits) ran on chosen layouts"
    assert {2, 3} <= {key[1] for key in fast_paths.MATMUL_LAYOUTS.choices}
    assert pending <= {8, 1}, "the prefill's keys (8 rows, 1 row of logits), run once, may stay untimed"


def test_drafters_without_adapters_and_passes_without_masks_run_on_chosen_layouts_too(monkeypatch):
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4).eval()  # no block adapters
    monkeypatch.setattr(fast_paths, "MATMUL_LAYOUTS", MatmulLayouts(samples=1))
    ids = random_prompt(5)
    with torch.no_grad():
        reference = target(ids).logits[:, -1]
    with apply_fast_paths(drafter):
        out = drafter.draft_logits(ids, D3DCache(), num_masks=0)[:, -1]  # no masks: the committed rows only
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    config = drafter.config
    layouts = fast_paths.MATMUL_LAYOUTS
    seen = {key[:2] for key in [*layouts.choices, *layouts._trials]}
    assert ((config.intermediate_size, config.hidden_size), 5) in seen


def _greedy(target, ids, drafter=None, max_new_tokens=24, **options):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, **options)
    return target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, generation_config=config)


def test_target_matmul_layouts_route_the_targets_linears_and_restore_them(monkeypatch):
    target = tiny_target("llama").eval()
    monkeypatch.setattr(fast_paths, "MATMUL_LAYOUTS", MatmulLayouts())
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear]
    own = linears[0]
    own.forward = lambda x: torch.nn.functional.linear(x, own.weight, own.bias)  # e.g. an accelerate hook
    with torch.no_grad(), target_matmul_layouts(target) as routed:
        assert routed == linears[1:], "modules with an instance-level forward are left alone"
        target(random_prompt(1))  # one row: nn.Linear's own call, untimed
        assert fast_paths.MATMUL_LAYOUTS.choices == {} and fast_paths.MATMUL_LAYOUTS.settled()
        out = target(random_prompt(3)).logits
    config = target.config
    shapes = {key[0] for key in [*fast_paths.MATMUL_LAYOUTS.choices, *fast_paths.MATMUL_LAYOUTS._trials]}
    assert {(config.vocab_size, config.hidden_size), (config.intermediate_size, config.hidden_size)} <= shapes
    assert all("forward" not in m.__dict__ for m in linears[1:]) and "forward" in own.__dict__
    with torch.no_grad():
        reference = target(random_prompt(3)).logits
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="inside"):
        with target_matmul_layouts(target):
            raise RuntimeError("inside")
    assert all("forward" not in m.__dict__ for m in linears[1:]), "restored after an exception too"


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_with_the_targets_matmul_layouts_is_the_targets_own(monkeypatch, family):
    target = tiny_target(family, sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    monkeypatch.setattr(fast_paths, "MATMUL_LAYOUTS", MatmulLayouts(samples=1))
    for seed in range(3):
        ids = random_prompt(6 + 3 * seed, seed=seed)
        reference = _greedy(target, ids)
        out = _greedy(target, ids, drafter, d3d_target_matmul_layouts=True, d3d_num_drafts=3)
        assert torch.equal(out, reference), seed
        assert drafter.last_generation_stats.target_matmul_layouts
    assert all("forward" not in m.__dict__ for m in target.modules()), "the target is restored after generate"
    routed = []  # the calibration is done: every target forward of this call is a verification (or the prefill)
    hook = target.lm_head.register_forward_pre_hook(lambda module, args: routed.append("forward" in module.__dict__))
    _greedy(target, random_prompt(8, seed=5), drafter, d3d_target_matmul_layouts=True, d3d_num_drafts=3)
    hook.remove()
    assert routed and all(routed), "the decoding loop's target forwards ran on the layouts"
    shapes = {key[0] for key in [*fast_paths.MATMUL_LAYOUTS.choices, *fast_paths.MATMUL_LAYOUTS._trials]}
    assert (target.config.vocab_size, target.config.hidden_size) in shapes, "the verification ran on the layouts"
    _greedy(target, random_prompt(6), drafter, d3d_num_drafts=3)
    assert not drafter.last_generation_stats.target_matmul_layouts, "off by default"


@pytest.mark.parametrize(
    "options",
    [
        {"d3d_target_matmul_layouts": "yes"},
        {"d3d_target_matmul_layouts": True, "d3d_decoding_loop": "transformers"},
        {"d3d_target_matmul_layouts": True, "d3d_async": True, "d3d_num_drafts": "full"},
    ],
)
def test_target_matmul_layouts_option_errors(options):
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    with pytest.raises(ValueError, match="d3d_target_matmul_layouts"):
        _greedy(target, random_prompt(), drafter, **options)


ONEDNN_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
packed_layout = pytest.mark.skipif(
    not ONEDNN_BF16, reason="oneDNN has no native bfloat16 on this CPU (then the packed layout is never a candidate)"
)


def test_packed_layout_is_a_candidate_only_for_half_precision_on_onednn():
    assert MatmulLayouts.candidates(torch.float32) == MatmulLayouts.LAYOUTS
    assert MatmulLayouts.candidates(torch.float64) == MatmulLayouts.LAYOUTS
    with_packed = (*MatmulLayouts.LAYOUTS, MatmulLayouts.PACKED)
    assert MatmulLayouts.candidates(torch.bfloat16) == (with_packed if ONEDNN_BF16 else MatmulLayouts.LAYOUTS)


@packed_layout
def test_a_packed_copy_is_kept_while_another_row_count_still_times_it():
    layouts = ScriptedLayouts({"x W^T": 1.0, "W x^T": 1.5, MatmulLayouts.PACKED: 2.0}, samples=1)
    weight = torch.randn(12, 6, dtype=torch.bfloat16)
    two, three = torch.randn(2, 6, dtype=torch.bfloat16), torch.randn(3, 6, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):  # 3 rows: x W^T, W x^T, packed (one call each so far)
            layouts.linear(three, weight)
        for _ in range(6):  # 2 rows: timed to the end, packed rejected
            layouts.linear(two, weight)
        assert len(layouts.choices) == 1 and not layouts.settled()
        assert layouts.packed_bytes > 0, "3 rows are still timing the packed layout"
        for _ in range(3):
            layouts.linear(three, weight)
    assert layouts.settled() and layouts.packed_bytes == 0


@packed_layout
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layout_gives_linear_values_exactly(bias):
    torch.manual_seed(0)
    layouts = MatmulLayouts()
    weight = torch.randn(40, 24, dtype=torch.bfloat16)
    b = torch.randn(40, dtype=torch.bfloat16) if bias else None
    for rows in (1, 3, 8):
        x = torch.randn(rows, 30, dtype=torch.bfloat16)[:, 3:27]  # a strided view, as the block rows are
        out = layouts._run(MatmulLayouts.PACKED, x, weight, b)
        # oneDNN's own x W^T kernel without the per-call weight reorder: the same bits as nn.Linear
        assert torch.equal(out, torch.nn.functional.linear(x, weight, b))
        assert out.is_contiguous() and out.dtype == torch.bfloat16
    assert layouts.packed_bytes == weight.numel() * 2, "one packed copy per weight, reused"


@packed_layout
def test_packed_weight_follows_changes_to_its_weight_and_dies_with_it():
    layouts = MatmulLayouts()
    weight = torch.randn(16, 8, dtype=torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    first = layouts.packed_weight(weight)
    assert layouts.packed_weight(weight) is first
    weight.mul_(2.0)  # an in-place edit (an optimiser step, a merged adapter)
    assert layouts.packed_weight(weight) is not first
    assert torch.equal(layouts._run(MatmulLayouts.PACKED, x, weight, None), torch.nn.functional.linear(x, weight))
    with torch.inference_mode():
        frozen = torch.randn(16, 8, dtype=torch.bfloat16)
    assert layouts.packed_weight(frozen) is layouts.packed_weight(frozen), "inference tensors: keyed by storage"
    del weight, frozen
    assert layouts.packed_bytes == 0, "a packed copy does not outlive its weight"


@packed_layout
@pytest.mark.parametrize("packed_cost", [0.5, 2.0])
def test_packed_layout_is_timed_with_the_others_and_its_copies_are_freed_unless_chosen(packed_cost):
    layouts = ScriptedLayouts({"x W^T": 1.0, "W x^T": 1.5, MatmulLayouts.PACKED: packed_cost}, samples=2)
    weights = [torch.randn(12, 6, dtype=torch.bfloat16) for _ in range(2)]  # e.g. two layers' q/k/v
    x = torch.randn(3, 6, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(9):  # 1 + 2 timed calls of each of the 3 layouts, in turn
            for weight in weights:
                torch.testing.assert_close(layouts.linear(x, weight), torch.nn.functional.linear(x, weight))
    assert layouts.settled() and layouts.ran.count(MatmulLayouts.PACKED) >= 3
    chosen = MatmulLayouts.PACKED if packed_cost < 1.0 else "x W^T"
    assert set(layouts.choices.values()) == {chosen}
    # a chosen packed layout keeps both layers' copies; a rejected one leaves no memory behind
    assert layouts.packed_bytes == (2 * weights[0].numel() * 2 if chosen == MatmulLayouts.PACKED else 0)


@packed_layout
@pytest.mark.parametrize("fused_projections", [False, True])
def test_bfloat16_draft_passes_on_packed_weights_match_nn_linear(monkeypatch, fused_projections):
    drafter = _drafter().to(torch.bfloat16)
    drafter.model.fused_projections = fused_projections
    ids = random_prompt(7)
    drafter.model.autotune_matmuls = False
    with apply_fast_paths(drafter):  # the same paths with `nn.functional.linear`
        reference = drafter.draft_logits(ids, D3DCache(), num_masks=3)
    drafter.model.autotune_matmuls = True
    layouts = ScriptedLayouts({"x W^T": 1.0, "W x^T": 1.0, MatmulLayouts.PACKED: 0.5})
    monkeypatch.setattr(fast_paths, "MATMUL_LAYOUTS", layouts)
    with apply_fast_paths(drafter):
        for _ in range(12):
            out = drafter.draft_logits(ids, D3DCache(), num_masks=3)
            torch.testing.assert_close(out, reference, rtol=2e-2, atol=2e-2)  # W x^T rounds differently in bfloat16
        assert layouts.settled() and set(layouts.choices.values()) == {MatmulLayouts.PACKED}
        layouts.ran.clear()
        out = drafter.draft_logits(ids, D3DCache(), num_masks=3)
    assert set(layouts.ran) == {MatmulLayouts.PACKED}
    assert torch.equal(out, reference), "packed weights: nn.Linear's bits"
    assert layouts.packed_bytes > 0
    drafter.model.autotune_matmuls = False
    assert layouts.packed_bytes == 0, "turning the layouts off frees the model's packed copies (the LM head's too)"


@packed_layout
def test_packing_a_weight_is_not_counted_in_the_packed_layouts_time():
    class CostlyPacking(ScriptedLayouts):
        def packed_weight(self, weight):
            if weight not in self._packed:
                self.now += 100.0  # a reorder per weight: one-time, and a key runs many weights (every layer's)
            return super().packed_weight(weight)

    layouts = CostlyPacking({"x W^T": 1.0, "W x^T": 1.5, MatmulLayouts.PACKED: 0.5}, samples=2)
    weights = [torch.randn(12, 6, dtype=torch.bfloat16) for _ in range(4)]  # four layers, one key
    x = torch.randn(2, 6, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            for weight in weights:
                layouts.linear(x, weight)
    assert set(layouts.choices.values()) == {MatmulLayouts.PACKED}
