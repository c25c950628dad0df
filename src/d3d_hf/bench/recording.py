"""Per-round statistics of one `generate` call (`RoundStats`) and how they are recorded: `RoundRecorder` times
transformers' assisted-generation rounds, `d3d_round_stats` reads a D3D drafter's own (the `d3d_hf.bench`
docstring says what is measured)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..modeling.runtime_d3d import RoundClock


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

    `with recorder.attach(target, drafter): target.generate(...)` makes the target's `_get_candidate_generator`
    (whatever it resolves to, including the D3D hook) and a D3D drafter's `build_candidate_generator` (which D3D's
    own loops call directly) return their usual generator with `get_candidates` and
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
        if getattr(generator, "_d3d_recorded", False):  # built by an instrumented drafter, seen again by the factory
            return generator
        generator._d3d_recorded = True
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
    def attach(self, target, assistant=None) -> Iterator[RoundRecorder]:
        """Instruments the candidate generators `target.generate` creates inside the block (resets first): those
        transformers' factory builds, and those a D3D `assistant` builds itself for D3D's own loops (its
        `build_candidate_generator`, which those loops call without the factory)."""
        self.reset()
        patched = [(target, "_get_candidate_generator")]  # bound through the class: the D3D hook when installed
        if getattr(assistant, "build_candidate_generator", None) is not None:
            patched.append((assistant, "build_candidate_generator"))
        saved = []
        for owner, name in patched:
            build = getattr(owner, name)
            saved.append((owner, name, owner.__dict__.get(name)))  # an instance-level patch of someone else

            def instrumented(*args, build=build, **kwargs):
                return self._instrument(build(*args, **kwargs))

            owner.__dict__[name] = instrumented
        try:
            yield self
        finally:
            for owner, name, previous in saved:
                if previous is None:
                    owner.__dict__.pop(name, None)
                else:
                    owner.__dict__[name] = previous

    def stats(self) -> RoundStats:
        """The recorded rounds as `RoundStats` (no hits)."""
        return RoundStats(
            rounds=len(self.acceptance_lengths),
            draft_seconds=sum(self.clock.draft_seconds),
            verify_seconds=sum(self.clock.verify_seconds),
            acceptance_lengths=list(self.acceptance_lengths),
            drafted_tokens=sum(self.drafted[: len(self.acceptance_lengths)]),
        )


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


__all__ = ["RoundRecorder", "RoundStats", "d3d_round_stats"]
