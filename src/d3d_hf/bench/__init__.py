"""Benchmark harness: runs decoding methods interleaved on the same prompts; metrics of docs/DESIGN.md section 6.

Methods (greedy decoding), one entry each in the registry `METHODS`:

- `target`: plain `target.generate` (the reference every other method is checked against).
- `pld`: transformers' prompt-lookup decoding, `target.generate(..., prompt_lookup_num_tokens=N)`: drafts are the
  tokens that followed the last earlier occurrence of the current n-gram in the sequence (no draft model).
- `ar-assist`: transformers' assisted generation with an autoregressive assistant of the same tokenizer,
  `target.generate(..., assistant_model=assistant)` (the assistant drafts up to its `num_assistant_tokens` tokens
  one forward each, stopping early below `assistant_confidence_threshold`; transformers' defaults unless the
  assistant's generation config sets them).
- `d3d`: `target.generate(..., assistant_model=drafter)` with synchronous D3D drafting.
- `d3d-async`: the same with `d3d_async=True` (packed successor drafting during verification, `--num-hypotheses`,
  `--reuse-on-miss`); reports the hit rate.

For each prompt the methods run one after the other (interleaved), so slow drifts of the machine hit all methods
alike. Every method runs on the same target object, so dtype and threads are the same.

**Batches** (`batch_size > 1`, `d3d-hf bench --batch-size N`): the prompts are taken `N` at a time (consecutive),
left-padded, and a method that decodes batches (`BenchMethod.batches`: `target`, transformers' batched greedy
decoding; `d3d` and its synchronous variants, D3D's batched loop) decodes each batch in one `generate` call; the
others (`pld`, `ar-assist`: transformers refuses an assistant or prompt lookup for a batch; `d3d-async`, `d3d-tree`:
D3D decodes them one sequence at a time) run the batch's prompts one after the other, and the table marks them "one
at a time". A run is then one batch: its tokens are all its sequences' generated tokens (each up to its eos), its
seconds the wall time of the batch (tokens/s of the whole batch), its rounds the target forwards of the batch, and
it matches the target when every sequence equals its `target` output.

What is measured, and how honestly:

- **tokens/s** and **speed-up**: new tokens over the wall time of the whole `generate` call (prefill included).
- **rounds**: target forwards. For `target` one per generated token; for the speculative methods one per
  verification round (the first round includes the prompt prefill).
- **tau**: new tokens / rounds, bonus token included.
- **draft / verify time per round** (speculative methods): the candidate generator of each call is instrumented
  (`RoundRecorder`) with the bundle's `RoundClock`, or its own clock is read when it keeps one (D3D's candidate
  generator does: one clock per round, never two): *draft* is the wall time inside `get_candidates` (pld: the
  n-gram lookup; ar-assist: the assistant's forwards, including its own prompt prefill in round 1; d3d: the draft
  pass); *verify* is the time from the end of
  `get_candidates` to `update_candidate_strategy`, i.e. the target's forward over the candidates plus
  transformers' acceptance bookkeeping (round 1 includes the target's prefill). Not in either: the work
  transformers does between rounds after `update_candidate_strategy` (model-kwargs update, stopping criteria);
  it is in tokens/s but not in draft + verify. For `target` no split is measured (0).
- **acceptance lengths**: tokens committed per round (`num_matches + 1`, after transformers' eos/length crop).
- **hit rate** (methods whose stats have `hits`, e.g. an asynchronous drafter): hits / rounds that followed a
  packed pass (`hits / (hits + reused + misses)`, the definition of `D3DGenerationStats.hit_rate`).
- **lossless match**: the output equals the `target` output token for token.

A new method is one `BenchMethod` passed to `register_method`: how to call `generate` (extra keyword arguments)
and how to read its per-round statistics after the call.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from tqdm.auto import tqdm

from ..modeling.calibration_d3d import cpu_model
from ..modeling.options_d3d import D3DGenerationOptions
from ..modeling.runtime_d3d import RoundClock
from ..prompts import Prompt, encode_prompt
from ..utils import library_versions


@dataclass
class RoundStats:
    """Per-round statistics of one `generate` call, as a method reports them.

    Attributes:
        rounds (`int`): target forwards.
        draft_seconds, verify_seconds (`float`): summed per-round draft and verify wall time (0 when not split).
        acceptance_lengths (`list[int]`): tokens committed per round (empty when not recorded).
        drafted_tokens (`int`): draft tokens proposed to the target.
        hits (`int`, *optional*): rounds whose block was pre-drafted (asynchronous drafting); `None` for methods
            without the notion.
        packed_rounds (`int`, *optional*): rounds that followed a packed pass (hits, reused and missed blocks), the
            denominator of the hit rate; `None` with `hits`.
        round_sources, round_candidates (`list`): per round, where its candidates came from (`"drafter"`,
            `"lookup"`, `"target"`) and how many were sent (the chosen `k`); empty for methods that do not choose.
        successor_blocks, successor_masks, successor_hit_flags (`list`): fused successor drafting
            (`D3DGenerationStats`): per verification, the drafter blocks it computed, their masks each, and whether
            the accepted path ended at one; empty without it.
        ready_rounds (`int`): rounds whose drafts were such a block (no draft pass).
        ready_round_flags (`list[bool]`): per round, whether it was one of those.
    """

    rounds: int
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
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


class RoundRecorder:
    """Times the rounds of transformers' assisted-generation loop by instrumenting its candidate generator.

    `with recorder.attach(target): target.generate(...)` makes the target's `_get_candidate_generator` (whatever
    it resolves to, including the D3D hook) return its usual generator with `get_candidates` and
    `update_candidate_strategy` wrapped (instance attributes, so `isinstance` checks still see the original
    class). Rounds are timed by one `RoundClock`: the generator's own when it keeps one (`round_clock`, as
    `D3DCandidateGenerator` does), else the recorder's. After the call, `stats()` holds the rounds of that call.
    Outside `attach` nothing is changed.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.clock = RoundClock()
        self.drafted: list[int] = []
        self.acceptance_lengths: list[int] = []

    def _instrument(self, generator):
        times_itself = isinstance(getattr(generator, "round_clock", None), RoundClock)
        if times_itself:  # the generator keeps the round clock (D3D): read it instead of timing twice
            self.clock = generator.round_clock
        clock = self.clock
        get_candidates, update = generator.get_candidates, generator.update_candidate_strategy

        def counted_get_candidates(input_ids, *args, **kwargs):
            if not times_itself:
                clock.start_draft()
            out = get_candidates(input_ids, *args, **kwargs)
            if not times_itself:
                clock.end_draft()
            self.drafted.append(int(out[0].shape[1] - input_ids.shape[1]))
            return out

        def counted_update(input_ids, scores, num_matches, *args, **kwargs):
            if not times_itself:
                clock.end_verify()
            self.acceptance_lengths.append(int(num_matches) + 1)
            return update(input_ids, scores, num_matches, *args, **kwargs)

        generator.get_candidates = counted_get_candidates
        generator.update_candidate_strategy = counted_update
        return generator

    @contextmanager
    def attach(self, target) -> Iterator[RoundRecorder]:
        """Instruments the candidate generators `target.generate` creates inside the block (resets first)."""
        self.reset()
        factory = target._get_candidate_generator  # bound through the class: the D3D hook when installed

        def instrumented_factory(*args, **kwargs):
            return self._instrument(factory(*args, **kwargs))

        previous = target.__dict__.get("_get_candidate_generator")  # an instance-level patch of someone else
        target.__dict__["_get_candidate_generator"] = instrumented_factory
        try:
            yield self
        finally:
            if previous is None:
                target.__dict__.pop("_get_candidate_generator", None)
            else:
                target.__dict__["_get_candidate_generator"] = previous

    def stats(self) -> RoundStats:
        """The recorded rounds as `RoundStats` (no hits)."""
        return RoundStats(
            rounds=len(self.acceptance_lengths),
            draft_seconds=sum(self.clock.draft_seconds),
            verify_seconds=sum(self.clock.verify_seconds),
            acceptance_lengths=list(self.acceptance_lengths),
            drafted_tokens=sum(self.drafted[: len(self.acceptance_lengths)]),
        )


