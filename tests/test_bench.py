"""Benchmark harness (d3d_hf.bench): statistics, the method registry, every method checked against the target."""

from __future__ import annotations

import pytest
import torch
from _tiny import tiny_target, weight_sharing_drafter

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.bench import (
    METHODS,
    BenchMethod,
    PromptRun,
    RoundStats,
    format_round_plans,
    format_table,
    merge_results,
    register_method,
    run_benchmark,
    summarize,
)
from d3d_hf.prompts import Prompt


class IdTokenizer:
    """A stand-in tokenizer whose 'chat template' reads the user message as space-separated token ids."""

    chat_template = "ids"

    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": [int(t) for t in messages[-1]["content"].split()]}


def _prompts(n=3, vocab_size=97):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, vocab_size, (6 + i,), generator=g).tolist() for i in range(n)]
    return [
        Prompt(id=f"p{i}", messages=[{"role": "user", "content": " ".join(map(str, x))}]) for i, x in enumerate(ids)
    ]


def _run(prompt_id, tokens, seconds, rounds, match=True, **kwargs):
    return PromptRun(
        prompt_id=prompt_id,
        new_tokens=tokens,
        seconds=seconds,
        rounds=rounds,
        tau=tokens / rounds,
        matches_target=match,
        **kwargs,
    )


# ---------------------------------------------------------------------------------------------------------------
# statistics


def test_summarize_median_aggregate_tau_and_match():
    reference = [_run("a", 10, 1.0, 10), _run("b", 10, 2.0, 10), _run("c", 30, 1.0, 30)]
    runs = [
        _run("a", 10, 0.5, 4, draft_seconds=0.2, verify_seconds=0.2),  # 2x
        _run("b", 10, 4.0, 5, match=False, draft_seconds=1.0, verify_seconds=2.0),  # 0.5x
        _run("c", 30, 0.5, 10, draft_seconds=0.1, verify_seconds=0.3),  # 2x
    ]
    s = summarize(runs, reference)
    assert s["speedup"] == pytest.approx((50 / 5.0) / (50 / 4.0))  # aggregate: all tokens over all seconds
    assert s["median_speedup"] == pytest.approx(2.0)
    assert s["tau"] == pytest.approx(50 / 19)
    assert s["lossless_match"] == pytest.approx(2 / 3)
    assert s["draft_ms"] == pytest.approx(1e3 * 1.3 / 19)
    assert s["verify_ms"] == pytest.approx(1e3 * 2.5 / 19)
    assert s["hit_rate"] is None


def test_summarize_hit_rate_counts_only_runs_that_report_hits():
    reference = [_run("a", 10, 1.0, 10), _run("b", 10, 1.0, 10)]
    runs = [_run("a", 10, 1.0, 4, hits=1), _run("b", 10, 1.0, 6, hits=6)]
    assert summarize(runs, reference)["hit_rate"] == pytest.approx(7 / 10)
    assert summarize([_run("a", 10, 1.0, 4, hits=0)], reference[:1])["hit_rate"] == 0.0


def test_summarize_rejects_misaligned_runs():
    with pytest.raises(ValueError, match="same prompts"):
        summarize([_run("a", 1, 1.0, 1)], [_run("b", 1, 1.0, 1)])
    with pytest.raises(ValueError, match="one reference run per run"):
        summarize([], [])


def test_merge_reads_old_result_files_and_recomputes():
    old = {
        "prompt_id": "a",
        "new_tokens": 4,
        "seconds": 1.0,
        "rounds": 4,
        "tau": 1.0,
        "matches_target": True,
        "draft_seconds": 0.0,
        "verify_seconds": 0.0,
        "output_ids": [1, 2, 3, 4],
    }  # written before the new fields
    shard = {"runs": {"target": [old]}, "summary": {}, "settings": {"command": "x"}}
    other = {"runs": {"target": [dict(old, prompt_id="b")]}, "summary": {}, "settings": {"command": "y"}}
    merged = merge_results([shard, other])
    assert merged["summary"]["target"]["prompts"] == 2 and merged["settings"]["commands"] == ["x", "y"]


