"""The cost-aware engine inside `D3DCandidateGenerator` (modeling/generation_d3d.py with modeling/policy_d3d.py):
rounds from the drafter, from prompt lookup and plain target steps mixed in one call stay lossless (greedy and
sampling), the policy steps aside when drafting cannot pay, calibrations are keyed, cached and reused."""

from __future__ import annotations

import warnings

import pytest
import torch
from _tiny import chi_square_p_value, random_prompt, tiny_target
from d3d_hf.modeling import calibration_d3d
from d3d_hf.modeling.estimates_d3d import CostCurve
from d3d_hf.modeling.policy_d3d import DraftPolicy, RoundDecision
from transformers import GenerationConfig

from d3d_hf import D3DForDiffusionDrafting


@pytest.fixture(autouse=True)
def _fresh_policies(monkeypatch):
    """Every test starts with no calibrated policy in memory (a new process)."""
    monkeypatch.setattr(calibration_d3d, "_POLICIES", {})


class AlternatingPolicy(DraftPolicy):
    """Cycles target step -> lookup (when a match exists) -> drafter, so that one call mixes every source."""

    def __init__(self, max_drafts: int):
        super().__init__(CostCurve({1: 1.0}), CostCurve({1: 1.0}), max_drafts=max_drafts)
        self.calls = 0

    def decide(self, num_pending, lookup_tokens=0, max_candidates=None, lookup_ngram_size=None):
        self.calls += 1
        limit = self.max_drafts if max_candidates is None else min(self.max_drafts, max_candidates)
        turn = self.calls % 3
        if turn == 1 and lookup_tokens:
            return RoundDecision("lookup", num_lookup=min(lookup_tokens, limit), num_pending=num_pending)
        if turn == 2 or limit == 0:
            return RoundDecision("target", num_pending=num_pending)
        return RoundDecision("drafter", num_masks=limit, num_pending=num_pending, explore=True)


def _greedy(target, ids, drafter=None, max_new_tokens=40, **options):
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, **options)
    return target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, generation_config=config)


def _repetitive_prompt(seed: int = 0) -> torch.LongTensor:
    """A prompt with repeated n-grams, so that prompt lookup finds matches."""
    piece = random_prompt(6, seed=seed)
    return torch.cat([piece, piece, piece[:, :3]], dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_sources_greedy_is_lossless(family):
    target = tiny_target(family, sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    drafter.draft_policy = AlternatingPolicy(drafter.config.block_size - 1)
    for seed in range(3):
        ids = _repetitive_prompt(seed)
        assert torch.equal(_greedy(target, ids, drafter), _greedy(target, ids))
        stats = drafter.last_generation_stats
        assert {"target", "lookup", "drafter"} <= set(stats.round_sources), stats.round_sources
        assert len(stats.round_sources) == len(stats.round_candidates) == stats.rounds
        assert sum(stats.round_candidates) == stats.drafted_tokens
        assert stats.policy == "adaptive"


def test_measured_policy_is_lossless_and_records_its_curves():
    """The real adaptive policy (curves measured on first use) on a tiny target: output identical to the target's,
    every round planned, the curves the call decided with recorded."""
    target = tiny_target("llama", sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=8)
    for seed in range(2):
        ids = _repetitive_prompt(seed)
        assert torch.equal(_greedy(target, ids, drafter, max_new_tokens=30), _greedy(target, ids, max_new_tokens=30))
        stats = drafter.last_generation_stats
        assert len(stats.round_sources) == stats.rounds
        assert set(stats.cost_curves_ms) == {"verify", "draft"} and stats.cost_curves_ms["verify"][1] > 0


def test_mixed_sources_sampling_preserves_the_target_distribution():
    """Chi-square goodness of fit of 2-token samples against the exact target law with lookup, drafter and target
    rounds mixed (lookup drafts carry point-mass scores, so speculative sampling stays exact)."""
    from test_generation import _exact_two_token_distribution

    vocab = 8
    target = tiny_target("qwen3", vocab_size=vocab, seed=11, sharpen=10.0)
    target.generation_config.eos_token_id = None
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=1, block_size=4)
    policy = AlternatingPolicy(drafter.config.block_size - 1)
    drafter.draft_policy = policy
    ids = torch.tensor([[3, 5, 4, 3, 5]])  # "3 5" occurred before, followed by 4: lookup proposes 4, 3, 5
    temperature, top_k = 0.9, 6
    exact = _exact_two_token_distribution(target, ids, temperature, top_k).flatten()
    torch.manual_seed(4321)
    n = 1500
    counts = torch.zeros(vocab * vocab)
    sources = {"lookup": 0, "drafter": 0, "target": 0}
    rejected_lookup = 0
    for _ in range(n):
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=drafter,
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            top_p=1.0,
            max_new_tokens=2,
            pad_token_id=0,
        )
        a, b = out[0, -2:].tolist()
        counts[a * vocab + b] += 1
        stats = drafter.last_generation_stats
        for source in stats.round_sources:
            sources[source] += 1
        rejected_lookup += stats.round_sources[0] == "lookup" and stats.accepted_drafts < stats.drafted_tokens
    assert min(sources.values()) > n // 10, sources
    assert rejected_lookup > n // 20, "lookup drafts must be rejected often enough to exercise the residual"
    p_value = chi_square_p_value(counts, exact, n)
    assert p_value > 1e-3, f"p={p_value:.2e}"