@dataclass(frozen=True)
class BenchMethod:
    """One decoding method of the benchmark (an entry of `METHODS`).

    Attributes:
        name (`str`): the method's name (`--methods`).
        description (`str`): one line for tables and `--help`.
        generate_kwargs (`Callable[[Mapping], dict]`): given the resources (drafter, assistant, settings), the
            extra keyword arguments of `target.generate` (greedy decoding, `max_new_tokens` and the attention mask
            are added by the harness).
        read_stats (`Callable[[Mapping, RoundRecorder], RoundStats]`, *optional*): reads the per-round statistics
            after the call; `None` for plain decoding (one round per token, nothing split).
        requires (`tuple[str, ...]`): resource names that must be given (e.g. `("drafter",)`).
        settings (`Callable[[Mapping], dict]`, *optional*): method settings to record in the results.
        cost_model (`str`, *optional*): which speed-up formula of `d3d_hf.costmodel` predicts this method:
            `"sync"` (D3D drafter timings), `"async"` (D3D timings and the hit rate), `"rounds"` (the measured
            draft time per round), or `None` (no prediction).
        batches (`bool`, defaults to `False`): whether one `generate` call decodes a left-padded batch of prompts
            (`run_benchmark(batch_size > 1)`); otherwise a batch's prompts run one at a time.
    """

    name: str
    description: str
    generate_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]]
    read_stats: Callable[[Mapping[str, Any], RoundRecorder], RoundStats] | None = None
    requires: tuple[str, ...] = ()
    settings: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    cost_model: str | None = None
    batches: bool = False


