"""The rate model of the cost-aware drafting policy: what each option of a round is expected to give.

Part of the self-contained remote-code bundle: imports only the Python standard library, torch and its siblings.

A round's options are a plain target step, a draft pass of `m` masks and a prompt-lookup round of `k` tokens, for one
sequence or for a batch (`SequenceState` per sequence). Each is rated by its expected committed tokens per second,
`E[tokens] / (t_draft + t_verify)`, from the measured cost curves (`estimates_d3d.CostCurve`, scaled for a batch by
`BatchedCosts`) and the learned acceptance (`AcceptanceCalibrator`, `LookupAcceptance`); d3d-hf docs/DESIGN.md
section 9, our design. `RoundRates` holds that arithmetic; `policy_d3d.DraftPolicy` builds on it and decides
(exploration, the choice after a pass, learning, persistence).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .estimates_d3d import (
    _MIN_SECONDS,
    BatchedCosts,
    _check_probabilities,
    _check_seconds,
    _is_int,
    expected_tokens,
)

#: The sources a round can take its candidates from.
SOURCES = ("target", "drafter", "lookup")


@dataclass(frozen=True)
class SequenceState:
    """What one sequence brings to a round's decision (`DraftPolicy.decide`, `DraftPolicy.choose` with `batch`).

    Attributes:
        limit (`int`, *optional*): most candidates the sequence may send this round (room before `max_length`, at
            most `block_size - 1`); `None`: no limit but the policy's `max_drafts` (which also caps a pass's masks).
        draft_pending (`int`, defaults to 1): committed tokens the drafter has not cached (the pass ingests them; the
            anchor included, so >= 1).
        verify_pending (`int`, defaults to 1): committed tokens the target has not cached (the verification's rows
            before the candidates; 1 in a chain, where only the bonus token is new).
        lookup_tokens (`int`, defaults to 0): length of the sequence's prompt-lookup match (0: none); in
            `choose(batch=...)`, the lookup tokens the sequence sends instead of drafts.
        lookup_ngram_size (`int`, *optional*): size of the n-gram that matched (`LookupAcceptance` keeps the lookup
            estimate per size).
    """

    limit: int | None = None
    draft_pending: int = 1
    verify_pending: int = 1
    lookup_tokens: int = 0
    lookup_ngram_size: int | None = None


@dataclass(frozen=True)
class RoundDecision:
    """What one round does, decided by `DraftPolicy.decide` before it starts.

    Attributes:
        source (`str`): `"target"` (a plain target step: no drafts), `"drafter"` (run a draft pass with `pass_masks`
            masks, then `DraftPolicy.choose` how many of its first `num_masks` drafts to send) or `"lookup"` (send
            the first `num_lookup` prompt-lookup tokens, no draft pass).
        num_masks (`int`): drafts the pass may give this round; 0 unless `source == "drafter"`.
        num_lookup (`int`): lookup tokens to send (a batch: the most any sequence sends); 0 unless `source ==
            "lookup"`.
        num_pending (`int`): committed tokens the drafter had not cached (the pass ingests them; a batch: the most of
            any sequence).
        explore (`bool`): the round was forced by the exploration rule (`DraftPolicy`), not chosen by the rates.
        target_rate (`float`): expected tokens per second of a plain target step, `1 / t_verify(1)` (a batch: its
            sequences' tokens per second).
        drafter_rate (`float`, *optional*): of the best drafter plan (`None` when the drafter cannot be used).
        lookup_rate (`float`, *optional*): of the best lookup round (`None` without lookup tokens).
        expected_rate (`float`): of the option taken (under exploration, not the best one).
        lookup_ngram_size (`int`, *optional*): size of the n-gram the lookup tokens matched (what
            `observe_round` files the outcome under), `None` when not known or without lookup tokens.
        ready (`bool`): a drafter round whose block was drafted inside the previous verification (fused successor
            drafting, `successor_d3d`): no draft pass, `num_masks` is the ready block's size.
        block_masks (`int`, *optional*): masks the pass computes when more than `num_masks` (a fixed plan keeps its
            block whole near `max_length`: masks attend to each other, so their number changes the drafts).
        lookup_rows (`tuple[bool, ...]`): a batch's drafter or lookup round: which sequences send their lookup
            match instead of drafts (empty for one sequence).
    """

    source: str
    num_masks: int = 0
    num_lookup: int = 0
    num_pending: int = 0
    explore: bool = False
    target_rate: float = 0.0
    drafter_rate: float | None = None
    lookup_rate: float | None = None
    expected_rate: float = 0.0
    lookup_ngram_size: int | None = None
    ready: bool = False
    block_masks: int | None = None
    lookup_rows: tuple[bool, ...] = ()

    @property
    def pass_masks(self) -> int:
        """Masks of the round's draft pass: `block_masks` if set, else `num_masks`."""
        return self.num_masks if self.block_masks is None else self.block_masks

    @property
    def draft_rows(self) -> int:
        """Rows of the draft pass, `num_pending + pass_masks` (0 when there is no pass)."""
        return self.num_pending + self.pass_masks if self.source == "drafter" and not self.ready else 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict (for logs)."""
        return asdict(self)


@dataclass(frozen=True)
class _Option:
    source: str
    count: int  # masks (drafter), tokens (lookup) or drafts to send (choose)
    rate: float
    seconds: float
    rows: tuple[bool, ...] = ()  # a batch: which sequences send their lookup match


def _pick(options: Sequence[_Option], tolerance: float) -> _Option:
    """The best rate; among options within `tolerance` of it, the cheapest (fewest seconds, then higher rate)."""
    best = max(o.rate for o in options)
    near = [o for o in options if o.rate >= best * (1.0 - tolerance)]
    return min(near, key=lambda o: (o.seconds, -o.rate))


def _rate(tokens: float, seconds: float) -> float:
    return tokens / max(seconds, _MIN_SECONDS)


class RoundRates:
    """The rates of a round's options (module docstring), the base of `DraftPolicy`.

    Reads the attributes `DraftPolicy.__init__` sets: `verify_curve` and `draft_curve` (`CostCurve`, the latter
    optional), `calibrator` (`AcceptanceCalibrator`), `lookup` (`LookupAcceptance`), `max_drafts`, `mode`,
    `tie_tolerance` and `curve_weight`.
    """

    def _verify(self, rows: int) -> float:
        if self.verify_curve is None:
            raise ValueError("This policy has no `verify_curve`.")
        return self.verify_curve(rows)

    def target_rate(self) -> float:
        """`R_target = 1 / t_verify(1)`: tokens per second of a plain target step."""
        return _rate(1.0, self._verify(1))

    def _limit(self, max_candidates: int | None) -> int:
        if max_candidates is None:
            return self.max_drafts
        if not _is_int(max_candidates) or max_candidates < 0:
            raise ValueError(f"`max_candidates` must be an int >= 0 or None, got {max_candidates!r}.")
        return min(self.max_drafts, max_candidates)

    @staticmethod
    def _check_pending(num_pending: int) -> int:
        if not _is_int(num_pending) or num_pending < 1:
            raise ValueError(
                f"`num_pending` must be an int >= 1 (committed tokens the drafter has not cached, the anchor "
                f"included), got {num_pending!r}."
            )
        return num_pending

    def ready_profile(self, num_drafts: int) -> list[float]:
        """Per-position acceptance of the drafts of a block drafted inside a verification (fused successor
        drafting): its anchor is the accepted path's last token, whose bonus token the target computed in that
        verification, so its first mask plays the part of a draft pass's second draft (the first draft of a pass,
        the anchor row's own prediction, is the target's), and so on: `position_profile(num_drafts + 1)[1:]`."""
        return self.calibrator.position_profile(num_drafts + 1)[1:]

    # ---- the rate model: what every option of a round is expected to give ----------------------------------------

    @property
    def batched_costs(self) -> BatchedCosts:
        """What forwards over a batch cost against the single-sequence curves (`BatchedCosts`), learned by this
        process's batched rounds (`batched_decoding_d3d`) and read by `decide` / `choose` with `batch`; in memory
        only (not in `state_dict`)."""
        costs = self.__dict__.get("_batched_costs")
        if costs is None:
            costs = self._batched_costs = BatchedCosts(self.curve_weight)
        return costs

    @batched_costs.setter
    def batched_costs(self, costs: BatchedCosts) -> None:
        self._batched_costs = costs

    def _costs(self, batch_size: int | None) -> tuple[Callable[[int], float], Callable[[int], float] | None]:
        """`(t_verify(rows), t_draft(rows))` of a round: the curves themselves for one sequence (`batch_size=None`),
        else the curves at the batch's total rows scaled by `batched_costs` (rows per sequence)."""
        if batch_size is None:
            return self._verify, self.draft_curve
        costs, draft_curve = self.batched_costs, self.draft_curve

        def verify(rows: int) -> float:
            return costs.seconds("verify", self.verify_curve, batch_size, rows)

        def draft(rows: int) -> float:
            return costs.seconds("draft", draft_curve, batch_size, rows)

        return verify, None if draft_curve is None else draft

    def _lookup_limits(self, sequences: Sequence[SequenceState]) -> list[int]:
        return [s.lookup_tokens if s.limit is None else min(s.lookup_tokens, s.limit) for s in sequences]

    def _round_options(
        self,
        sequences: Sequence[SequenceState],
        batched: bool,
        tree: tuple[int, float | None] | None = None,
        ready_masks: int = 0,
        draft_pass: bool = True,
    ) -> tuple[_Option, list[_Option], list[_Option]]:
        """The plain step, the drafter options (by masks) and the lookup options (by tokens) of one round over
        `sequences` (`decide`). Each option's tokens are the sequences' expected committed tokens summed, its
        seconds the round's draft pass (if any) and one verification over the longest sequence's rows. In a batch,
        a drafter round lets each sequence send its lookup match instead where that is expected to give more
        (`_Option.rows`); one sequence never does (that round is the lookup option)."""
        verify, draft = self._costs(len(sequences) if batched else None)
        limits = [self._limit(s.limit) for s in sequences]
        lookups = self._lookup_limits(sequences)
        q = [
            self.lookup.probabilities(n, s.lookup_ngram_size or None) if n else []
            for n, s in zip(lookups, sequences, strict=True)
        ]
        pending = [s.verify_pending for s in sequences]
        seconds = verify(max(pending))
        target = _Option("target", 0, _rate(len(sequences), seconds), seconds)
        lookup = []
        for k in range(1, max(lookups) + 1):
            counts = [min(n, k) for n in lookups]
            tokens = sum(expected_tokens(q[r], counts[r]) for r in range(len(sequences)))
            seconds = verify(max(p + c for p, c in zip(pending, counts, strict=True)))
            lookup.append(_Option("lookup", k, _rate(tokens, seconds), seconds, tuple(c > 0 for c in counts)))
        most = max(limits)
        drafter = []
        if ready_masks > 0 and most >= 1:  # one sequence's block drafted in the last verification: no pass
            profile = self.ready_profile(min(ready_masks, most))
            for k in range(1, len(profile) + 1):
                seconds = verify(k + 1)
                drafter.append(_Option("drafter", k, _rate(expected_tokens(profile, k), seconds), seconds))
        elif draft is not None and draft_pass and most >= 1:
            profile = self.calibrator.position_profile(most)
            draft_pending = max(s.draft_pending for s in sequences)
            if tree is not None and tree[1] is not None:  # a tree: every mask, `nodes` verified, `gain` x the chain
                nodes, gain = tree
                seconds = draft(draft_pending + most) + verify(nodes + 1)
                expected = 1.0 + gain * (expected_tokens(profile, most) - 1.0)
                return target, [_Option("drafter", most, _rate(expected, seconds), seconds)], lookup
            for m in range(1, most + 1):
                tokens, rows, use = 0.0, 0, []
                for r, limit in enumerate(limits):
                    count = min(m, limit)
                    by_drafter = expected_tokens(profile, count)
                    by_lookup = expected_tokens(q[r], min(count, lookups[r])) if batched else 0.0
                    use.append(by_lookup > by_drafter)
                    tokens += max(by_drafter, by_lookup)
                    rows = max(rows, pending[r] + count)
                seconds = draft(draft_pending + m) + verify(rows)
                drafter.append(_Option("drafter", m, _rate(tokens, seconds), seconds, tuple(use) if batched else ()))
        return target, drafter, lookup

    def plan_rates(self, num_pending: int, max_candidates: int | None = None) -> list[float]:
        """Expected rates `[R_target, R_draft(1), ..., R_draft(m_max)]` of `plan`'s options (for logs and tests).

        Args:
            num_pending (`int`): committed tokens the drafter has not cached, >= 1.
            max_candidates (`int`, *optional*): most drafts this round may send (room left before `max_length`).

        Returns:
            `list[float]`: index `m` is the rate with `m` masks (index 0 the plain target step); only index 0
            without a draft curve.
        """
        target, drafter, _ = self._round_options([self._sequence(num_pending, 0, max_candidates)], False)
        return [target.rate] + [o.rate for o in drafter]

    def plan(self, num_pending: int, max_candidates: int | None = None) -> int:
        """Masks `m` to compute in the next draft pass (0 = no pass: a plain target step), before any draft.

        Adaptive mode: `argmax_m` of `R_target` (m = 0) and `R_draft(m)` (class docstring), near-ties to the cheaper
        option; no lookup and no exploration (that is `decide`'s). Fixed mode `k`: `min(k, limit)`. `"off"`: 0.

        Args:
            num_pending (`int`): committed tokens the drafter has not cached yet (the pass ingests them; the anchor
                included, so >= 1).
            max_candidates (`int`, *optional*): most drafts this round may send (e.g. `max_length - seq_len - 1`);
                the limit is `min(max_drafts, max_candidates)`.

        Returns:
            `int` in `[0, limit]`.

        Raises:
            ValueError: if `num_pending < 1` or `max_candidates < 0`.
        """
        sequence = self._sequence(num_pending, 0, max_candidates)
        if self.mode == "off":
            return 0
        if _is_int(self.mode):
            return min(self.mode, self._limit(max_candidates))
        target, drafter, _ = self._round_options([sequence], False)
        best = _pick([target, *drafter], self.tie_tolerance)
        return best.count if best.source == "drafter" else 0

    def choose_rates(self, confidences: Sequence[float] | torch.Tensor, draft_seconds: float) -> list[float]:
        """`[expected_tokens(p, k) / (draft_seconds + t_verify(k + 1)) for k in 0..m]` with calibrated `p`."""
        draft_seconds = _check_seconds(draft_seconds, "`draft_seconds`")
        probs = self.calibrator.probabilities(confidences)
        return [_rate(expected_tokens(probs, k), draft_seconds + self._verify(k + 1)) for k in range(len(probs) + 1)]

    @property
    def lookup_probability(self) -> float:
        """The learned acceptance of a lookup span's first token, pooled over n-gram sizes (`LookupAcceptance`)."""
        return self.lookup.probabilities(1)[0]

    def lookup_rates(
        self, num_lookup_tokens: int, lookup_probability: float | None = None, ngram_size: int | None = None
    ) -> list[float]:
        """`[expected_tokens(q, k) / t_verify(k + 1) for k in 0..L]` (index 0 is the plain target step), with `q`
        the learned per-position acceptance for a match of `ngram_size` (`LookupAcceptance.probabilities`), or `[p]
        * L` for a given `lookup_probability` `p`."""
        if not _is_int(num_lookup_tokens) or num_lookup_tokens < 0:
            raise ValueError(f"`num_lookup_tokens` must be an int >= 0, got {num_lookup_tokens!r}.")
        if lookup_probability is None:
            probs = self.lookup.probabilities(num_lookup_tokens, ngram_size)
        else:
            probs = _check_probabilities([lookup_probability] * num_lookup_tokens, "`lookup_probability`")
        return [_rate(expected_tokens(probs, k), self._verify(k + 1)) for k in range(num_lookup_tokens + 1)]

    def choose_lookup(
        self,
        num_lookup_tokens: int,
        lookup_probability: float | None = None,
        max_candidates: int | None = None,
        ngram_size: int | None = None,
    ) -> tuple[int, float]:
        """The best lookup round: `k* = argmax_{1 <= k <= L} expected_tokens(q, k) / t_verify(k + 1)`.

        Args:
            num_lookup_tokens (`int`): length `L` of the lookup match, >= 0.
            lookup_probability (`float`, *optional*): a per-token acceptance `p` to use for every position instead
                of the learned `q` (`lookup_rates`).
            max_candidates (`int`, *optional*): most tokens this round may send.
            ngram_size (`int`, *optional*): size of the n-gram that matched.

        Returns:
            `(k, rate)`: tokens to send (near-ties to fewer) and the round's expected tokens per second; `(0,
            R_target)` when `L` (after the cap) is 0.
        """
        limit = num_lookup_tokens if max_candidates is None else min(num_lookup_tokens, max(max_candidates, 0))
        rates = self.lookup_rates(limit, lookup_probability, ngram_size)
        options = [_Option("lookup", k, rates[k], self._verify(k + 1)) for k in range(1, limit + 1)]
        if not options:
            return 0, self.target_rate()
        best = _pick(options, self.tie_tolerance)
        return best.count, best.rate

    def _sequence(self, num_pending: int, lookup_tokens: int, max_candidates: int | None, ngram=None) -> SequenceState:
        """One sequence's `SequenceState` from `decide`'s scalar arguments, checked."""
        num_pending = self._check_pending(num_pending)
        if not _is_int(lookup_tokens) or lookup_tokens < 0:
            raise ValueError(f"`lookup_tokens` must be an int >= 0, got {lookup_tokens!r}.")
        self._limit(max_candidates)
        return SequenceState(max_candidates, num_pending, 1, lookup_tokens, ngram)

    @staticmethod
    def _check_batch(batch: Sequence[SequenceState]) -> list[SequenceState]:
        sequences = list(batch)
        if not sequences or not all(isinstance(s, SequenceState) for s in sequences):
            raise ValueError(f"`batch` must be a non-empty sequence of `SequenceState`, got {batch!r}.")
        for s in sequences:
            counts = (s.draft_pending, s.verify_pending, s.lookup_tokens, 0 if s.limit is None else s.limit)
            if not all(_is_int(c) for c in counts) or min(counts[:2]) < 1 or min(counts[2:]) < 0:
                raise ValueError(f"Bad `SequenceState` {s!r}: pending counts >= 1, lookup tokens and limit >= 0.")
        return sequences


__all__ = ["SOURCES", "RoundDecision", "RoundRates", "SequenceState"]
