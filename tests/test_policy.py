"""The cost-aware drafting policy (modeling/policy_d3d.py, estimates_d3d.py, calibration_d3d.py) and prompt lookup
(modeling/lookup_d3d.py).

Synthetic cost curves and acceptance only, except one short timing of a tiny random Llama target and its drafter;
no timing is asserted beyond positivity and the monotone envelope.
"""

import json
import math
import os

import pytest
import torch
from _tiny import tiny_target
from d3d_hf.modeling.acceptance_d3d import AcceptanceCalibrator, LookupAcceptance
from d3d_hf.modeling.calibration_d3d import (
    CALIBRATION_FORMAT_VERSION,
    CalibrationStore,
    calibration_key,
    config_fingerprint,
    cpu_model,
    default_cache_dir,
    measure_cost_curves,
)
from d3d_hf.modeling.estimates_d3d import BatchedCosts, CostCurve, expected_tokens
from d3d_hf.modeling.lookup_d3d import lookup_candidates, lookup_match
from d3d_hf.modeling.policy_d3d import DraftPolicy, RoundDecision
from transformers.generation import PromptLookupCandidateGenerator

from d3d_hf import D3DForDiffusionDrafting

#: docs/DESIGN.md section 9, float32, seconds by rows.
FP32 = {1: 0.0587, 2: 0.0960, 4: 0.1034, 8: 0.0977, 16: 0.1099}


def flat(seconds: float) -> CostCurve:
    return CostCurve({1: seconds})


def policy(verify=None, draft=None, explore_every=None, **calibrator_kwargs) -> DraftPolicy:
    return DraftPolicy(
        verify if verify is not None else flat(1.0),
        draft,
        AcceptanceCalibrator(**calibrator_kwargs),
        max_drafts=15,
        explore_every=explore_every,
    )


# ---- CostCurve ---------------------------------------------------------------------------------------------------


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve({2: 1.0, 4: 2.0, 8: 2.0, 12: 4.0})
    assert curve(1) == 1.0 and curve(1.5) == 1.0  # flat below the first point
    assert curve(3) == pytest.approx(1.5)
    assert curve(6) == pytest.approx(2.0)
    assert curve(10) == pytest.approx(3.0)
    assert curve(16) == pytest.approx(6.0)  # slope of the last two points: 0.5 per row
    falling = CostCurve({1: 1.0, 2: 3.0, 4: 2.0})
    assert falling(3) == pytest.approx(2.5)
    assert falling(100) == pytest.approx(2.0)  # never below the last value
    assert flat(0.25)(1) == flat(0.25)(1000) == 0.25
    assert CostCurve(FP32)(3) == pytest.approx(0.0997)


def test_cost_curve_observe_and_round_trip():
    curve = CostCurve({1: 1.0, 4: 4.0})
    curve.observe(1, 2.0, weight=0.25, max_ratio=None)
    assert curve(1) == pytest.approx(1.25)  # moving average at an existing point
    curve.observe(2, 0.5, max_ratio=None)
    assert curve.points == {1: pytest.approx(1.25), 2: 0.5, 4: 4.0}  # a new q becomes a point
    assert curve(3) == pytest.approx(2.25)
    state = json.loads(json.dumps(curve.to_dict()))
    assert CostCurve.from_dict(state).points == curve.points
    assert curve.monotone().points == {1: pytest.approx(1.25), 2: pytest.approx(1.25), 4: 4.0}


def test_cost_curve_observe_clamps_one_disturbed_round():
    curve = CostCurve({1: 0.040, 6: 0.060})
    curve.observe(6, 0.400)  # one round 6.7x slower than usual (another process took the core)
    assert curve(6) == pytest.approx(0.060 * 1.1)  # moved by weight * (max_ratio - 1) = 10%, not by 113%
    interpolated = curve(3)  # 0.040 + (0.066 - 0.040) * 2 / 5
    curve.observe(3, 0.001)  # a new point starts from the measurement clamped around the interpolated value
    assert curve.points[3] == pytest.approx(interpolated / 1.5)
    for _ in range(30):  # a lasting change is followed
        curve.observe(1, 0.080)
    assert curve(1) == pytest.approx(0.080, rel=0.01)


@pytest.mark.parametrize(
    "points", [{}, {0: 1.0}, {-1: 1.0}, {1.5: 1.0}, {1: -0.1}, {1: math.nan}, {1: math.inf}, {1: "fast"}]
)
def test_cost_curve_rejects_bad_points(points):
    with pytest.raises(ValueError):
        CostCurve(points)


def test_cost_curve_rejects_bad_queries_and_observations():
    curve = flat(1.0)
    for q in (0, 0.5, -3, math.nan):
        with pytest.raises(ValueError):
            curve(q)
    for args in ((0, 1.0), (1, -1.0), (1, math.inf), (1, 1.0, 0.0), (1, 1.0, 1.5), (1, 1.0, 0.2, 0.9)):
        with pytest.raises(ValueError):
            curve.observe(*args)
    with pytest.raises(ValueError):
        CostCurve.from_dict({"rows": []})