def d3d_round_stats(stats) -> RoundStats:
    """`RoundStats` from a D3D drafter's `last_generation_stats` (`hits` is read when the call was asynchronous)."""
    asynchronous = getattr(stats, "asynchronous", True)
    hits = getattr(stats, "hits", None) if asynchronous else None
    packed_rounds = None
    if hits is not None:
        packed_rounds = int(hits) + int(getattr(stats, "reused", 0)) + int(getattr(stats, "misses", 0))
    return RoundStats(
        rounds=stats.rounds,
        draft_seconds=sum(stats.draft_seconds),
        verify_seconds=sum(stats.verify_seconds),
        acceptance_lengths=list(stats.acceptance_lengths),
        drafted_tokens=int(getattr(stats, "drafted_tokens", 0)),
        hits=None if hits is None else int(hits),
        packed_rounds=packed_rounds,
        round_sources=list(getattr(stats, "round_sources", [])),
        round_candidates=list(getattr(stats, "round_candidates", [])),
        successor_blocks=list(getattr(stats, "successor_blocks", [])),
        successor_masks=list(getattr(stats, "successor_masks", [])),
        successor_hit_flags=list(getattr(stats, "successor_hit_flags", [])),
        ready_round_flags=list(getattr(stats, "ready_round_flags", [])),
        ready_rounds=int(getattr(stats, "ready_rounds", 0)),
    )


def _assistant_settings(resources: Mapping[str, Any]) -> dict[str, Any]:
    assistant = resources["assistant"]
    gen = assistant.generation_config
    defaults = {
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
    }  # transformers 5.24 defaults when unset
    out = {k: getattr(gen, k, None) if getattr(gen, k, None) is not None else v for k, v in defaults.items()}
    out.update(
        assistant=resources.get("assistant_name") or getattr(assistant, "name_or_path", None),
        assistant_layers=getattr(assistant.config.get_text_config(), "num_hidden_layers", None),
        assistant_parameters=sum(p.numel() for p in assistant.parameters()),
    )
    return out


