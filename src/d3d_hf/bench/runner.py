"""Running the benchmark: `run_benchmark` decodes the prompts with every method, interleaved, one prompt or one
left-padded batch at a time, and times each call (the `d3d_hf.bench` docstring says what is measured)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

import torch
from tqdm.auto import tqdm

from ..prompts import Prompt, encode_prompt
from .methods import DEFAULT_METHODS, METHODS, _check_methods
from .recording import RoundRecorder, RoundStats
from .summary import PromptRun, summarize


def _generate(target, input_ids: torch.LongTensor, max_new_tokens: int, **kwargs) -> torch.LongTensor:
    settings = {"max_new_tokens": max_new_tokens, "do_sample": False}
    if "generation_config" in kwargs:
        # a method's own GenerationConfig gets the harness's settings (transformers deprecates passing both)
        kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
        kwargs["generation_config"].update(**settings)
    else:
        kwargs.update(settings)
    return target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)


def run_benchmark(
    target,
    tokenizer,
    prompts: Sequence[Prompt],
    methods: Sequence[str] = DEFAULT_METHODS,
    drafter=None,
    max_new_tokens: int = 128,
    warmup: bool = True,
    progress: bool = True,
    on_prompt: Callable[[Prompt, dict[str, PromptRun]], None] | None = None,
    *,
    assistant=None,
    prompt_lookup_num_tokens: int = 10,
    max_matching_ngram_size: int = 2,
    resources: Mapping[str, Any] | None = None,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Runs `methods` interleaved on `prompts` (greedy) and returns per-prompt runs and per-method summaries.

    Args:
        target (`PreTrainedModel`): the target causal LM.
        tokenizer (`PreTrainedTokenizerBase`): its tokenizer (chat template used for the prompts).
        prompts (`Sequence[Prompt]`): the prompts.
        methods (`Sequence[str]`, defaults to `("target", "d3d")`): names from `METHODS`; `target` is always run
            first (it is the reference).
        drafter (`D3DForDiffusionDrafting`, *optional*): required for `d3d`.
        max_new_tokens (`int`, defaults to 128): new tokens per prompt.
        warmup (`bool`, defaults to `True`): one untimed short call per method first.
        progress (`bool`, defaults to `True`): show a tqdm progress bar.
        on_prompt (`Callable`, *optional*): called after each prompt with the prompt and its runs by method.
        assistant (`PreTrainedModel`, *optional*): autoregressive assistant of the same tokenizer, for `ar-assist`.
        prompt_lookup_num_tokens (`int`, defaults to 10), max_matching_ngram_size (`int`, defaults to 2): `pld`
            settings (transformers' `generate` arguments of the same names).
        resources (`Mapping`, *optional*): further resources for registered methods (merged over the above).
        batch_size (`int`, defaults to 1): prompts per batch (`d3d_hf.bench` docstring, "Batches"); a run is then
            one batch.

    Returns:
        `dict` with `runs` (method -> list of `PromptRun` as dicts), `summary` (method -> `summarize(...)`, plus
        `batch_size` and `one_at_a_time` when `batch_size > 1`) and `method_settings` (method -> its recorded
        settings).

    Raises:
        ValueError: for an unknown method, no prompts, a method without the resource it needs, or `batch_size < 1`.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an int >= 1, got {batch_size!r}.")
    res: dict[str, Any] = {
        "drafter": drafter,
        "assistant": assistant,
        "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
        "max_matching_ngram_size": max_matching_ngram_size,
        **(resources or {}),
    }
    methods = _check_methods(methods, res)
    if not prompts:
        raise ValueError("No prompts to benchmark.")
    kwargs = {m: METHODS[m].generate_kwargs(res) for m in methods}
    recorder = RoundRecorder()
    runs: dict[str, list[PromptRun]] = {m: [] for m in methods}

    recorded: dict[str, dict] = {}

    def record(m: str) -> None:
        """Keeps method `m`'s settings as its own call left them (a D3D method's come from the drafter's
        `last_generation_stats`, which the next method's call replaces)."""
        if METHODS[m].settings:
            recorded[m] = METHODS[m].settings(res)

    def settings_of(m: str) -> dict:
        return recorded.get(m) or (METHODS[m].settings(res) if METHODS[m].settings else {})

    def call(m: str, input_ids: torch.LongTensor, new_tokens: int) -> torch.LongTensor:
        if METHODS[m].read_stats is None:
            output = _generate(target, input_ids, new_tokens, **kwargs[m])
        else:
            with recorder.attach(target, res.get("drafter")):
                output = _generate(target, input_ids, new_tokens, **kwargs[m])
        record(m)
        return output

    encoded = [encode_prompt(tokenizer, p).to(target.device) for p in prompts]
    if batch_size > 1:
        runs = _run_batches(
            target,
            tokenizer,
            prompts,
            encoded,
            methods,
            res,
            kwargs,
            recorder,
            batch_size,
            max_new_tokens,
            warmup,
            progress,
            on_prompt,
            record,
        )
        summary = {m: summarize(runs[m], runs["target"]) for m in methods}
        for m in methods:
            summary[m].update(batch_size=batch_size, one_at_a_time=not METHODS[m].batches)
        return {
            "runs": {m: [asdict(r) for r in rs] for m, rs in runs.items()},
            "summary": summary,
            "method_settings": {m: settings_of(m) for m in methods},
        }
    if warmup:
        for m in methods:
            call(m, encoded[0], min(8, max_new_tokens))

    for prompt, input_ids in tqdm(list(zip(prompts, encoded, strict=True)), desc="bench", disable=not progress):
        reference_ids = None
        per_method = {}
        for m in methods:
            start = time.perf_counter()
            output = call(m, input_ids, max_new_tokens)
            seconds = time.perf_counter() - start
            new_ids = output[0, input_ids.shape[1] :].tolist()
            if m == "target":
                reference_ids = new_ids
            method = METHODS[m]
            stats = RoundStats(rounds=len(new_ids)) if method.read_stats is None else method.read_stats(res, recorder)
            run = PromptRun(
                prompt_id=prompt.id,
                new_tokens=len(new_ids),
                seconds=seconds,
                rounds=stats.rounds,
                tau=len(new_ids) / stats.rounds if stats.rounds else 0.0,
                matches_target=new_ids == reference_ids,
                output_ids=new_ids,
                **_round_fields(stats),
            )
            runs[m].append(run)
            per_method[m] = run
        if on_prompt is not None:
            on_prompt(prompt, per_method)

    summary = {m: summarize(runs[m], runs["target"]) for m in methods}
    method_settings = {m: settings_of(m) for m in methods}
    return {
        "runs": {m: [asdict(r) for r in rs] for m, rs in runs.items()},
        "summary": summary,
        "method_settings": method_settings,
    }


