"""Cost model (d3d_hf.costmodel): the speed-up arithmetic against hand computations, the measurements, the
`d3d-hf cost-model` command."""

from __future__ import annotations

import json

import pytest
from _tiny import tiny_target

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.cli import main
from d3d_hf.costmodel import (
    CostModel,
    _interpolate,
    format_cost_model,
    measure_cost_model,
    predict_speedups,
)


def _cost():
    # target: 20 ms for one token, 30 ms for 16; drafter: 10 ms at B + 0, 14 ms at B + 4, 40 ms at 2B + 15
    return CostModel(
        prefix_length=100,
        target_ms={1: 20.0, 8: 24.0, 16: 30.0},
        draft_ms={16: 10.0, 20: 14.0, 47: 41.0},
        block_size=16,
    )


def test_interpolation_and_extrapolation():
    points = {1: 10.0, 3: 30.0, 5: 34.0}
    assert _interpolate(points, 2) == pytest.approx(20.0)
    assert _interpolate(points, 3) == pytest.approx(30.0)
    assert _interpolate(points, 4) == pytest.approx(32.0)
    assert _interpolate(points, 7) == pytest.approx(38.0)  # slope of the last segment
    assert _interpolate(points, 0) == pytest.approx(0.0)  # extrapolated down, never negative
    assert _interpolate({4: 7.0}, 9) == 7.0


def test_sync_speedup_formula():
    cost = _cost()
    # tau 3: T = 2 extra tokens -> t_draft(18) = 12 ms; t_target(16) = 30 ms; t_target(1) = 20 ms
    assert cost.sync_speedup(3.0) == pytest.approx(3 * 20 / (12 + 30))
    # tau 1 (nothing accepted): a full round costs draft + verify for one token
    assert cost.sync_speedup(1.0) == pytest.approx(20 / (10 + 30))
    assert cost.sync_speedup(5.0, block_size=8) == pytest.approx(5 * 20 / (_interpolate(cost.draft_ms, 12) + 24))


def test_async_speedup_formula():
    cost = _cost()
    # tau 3, |H| = 1: L_pack = 15 + 16 + 2 = 33 -> t_draft(33) = 14 + (41 - 14) * 13 / 27 = 27 ms
    pack = 14 + 27 * 13 / 27
    assert cost.async_speedup(3.0, hit_rate=1.0) == pytest.approx(3 * 20 / max(30, pack))
    assert cost.async_speedup(3.0, hit_rate=0.0) == pytest.approx(3 * 20 / (max(30, pack) + 12))
    assert cost.async_speedup(3.0, hit_rate=0.5) == pytest.approx(3 * 20 / (max(30, pack) + 6))
    # every hit with a cheap packed pass: only the verify forward remains
    cheap = CostModel(1, {1: 20.0, 16: 30.0}, {16: 1.0, 64: 2.0}, 16)
    assert cheap.async_speedup(4.0, 1.0) == pytest.approx(4 * 20 / 30)
    with pytest.raises(ValueError, match="hit_rate"):
        cost.async_speedup(3.0, hit_rate=1.5)
    with pytest.raises(ValueError, match="hypotheses"):
        cost.async_speedup(3.0, 0.5, hypotheses=0)


def test_rounds_speedup_and_predictions_per_method():
    cost = _cost()
    assert cost.rounds_speedup(2.0, 0.004, 7.0) == pytest.approx(2 * 20 / (4 + 24))
    base = {"draft_ms": 4.0, "rounds": 10, "drafted_tokens": 70}
    summary = {
        "target": {"tau": 1.0},
        "pld": dict(base, tau=2.0),
        "d3d": dict(base, tau=3.0),
        "d3d-async": dict(base, tau=3.0, hit_rate=1.0),
        "other": dict(base, tau=2.0),
    }
    kinds = {"pld": "rounds", "d3d": "sync", "d3d-async": "async", "other": None}
    got = predict_speedups(cost, summary, kinds, {"d3d": {"block_size": 16}})
    assert got["target"] == 1.0 and got["other"] is None
    assert got["pld"] == pytest.approx(cost.rounds_speedup(2.0, 0.004, 7.0))
    assert got["d3d"] == pytest.approx(cost.sync_speedup(3.0))
    assert got["d3d-async"] == pytest.approx(cost.async_speedup(3.0, 1.0))
    # a cost model without drafter timings cannot predict D3D
    assert predict_speedups(CostModel(1, {1: 1.0}), summary, kinds)["d3d"] is None


def test_round_trip_and_table():
    cost = _cost()
    again = CostModel.from_dict(cost.to_dict())
    assert again == cost
    text = format_cost_model(cost, taus=[2.0, 3.0], hit_rates=[0.5])
    assert "| 16 | 30.00 |" in text and "async h=0.50" in text
    assert f"| 3.00 | {cost.sync_speedup(3.0):.2f}x | {cost.async_speedup(3.0, 0.5):.2f}x |" in text


def test_measurement_on_tiny_models():
    target = tiny_target()
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    cost = measure_cost_model(
        target, drafter, prefix_length=12, verify_lengths=(1, 4), extra_tokens=(0, 2), repeats=2, warmup=1
    )
    assert set(cost.target_ms) == {1, 4} and set(cost.draft_ms) == {4, 6}
    assert all(ms > 0 for ms in [*cost.target_ms.values(), *cost.draft_ms.values()])
    assert cost.block_size == 4 and cost.settings["dtype"] == "float32"
    assert cost.sync_speedup(2.0) > 0


def test_cost_model_command(tiny_folders, tmp_path, capsys):
    out = tmp_path / "cost.json"
    args = [
        "cost-model",
        "--drafter",
        str(tiny_folders / "drafter"),
        "--prefix-length",
        "16",
        "--repeats",
        "2",
        "--tau",
        "2,3",
        "--hit-rate",
        "0.5",
        "--output",
        str(out),
        "--threads",
        "1",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| tau | sync speed-up | async h=0.50 |" in printed and "| 3.00 |" in printed
    assert json.loads(out.read_text())["block_size"] == 4
    assert main(["cost-model", "--drafter", str(tiny_folders / "drafter"), "--hit-rate", "2"]) == 2