def _d3d_settings(resources: Mapping[str, Any]) -> dict[str, Any]:
    """A D3D method's recorded settings: the drafter, and the options and overrides of its last call as the
    generator resolved them (`D3DGenerationOptions`, `D3DGenerationStats.overrides`)."""
    drafter = resources["drafter"]
    stats = getattr(drafter, "last_generation_stats", None)
    options = getattr(stats, "options", None) or D3DGenerationOptions.resolve(None, drafter)
    return {
        "drafter": resources.get("drafter_name"),
        "block_size": drafter.config.block_size,
        "drafter_layers": drafter.config.num_hidden_layers,
        "num_drafts": getattr(stats, "policy", None),
        "prompt_lookup": options.prompt_lookup,
        "asynchronous": getattr(stats, "asynchronous", None),
        "options": options.to_dict(),
        "overrides": dict(getattr(stats, "overrides", {}) or {}),
        # the cost curves the adaptive engine decided with, as they stood at the last call's start (ms by rows)
        "cost_curves_ms": getattr(stats, "cost_curves_ms", None),
    }


METHODS: dict[str, BenchMethod] = {}
"""The method registry: name -> `BenchMethod`, in table order (`list(METHODS)` gives the names)."""

DEFAULT_METHODS = ("target", "d3d")
"""Methods `run_benchmark` runs when none are given."""

RESOURCE_HINTS = {"drafter": "--drafter DIR", "assistant": "--assistant ar-smollm2-135m-instruct (shipped) or DIR"}
"""How a user supplies each resource on the command line (for error messages)."""


def register_method(method: BenchMethod, overwrite: bool = False) -> BenchMethod:
    """Adds `method` to `METHODS`.

    Raises:
        ValueError: if a method of that name exists and `overwrite` is `False`.
    """
    if method.name in METHODS and not overwrite:
        raise ValueError(f"A benchmark method named {method.name!r} is already registered.")
    METHODS[method.name] = method
    return method


register_method(BenchMethod("target", "target alone (greedy generate)", lambda r: {}, batches=True))
register_method(
    BenchMethod(
        "pld",
        "transformers prompt-lookup decoding",
        lambda r: {
            "prompt_lookup_num_tokens": int(r.get("prompt_lookup_num_tokens", 10)),
            "max_matching_ngram_size": int(r.get("max_matching_ngram_size", 2)),
        },
        read_stats=lambda r, recorder: recorder.stats(),
        settings=lambda r: {
            "prompt_lookup_num_tokens": int(r.get("prompt_lookup_num_tokens", 10)),
            "max_matching_ngram_size": int(r.get("max_matching_ngram_size", 2)),
        },
        cost_model="rounds",
    )
)
register_method(
    BenchMethod(
        "ar-assist",
        "transformers assisted generation, autoregressive assistant",
        lambda r: {"assistant_model": r["assistant"]},
        read_stats=lambda r, recorder: recorder.stats(),
        requires=("assistant",),
        settings=_assistant_settings,
        cost_model="rounds",
    )
)
register_method(
    BenchMethod(
        "d3d",
        "D3D drafting (the cost-aware engine; `num_drafts` fixes the drafts per round)",
        lambda r: _d3d_kwargs(r),
        read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
        requires=("drafter",),
        settings=_d3d_settings,
        cost_model="sync",
        batches=True,
    )
)


#: the options each D3D method takes from the resources (the command line's flags, by field name)
_METHOD_OPTIONS = {
    "d3d": ("num_drafts", "prompt_lookup"),
    "d3d-async": ("num_drafts", "num_hypotheses", "reuse_on_miss", "worker_threads"),
    "d3d-tree": ("num_drafts", "prompt_lookup", "tree_budget", "tree_branching"),
}


def _given_options(resources: Mapping[str, Any], method: str) -> dict[str, Any]:
    """`{generate name: value}` of the declared options that `method` takes and the resources give."""
    names = {f.name: f.metadata["option"] for f in D3DGenerationOptions.option_fields()}
    return {
        names[name]: resources[name] for name in _METHOD_OPTIONS[method] if resources.get(name) is not None
    }