def test_engine_takes_plain_target_steps_when_drafting_cannot_pay():
    """A draft pass that costs two target steps and no lookup: every round is a plain target step (after the
    warm-up round), no draft pass after the first."""
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    drafter.draft_policy = DraftPolicy(
        CostCurve({1: 0.05, 16: 0.06}), CostCurve({1: 0.1, 16: 0.12}), max_drafts=3, explore_every=None
    )
    ids = random_prompt(9)
    calls = []
    original = drafter.draft_logits
    drafter.draft_logits = lambda *a, **k: calls.append(1) or original(*a, **k)
    out = _greedy(target, ids, drafter, max_new_tokens=20, d3d_prompt_lookup=False)
    assert torch.equal(out, _greedy(target, ids, max_new_tokens=20))
    sources = drafter.last_generation_stats.round_sources
    assert sources[1:] == ["target"] * (len(sources) - 1) and len(calls) <= 1


def test_engine_drafts_every_round_when_verification_is_free():
    target = tiny_target("llama", sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    drafter.draft_policy = DraftPolicy(CostCurve({1: 0.05, 16: 0.05}), CostCurve({1: 0.001, 64: 0.001}), max_drafts=3)
    ids = random_prompt(9)
    out = _greedy(target, ids, drafter, max_new_tokens=20, d3d_prompt_lookup=False)
    assert torch.equal(out, _greedy(target, ids, max_new_tokens=20))
    stats = drafter.last_generation_stats
    # every round drafts (a plain step only where the length limit leaves no room for a draft)
    assert set(stats.round_sources[:-1]) == {"drafter"} and max(stats.round_candidates) == 3


def test_calibration_is_measured_once_keyed_and_restored_from_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path))  # not a calibration another test stored for this pair
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    measured = []
    real = calibration_d3d.measure_cost_curves

    def counted(*a, **k):  # full calibrations only (not the one-row drift check of a restored one)
        if k.get("rows") is None:
            measured.append(1)
        return real(*a, **k)

    monkeypatch.setattr(calibration_d3d, "measure_cost_curves", counted)
    # a measurement disturbed by other jobs is redone (tested below); here every measurement counts as plausible
    monkeypatch.setattr(calibration_d3d, "_plausible", lambda verify, draft: verify is not None)
    # and the restored curves count as current (a loaded machine can fail the drift check: tested on its own below)
    monkeypatch.setattr(calibration_d3d, "_drifted", lambda *args: False)
    ids = random_prompt(7)
    _greedy(target, ids, drafter, max_new_tokens=8)
    _greedy(target, ids, drafter, max_new_tokens=8)
    assert len(measured) == 1, "one calibration per (target, drafter, dtype, threads, device, CPU)"
    (key,) = calibration_d3d._POLICIES
    assert calibration_d3d.CalibrationStore().load(key) is not None, "the calibration is stored on disk"
    calibration_d3d._POLICIES.clear()  # a new process: the stored state is used, nothing is measured again
    _greedy(target, ids, drafter, max_new_tokens=8)
    assert len(measured) == 1
    # another dtype (or another drafter) is another calibration
    _greedy(target.to(torch.float64), ids, drafter.to(torch.float64), max_new_tokens=8)
    assert len(measured) == 2 and len(calibration_d3d._POLICIES) == 2
    drafter.model.fused_projections = False  # another weight layout of the draft pass costs otherwise
    _greedy(target, ids, drafter, max_new_tokens=8)
    assert len(measured) == 3 and len(calibration_d3d._POLICIES) == 3
    drafter.model.autotune_matmuls = False  # and so do other matmul layouts
    _greedy(target, ids, drafter, max_new_tokens=8)
    assert len(measured) == 4 and len(calibration_d3d._POLICIES) == 4
    _greedy(target, ids, drafter, max_new_tokens=8, d3d_target_matmul_layouts=True)  # and the target's layouts
    assert len(measured) == 5 and len(calibration_d3d._POLICIES) == 5