def _left_pad(encoded: Sequence[torch.LongTensor], pad_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`(input_ids, attention_mask)` of `(1, n)` prompts, left-padded to the longest."""
    width = max(ids.shape[1] for ids in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long, device=encoded[0].device)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(encoded):
        input_ids[i, width - ids.shape[1] :] = ids[0]
        mask[i, width - ids.shape[1] :] = 1
    return input_ids, mask


def _generated(row: torch.Tensor, eos_ids: set[int]) -> list[int]:
    """A row's generated ids up to and including its first eos (what follows is a batch's padding)."""
    tokens = row.tolist()
    ends = [i for i, token in enumerate(tokens) if token in eos_ids]
    return tokens[: ends[0] + 1] if ends else tokens


def _round_fields(stats: RoundStats) -> dict[str, Any]:
    """A `RoundStats`'s fields but `rounds`, lists copied: what a `PromptRun` takes from it."""
    return {
        f.name: list(getattr(stats, f.name)) if isinstance(getattr(stats, f.name), list) else getattr(stats, f.name)
        for f in fields(RoundStats)
        if f.name != "rounds"
    }


def _combine(stats: Sequence[RoundStats]) -> RoundStats:
    """One `RoundStats` of several calls (a batch's prompts run one at a time): lists concatenated, counts and
    seconds summed (`hits`/`packed_rounds` over the calls that have them, `None` when none has)."""
    combined = {}
    for f in fields(RoundStats):
        values = [getattr(s, f.name) for s in stats]
        if values and isinstance(values[0], list):
            combined[f.name] = [x for v in values for x in v]
        else:
            present = [v for v in values if v is not None]
            combined[f.name] = sum(present) if present else None
    return RoundStats(**combined)