def _d3d_kwargs(resources: Mapping[str, Any]) -> dict[str, Any]:
    return _d3d_kwargs_with(resources)


def _tree_budget(resources: Mapping[str, Any]) -> int | str:
    """`d3d_tree_budget` of the `d3d-tree` method (`--tree-budget`): a node count (default 16) or "adaptive"."""
    value = resources.get("tree_budget") or 16
    return int(value) if str(value).isdigit() else str(value)


def _d3d_kwargs_with(resources: Mapping[str, Any], method: str = "d3d", **options: Any) -> dict[str, Any]:
    """`generate` arguments of a D3D method: the drafter and the options the method takes from the resources,
    plus `options`, as keyword arguments of `generate` (the hook moves them into the call's config)."""
    return {"assistant_model": resources["drafter"], **_given_options(resources, method), **options}


def _d3d_tree_kwargs(resources: Mapping[str, Any]) -> dict[str, Any]:
    return _d3d_kwargs_with(resources, "d3d-tree", d3d_tree_budget=_tree_budget(resources))


def _d3d_tree_settings(resources: Mapping[str, Any]) -> dict[str, Any]:
    return {**_d3d_settings(resources), "tree_budget": _tree_budget(resources)}


def _d3d_async_settings(resources: Mapping[str, Any]) -> dict[str, Any]:
    settings = _d3d_settings(resources)
    options = settings["options"]
    stats = getattr(resources["drafter"], "last_generation_stats", None)
    return {
        **settings,
        "hypotheses": options["d3d_num_hypotheses"],
        "reuse_on_miss": options["d3d_reuse_on_miss"],
        "worker_threads": getattr(stats, "worker_threads", None) or options["d3d_worker_threads"],
    }


def _d3d_async_kwargs(resources: Mapping[str, Any]) -> dict[str, Any]:
    # `d3d_async=True`: the packed pass runs on every device (on CPU with one warning per process)
    return _d3d_kwargs_with(resources, "d3d-async", d3d_async=True)


register_method(
    BenchMethod(
        "d3d-async",
        "asynchronous D3D drafting (packed successor blocks during verification)",
        _d3d_async_kwargs,
        read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
        requires=("drafter",),
        settings=_d3d_async_settings,
        cost_model="async",
    )
)


register_method(
    BenchMethod(
        "d3d-tree",
        "D3D with tree verification in D3D's own loop (best-first draft trees; `tree_budget` nodes at most)",
        _d3d_tree_kwargs,
        read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
        requires=("drafter",),
        settings=_d3d_tree_settings,
        cost_model="sync",
    )
)


def _register_d3d_variant(name: str, description: str, **options: Any) -> None:
    """Registers a synchronous D3D method that is `d3d` with extra `GenerationConfig` options (an ablation or an
    opt-in): same statistics, settings and cost model."""
    register_method(
        BenchMethod(
            name,
            description,
            lambda r: _d3d_kwargs_with(r, **options),
            read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
            requires=("drafter",),
            settings=_d3d_settings,
            cost_model="sync",
            batches=True,
        )
    )


_register_d3d_variant(
    "engine-lookup",
    "the default D3D engine with its drafter never drafting (plain target steps and the engine's sized prompt-lookup "
    "rounds, same calibration): what `d3d` adds over it is the drafter's contribution",
    d3d_draft_passes=False,
)
_register_d3d_variant(
    "d3d-no-fused",
    "the default D3D engine with fused successor drafting off (every drafter round runs its own draft pass): what "
    "`d3d` adds over it is what drafting inside the verifications adds",
    d3d_fused_drafting=False,
)
_register_d3d_variant(
    "d3d-fused",
    "the default D3D engine with fused successor drafting forced on (`d3d_fused_drafting=True`; its default 'auto' "
    "is off on CPU): the next round's block drafted inside each verification where the policy places one",
    d3d_fused_drafting=True,
)
_register_d3d_variant(
    "d3d-own-cache",
    "D3D (chain rounds) with the drafter's own cache: committed tokens re-run by the drafter (the ablation of "
    "`d3d_share_target_cache`)",
    d3d_share_target_cache=False,
)
_register_d3d_variant(
    "d3d-target-layouts",
    "D3D with the target's verification forwards on the faster matmul layout of the machine "
    "(`d3d_target_matmul_layouts=True`; CPU)",
    d3d_target_matmul_layouts=True,
)


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


