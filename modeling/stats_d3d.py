"""`D3DGenerationStats`: what happened in one `generate` call with a D3D drafter, and its settings once.

Part of the self-contained remote-code bundle: imports only the standard library and its siblings.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from .options_d3d import D3DGenerationOptions


@dataclass
class D3DGenerationStats:
    """Statistics of one `generate` call with a D3D drafter (stored as `drafter.last_generation_stats`).

    The call's settings are recorded once, in `options`; where the engine replaced a default, `overrides` says so.
    Every other field records what happened.

    Attributes:
        options (`D3DGenerationOptions`): the call's resolved `d3d_*` options.
        overrides (`dict[str, str]`): option name -> why the engine ran something other than its default value
            (e.g. `{"d3d_async": "auto: synchronous on cpu ..."}`); an explicit value is never replaced.
        rounds (`int`): target verification forwards (the first one includes the prompt prefill).
        new_tokens (`int`): tokens committed by those forwards (accepted drafts plus one bonus token each).
        accepted_drafts (`int`): draft tokens the target accepted.
        drafted_tokens (`int`): draft tokens proposed (tree nodes with a tree).
        draft_seconds (`list[float]`): wall time of each round's drafting on the critical path, seconds: the draft
            pass (synchronous), or waiting for the packed pass plus choosing the tokens (asynchronous hit).
        verify_seconds (`list[float]`): wall time from the end of each round's drafting to the end of its
            verification (target forward plus the acceptance bookkeeping), seconds.
        acceptance_lengths (`list[int]`): tokens committed per round (`tau` of each round).
        round_sources (`list[str]`): per round, where its candidates came from: `"drafter"`, `"lookup"` (prompt
            lookup, no draft pass) or `"target"` (none: a plain target step).
        round_candidates (`list[int]`): per round, the candidates sent for verification (tree: nodes).
        asynchronous (`bool`): whether packed successor drafting ran (`d3d_async` resolved).
        policy (`str`): how drafts per round were chosen: `"adaptive"` or the fixed number that ran.
        hits (`int`): rounds whose block came from the packed pass (real outcome a hypothesis, bonus guess right).
        reused (`int`): missed rounds that still used a packed block (`d3d_reuse_on_miss=True`).
        misses (`int`): rounds after a packed pass that needed a synchronous draft.
        packed_seconds (`list[float]`): wall time of each joined packed pass on the worker thread, seconds (off the
            critical path; on CUDA the time to enqueue it).
        join_wait_seconds (`list[float]`): how long each join waited for the packed pass (CPU), seconds.
        worker_threads (`int`): torch threads of the CPU worker that ran packed passes (0 when none ran on it).
        cost_curves_ms (`dict`, *optional*): the adaptive policy's cost curves when the call started, milliseconds by
            new rows (`{"verify": {rows: ms}, "draft": {rows: ms}}`); `None` for a fixed plan.
        decoding_loop (`str`): the loop that ran the call: `"d3d"` (`decoding_d3d`) or `"transformers"`.
        shared_target_cache (`bool`): the draft passes attended to the target's cache.
        target_gqa_attention (`bool`): the target's forwards ran on `fast_paths_d3d.gqa_sdpa_attention_forward`.
        fused_drafting (`bool`): fused successor drafting ran (`d3d_fused_drafting` resolved; `successor_d3d`).
        successor_blocks (`list[int]`): per verification (fused drafting), the drafter blocks it computed after
            the acceptance lengths where the path was likely to end (0: none).
        successor_masks (`list[int]`): per verification, the masks of each of those blocks.
        successor_hits (`int`): verifications whose accepted path ended where a block was drafted.
        successor_hit_flags (`list[bool]`): per verification that drafted blocks or not, whether it was a hit.
        ready_rounds (`int`): rounds whose drafts were such a block (no draft pass).
        ready_round_flags (`list[bool]`): per round, whether its drafts were such a block (so the acceptance of
            ready rounds and of drafter rounds with a pass can be told apart: `acceptance_by_drafting`).
        batch_size (`int`): sequences decoded together (`batched_decoding_d3d`; 1 for one sequence). For a batch,
            `rounds` counts the batch's target forwards, and `new_tokens`, `accepted_drafts`, `drafted_tokens`,
            `acceptance_lengths` and `round_candidates` sum over its sequences: `tau` is the batch's tokens per forward.
    """

    options: D3DGenerationOptions = field(default_factory=D3DGenerationOptions)
    overrides: dict[str, str] = field(default_factory=dict)
    rounds: int = 0
    new_tokens: int = 0
    accepted_drafts: int = 0
    drafted_tokens: int = 0
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    round_sources: list[str] = field(default_factory=list)
    round_candidates: list[int] = field(default_factory=list)
    asynchronous: bool = False
    policy: str = "adaptive"
    hits: int = 0
    reused: int = 0
    misses: int = 0
    packed_seconds: list[float] = field(default_factory=list)
    join_wait_seconds: list[float] = field(default_factory=list)
    worker_threads: int = 0
    cost_curves_ms: dict[str, dict[int, float]] | None = None
    decoding_loop: str = "transformers"
    shared_target_cache: bool = False
    target_gqa_attention: bool = False
    fused_drafting: bool = False
    successor_blocks: list[int] = field(default_factory=list)
    successor_masks: list[int] = field(default_factory=list)
    successor_hits: int = 0
    ready_rounds: int = 0
    successor_hit_flags: list[bool] = field(default_factory=list)
    ready_round_flags: list[bool] = field(default_factory=list)
    batch_size: int = 1

    def record_round_plan(self, source: str, num_candidates: int, ready: bool = False) -> None:
        """Records where a round's candidates came from, how many were sent, and whether they were a block drafted
        inside the last verification (`ready`)."""
        self.ready_round_flags.append(bool(ready))
        self.round_sources.append(source if num_candidates or source != "drafter" else "target")
        self.round_candidates.append(int(num_candidates))
        self.drafted_tokens += int(num_candidates)

    def record_outcome(self, num_matches: int) -> None:
        """Records one verified round: `num_matches` candidates accepted plus one bonus token."""
        self.rounds += 1
        self.accepted_drafts += num_matches
        self.new_tokens += num_matches + 1
        self.acceptance_lengths.append(num_matches + 1)

    @property
    def tau(self) -> float:
        """Mean acceptance length: committed tokens per target verification forward, bonus included."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def hit_rate(self) -> float:
        """Fraction of rounds after a packed pass whose block was pre-drafted (`hits / (hits + reused + misses)`)."""
        total = self.hits + self.reused + self.misses
        return self.hits / total if total else 0.0

    @property
    def num_hypotheses(self) -> int:
        """Successor blocks per packed pass (0 when packed successor drafting did not run)."""
        return self.options.num_hypotheses if self.asynchronous else 0

    @property
    def tree_budget(self) -> int | str | None:
        """`d3d_tree_budget` of the call (`None`: chain verification)."""
        return self.options.tree_budget

    @property
    def target_matmul_layouts(self) -> bool:
        """Whether the target's verification forwards ran on `MatmulLayouts` (`d3d_target_matmul_layouts`)."""
        return self.options.target_matmul_layouts

    @property
    def asynchronous_off_reason(self) -> str | None:
        """Why packed successor drafting did not run although `d3d_async` allowed it (`None` otherwise)."""
        return self.overrides.get("d3d_async") if not self.asynchronous else None

    @property
    def successor_hit_rates(self) -> dict[int, float]:
        """Fused drafting: by the number of blocks a verification drafted, the fraction of those verifications
        whose accepted path ended at one of them (a hit). Computed from `successor_blocks` and the hits recorded
        per verification in `successor_hit_flags`."""
        totals, hits = Counter(), Counter()
        for blocks, hit in zip(self.successor_blocks, self.successor_hit_flags, strict=False):
            if blocks:
                totals[blocks] += 1
                hits[blocks] += int(hit)
        return {n: hits[n] / totals[n] for n in sorted(totals)}

    def record_successor_outcome(self, hit: bool) -> None:
        """Records whether this verification's accepted path ended at one of its blocks."""
        self.successor_hit_flags.append(bool(hit))
        self.successor_hits += int(hit)

    @property
    def acceptance_by_drafting(self) -> dict[str, float]:
        """Mean tokens committed per drafter round (`tau` of those rounds), by how the drafts were made: `"pass"`
        (a draft pass) and `"ready"` (a block drafted inside the previous verification); a kind with no round is
        left out."""
        lengths: dict[str, list[int]] = {"pass": [], "ready": []}
        rounds = zip(self.round_sources, self.ready_round_flags, self.acceptance_lengths, strict=False)
        for source, ready, length in rounds:
            if source == "drafter":
                lengths["ready" if ready else "pass"].append(length)
        return {kind: sum(v) / len(v) for kind, v in lengths.items() if v}

    @property
    def tokens_by_source(self) -> dict[str, int]:
        """Committed tokens (accepted candidates plus the bonus token) by the source of their round's candidates."""
        counts = Counter()
        for source, length in zip(self.round_sources, self.acceptance_lengths, strict=False):
            counts[source] += length
        return dict(counts)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (with `tau`, `hit_rate` and `tokens_by_source`), for JSON."""
        out = asdict(self)
        out["options"] = self.options.to_dict()
        return {
            **out,
            "tau": self.tau,
            "hit_rate": self.hit_rate,
            "tokens_by_source": self.tokens_by_source,
            "successor_hit_rates": self.successor_hit_rates,
            "acceptance_by_drafting": self.acceptance_by_drafting,
        }


__all__ = ["D3DGenerationStats"]
