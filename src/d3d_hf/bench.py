"""Benchmark harness: runs decoding methods interleaved on the same prompts; metrics of docs/DESIGN.md section 6.

Methods (greedy decoding, batch size 1):

- `target`: plain `target.generate` (the reference every other method is checked against).
- `d3d`: `target.generate(..., assistant_model=drafter)` with synchronous D3D drafting.

For each prompt the methods run one after the other (interleaved), so slow drifts of the machine hit all methods
alike. Timing covers the whole `generate` call (prefill included) and is wall-clock.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from .prompts import Prompt, encode_prompt

METHODS = ("target", "d3d")


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
        draft_seconds, verify_seconds (`float`): summed per-round draft and verify wall time (D3D only).
        output_ids (`list[int]`): the generated ids.
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

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def summarize(runs: Sequence[PromptRun], reference: Sequence[PromptRun]) -> dict[str, Any]:
    """Aggregates one method's runs against the `target` runs of the same prompts (same order).

    Returns:
        `dict` with `tokens_per_second` (aggregate: all tokens / all seconds), `median_tokens_per_second`,
        `speedup` (aggregate tokens/s over the reference's aggregate), `median_speedup` (median over prompts of the
        per-prompt speed-up), `tau` (all new tokens / all target forwards), `lossless_match` (fraction of prompts
        whose output equals the reference's), `rounds`, `new_tokens`, `seconds`, and the mean per-round
        `draft_ms` and `verify_ms`.

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
    }


def _generate(target, input_ids: torch.LongTensor, max_new_tokens: int, assistant_model=None) -> torch.LongTensor:
    return target.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        assistant_model=assistant_model,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )


def run_benchmark(
    target,
    tokenizer,
    prompts: Sequence[Prompt],
    methods: Sequence[str] = METHODS,
    drafter=None,
    max_new_tokens: int = 128,
    warmup: bool = True,
    progress: bool = True,
    on_prompt: Callable[[Prompt, dict[str, PromptRun]], None] | None = None,
) -> dict[str, Any]:
    """Runs `methods` interleaved on `prompts` (greedy) and returns per-prompt runs and per-method summaries.

    Args:
        target (`PreTrainedModel`): the target causal LM.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer (chat template used for the prompts).
        prompts (`Sequence[Prompt]`): the prompts.
        methods (`Sequence[str]`): a subset of `METHODS`; `target` is always run (it is the reference).
        drafter (`D3DForDiffusionDrafting`, *optional*): required for `d3d`.
        max_new_tokens (`int`, defaults to 128): new tokens per prompt.
        warmup (`bool`, defaults to `True`): one untimed short call per method first.
        progress (`bool`, defaults to `True`): show a tqdm progress bar.
        on_prompt (`Callable`, *optional*): called after each prompt with the prompt and its runs by method.

    Returns:
        `dict` with `runs` (method -> list of `PromptRun` as dicts) and `summary` (method -> `summarize(...)`).

    Raises:
        ValueError: for an unknown method, no prompts, or `d3d` without a drafter.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"Unknown method(s) {unknown}; choose from {list(METHODS)}.")
    if not prompts:
        raise ValueError("No prompts to benchmark.")
    if "d3d" in methods and drafter is None:
        raise ValueError("Method `d3d` needs a drafter (`--drafter`).")
    methods = ["target"] + [m for m in methods if m != "target"]
    assistants = {"target": None, "d3d": drafter}
    runs: dict[str, list[PromptRun]] = {m: [] for m in methods}

    encoded = [encode_prompt(tokenizer, p).to(target.device) for p in prompts]
    if warmup:
        for m in methods:
            _generate(target, encoded[0], min(8, max_new_tokens), assistants[m])

    for prompt, input_ids in tqdm(list(zip(prompts, encoded, strict=True)), desc="bench", disable=not progress):
        reference_ids = None
        per_method = {}
        for m in methods:
            start = time.perf_counter()
            output = _generate(target, input_ids, max_new_tokens, assistants[m])
            seconds = time.perf_counter() - start
            new_ids = output[0, input_ids.shape[1] :].tolist()
            if m == "target":
                reference_ids = new_ids
                rounds, draft_s, verify_s = len(new_ids), 0.0, 0.0
            else:
                stats = assistants[m].last_generation_stats
                rounds, draft_s, verify_s = stats.rounds, sum(stats.draft_seconds), sum(stats.verify_seconds)
            run = PromptRun(
                prompt_id=prompt.id,
                new_tokens=len(new_ids),
                seconds=seconds,
                rounds=rounds,
                tau=len(new_ids) / rounds if rounds else 0.0,
                matches_target=new_ids == reference_ids,
                draft_seconds=draft_s,
                verify_seconds=verify_s,
                output_ids=new_ids,
            )
            runs[m].append(run)
            per_method[m] = run
        if on_prompt is not None:
            on_prompt(prompt, per_method)

    summary = {m: summarize(runs[m], runs["target"]) for m in methods}
    return {"runs": {m: [asdict(r) for r in rs] for m, rs in runs.items()}, "summary": summary}


def merge_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Merges results of `run_benchmark` over disjoint prompt shards (same methods and settings) into one.

    The per-prompt runs are concatenated in the given order and the summaries recomputed with `summarize`; the
    settings are the first shard's, with `num_prompts` updated and the shard commands listed under `commands`.

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
    settings["commands"] = [r.get("settings", {}).get("command") for r in results]
    settings.pop("command", None)
    return {
        "runs": {m: [asdict(run) for run in rs] for m, rs in runs.items()},
        "summary": {m: summarize(runs[m], runs["target"]) for m in methods},
        "settings": settings,
    }


def environment_info() -> dict[str, Any]:
    """Versions, machine and thread count, for the results file (docs/DESIGN.md section 6: always record these)."""
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    """Markdown table of per-method summaries."""
    lines = [
        "| method | tokens/s | speed-up (aggregate) | speed-up (median) | tau | lossless match "
        "| draft ms/round | verify ms/round |",
        "|" + "---|" * 8,
    ]
    for method, s in summary.items():
        lines.append(
            f"| {method} | {s['tokens_per_second']:.1f} | {s['speedup']:.2f}x | {s['median_speedup']:.2f}x | "
            f"{s['tau']:.2f} | {100 * s['lossless_match']:.0f}% | {s['draft_ms']:.1f} | {s['verify_ms']:.1f} |"
        )
    return "\n".join(lines)


__all__ = ["METHODS", "PromptRun", "environment_info", "format_table", "merge_results", "run_benchmark", "summarize"]