def test_batched_costs_scale_the_single_sequence_curve_per_batch_and_width():
    """Unmeasured: the curve at batch x rows. Measured: that times the learned ratio, per curve, batch size and
    width (between widths as a `CostCurve` reads), bounded; each (curve, batch) learns on its own."""
    curve = CostCurve({1: 0.010, 4: 0.012, 16: 0.020, 64: 0.060})
    costs = BatchedCosts(weight=0.5)
    assert costs.seconds("verify", curve, 4, 1) == pytest.approx(0.012)
    costs.observe("verify", curve, 4, 1, 0.024)  # first measurement of (verify, 4): taken as is
    assert costs.seconds("verify", curve, 4, 1) == pytest.approx(0.024)
    assert costs.seconds("verify", curve, 4, 4) == pytest.approx(2 * 0.020)  # one point: a flat ratio
    costs.observe("verify", curve, 4, 4, 0.030)  # a new width: clamped to 1.5x the ratio read there (2 -> 3 max)
    assert costs.ratio("verify", 4, 4) == pytest.approx(0.030 / 0.020)
    assert costs.ratio("verify", 4, 1) == pytest.approx(2.0)
    assert costs.ratio("verify", 8, 1) == 1.0 and costs.ratio("draft", 4, 1) == 1.0
    costs.observe("verify", curve, 4, 1, 0.012)  # EMA with the clamp: 2 -> max(1, 2 / 1.5) -> halfway
    assert costs.ratio("verify", 4, 1) == pytest.approx(0.5 * 2 + 0.5 * (2 / 1.5))
    costs.observe("draft", curve, 8, 2, 100.0)
    assert costs.ratio("draft", 8, 2) == BatchedCosts.RATIO_BOUNDS[1]
    assert set(costs.to_dict()) == {"verify", "draft"} and set(costs.to_dict()["verify"][4]) == {1, 4}
    for args in (("prefill", curve, 4, 1), ("verify", curve, 0, 1), ("verify", curve, 4, 0)):
        with pytest.raises(ValueError):
            costs.seconds(*args)
    with pytest.raises(ValueError):
        costs.observe("verify", curve, 4, 1, -1.0)
    with pytest.raises(ValueError):
        BatchedCosts(weight=0.0)


# ---- expected_tokens and the calibrator ---------------------------------------------------------------------------


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 2) == 1.75
    assert expected_tokens([0.5, 0.5], 1) == 1.5
    assert expected_tokens([0.9, 0.8], 0) == 1.0
    assert expected_tokens([1.0] * 4, 4) == 5.0
    assert expected_tokens(torch.tensor([0.5, 0.0, 1.0]), 3) == 1.5
    for probs, k in (([0.5], 2), ([0.5], -1), ([1.5], 1), ([math.nan], 1)):
        with pytest.raises(ValueError):
            expected_tokens(probs, k)


def test_calibrator_starts_as_identity():
    confidences = [0.0, 0.05, 0.33, 0.5, 0.9, 0.999, 1.0]
    assert AcceptanceCalibrator().probabilities(confidences) == pytest.approx(confidences)
    with pytest.raises(ValueError):
        AcceptanceCalibrator().probabilities([1.2])


def test_calibrator_converges_to_the_observed_rate():
    calibrator = AcceptanceCalibrator(prior_strength=4.0)
    for i in range(300):  # confident drafts that the target accepts 30% of the time
        calibrator.observe([0.92], num_accepted=int(i % 10 < 3))
    assert calibrator.probabilities([0.92])[0] == pytest.approx(0.3, abs=0.01)
    assert calibrator.probabilities([0.25])[0] == pytest.approx(0.25)  # other bins untouched


def test_calibrator_observe_counts_accepts_then_one_rejection():
    calibrator = AcceptanceCalibrator(num_bins=10, profile_memory=None)
    calibrator.observe([0.95, 0.15, 0.55, 0.75], num_accepted=1)
    state = calibrator.to_dict()
    assert state["accepted"] == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert state["total"] == [0, 1, 0, 0, 0, 0, 0, 0, 0, 1]  # the 0.55 and 0.75 drafts were never judged
    assert state["profile_total"] == [1, 1, 0, 0] and state["profile_accepted"] == [1, 0, 0, 0]
    with pytest.raises(ValueError):
        calibrator.observe([0.5], num_accepted=2)
    with pytest.raises(ValueError):
        calibrator.observe([0.5, 0.5], num_accepted=1, num_sent=3)


def test_position_profile_prior_and_update():
    calibrator = AcceptanceCalibrator(profile_prior=0.6, profile_decay=0.9)
    assert calibrator.position_profile(3) == pytest.approx([0.6, 0.54, 0.486])
    for _ in range(200):  # the first draft always accepted, the second always rejected
        calibrator.observe([0.5, 0.5, 0.5], num_accepted=1)
    profile = calibrator.position_profile(3)
    assert profile[0] > 0.95 and profile[1] < 0.05
    assert profile[2] == pytest.approx(0.486)  # never reached: still the prior


def test_position_profile_counts_unsent_drafts_softly():
    calibrator = AcceptanceCalibrator(profile_memory=None)
    calibrator.observe([0.8, 0.5, 0.4], num_accepted=1, num_sent=1)  # only d1 sent; d2, d3 computed
    state = calibrator.to_dict()
    assert state["total"] == [0, 0, 0, 0, 0, 0, 0, 0, 1, 0]  # the calibration saw only d1
    assert state["profile_total"] == pytest.approx([1.0, 1.0, 0.5])
    assert state["profile_accepted"] == pytest.approx([1.0, 0.5, 0.2])