def _run_batches(
    target,
    tokenizer,
    prompts,
    encoded,
    methods,
    res,
    kwargs,
    recorder,
    batch_size,
    max_new_tokens,
    warmup,
    progress,
    on_prompt,
    record,
) -> dict[str, list[PromptRun]]:
    """`run_benchmark`'s loop over batches of `batch_size` prompts (`d3d_hf.bench` docstring, "Batches"): one
    `PromptRun` per batch and method; `record(m)` keeps a method's settings after each of its calls."""
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = target.generation_config.pad_token_id
    eos = target.generation_config.eos_token_id
    if pad_id is None:
        pad_id = eos[0] if isinstance(eos, list) else eos
    if pad_id is None:
        raise ValueError("Batched benchmarks need a pad token: the tokenizer and the target define none.")
    eos_ids = set() if eos is None else {int(e) for e in (eos if isinstance(eos, list) else [eos])}

    def generate(m: str, input_ids, mask, settings) -> tuple[torch.LongTensor, list[RoundStats]]:
        method = METHODS[m]
        if method.read_stats is None:
            return target.generate(input_ids, attention_mask=mask, **settings), []
        with recorder.attach(target, res.get("drafter")):
            out = target.generate(input_ids, attention_mask=mask, **settings)
        return out, [method.read_stats(res, recorder)]

    def call(m: str, input_ids, mask, new_tokens: int) -> tuple[list[list[int]], list[RoundStats]]:
        """Generated ids per sequence, and the round statistics of the call (one per prompt one at a time)."""
        settings = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": pad_id, **kwargs[m]}
        if METHODS[m].batches:
            out, stats = generate(m, input_ids, mask, settings)
            record(m)
            return [_generated(row, eos_ids) for row in out[:, input_ids.shape[1] :]], stats
        sequences, stats = [], []
        for row, row_mask in zip(input_ids, mask, strict=True):
            ids = row[row_mask.bool()][None]
            out, one = generate(m, ids, torch.ones_like(ids), settings)
            sequences.append(_generated(out[0, ids.shape[1] :], eos_ids))
            stats += one
        record(m)
        return sequences, stats

    batches = [list(range(i, min(i + batch_size, len(prompts)))) for i in range(0, len(prompts), batch_size)]
    padded = [_left_pad([encoded[i] for i in batch], pad_id) for batch in batches]
    if warmup:
        for m in methods:
            call(m, *padded[0], min(8, max_new_tokens))
    runs: dict[str, list[PromptRun]] = {m: [] for m in methods}
    for batch, (input_ids, mask) in tqdm(list(zip(batches, padded, strict=True)), desc="bench", disable=not progress):
        reference = None
        per_method = {}
        for m in methods:
            start = time.perf_counter()
            sequences, stats = call(m, input_ids, mask, max_new_tokens)
            seconds = time.perf_counter() - start
            if m == "target":
                reference = sequences
            new_tokens = sum(len(s) for s in sequences)
            if stats:
                rounds = _combine(stats)
            else:  # plain decoding: one forward per token of the longest sequence (a batch) or of each one
                rounds = RoundStats(rounds=max(map(len, sequences)) if METHODS[m].batches else new_tokens)
            run = PromptRun(
                prompt_id="+".join(prompts[i].id for i in batch),
                new_tokens=new_tokens,
                seconds=seconds,
                rounds=rounds.rounds,
                tau=new_tokens / rounds.rounds if rounds.rounds else 0.0,
                matches_target=sequences == reference,
                output_ids=[t for s in sequences for t in s],
                **_round_fields(rounds),
                sequences=sequences,
            )
            runs[m].append(run)
            per_method[m] = run
        if on_prompt is not None:
            for i in batch:
                on_prompt(prompts[i], per_method)
    return runs


__all__ = ["run_benchmark"]