def unknown_methods(methods: Sequence[str]) -> list[str]:
    """The names in `methods` that are not registered in `METHODS`, in the order given."""
    return [m for m in methods if m not in METHODS]


def missing_resource(methods: Sequence[str], resources: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first `(method, resource)` such that a (registered) method of `methods` requires a resource that
    `resources` lacks (absent or `None`), in the order of `methods` and of each method's `requires`; `None` when
    every method has what it needs."""
    for m in methods:
        for name in METHODS[m].requires:
            if resources.get(name) is None:
                return m, name
    return None


def _check_methods(methods: Sequence[str], resources: Mapping[str, Any]) -> list[str]:
    unknown = unknown_methods(methods)
    if unknown:
        raise ValueError(f"Unknown method(s) {unknown}; choose from {list(METHODS)}.")
    missing = missing_resource(methods, resources)
    if missing is not None:
        m, name = missing
        hint = f" (`{RESOURCE_HINTS[name]}`)" if name in RESOURCE_HINTS else ""
        raise ValueError(f"Method `{m}` needs a {name}{hint}.")
    return ["target"] + [m for m in dict.fromkeys(methods) if m != "target"]


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
        batch_size (`int`, defaults to 1): prompts per batch (module docstring, "Batches"); a run is then one batch.

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

    def call(m: str, input_ids: torch.LongTensor, new_tokens: int) -> torch.LongTensor:
        if METHODS[m].read_stats is None:
            return _generate(target, input_ids, new_tokens, **kwargs[m])
        with recorder.attach(target):
            return _generate(target, input_ids, new_tokens, **kwargs[m])

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
        )
        summary = {m: summarize(runs[m], runs["target"]) for m in methods}
        for m in methods:
            summary[m].update(batch_size=batch_size, one_at_a_time=not METHODS[m].batches)
        return {
            "runs": {m: [asdict(r) for r in rs] for m, rs in runs.items()},
            "summary": summary,
            "method_settings": {m: METHODS[m].settings(res) if METHODS[m].settings else {} for m in methods},
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
    method_settings = {m: METHODS[m].settings(res) if METHODS[m].settings else {} for m in methods}
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
) -> dict[str, list[PromptRun]]:
    """`run_benchmark`'s loop over batches of `batch_size` prompts (module docstring, "Batches"): one `PromptRun` per
    batch and method."""
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
        with recorder.attach(target):
            out = target.generate(input_ids, attention_mask=mask, **settings)
        return out, [method.read_stats(res, recorder)]

    def call(m: str, input_ids, mask, new_tokens: int) -> tuple[list[list[int]], list[RoundStats]]:
        """Generated ids per sequence, and the round statistics of the call (one per prompt one at a time)."""
        settings = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": pad_id, **kwargs[m]}
        if METHODS[m].batches:
            out, stats = generate(m, input_ids, mask, settings)
            return [_generated(row, eos_ids) for row in out[:, input_ids.shape[1] :]], stats
        sequences, stats = [], []
        for row, row_mask in zip(input_ids, mask, strict=True):
            ids = row[row_mask.bool()][None]
            out, one = generate(m, ids, torch.ones_like(ids), settings)
            sequences.append(_generated(out[0, ids.shape[1] :], eos_ids))
            stats += one
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
    "DEFAULT_METHODS",
    "METHODS",
    "BenchMethod",
    "PromptRun",
    "RoundRecorder",
    "RoundStats",
    "d3d_round_stats",
    "format_round_plans",
    "environment_info",
    "format_table",
    "merge_results",
    "missing_resource",
    "register_method",
    "run_benchmark",
    "summarize",
    "unknown_methods",
]