def test_calibrator_round_trip_and_malformed_state():
    calibrator = AcceptanceCalibrator(num_bins=5)
    calibrator.observe([0.9, 0.7, 0.2], num_accepted=2)
    clone = AcceptanceCalibrator.from_dict(json.loads(json.dumps(calibrator.to_dict())))
    assert clone.probabilities([0.9, 0.7, 0.2]) == calibrator.probabilities([0.9, 0.7, 0.2])
    assert clone.position_profile(4) == calibrator.position_profile(4)
    broken = calibrator.to_dict()
    broken["accepted"] = [1.0]
    with pytest.raises(ValueError):
        AcceptanceCalibrator.from_dict(broken)
    with pytest.raises(ValueError):
        AcceptanceCalibrator.from_dict({"num_bins": 10})


# ---- plan: before the draft pass -----------------------------------------------------------------------------------


def test_plan_takes_a_target_step_when_drafting_cannot_pay():
    # a draft pass costs two target steps; acceptance at the prior (0.6, decaying)
    p = policy(verify=flat(1.0), draft=flat(2.0))
    assert p.plan(num_pending=2) == 0
    rates = p.plan_rates(num_pending=2)
    assert len(rates) == 16 and max(rates[1:]) < rates[0] == 1.0
    # the shipped full-depth drafter in fp32 (docs/DESIGN.md section 9): 100% first draft, ~0.2 after it
    calibrator = AcceptanceCalibrator(profile_prior=1.0, profile_decay=0.2)
    real = DraftPolicy(CostCurve(FP32), CostCurve(FP32), calibrator, explore_every=None)
    assert real.plan(num_pending=3) == 0


def test_plan_drafts_when_it_pays():
    # same costs as above, but a drafter whose drafts are nearly always accepted pays back its pass
    p = policy(verify=flat(1.0), draft=flat(2.0), profile_prior=0.95, profile_decay=1.0)
    assert 1 <= p.plan(num_pending=2) <= 15


def test_plan_takes_every_draft_when_verification_is_free_and_drafting_cheap():
    p = policy(verify=flat(1.0), draft=flat(0.05), profile_prior=0.95, profile_decay=1.0)
    assert p.plan(num_pending=1) == 15
    assert p.plan(num_pending=1, max_candidates=6) == 6  # room left before max_length
    assert p.plan(num_pending=1, max_candidates=0) == 0


def test_plan_grows_with_cheaper_rows():
    # with verification that grows per row, fewer masks; with a flat curve, more
    steep = policy(verify=CostCurve({1: 1.0, 16: 4.0}), draft=flat(0.1), profile_prior=0.8, profile_decay=1.0)
    level = policy(verify=flat(1.0), draft=flat(0.1), profile_prior=0.8, profile_decay=1.0)
    assert 1 <= steep.plan(1) < level.plan(1)


# ---- choose: after the draft pass ---------------------------------------------------------------------------------


def test_choose_cuts_at_a_low_confidence_draft():
    p = policy(verify=CostCurve({1: 0.05, 16: 0.125}))
    confident = [0.99, 0.98, 0.97, 0.05, 0.9, 0.9]
    assert p.choose(confident, draft_seconds=0.1) == 3
    assert p.choose([0.99, 0.98, 0.97, 0.97, 0.9, 0.9], draft_seconds=0.1) == 6
    assert p.choose([0.01, 0.9], draft_seconds=0.1) == 0  # nothing worth a longer verification
    assert p.choose([], draft_seconds=0.1) == 0
    rates = p.choose_rates(confident, draft_seconds=0.1)
    assert rates.index(max(rates)) == 3


def test_choose_breaks_near_ties_towards_the_cheaper_verification():
    verify = CostCurve({1: 1.0, 2: 1.0, 3: 1.001})
    confidences = [1.0, 0.01]  # the second draft adds 0.5% tokens for 0.1% more time
    tolerant = DraftPolicy(verify, flat(0.5), max_drafts=15, explore_every=None)
    strict = DraftPolicy(verify, flat(0.5), max_drafts=15, explore_every=None, tie_tolerance=0.0)
    assert strict.choose(confidences, draft_seconds=0.0) == 2
    assert tolerant.choose(confidences, draft_seconds=0.0) == 1
    # "cheaper" means fewer seconds, not fewer drafts: a measured curve may dip (docs/DESIGN.md section 9)
    dipping = DraftPolicy(CostCurve({1: 1.0, 2: 1.101, 3: 1.1}), flat(0.5), max_drafts=15, explore_every=None)
    assert dipping.choose([1.0, 0.0], draft_seconds=0.0) == 2


def test_choose_uses_the_calibrated_probabilities():
    p = policy(verify=CostCurve({1: 0.05, 16: 0.125}))
    assert p.choose([0.97] * 6, draft_seconds=0.1) == 6
    for _ in range(200):  # drafts of confidence 0.97 turn out to be rejected
        p.calibrator.observe([0.97], num_accepted=0)
    assert p.choose([0.97] * 6, draft_seconds=0.1) == 0


# ---- modes ---------------------------------------------------------------------------------------------------------


