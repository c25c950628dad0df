"""Benchmark results: one method on one prompt (`PromptRun`), the per-method summary (`summarize`), the Markdown
tables (`format_table`, `format_round_plans`), merging shards (`merge_results`) and the machine's description
(`environment_info`)."""

from __future__ import annotations

import os
import platform
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..modeling.calibration_d3d import cpu_model
from ..utils import library_versions


@dataclass
class PromptRun:
    """One method on one prompt.

    Attributes:
        prompt_id (`str`): the prompt's id.
        new_tokens (`int`): generated tokens (prompt excluded).
        seconds (`float`): wall time of the `generate` call, seconds.
        rounds (`int`): target forwards (for `target`: one per token).
        tau (`float`): tokens committed per target forward.
        matches_target (`bool`): output identical, token for token, to the `target` method's output.
        draft_seconds, verify_seconds (`float`): summed per-round draft and verify wall time (speculative methods).
        output_ids (`list[int]`): the generated ids.
        acceptance_lengths (`list[int]`): tokens committed per round (speculative methods).
        drafted_tokens (`int`): draft tokens proposed.
        hits (`int`, *optional*): pre-drafted rounds (methods with a hit rate), else `None`.
        packed_rounds (`int`, *optional*): rounds that followed a packed pass (the hit rate's denominator).
        round_sources, round_candidates, successor_blocks, successor_masks, successor_hit_flags (`list`),
        ready_rounds (`int`), ready_round_flags (`list[bool]`): as in `RoundStats`.
        sequences (`list[list[int]]`, *optional*): a batch run's generated ids per sequence (`output_ids` is then
            their concatenation); `None` for one prompt.
    """

    prompt_id: str
    new_tokens: int
    seconds: float
    rounds: int
    tau: float
    matches_target: bool
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    drafted_tokens: int = 0
    hits: int | None = None
    packed_rounds: int | None = None
    round_sources: list[str] = field(default_factory=list)
    round_candidates: list[int] = field(default_factory=list)
    successor_blocks: list[int] = field(default_factory=list)
    successor_masks: list[int] = field(default_factory=list)
    successor_hit_flags: list[bool] = field(default_factory=list)
    ready_rounds: int = 0
    ready_round_flags: list[bool] = field(default_factory=list)
    sequences: list[list[int]] | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def summarize(runs: Sequence[PromptRun], reference: Sequence[PromptRun]) -> dict[str, Any]:
    """Aggregates one method's runs against the `target` runs of the same prompts (same order).

    Returns:
        `dict` with `tokens_per_second` (aggregate: all tokens / all seconds), `median_tokens_per_second`,
        `speedup` (aggregate tokens/s over the reference's aggregate), `median_speedup` (median over prompts of the
        per-prompt speed-up), `tau` (all new tokens / all target forwards), `lossless_match` (fraction of prompts
        whose output equals the reference's), `rounds`, `new_tokens`, `seconds`, the mean per-round `draft_ms` and
        `verify_ms`, `drafted_tokens`, and `hit_rate` (all hits / all rounds that followed a packed pass, over the
        runs that report hits; `None` when none does).

    Raises:
        ValueError: if `runs` is empty or does not line up with `reference`.
    """
    if not runs or len(runs) != len(reference):
        raise ValueError(f"Need one reference run per run, got {len(runs)} runs and {len(reference)} references.")
    if any(r.prompt_id != ref.prompt_id for r, ref in zip(runs, reference, strict=True)):
        raise ValueError("Runs and reference runs must cover the same prompts in the same order.")
    tokens = sum(r.new_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    rounds = sum(r.rounds for r in runs)
    ref_tps = sum(r.new_tokens for r in reference) / max(sum(r.seconds for r in reference), 1e-12)
    tps = tokens / max(seconds, 1e-12)
    per_prompt_speedup = [
        r.tokens_per_second / ref.tokens_per_second
        for r, ref in zip(runs, reference, strict=True)
        if ref.tokens_per_second > 0
    ]
    with_hits = [r for r in runs if r.hits is not None]
    hit_rounds = sum(r.rounds if r.packed_rounds is None else r.packed_rounds for r in with_hits)
    return {
        "prompts": len(runs),
        "new_tokens": tokens,
        "seconds": seconds,
        "rounds": rounds,
        "tokens_per_second": tps,
        "median_tokens_per_second": statistics.median(r.tokens_per_second for r in runs),
        "speedup": tps / ref_tps if ref_tps > 0 else 0.0,
        "median_speedup": statistics.median(per_prompt_speedup) if per_prompt_speedup else 0.0,
        "tau": tokens / rounds if rounds else 0.0,
        "lossless_match": sum(r.matches_target for r in runs) / len(runs),
        "draft_ms": 1e3 * sum(r.draft_seconds for r in runs) / rounds if rounds else 0.0,
        "verify_ms": 1e3 * sum(r.verify_seconds for r in runs) / rounds if rounds else 0.0,
        "drafted_tokens": sum(r.drafted_tokens for r in runs),
        "hit_rate": (sum(r.hits for r in with_hits) / hit_rounds if hit_rounds else 0.0) if with_hits else None,
        **_round_plan_summary(runs),
    }


def _round_plan_summary(runs: Sequence[PromptRun]) -> dict[str, Any]:
    """`round_sources` (rounds per candidate source), `tokens_by_source` (committed tokens per source of their
    round's candidates, bonus tokens included), `drafter_token_share` (the share of committed tokens that came from
    drafter rounds) and `candidates_histogram` (rounds per number of candidates sent, the chosen `k`) over the runs
    that record them; empty otherwise."""
    sources = [source for r in runs for source in r.round_sources]
    if not sources:
        return {}
    counts = Counter(k for r in runs for k in r.round_candidates)
    tokens = Counter()
    for r in runs:
        for source, length in zip(r.round_sources, r.acceptance_lengths, strict=False):
            tokens[source] += length
    committed = sum(tokens.values())
    out = {
        "round_sources": dict(sorted(Counter(sources).items())),
        "tokens_by_source": dict(sorted(tokens.items())),
        "drafter_token_share": tokens["drafter"] / committed if committed else 0.0,
        "candidates_histogram": {str(k): counts[k] for k in sorted(counts)},
    }
    verifications, hits, rows = Counter(), Counter(), 0
    for r in runs:
        for blocks, masks, hit in zip(r.successor_blocks, r.successor_masks, r.successor_hit_flags, strict=False):
            if blocks:
                verifications[blocks] += 1
                hits[blocks] += int(hit)
                rows += blocks * masks
    if verifications:
        total = sum(verifications.values())
        out["successor"] = {
            "verifications_with_blocks": total,
            "block_rows_per_verification": rows / total,
            "hit_rate": sum(hits.values()) / total,
            "hit_rate_by_blocks": {str(n): hits[n] / verifications[n] for n in sorted(verifications)},
            "verifications_by_blocks": {str(n): verifications[n] for n in sorted(verifications)},
            "ready_rounds": sum(r.ready_rounds for r in runs),
        }
        lengths: dict[str, list[int]] = {"pass": [], "ready": []}
        for r in runs:
            for source, ready, length in zip(r.round_sources, r.ready_round_flags, r.acceptance_lengths, strict=False):
                if source == "drafter":
                    lengths["ready" if ready else "pass"].append(length)
        out["successor"]["drafter_round_tau"] = {k: sum(v) / len(v) for k, v in lengths.items() if v}
    return out


def format_round_plans(summary: dict[str, dict[str, Any]]) -> str:
    """Markdown table of where each method's rounds took their candidates and how many they sent (the chosen-`k`
    histogram), for the methods that record it; an empty string when none does."""
    rows = [(m, s) for m, s in summary.items() if s.get("round_sources")]
    if not rows:
        return ""
    lines = [
        "| method | target steps | lookup rounds | drafter rounds | tokens from drafter rounds "
        "| rounds by candidates sent (k: rounds) |"
    ]
    lines.append("|---|---|---|---|---|---|")
    for method, s in rows:
        sources = s["round_sources"]
        histogram = ", ".join(f"{k}: {n}" for k, n in s["candidates_histogram"].items())
        share = s.get("drafter_token_share")
        share_text = "" if share is None else f"{100 * share:.0f}%"
        lines.append(
            f"| `{method}` | {sources.get('target', 0)} | {sources.get('lookup', 0)} | {sources.get('drafter', 0)} "
            f"| {share_text} | {histogram} |"
        )
    fused = [(m, s["successor"]) for m, s in rows if s.get("successor")]
    if fused:
        lines += [
            "",
            "Fused successor drafting (blocks drafted inside verifications; a hit: the accepted path ended at one):",
            "",
            "| method | verifications with blocks | block rows each | hit rate | hit rate by blocks (blocks: rate, "
            "verifications) | rounds drafted by a hit (no pass) | tau of drafter rounds: after a pass / ready |",
            "|---|---|---|---|---|---|---|",
        ]
        for method, f in fused:
            counts, taus = f["verifications_by_blocks"], f.get("drafter_round_tau", {})
            rates = f["hit_rate_by_blocks"].items()
            by_blocks = ", ".join(f"{n}: {100 * rate:.0f}% ({counts[n]})" for n, rate in rates)
            lines.append(
                f"| `{method}` | {f['verifications_with_blocks']} | {f['block_rows_per_verification']:.1f} "
                f"| {100 * f['hit_rate']:.0f}% | {by_blocks} | {f['ready_rounds']} | "
                + " / ".join(f"{taus[k]:.2f}" if k in taus else "-" for k in ("pass", "ready"))
                + " |"
            )
    return "\n".join(lines)


def merge_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merges results of `run_benchmark` over disjoint prompt shards (same methods and settings) into one.

    The per-prompt runs are concatenated in the given order and the summaries recomputed with `summarize`; the
    settings (and method settings) are the first shard's, with `num_prompts` updated and the shard commands listed
    under `commands`. A cost model (`cost_model`) is not carried over: it was measured per shard.

    Raises:
        ValueError: if `results` is empty, the shards ran different methods, or a prompt appears twice.
    """
    if not results:
        raise ValueError("Nothing to merge.")
    methods = list(results[0]["runs"])
    if any(list(r["runs"]) != methods for r in results):
        raise ValueError(f"Every shard must run the same methods ({methods}).")
    runs = {m: [PromptRun(**run) for r in results for run in r["runs"][m]] for m in methods}
    ids = [run.prompt_id for run in runs["target"]]
    if len(set(ids)) != len(ids):
        raise ValueError("The shards overlap: a prompt id appears more than once.")
    settings = dict(results[0].get("settings", {}))
    settings["num_prompts"] = len(ids)
    settings["limit"], settings["offset"] = None, 0  # the merged shards are one run over their union
    settings["commands"] = [r.get("settings", {}).get("command") for r in results]
    settings.pop("command", None)
    merged = {
        "runs": {m: [asdict(run) for run in rs] for m, rs in runs.items()},
        "summary": {m: summarize(runs[m], runs["target"]) for m in methods},
        "settings": settings,
    }
    if "method_settings" in results[0]:
        merged["method_settings"] = results[0]["method_settings"]
    return merged


def environment_info() -> dict[str, Any]:
    """Versions, machine, CPU model with its speed-relevant extensions (AVX2, AVX-512, AVX-512-BF16, AMX) and thread
    count, for the results file (docs/DESIGN.md section 6: always record these)."""
    versions = library_versions("torch", "transformers")
    return {
        "torch": versions["torch"],
        "transformers": versions["transformers"],
        "python": versions["python"],
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu": cpu_model(),
    }


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """Markdown table of per-method summaries.

    The eight base columns are always shown; a `hit rate` column is added when some method reports one, and a
    `predicted speed-up` column (the cost model's, `d3d_hf.costmodel`) when some summary has `predicted_speedup`.
    """
    show_hits = any(s.get("hit_rate") is not None for s in summary.values())
    show_pred = any(s.get("predicted_speedup") is not None for s in summary.values())
    header = (
        "| method | tokens/s | speed-up (aggregate) | speed-up (median) | tau | lossless match "
        "| draft ms/round | verify ms/round |"
    )
    columns = 8
    if show_hits:
        header += " hit rate |"
        columns += 1
    if show_pred:
        header += " predicted speed-up |"
        columns += 1
    lines = [header, "|" + "---|" * columns]
    for method, s in summary.items():
        name = f"{method} (batch of {s['batch_size']})" if s.get("batch_size", 1) > 1 else method
        if s.get("batch_size", 1) > 1 and s.get("one_at_a_time"):
            name = f"{method} (one at a time)"
        row = (
            f"| {name} | {s['tokens_per_second']:.1f} | {s['speedup']:.2f}x | {s['median_speedup']:.2f}x | "
            f"{s['tau']:.2f} | {100 * s['lossless_match']:.0f}% | {s['draft_ms']:.1f} | {s['verify_ms']:.1f} |"
        )
        if show_hits:
            row += f" {100 * s['hit_rate']:.0f}% |" if s.get("hit_rate") is not None else " - |"
        if show_pred:
            row += f" {s['predicted_speedup']:.2f}x |" if s.get("predicted_speedup") is not None else " - |"
        lines.append(row)
    return "\n".join(lines)


__all__ = [
    "PromptRun",
    "environment_info",
    "format_round_plans",
    "format_table",
    "merge_results",
    "summarize",
]