def test_format_table_adds_columns_only_when_present():
    base = {
        "tokens_per_second": 10.0,
        "speedup": 1.0,
        "median_speedup": 1.0,
        "tau": 1.0,
        "lossless_match": 1.0,
        "draft_ms": 0.0,
        "verify_ms": 0.0,
    }
    plain = format_table({"target": base})
    assert "hit rate" not in plain and "predicted" not in plain
    assert all(line.count("|") == 9 for line in plain.splitlines())
    table = format_table({"target": dict(base, hit_rate=None), "x": dict(base, hit_rate=0.25, predicted_speedup=1.5)})
    assert "| hit rate | predicted speed-up |" in table
    assert table.splitlines()[-1].endswith("| 25% | 1.50x |") and table.splitlines()[-2].endswith("| - | - |")


# ---------------------------------------------------------------------------------------------------------------
# methods on tiny models


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama", sharpen=10.0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    assistant = tiny_target("llama", sharpen=10.0)  # the same weights: it drafts what the target decodes
    return target, drafter, assistant


def test_every_method_matches_the_target_and_reports_rounds(pair):
    target, drafter, assistant = pair
    result = run_benchmark(
        target,
        IdTokenizer(),
        _prompts(),
        methods=[m for m in METHODS if m != "d3d-fused"],  # fused drafting needs a weight-sharing drafter: below
        drafter=drafter,
        assistant=assistant,
        max_new_tokens=20,
        progress=False,
        prompt_lookup_num_tokens=3,
    )
    assert list(result["summary"]) == ["target", "pld", "ar-assist", "d3d", "d3d-async", "d3d-tree", "engine-lookup",
                                      "d3d-no-fused", "d3d-own-cache", "d3d-target-layouts"]
    for run in result["runs"]["engine-lookup"]:  # the engine without its drafter never drafts
        assert "drafter" not in run["round_sources"]
    assert result["summary"]["engine-lookup"]["drafter_token_share"] == 0.0
    for method, runs in result["runs"].items():
        for run in runs:
            assert run["matches_target"], (method, run["prompt_id"])
            assert run["new_tokens"] == 20
            if method == "target":
                assert run["rounds"] == 20 and run["acceptance_lengths"] == []
            else:
                # one acceptance length per target forward, summing to the generated tokens
                assert len(run["acceptance_lengths"]) == run["rounds"] > 0
                assert sum(run["acceptance_lengths"]) == run["new_tokens"]
                assert run["draft_seconds"] > 0 and run["verify_seconds"] > 0
        assert result["summary"][method]["lossless_match"] == 1.0
    # an assistant with the target's own weights drafts what the target would decode: every round accepts its drafts
    # (transformers' assistant stops drafting below its confidence threshold, so a round may hold just one)
    assert result["summary"]["ar-assist"]["tau"] >= 2
    assert result["method_settings"]["pld"]["prompt_lookup_num_tokens"] == 3
    assert result["method_settings"]["ar-assist"]["num_assistant_tokens"] == 20
    assert result["method_settings"]["d3d"]["block_size"] == 4
    assert result["method_settings"]["d3d-async"]["hypotheses"] == 4
    assert result["method_settings"]["d3d-tree"]["tree_budget"] == 16
    assert result["method_settings"]["d3d-async"]["worker_threads"] == max(1, torch.get_num_threads() // 2)
    # each method's settings are its own calls', not those of the D3D method that ran last
    settings = result["method_settings"]
    assert settings["d3d"]["options"]["d3d_draft_passes"] is True and settings["d3d"]["asynchronous"] is False
    assert settings["engine-lookup"]["options"]["d3d_draft_passes"] is False
    assert settings["d3d-async"]["asynchronous"] is True
    assert settings["d3d-tree"]["options"]["d3d_tree_budget"] == 16
    assert settings["d3d"]["options"]["d3d_tree_budget"] is None
    assert result["summary"]["d3d"]["hit_rate"] is None
    assert 0.0 <= result["summary"]["d3d-async"]["hit_rate"] <= 1.0
    # the instrumentation is gone after the calls
    assert "_get_candidate_generator" not in target.__dict__


def test_bench_reports_fused_successor_drafting():
    target = tiny_target("llama", seed=4, sharpen=3.0)
    drafter = weight_sharing_drafter(target, block_size=4, scale=0.05, seed=3)
    # pinned through the drafter's own generation config (what the bench's methods read unless a method sets the
    # option): a block after every acceptance length, so that hits do not depend on timings or on a policy an
    # earlier test of the process calibrated; `d3d-fused` sets d3d_fused_drafting=True (the default 'auto' is off on
    # CPU), `d3d-no-fused` False
    drafter.generation_config.d3d_num_drafts = 3
    result = run_benchmark(target, IdTokenizer(), _prompts(), methods=["target", "d3d", "d3d-fused", "d3d-no-fused"],
                           drafter=drafter, max_new_tokens=30, progress=False)
    fused = result["summary"]["d3d-fused"]["successor"]
    assert fused["verifications_with_blocks"] > 0 and 0 < fused["hit_rate"] <= 1
    assert fused["ready_rounds"] > 0 and fused["block_rows_per_verification"] > 0
    assert sum(fused["verifications_by_blocks"].values()) == fused["verifications_with_blocks"]
    assert set(fused["drafter_round_tau"]) == {"pass", "ready"} and min(fused["drafter_round_tau"].values()) >= 1
    assert "successor" not in result["summary"]["d3d-no-fused"] and "successor" not in result["summary"]["d3d"]
    assert {result["summary"][m]["lossless_match"] for m in ("d3d", "d3d-fused", "d3d-no-fused")} == {1.0}
    table = format_round_plans(result["summary"])
    assert "Fused successor drafting" in table and "| `d3d-fused` |" in table.split("Fused successor")[1]


def test_methods_need_their_resources(pair):
    target, drafter, _ = pair
    with pytest.raises(ValueError, match="`ar-assist` needs a assistant.*--assistant"):
        run_benchmark(target, IdTokenizer(), _prompts(1), methods=["target", "ar-assist"], progress=False)
    with pytest.raises(ValueError, match="`d3d` needs a drafter"):
        run_benchmark(target, IdTokenizer(), _prompts(1), methods=["d3d"], progress=False)
    with pytest.raises(ValueError, match="Unknown method"):
        run_benchmark(target, IdTokenizer(), _prompts(1), methods=["eagle"], drafter=drafter, progress=False)


def test_a_registered_method_with_hits_is_benchmarked(pair):
    """The shape of `d3d-async`: a drafter whose stats carry `hits`, registered as one entry."""
    target, drafter, _ = pair

    def read(resources, recorder):
        stats = recorder.stats()
        return RoundStats(
            stats.rounds,
            stats.draft_seconds,
            stats.verify_seconds,
            stats.acceptance_lengths,
            stats.drafted_tokens,
            hits=stats.rounds // 2,
        )

    register_method(
        BenchMethod(
            "test-hits",
            "d3d with fake hits",
            lambda r: {"assistant_model": r["drafter"]},
            read_stats=read,
            requires=("drafter",),
        )
    )
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_method(METHODS["test-hits"])
        result = run_benchmark(
            target,
            IdTokenizer(),
            _prompts(2),
            methods=["test-hits"],
            drafter=drafter,
            max_new_tokens=12,
            progress=False,
            warmup=False,
        )
        s = result["summary"]["test-hits"]
        rounds = [r["rounds"] for r in result["runs"]["test-hits"]]
        assert s["hit_rate"] == pytest.approx(sum(r // 2 for r in rounds) / sum(rounds))
        assert s["lossless_match"] == 1.0
        assert "hit rate" in format_table(result["summary"])
    finally:
        METHODS.pop("test-hits")


def test_recorder_restores_an_instance_level_factory(pair):
    target, drafter, _ = pair
    calls = []

    def factory(*args, **kwargs):
        calls.append(1)
        return type(target)._get_candidate_generator(target, *args, **kwargs)

    target.__dict__["_get_candidate_generator"] = factory
    try:
        result = run_benchmark(
            target,
            IdTokenizer(),
            _prompts(1),
            methods=["pld", "d3d"],  # pld runs in transformers' loop, which asks the factory; D3D's loop does not
            drafter=drafter,
            max_new_tokens=6,
            progress=False,
            warmup=False,
        )
        assert calls and result["summary"]["pld"]["lossless_match"] == 1.0
        assert result["summary"]["d3d"]["lossless_match"] == 1.0
        assert target.__dict__["_get_candidate_generator"] is factory
    finally:
        target.__dict__.pop("_get_candidate_generator", None)