def test_fixed_mode_drafts_k_every_round():
    p = DraftPolicy(flat(1.0), flat(5.0), max_drafts=15, mode=4)
    assert p.plan(num_pending=1) == 4
    assert p.plan(num_pending=1, max_candidates=2) == 2
    assert p.choose([0.01] * 4, draft_seconds=5.0) == 4
    assert p.choose([0.01] * 3, draft_seconds=5.0) == 3
    for _ in range(40):
        decision = p.decide(num_pending=1, lookup_tokens=10)
        assert (decision.source, decision.num_masks, decision.explore) == ("drafter", 4, False)
    assert p.decide(num_pending=1, max_candidates=0).source == "target"
    assert DraftPolicy(max_drafts=15, mode=4).plan(1) == 4  # fixed modes need no curves


def test_off_mode_never_drafts():
    for mode in ("off", 0):
        p = DraftPolicy(flat(1.0), flat(0.001), max_drafts=15, mode=mode)
        assert p.mode == "off"
        assert p.plan(num_pending=1) == 0
        assert p.choose([1.0] * 5, draft_seconds=0.0) == 0
        for _ in range(40):
            assert p.decide(num_pending=1, lookup_tokens=10).source == "target"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": 16},
        {"mode": -1},
        {"mode": "fast"},
        {"mode": True},
        {"max_drafts": -1},
        {"tie_tolerance": 1.0},
        {"explore_every": 0},
        {"curve_weight": 0.0},
        {"verify_curve": None},
    ],
)
def test_policy_rejects_bad_settings(kwargs):
    settings = {"verify_curve": flat(1.0), "max_drafts": 15, **kwargs}
    with pytest.raises(ValueError):
        DraftPolicy(**settings)


# ---- lookup --------------------------------------------------------------------------------------------------------


def test_lookup_is_preferred_when_a_long_match_is_likely_accepted_and_free():
    p = policy(verify=flat(1.0), draft=flat(2.0))
    for _ in range(50):
        p.observe_lookup(num_sent=10, num_accepted=9)  # lookup tokens are usually right
    assert p.lookup_probability > 0.85
    decision = p.decide(num_pending=1, lookup_tokens=10)
    assert (decision.source, decision.num_lookup, decision.num_masks) == ("lookup", 10, 0)
    assert decision.lookup_rate == pytest.approx(expected_tokens(p.lookup.probabilities(10), 10) / 1.0)
    assert decision.lookup_rate > decision.target_rate > decision.drafter_rate
    assert decision.expected_rate == decision.lookup_rate
    assert p.choose_lookup(10) == (10, pytest.approx(decision.lookup_rate))
    assert p.choose_lookup(10, max_candidates=3)[0] == 3
    assert p.decide(num_pending=1, lookup_tokens=0).source == "target"  # no match: no lookup
    # an excellent cheap drafter beats a short lookup match
    good = policy(verify=flat(1.0), draft=flat(0.01), profile_prior=0.99, profile_decay=1.0)
    assert good.decide(num_pending=1, lookup_tokens=2).source == "drafter"


def test_lookup_is_skipped_when_it_does_not_pay():
    # fp32 curve of docs/DESIGN.md section 9 and a poor lookup estimate: the longer verification is not worth it
    p = DraftPolicy(CostCurve(FP32), None, max_drafts=15, explore_every=None)
    for _ in range(50):
        p.observe_lookup(num_sent=10, num_accepted=0)
    assert p.lookup_probability < 0.1
    assert p.choose_lookup(10)[1] < p.target_rate()
    decision = p.decide(num_pending=5, lookup_tokens=10)
    assert decision.source == "target" and decision.drafter_rate is None


def test_lookup_estimate():
    p = policy()
    assert p.lookup_probability == 0.5  # the prior
    p.observe_lookup(num_sent=4, num_accepted=4)  # position 1 reached and accepted once: (1 + 4 * 0.5) / (1 + 4)
    assert p.lookup_probability == pytest.approx(0.6)
    for _ in range(300):
        p.observe_lookup(num_sent=5, num_accepted=1)  # first accepted, second rejected ...
    assert p.lookup_probability > 0.95 and p.lookup.probabilities(2)[1] < 0.1  # counts fade over 64 rounds
    for _ in range(300):
        p.observe_lookup(num_sent=5, num_accepted=0)  # ... and lately none: the estimate follows (it fades)
    assert p.lookup_probability < 0.05
    with pytest.raises(ValueError):
        p.observe_lookup(num_sent=2, num_accepted=3)


def test_lookup_acceptance_is_learned_per_position_and_ngram_size():
    est = LookupAcceptance(prior=0.5, prior_strength=4.0, memory=None)
    assert est.probabilities(3) == [0.5, 0.5, 0.5]  # nothing seen: one geometric rate
    # copied spans: the first token is a coin flip, but once it is accepted the whole span of 8 is
    for i in range(200):
        est.observe(num_sent=8, num_accepted=8 if i % 2 else 0, ngram_size=3)
    q = est.probabilities(8, ngram_size=3)
    assert q[0] == pytest.approx(0.5, abs=0.01) and min(q[1:]) > 0.97
    # one-token matches that usually fail are filed apart, and do not spoil 3-gram matches
    for _ in range(200):
        est.observe(num_sent=4, num_accepted=0, ngram_size=1)
    assert est.probabilities(1, ngram_size=1)[0] < 0.05
    assert est.probabilities(8, ngram_size=3)[1] > 0.97
    # a size never seen borrows the pooled estimate, position by position
    assert est.probabilities(3, ngram_size=2) == pytest.approx(est.probabilities(3))
    # deep positions never reached keep the estimate of the position before them
    assert est.probabilities(12, ngram_size=3)[8:] == pytest.approx([est.probabilities(8, ngram_size=3)[7]] * 4)
    state = json.loads(json.dumps(est.to_dict()))
    assert LookupAcceptance.from_dict(state).probabilities(8, 3) == est.probabilities(8, 3)
    for bad in ({}, {**state, "counts": {"3": [[1.0], [0.5]]}}, {**state, "counts": {"3": [[1.0, 1.0], [1.0]]}}):
        with pytest.raises(ValueError):
            LookupAcceptance.from_dict(bad)
    for args in ((2, 3), (2, 1, 0), (2, 1, 1.5)):
        with pytest.raises(ValueError):
            est.observe(*args)