def test_async_auto_steps_aside_on_cpu_and_true_runs_the_packed_pass():
    """`d3d_async="auto"` (the default) drafts synchronously on CPU and says why; `True` is honoured (the adaptive
    plan it replaces is recorded as an override)."""
    target = tiny_target("llama", sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    ids = random_prompt(9)
    ref = _greedy(target, ids, max_new_tokens=16)
    assert torch.equal(_greedy(target, ids, drafter, max_new_tokens=16), ref)
    stats = drafter.last_generation_stats
    assert not stats.asynchronous and "cpu" in stats.asynchronous_off_reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the once-per-process CPU warning: tests/test_options.py
        out = _greedy(target, ids, drafter, max_new_tokens=16, d3d_async=True)
    assert torch.equal(out, ref)
    stats = drafter.last_generation_stats
    assert stats.asynchronous and stats.hits + stats.reused + stats.misses > 0 and stats.policy == "3"
    assert stats.overrides["d3d_num_drafts"].startswith("adaptive -> full")


@pytest.mark.parametrize("value", ["fast", -1, 4, 1.5, True])
def test_num_drafts_option_is_validated(value):
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    with pytest.raises(ValueError, match="d3d_num_drafts"):
        _greedy(target, random_prompt(), drafter, d3d_num_drafts=value)


def test_fixed_num_drafts_and_lookup_option():
    target = tiny_target("llama", sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    ids = _repetitive_prompt()
    ref = _greedy(target, ids, max_new_tokens=12)
    for k in (0, 1, 3):
        assert torch.equal(_greedy(target, ids, drafter, max_new_tokens=12, d3d_num_drafts=k), ref)
        stats = drafter.last_generation_stats
        assert max(stats.round_candidates) == k and stats.policy == str(k) and "lookup" not in stats.round_sources
    with pytest.raises(ValueError, match="d3d_prompt_lookup"):
        _greedy(target, ids, drafter, d3d_prompt_lookup="yes")


def test_a_disturbed_calibration_is_measured_again_and_a_stored_one_replaced(monkeypatch, tmp_path):
    """A measurement (or a stored state) whose multi-row points cost 20 one-row steps (another job loaded the CPU)
    is redone, and only a plausible one is stored."""
    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path))
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    bad = (CostCurve({1: 0.01, 2: 0.2, 16: 0.3}), CostCurve({1: 0.01, 16: 0.3}))
    good = (CostCurve({1: 0.01, 2: 0.012, 16: 0.02}), CostCurve({1: 0.01, 16: 0.02}))
    results = [bad, good]
    monkeypatch.setattr(calibration_d3d, "measure_cost_curves", lambda *a, **k: results.pop(0))
    policy, key = calibration_d3d.policy_for(target, drafter)
    assert not results and policy.verify_curve(2) == pytest.approx(0.012)
    store = calibration_d3d.CalibrationStore()
    poisoned = DraftPolicy(*bad, max_drafts=3)
    poisoned.save_to(store, key)
    calibration_d3d._POLICIES.clear()
    results[:] = [good]
    policy, _ = calibration_d3d.policy_for(target, drafter)
    assert not results and policy.verify_curve(2) == pytest.approx(0.012)


