"""`benchmarks/learning_curve.py --record`: a finished run folder becomes a row of the curve's runs.json, read from
its trainer state, and the table renders it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def curve():
    return load_benchmark("learning_curve")


def _run(tmp_path, name, step, max_steps):
    folder = tmp_path / "runs" / name
    folder.mkdir(parents=True)
    history = [
        {"step": 10, "loss": 9.0, "block_loss": 5.0, "ar_loss": 0.0, "distill_loss": 4.0},
        {"step": step, "loss": 7.25, "block_loss": 4.0, "ar_loss": 0.0, "distill_loss": 3.25},
        {"step": step, "train_runtime": 1234.5},
    ]
    state = {"global_step": step, "max_steps": max_steps, "train_batch_size": 16, "log_history": history}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def test_record_adds_the_run_and_the_table_shows_it(curve, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "runs.json").write_text(json.dumps({"adapter-r8-1000": {
        "capacity": "adapter-r8", "rows": 1000, "steps": 125, "max_steps": 125, "batch_size": 16, "samples_seen": 2000,
        "finished": True, "final_loss": {"block_loss": 4.1}, "train_runtime_s": 72.0}}))  # fmt: skip
    entry = curve.record_run(_run(tmp_path, "adapter-r8-300", 37, 37), results, "cpu")
    assert entry == {
        "capacity": "adapter-r8", "rows": 300, "steps": 37, "max_steps": 37, "batch_size": 16, "samples_seen": 592,
        "finished": True, "final_loss": {"loss": 7.25, "block_loss": 4.0, "ar_loss": 0.0, "distill_loss": 3.25},
        "train_runtime_s": 1234.5, "device": "cpu",
    }  # fmt: skip
    runs = json.loads((results / "runs.json").read_text())
    assert set(runs) == {"adapter-r8-1000", "adapter-r8-300"}  # the earlier runs are kept
    for set_name in curve.SETS:
        (results / f"adapter-r8-300-{set_name}.json").write_text(
            json.dumps({"tau": {"x": 2.125}, "lossless": {"x": 1.0}})
        )
    table = curve.render_measured(results)
    rows = [line for line in table.splitlines() if line.startswith("| adapter-r8")]
    assert rows[0].startswith("| adapter-r8-300 | 300 | 37 | 592 | 2.12 (100%)")  # fewest samples first
    stopped = curve.record_run(_run(tmp_path, "adapter-r8-mlp-300", 20, 37), results, "cpu")
    assert not stopped["finished"] and stopped["samples_seen"] == 320
    assert stopped["capacity"] == "adapter-r8-mlp" and "subset" not in stopped  # the longest preset, not adapter-r8


def test_record_reads_a_data_subset_from_the_folder_name(curve, tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    entry = curve.record_run(_run(tmp_path, "adapter-r8-magpie-500", 62, 62), results, "cpu")
    assert (entry["capacity"], entry["subset"], entry["rows"]) == ("adapter-r8", "magpie", 500)
    plain = curve.record_run(_run(tmp_path, "adapter-r8-500", 62, 62), results, "cpu")
    assert "subset" not in plain
    for name in ("adapter-r8-magpie-500", "adapter-r8-500"):
        for set_name in curve.SETS:
            (results / f"{name}-{set_name}.json").write_text(json.dumps({"tau": {"x": 2.0}, "lossless": {"x": 1.0}}))
    drawn = {}
    monkeypatch.setattr(curve, "_plot", lambda series, references, xlabel, path: drawn.update(series))
    curve.render_measured(results)
    assert {"adapter-r8 humaneval", "adapter-r8 (magpie rows) humaneval"} <= set(drawn)  # a line each


def test_record_refuses_a_folder_it_cannot_read(curve, tmp_path):
    with pytest.raises(ValueError, match="capacity"):
        curve.record_run(_run(tmp_path, "my-run", 5, 5), tmp_path, "cpu")
    (tmp_path / "adapter-r8-5").mkdir()
    with pytest.raises(ValueError, match="trainer_state"):
        curve.record_run(tmp_path / "adapter-r8-5", tmp_path, "cpu")


def test_every_preset_is_a_valid_train_command(curve, tmp_path):
    """Each capacity preset parses with `d3d-hf train`'s own parser into the settings it names (a misspelt flag or
    value would otherwise surface only when a lease or an hour-long run starts)."""
    from trl import TrlParser

    from d3d_hf.training import D3DTrainingConfig, D3DTrainScriptArguments

    parser = TrlParser((D3DTrainScriptArguments, D3DTrainingConfig))
    for capacity, flags in curve.CAPACITIES.items():
        command = curve.train_command(capacity, 300, tmp_path / capacity, data="data", epochs=2)
        script, config = parser.parse_args_and_config(args=command[command.index("train") + 1 :])
        assert config.max_steps == 150 and script.max_samples == 300, capacity
        assert config.learning_rate == float(flags[flags.index("--learning_rate") + 1]), capacity
        if "--target_dtype" in flags:
            assert script.target_dtype == flags[flags.index("--target_dtype") + 1], capacity
        if "--drafter" in flags:  # a warm start names a drafter that exists in the checkout
            assert (Path(script.drafter) / "config.json").is_file(), capacity
    assert curve.CAPACITIES["adapter-r32-lr2e-3"] == [
        "2e-3" if flag == "5e-4" else flag for flag in curve.CAPACITIES["adapter-r32"]
    ]


def test_a_lease_refuses_capacities_it_cannot_train_before_it_starts(tmp_path, monkeypatch):
    """`scale_run.py run` refuses an unknown capacity, and a warm-start preset whose drafter the call did not carry,
    before any of the lease's time goes to runs that would fail on start."""
    import argparse

    scale = load_benchmark("gpu/scale_run")
    assert scale._missing_drafters(["warm-r32-lr2e-3", "adapter-r8"]) == []  # the shipped drafter is in the checkout
    monkeypatch.setitem(scale.CAPACITIES, "warm-elsewhere", ["--drafter", str(tmp_path / "absent"), "--dtype", "bf16"])
    with pytest.raises(SystemExit, match="absent.*carry"):
        scale.run(argparse.Namespace(capacities="adapter-r8,warm-elsewhere", small=""))
    with pytest.raises(SystemExit, match="unknown capacities.*adapter-r9"):
        scale.run(argparse.Namespace(capacities="adapter-r9", small=""))