def test_lookup_sends_the_whole_span_when_copies_run_long():
    """A geometric rate of ~0.5 would send 1-2 tokens on a curve where 11 rows cost twice 1; the per-position estimate
    learned from spans that are either rejected at once or copied whole sends all of them."""
    verify = CostCurve({1: 1.0, 3: 1.1, 11: 2.0})
    p = DraftPolicy(verify, None, max_drafts=15, explore_every=None)
    for i in range(100):
        p.observe_lookup(num_sent=10, num_accepted=10 if i % 2 else 0, ngram_size=2)
    geometric = p.choose_lookup(10, lookup_probability=0.5)[0]
    decision = p.decide(num_pending=1, lookup_tokens=10, lookup_ngram_size=2)
    assert geometric <= 2 and (decision.source, decision.num_lookup, decision.lookup_ngram_size) == ("lookup", 10, 2)
    p.observe_round(decision, num_sent=10, num_accepted=0)
    assert p.lookup.num_observations == 101


def test_lookup_match_reports_the_ngram_size():
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7]])
    tokens, size = lookup_match(ids, max_ngram_size=3, num_tokens=2)
    assert tokens.tolist() == [[8, 9]] and size == 3
    assert lookup_match(ids, max_ngram_size=1, num_tokens=2)[1] == 1
    tokens, size = lookup_match(torch.tensor([[1, 2, 3]]), num_tokens=2)
    assert tokens.shape == (1, 0) and size == 0


# ---- exploration ---------------------------------------------------------------------------------------------------


def _drafter_rounds(p: DraftPolicy, rounds: int, **decide_kwargs) -> list[int]:
    return [i for i in range(rounds) if p.decide(num_pending=1, **decide_kwargs).source == "drafter"]


def test_exploration_tries_the_drafter_now_and_then():
    def make(explore_every=4):
        verify = CostCurve({1: 1.0, 16: 2.5})
        return DraftPolicy(verify, flat(2.0), max_drafts=15, explore_every=explore_every, explore_backoff=2.0)

    p = make()
    assert p.plan(1) == 0  # drafting does not pay ...
    assert _drafter_rounds(p, 60) == [0, 4, 12, 28]  # ... yet: warm-up, then intervals 4, 8, 16 (doubling)
    assert _drafter_rounds(make(), 60) == [0, 4, 12, 28]  # deterministic
    assert _drafter_rounds(make(explore_every=None), 60) == []  # disabled
    p = make()
    decision = p.decide(num_pending=1)
    assert decision.explore and decision.num_masks == 15
    assert p.choose([0.01] * 15, draft_seconds=2.0, decision=decision) == 15  # an exploring round sends all
    assert p.choose([0.01] * 15, draft_seconds=2.0) == 0


def test_exploration_interval_resets_when_drafting_pays_and_warm_up_needs_no_history():
    p = DraftPolicy(flat(1.0), flat(2.0), max_drafts=15, explore_every=4)
    assert _drafter_rounds(p, 13) == [0, 4, 12]  # interval now 16
    p.draft_curve = flat(0.01)
    p.calibrator = AcceptanceCalibrator(profile_prior=0.95, profile_decay=1.0)
    decision = p.decide(num_pending=1)
    assert decision.source == "drafter" and not decision.explore  # the rates chose it
    p.draft_curve = flat(2.0)
    p.calibrator = AcceptanceCalibrator()
    assert _drafter_rounds(p, 12) == [3, 11]  # back to an interval of 4 (then doubling again)
    seasoned = AcceptanceCalibrator()
    seasoned.observe([0.5], num_accepted=0)  # a calibrator with history (e.g. restored): no warm-up
    q = DraftPolicy(flat(1.0), flat(2.0), seasoned, max_drafts=15, explore_every=4)
    assert _drafter_rounds(q, 8) == [3]


def test_exploration_tries_lookup_now_and_then():
    verify = CostCurve({1: 1.0, 2: 1.5})  # a lookup token costs half a step: not worth it at 5% acceptance
    p = DraftPolicy(verify, None, max_drafts=15, explore_every=4, lookup_prior=0.05)
    assert p.choose_lookup(3)[1] < p.target_rate()
    sources = [p.decide(num_pending=1, lookup_tokens=3).source for _ in range(30)]
    assert [i for i, s in enumerate(sources) if s == "lookup"] == [0, 4, 12, 28]
    # rounds without a lookup match do not count towards the interval
    p = DraftPolicy(verify, None, max_drafts=15, explore_every=4, lookup_prior=0.05)
    picks = [p.decide(num_pending=1, lookup_tokens=3 * (i % 2)).source for i in range(12)]
    assert [i for i, s in enumerate(picks) if s == "lookup"] == [1, 9]