def test_a_stale_calibration_is_measured_again_at_its_first_use(monkeypatch, tmp_path):
    """A stored calibration is checked by one-row target forwards when a process first uses it: within the margin it
    is kept, beyond it (the machine got slower or faster) the curves are measured again and stored."""
    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path))
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    calls, one_row = [], [0.0]

    def fake(*args, rows=None, **kwargs):
        calls.append("check" if rows == (1,) else "full")
        if rows == (1,):
            return CostCurve({1: one_row[0]}), CostCurve({1: one_row[0]})
        scale = one_row[0] / 0.01 if one_row[0] else 1.0
        return CostCurve({1: 0.01 * scale, 2: 0.012 * scale, 16: 0.02 * scale}), CostCurve({1: 0.01, 16: 0.02})

    monkeypatch.setattr(calibration_d3d, "measure_cost_curves", fake)
    calibration_d3d.policy_for(target, drafter)
    assert calls == ["full"]
    calibration_d3d._POLICIES.clear()  # a new process, the machine as it was: kept
    one_row[0] = 0.0115
    policy, _ = calibration_d3d.policy_for(target, drafter)
    assert calls == ["full", "check"] and policy.verify_curve(1) == pytest.approx(0.01)
    calibration_d3d._POLICIES.clear()  # a new process on a machine twice as slow: measured again and stored
    one_row[0] = 0.02
    policy, key = calibration_d3d.policy_for(target, drafter)
    assert calls == ["full", "check", "check", "full"] and policy.verify_curve(1) == pytest.approx(0.02)
    calibration_d3d._POLICIES.clear()
    policy, _ = calibration_d3d.policy_for(target, drafter)  # the new curves were stored: no drift now
    assert calls[-1] == "check" and policy.verify_curve(1) == pytest.approx(0.02)
    calibration_d3d._POLICIES.clear()
    calibration_d3d.policy_for(target, drafter, drift_margin=None)
    assert calls[-1] == "check" and len(calls) == 5, "no check without a margin"


def test_calibration_key_follows_the_targets_attention(monkeypatch, tmp_path):
    """The verify curve measured with the target on `gqa_sdpa_attention_forward` (D3D's loop) is another key than
    with transformers' `"sdpa"` (e.g. a calibration made outside `target_gqa_attention`)."""
    from d3d_hf.modeling.patches_d3d import target_gqa_attention

    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path))
    target = tiny_target("llama")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    good = (CostCurve({1: 0.01, 2: 0.012, 16: 0.02}), CostCurve({1: 0.01, 16: 0.02}))
    monkeypatch.setattr(calibration_d3d, "measure_cost_curves", lambda *a, **k: good)
    _, plain = calibration_d3d.policy_for(target, drafter)
    with target_gqa_attention(target) as switched:
        _, gqa = calibration_d3d.policy_for(target, drafter)
    assert switched and plain != gqa
    assert calibration_d3d.policy_for(target, drafter)[1] == plain


class DrafterEveryRound(DraftPolicy):
    """Drafts every round and records the timings each round hands back to be learned."""

    def __init__(self, max_drafts: int):
        super().__init__(CostCurve({1: 1.0}), CostCurve({1: 1.0}), max_drafts=max_drafts)
        self.learned = []

    def decide(self, num_pending, lookup_tokens=0, max_candidates=None, lookup_ngram_size=None):
        limit = self.max_drafts if max_candidates is None else min(self.max_drafts, max_candidates)
        if limit == 0:
            return RoundDecision("target", num_pending=num_pending)
        return RoundDecision("drafter", num_masks=limit, num_pending=num_pending, explore=True)

    def observe_round(self, decision, **kwargs):
        if decision.source == "drafter":
            self.learned.append(kwargs.get("draft_seconds"))
        super().observe_round(decision, **kwargs)