# ---- observe_round and state ---------------------------------------------------------------------------------------


def test_observe_round_learns_acceptance_and_costs():
    p = DraftPolicy(CostCurve({1: 1.0, 16: 1.0}), CostCurve({1: 1.0, 16: 1.0}), max_drafts=15, explore_every=None)
    decision = RoundDecision("drafter", num_masks=4, num_pending=3)
    assert decision.draft_rows == 7
    p.observe_round(
        decision, num_sent=3, num_accepted=2, confidences=[0.9, 0.8, 0.7, 0.6], draft_seconds=1.4, verify_seconds=1.3
    )  # within CostCurve.observe's clamp (1.5x the curve's 1.0)
    assert p.calibrator.num_observations == 1
    assert p.draft_curve.points[7] == 1.4  # a new point at the pass's rows
    assert p.verify_curve.points[4] == 1.3  # num_sent + 1 rows
    p.observe_round(decision, num_sent=3, num_accepted=2, verify_seconds=1.2)
    assert p.verify_curve.points[4] == pytest.approx(0.8 * 1.3 + 0.2 * 1.2)
    p.observe_round(
        RoundDecision("lookup", num_lookup=5), num_sent=5, num_accepted=5, verify_seconds=1.5, verify_rows=30
    )
    assert p.lookup_probability > 0.5 and p.verify_curve.points[30] == 1.5
    p.observe_round(RoundDecision("target"), num_sent=0, num_accepted=0, verify_seconds=None)
    with pytest.raises(ValueError):
        p.observe_round(RoundDecision("target"), num_sent=2, num_accepted=0)
    with pytest.raises(ValueError):
        p.observe_round(decision, num_sent=1, num_accepted=2)


def test_policy_state_round_trip():
    p = DraftPolicy(CostCurve(FP32), CostCurve({1: 0.07, 16: 0.12}), max_drafts=15)
    p.observe_round(
        RoundDecision("drafter", num_masks=3, num_pending=2),
        num_sent=3,
        num_accepted=1,
        confidences=[0.9, 0.4, 0.3],
        draft_seconds=0.1,
        verify_seconds=0.1,
    )
    p.observe_lookup(6, 2)
    state = json.loads(json.dumps(p.state_dict()))
    q = DraftPolicy(flat(1.0), None, max_drafts=15)
    q.load_state_dict(state)
    assert q.plan_rates(3) == p.plan_rates(3)
    assert q.lookup_probability == p.lookup_probability
    with pytest.raises(ValueError):
        q.load_state_dict({"verify_curve": None})
    assert q.plan_rates(3) == p.plan_rates(3)  # unchanged by the failed load


# ---- calibration storage -------------------------------------------------------------------------------------------

KEY_PARTS = dict(
    target="HuggingFaceTB/SmolLM2-135M-Instruct",
    target_config="0123456789abcdef",
    drafter="d3d-smollm2",
    drafter_config="fedcba9876543210",
    dtype="float32",
    threads=2,
    device="cpu",
    cpu="AMD EPYC 7B13 [avx2]",
    torch_version="2.13.0",
)


def test_calibration_key_changes_with_each_part():
    key = calibration_key(**KEY_PARTS)
    assert key == calibration_key(**dict(reversed(list(KEY_PARTS.items()))))  # stable, order-free
    assert len(key) == 24 and all(c in "0123456789abcdef" for c in key)
    changed = {"dtype": torch.bfloat16, "threads": 4, "device": "cuda:0", "cpu": "Intel Xeon [avx2 avx512f]"}
    for name in KEY_PARTS:
        other = dict(KEY_PARTS, **{name: changed.get(name, str(KEY_PARTS[name]) + "x")})
        assert calibration_key(**other) != key, name
    assert calibration_key(**KEY_PARTS, kernel="onednn") != key
    assert calibration_key(**dict(KEY_PARTS, dtype=torch.float32)) == key  # a torch dtype reads like its name
    defaults = calibration_key(target="t")  # machine parts filled in
    assert defaults == calibration_key(target="t", threads=torch.get_num_threads(), torch_version=torch.__version__)


def test_config_fingerprint_ignores_names_and_sees_shapes():
    a = tiny_target(num_layers=1).config
    b = tiny_target(num_layers=1).config
    b._name_or_path = "somewhere/else"
    assert config_fingerprint(a) == config_fingerprint(b)
    assert config_fingerprint(a) != config_fingerprint(tiny_target(num_layers=2).config)


def test_cpu_model():
    info = cpu_model()
    assert isinstance(info["model"], str) and info["model"]
    assert set(info) == {"model", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
    assert all(isinstance(info[flag], bool) for flag in info if flag != "model")


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path / "d3d"))
    assert default_cache_dir() == str(tmp_path / "d3d" / "cost_curves")
    monkeypatch.delenv("D3D_HF_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "d3d_hf" / "cost_curves")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "d3d_hf" / "cost_curves")


def _trained_policy() -> DraftPolicy:
    p = DraftPolicy(CostCurve(FP32), CostCurve({1: 0.07, 16: 0.12}), max_drafts=15)
    p.observe_round(
        RoundDecision("drafter", num_masks=2, num_pending=2),
        num_sent=2,
        num_accepted=1,
        confidences=[0.8, 0.6],
        draft_seconds=0.09,
        verify_seconds=0.1,
    )
    return p


def test_calibration_store_round_trips_through_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path))
    store = CalibrationStore()
    assert store.folder == str(tmp_path / "cost_curves")
    key = calibration_key(**KEY_PARTS)
    assert store.load(key) is None
    p = _trained_policy()
    path = p.save_to(store, key, parts=KEY_PARTS)
    assert path == os.path.join(store.folder, f"{key}.json")
    assert os.listdir(store.folder) == [f"{key}.json"]  # no temporary file left behind
    with open(path) as f:
        record = json.load(f)
    assert record["format_version"] == CALIBRATION_FORMAT_VERSION and record["key"] == key
    assert record["parts"]["target"] == KEY_PARTS["target"]
    store.forget()
    q = DraftPolicy(flat(1.0), None, max_drafts=15)
    assert q.restore_from(CalibrationStore(), key)  # from the file
    assert q.state_dict() == p.state_dict()
    assert q.plan_rates(2) == p.plan_rates(2)
    # in memory: the state survives the file's removal until forgotten, and is a copy
    os.remove(path)
    state = store.load(key)
    state["calibrator"] = None
    assert store.load(key)["calibrator"] is not None
    store.forget(key)
    assert store.load(key) is None


@pytest.mark.parametrize(
    "content",
    [
        "{ not json",
        b"\xff\xfe\x00garbage",
        "[1, 2, 3]",
        "VERSION_OTHER",
        "KEY_OTHER",
        "STATE_MALFORMED",
    ],
)
def test_calibration_store_ignores_unusable_files(monkeypatch, tmp_path, content):
    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path))
    store = CalibrationStore()
    key = calibration_key(**KEY_PARTS)
    p = _trained_policy()
    path = p.save_to(store, key)
    store.forget()
    with open(path) as f:
        record = json.load(f)
    if content == "VERSION_OTHER":
        content = json.dumps(dict(record, format_version=CALIBRATION_FORMAT_VERSION + 1))
    elif content == "KEY_OTHER":
        content = json.dumps(dict(record, key="0" * 24))
    elif content == "STATE_MALFORMED":
        content = json.dumps(dict(record, state={"verify_curve": {"points": "fast"}}))
    with open(path, "wb") as f:
        f.write(content if isinstance(content, bytes) else content.encode())
    q = DraftPolicy(flat(1.0), None, max_drafts=15)
    before = q.state_dict()
    assert not q.restore_from(store, key)  # ignored, no crash
    assert q.state_dict() == before
    assert p.save_to(store, key) == path  # and replaced by the next save
    store.forget()
    assert q.restore_from(store, key) and q.state_dict() == p.state_dict()


def test_calibration_store_rejects_unsafe_keys(tmp_path):
    with pytest.raises(ValueError):
        CalibrationStore(str(tmp_path)).path("../escape")


def test_calibration_store_that_cannot_write_warns_once(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    store = CalibrationStore(str(blocker / "cost_curves"))
    with caplog.at_level("INFO", logger="d3d_hf.modeling.calibration_d3d"):
        assert store.save("k1", {"a": 1}) is None and store.save("k2", {"a": 2}) is None
        assert CalibrationStore(str(blocker / "cost_curves")).save("k1", {"a": 3}) is None
    levels = [r.levelname for r in caplog.records if "Could not save" in r.getMessage()]
    assert levels == ["WARNING", "INFO", "INFO"]
    assert store.load("k2") == {"a": 2}  # kept in memory


# ---- measure_cost_curves -------------------------------------------------------------------------------------------


def test_measure_cost_curves_on_a_tiny_pair():
    target = tiny_target(num_layers=2)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target)
    target.train()  # the measurement puts it in eval mode and restores the mode afterwards
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: tiny forwards on a busy shared machine stall on thread hand-offs
    try:
        verify, draft = measure_cost_curves(target, drafter, rows=(1, 2, 4, 8), context_length=16, repeats=1)
        raw_verify, _ = measure_cost_curves(target, drafter, rows=(3,), context_length=8, repeats=1, monotone=False)
    finally:
        torch.set_num_threads(threads)
    assert target.training and not drafter.training
    for curve in (verify, draft):
        values = list(curve.points.values())
        assert list(curve.points) == [1, 2, 4, 8]
        assert all(v > 0 for v in values)
        assert all(a <= b for a, b in zip(values, values[1:], strict=False))
    assert list(raw_verify.points) == [3]
    with pytest.raises(ValueError):
        measure_cost_curves(target, drafter, rows=(0,))


# ---- prompt lookup -------------------------------------------------------------------------------------------------


def _transformers_lookup(ids, max_ngram_size, num_tokens, eos_token_id=None):
    eos = None if eos_token_id is None else torch.tensor([eos_token_id])
    generator = PromptLookupCandidateGenerator(
        eos_token_id=eos, num_output_tokens=num_tokens, max_matching_ngram_size=max_ngram_size, max_length=10**6
    )
    candidates, _ = generator.get_candidates(ids)
    return candidates[:, ids.shape[1] :]


HAND_MADE = [
    [5, 6, 7, 8, 5, 6],  # a 2-gram seen before
    [1, 2, 3, 9, 2, 3, 4, 1, 2, 3],  # a 3-gram seen twice: the first occurrence
    [4, 4, 4, 4, 4],  # overlapping matches
    [7, 8, 9, 10],  # nothing matches
    [3],  # too short
    [1, 2, 1, 2, 1, 2, 1],  # continuation runs into the suffix
    [9, 1, 2, 5, 1, 2, 6, 6, 2],  # only a 1-gram matches
    [2, 7, 1, 2, 5, 9, 1, 2],  # with eos 5 the 2-gram's continuation is empty: no fall-back to the 1-gram
]