def test_passes_that_timed_matmul_layouts_are_not_learned_into_the_draft_curve(monkeypatch):
    """A draft pass during which `MatmulLayouts` still timed candidate layouts (a new row count) ran slower layouts
    than later passes will: the engine uses its time for the round but does not learn it."""
    import d3d_hf.modeling.fast_paths_d3d as fast_paths

    monkeypatch.setattr(fast_paths, "MATMUL_LAYOUTS", fast_paths.MatmulLayouts(samples=1))
    target = tiny_target("llama", sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    policy = drafter.draft_policy = DrafterEveryRound(3)
    timed_passes = []
    draft_logits = drafter.draft_logits

    def recording_draft_logits(*args, **kwargs):
        before = fast_paths.MATMUL_LAYOUTS.timed_calls
        out = draft_logits(*args, **kwargs)
        timed_passes.append(fast_paths.MATMUL_LAYOUTS.timed_calls != before)
        return out

    monkeypatch.setattr(drafter, "draft_logits", recording_draft_logits)
    ids = random_prompt(9)
    out = _greedy(target, ids, drafter, max_new_tokens=40, d3d_prompt_lookup=False)
    assert torch.equal(out, _greedy(target, ids, max_new_tokens=40))
    assert len(policy.learned) == len(timed_passes) and True in timed_passes and False in timed_passes
    for timing, timed_layouts in zip(policy.learned, timed_passes, strict=True):
        assert (timing is None) == timed_layouts


class RecordingVerify(DrafterEveryRound):
    def observe_round(self, decision, **kwargs):
        self.learned.append(kwargs.get("verify_seconds"))
        DraftPolicy.observe_round(self, decision, **kwargs)


def test_verifications_that_timed_the_targets_matmul_layouts_are_not_learned(monkeypatch):
    import d3d_hf.modeling.fast_paths_d3d as fast_paths

    monkeypatch.setattr(fast_paths, "MATMUL_LAYOUTS", fast_paths.MatmulLayouts(samples=1))
    target = tiny_target("llama", sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    policy = drafter.draft_policy = RecordingVerify(3)
    timed_forwards, before = [], []
    target.register_forward_pre_hook(lambda module, args: before.append(fast_paths.MATMUL_LAYOUTS.timed_calls))
    target.register_forward_hook(
        lambda module, args, out: timed_forwards.append(fast_paths.MATMUL_LAYOUTS.timed_calls != before.pop())
    )
    ids = random_prompt(9)
    config = {"d3d_target_matmul_layouts": True, "d3d_prompt_lookup": False}
    out = _greedy(target, ids, drafter, max_new_tokens=40, **config)
    # one target forward per round (the first also prefills the prompt, so its time is never learned); the last
    # round, a plain step at the length limit, is not observed (generation ends there)
    assert len(timed_forwards) == drafter.last_generation_stats.rounds == len(policy.learned) + 1
    learned, timed_layouts = policy.learned[1:], timed_forwards[1 : len(policy.learned)]
    assert True in timed_layouts and False in timed_layouts
    for timing, timed in zip(learned, timed_layouts, strict=True):
        assert (timing is None) == timed
    assert torch.equal(out, _greedy(target, ids, max_new_tokens=40))


def test_every_round_of_a_chain_a_tree_and_a_batch_is_decided_by_the_policy(monkeypatch):
    """One function decides a round (issue 36): `DraftPolicy.decide` is asked once per round of D3D's chain rounds,
    tree rounds and batched rounds (a batch with `batch=`), and nothing beside it overrides what it decided."""
    target = tiny_target("llama", sharpen=4.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    drafter.draft_policy = DraftPolicy(CostCurve({1: 0.05, 16: 0.05}), CostCurve({1: 0.001, 64: 0.001}), max_drafts=3)
    asked = []
    original = DraftPolicy.decide

    def decide(self, *args, **kwargs):
        decision = original(self, *args, **kwargs)
        asked.append(("batch" if kwargs.get("batch") is not None else "one", decision.source))
        return decision

    monkeypatch.setattr(DraftPolicy, "decide", decide)
    ids = random_prompt(9)
    for options in ({}, {"d3d_tree_budget": 4}):
        asked.clear()
        out = _greedy(target, ids, drafter, max_new_tokens=20, d3d_prompt_lookup=False, **options)
        assert torch.equal(out, _greedy(target, ids, max_new_tokens=20))
        stats = drafter.last_generation_stats
        # every round but one left without room before `max_length` (a plain step, nothing to decide)
        assert [kind for kind, _ in asked] == ["one"] * len(asked) and stats.rounds - len(asked) in (0, 1)
        assert [source for _, source in asked] == stats.round_sources[: len(asked)]
    asked.clear()
    batch = torch.cat([random_prompt(9, seed=1), random_prompt(9, seed=2)])
    config = GenerationConfig(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = target.generate(
        batch, attention_mask=torch.ones_like(batch), assistant_model=drafter, generation_config=config
    )
    assert torch.equal(out, target.generate(batch, attention_mask=torch.ones_like(batch), generation_config=config))
    assert [kind for kind, _ in asked] == ["batch"] * drafter.last_generation_stats.rounds
    assert "drafter" in {source for _, source in asked}