@pytest.mark.parametrize("sequence", HAND_MADE, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("max_ngram_size,num_tokens", [(1, 1), (2, 3), (3, 10)])
def test_lookup_matches_transformers(sequence, max_ngram_size, num_tokens):
    ids = torch.tensor([sequence])
    ours = lookup_candidates(ids, max_ngram_size=max_ngram_size, num_tokens=num_tokens)
    assert ours.dtype == torch.long and ours.shape[0] == 1
    assert torch.equal(ours, _transformers_lookup(ids, max_ngram_size, num_tokens))
    for eos in (5, 8, 2):
        cut = lookup_candidates(ids, max_ngram_size=max_ngram_size, num_tokens=num_tokens, eos_token_id=eos)
        assert torch.equal(cut, _transformers_lookup(ids, max_ngram_size, num_tokens, eos))


def test_lookup_matches_transformers_on_random_sequences():
    g = torch.Generator().manual_seed(0)
    for seed in range(40):
        ids = torch.randint(0, 6, (1, 5 + seed), generator=g)
        for max_ngram_size in (2, 3):
            assert torch.equal(lookup_candidates(ids, max_ngram_size, 7), _transformers_lookup(ids, max_ngram_size, 7))


def test_lookup_examples():
    ids = torch.tensor([[1, 2, 9, 7, 1, 2, 8, 1, 2]])
    assert lookup_candidates(ids, 2, 3).tolist() == [[9, 7, 1]]  # the first occurrence (transformers' rule)
    assert lookup_candidates(ids, 2, 3, occurrence="last").tolist() == [[8, 1, 2]]  # the most recent
    assert lookup_candidates(ids, 2, 3, eos_token_id=[7, 1]).tolist() == [[9]]
    assert lookup_candidates(ids, 2, 3, eos_token_id=9).shape == (1, 0)
    assert lookup_candidates(torch.tensor([[1, 2, 3]]), 3, 5).shape == (1, 0)
    for bad in (
        dict(input_ids=torch.tensor([1, 2, 1])),
        dict(input_ids=torch.tensor([[1, 2], [1, 2]])),
        dict(input_ids=ids, max_ngram_size=0),
        dict(input_ids=ids, num_tokens=0),
        dict(input_ids=ids, occurrence="best"),
    ):
        with pytest.raises(ValueError):
            lookup_candidates(**bad)


# ---- one decision for a batch ----------------------------------------------------------------------------------------


def test_a_batch_round_is_rated_on_the_batch_rows_and_lets_a_sequence_send_its_lookup_match():
    from d3d_hf.modeling.policy_d3d import SequenceState

    p = policy(verify=flat(1.0), draft=flat(0.01), profile_prior=0.6, profile_decay=0.5)
    p.calibrator.observe([0.6], num_accepted=1)  # past the warm-up
    for _ in range(50):
        p.observe_lookup(num_sent=8, num_accepted=8)
    batch = [SequenceState(limit=3, lookup_tokens=0), SequenceState(limit=3, lookup_tokens=3, lookup_ngram_size=3)]
    decision = p.decide(batch=batch)
    assert decision.source == "drafter" and decision.lookup_rows == (False, True)
    # one sequence: a drafter round never carries lookup rows (that round is the lookup option)
    assert p.decide(1, lookup_tokens=3, max_candidates=3).lookup_rows == ()
    # the batch's verification is dearer per row than one sequence's: plain steps where one sequence drafts
    dear = BatchedCosts.from_dict({"verify": {2: {1: 1.0, 2: 8.0, 16: 8.0}}})
    p.batched_costs = dear
    assert p.decide(batch=[SequenceState(limit=3)] * 2).source == "target"
    assert p.decide(1, max_candidates=3).source == "drafter"
    # no draft pass allowed (the prefill of a drafter on the target's cache): never a drafter round
    assert p.decide(batch=[SequenceState(limit=3)] * 2, draft_pass=False).source != "drafter"


def test_batch_decisions_refuse_mixed_arguments_and_bad_states():
    from d3d_hf.modeling.policy_d3d import SequenceState

    p = policy(verify=flat(1.0), draft=flat(0.01))
    with pytest.raises(ValueError, match="drop the scalar arguments"):
        p.decide(3, batch=[SequenceState(limit=3)])
    with pytest.raises(ValueError, match="SequenceState"):
        p.decide(batch=[])
    with pytest.raises(ValueError, match="pending counts >= 1"):
        p.decide(batch=[SequenceState(limit=3, verify_pending=0)])
    with pytest.raises(ValueError, match="2 sequences, `batch` 1"):
        p.choose([[0.5], None], 0.0, batch=[SequenceState()])


def test_a_fixed_plan_keeps_its_block_whole_near_the_length_limit():
    p = DraftPolicy(max_drafts=15, mode=4)
    decision = p.decide(num_pending=2, max_candidates=2)
    assert (decision.num_masks, decision.pass_masks, decision.draft_rows) == (2, 4, 6)
    assert p.decide(num_pending=1).block_masks is None  # room for the whole block
