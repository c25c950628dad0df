"""Cost-aware drafting policy: how many drafts a round should verify, and from which source.

Part of the self-contained remote-code bundle: imports only the Python standard library, torch and the public
transformers API, so a checkpoint loaded with
`trust_remote_code=True` can use it without d3d_hf installed.

Why (d3d-hf docs/DESIGN.md section 9; the D3D method is arXiv 2611.06425, everything here is our design): the
speed-up of a round over plain target decoding is

    S = E[tokens per round] * t_verify(1) / (t_draft + t_verify(k + 1)),

so whether a round should draft at all, and how many drafts it should send, follows from two measured cost curves
(`CostCurve`: forward seconds by new rows `q`) and from how likely each draft is to be accepted
(`AcceptanceCalibrator`). On the project's CPUs a full-depth drafter's pass costs about one target forward over the
same rows, so drafting 15 tokens every round makes decoding *slower* than the target alone; the policy drafts only
when the expected tokens per second beat a plain target step, and otherwise takes plain target steps or free
prompt-lookup drafts.

The pieces:

- `CostCurve`: seconds of one forward over `q` new rows, interpolated from measured points and updated online.
- `AcceptanceCalibrator`: drafter confidence -> probability the target accepts the draft (given all earlier drafts
  of the round were accepted), plus a per-position profile used before a draft pass.
- `expected_tokens(p, k) = 1 + sum_{j<=k} prod_{i<=j} p_i`: committed tokens of a round sending `k` drafts.
- `rates_d3d.RoundRates`: what each option of a round is expected to give, for one sequence or a batch.
- `DraftPolicy`: `decide` (before a round, the one place a chain, tree or batch round is decided: target step,
  drafter pass with `m` masks, or `k` lookup tokens), `choose` (after a draft pass: how many drafts to send),
  `observe_round` (after verification: learn).

Where the curves and the learned state come from (a short measurement, and a store per machine, model pair and
dtype) is the sibling `calibration_d3d.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from .acceptance_d3d import AcceptanceCalibrator, LookupAcceptance
from .estimates_d3d import (
    BatchedCosts,
    CostCurve,
    _as_floats,
    _check_probabilities,
    _check_seconds,
    _is_int,
    expected_tokens,
)
from .rates_d3d import SOURCES, RoundDecision, RoundRates, SequenceState, _Option, _pick, _rate

logger = logging.getLogger(__name__)


class DraftPolicy(RoundRates):
    r"""
    Decides, round by round, whether to draft and how many drafts to verify, from measured cost curves and learned
    acceptance. Follows d3d-hf docs/DESIGN.md section 9 and the D3D method (arXiv 2611.06425); the policy itself is
    our design. All rates are expected committed tokens per second of one round.

    **Before a round** (`decide`), three options are rated:

    - plain target step (no drafts): `R_target = 1 / t_verify(1)`;
    - drafter pass with `m` masks (`plan`), `1 <= m <= max_drafts`, on a drafter that has `c = num_pending`
      committed tokens to catch up, with the position profile `q_j` (`AcceptanceCalibrator.position_profile`):
      `R_draft(m) = expected_tokens(q, m) / (t_draft(c + m) + t_verify(m + 1))`; this assumes all `m` drafts are
      sent, a lower bound on what `choose` makes of the pass;
    - prompt lookup with `L` matched tokens from a match of n-gram size `n`, with the learned acceptance `q_n,j`
      of span position `j` (`LookupAcceptance`: copied spans are accepted more often deeper in, and longer
      matches are more reliable): for `k <= L`, `R_lookup(k) = expected_tokens(q_n, k) / t_verify(k + 1)` (no draft
      pass).

    The best rate wins; options within `tie_tolerance` (2%) of the best count as ties, and ties go to the cheaper
    option (fewer expected seconds per round). The choice is myopic: it does not weigh that catching the drafter up
    on `c` pending tokens must be paid by whichever later round drafts.

    **After a draft pass** (`choose`), with the calibrated probabilities `p_j = p(c_j)` of the computed drafts and
    the pass's measured `draft_seconds` (already paid, so part of this round's time):
    `k* = argmax_{0 <= k <= m} expected_tokens(p, k) / (draft_seconds + t_verify(k + 1))`, same tie rule.

    **Exploration** (adaptive mode only; deterministic, so runs are reproducible): a policy that prefers plain
    steps would never observe the drafter again, so

    - *warm-up*: the first round on which the drafter is usable, while the calibrator has no observation at all,
      is a drafter round; likewise the first round with lookup tokens while the lookup estimate has none;
    - *periodic*: after `interval - 1` consecutive decided rounds without a draft pass, the next round is a
      drafter round (so one round in `interval` drafts); `interval` starts at `explore_every` (256), is multiplied
      by `explore_backoff` (2) after each periodic exploration, up to `explore_max_interval` (4096), and returns to
      `explore_every` whenever the rates choose the drafter by themselves. Lookup has its own counter, counting
      only rounds that had lookup tokens.

    An exploration drafter round computes every allowed mask and `choose` sends all of them (so the calibrator
    sees outcomes at every position); an exploration lookup round sends all allowed lookup tokens. The drafter
    warm-up is taken before lookup exploration when both are due.

    **Masks and drafts.** A pass with `m` masks is `drafter.draft_logits(committed, cache, num_masks=m)` over
    `num_pending + m` rows; it returns `m + 1` score rows, and the policy counts the first `m` as the round's drafts
    (the last row, the guess one past the block, is left unused, as in the synchronous generator).

    Example (one round of a candidate generator; `lookup, n` from `lookup_d3d.lookup_match`):

        decision = policy.decide(num_pending=seq_len - cache_len, lookup_tokens=lookup.shape[1],
                                 max_candidates=max_length - seq_len - 1)
        if decision.source == "drafter":
            start = time.perf_counter()
            logits = drafter.draft_logits(committed, cache, num_masks=decision.num_masks)[0, :-1]
            draft_seconds = time.perf_counter() - start
            confidences = ...  # probability of each chosen draft token under its processed scores
            k = policy.choose(confidences, draft_seconds, decision)  # send the first k drafts
        elif decision.source == "lookup":
            k = decision.num_lookup  # send lookup[:, :k]
        else:
            k = 0  # no candidates: a plain target step
        ...  # after verification (transformers' update_candidate_strategy: num_matches accepted)
        policy.observe_round(decision, num_sent=k, num_accepted=num_matches, confidences=confidences,
                             draft_seconds=draft_seconds, verify_seconds=verify_seconds)

    Args:
        verify_curve (`CostCurve`, *optional*): target forward seconds by rows (`t_verify`); required in adaptive
            mode.
        draft_curve (`CostCurve`, *optional*): drafter pass seconds by rows (`t_draft`, rows = pending committed
            tokens + masks); without it the adaptive policy never drafts (target steps and lookup only).
        calibrator (`AcceptanceCalibrator`, *optional*): defaults to a fresh one.
        max_drafts (`int`, defaults to 15): most drafts a pass may produce (`block_size - 1`), >= 0.
        mode (`str` or `int`, defaults to `"adaptive"`): `"adaptive"`; `"off"` (always a plain target step); or an
            int `k` in `[0, max_drafts]`: always a drafter pass with `k` masks, all of them sent (`0` = `"off"`);
            fixed modes never use lookup and never explore.
        tie_tolerance (`float`, defaults to 0.02): relative rate difference treated as a tie, in [0, 1).
        explore_every (`int`, *optional*, defaults to 256): base exploration interval in rounds, >= 1; `None`
            disables exploration (warm-up included).
        explore_backoff (`float`, defaults to 2.0): interval growth per periodic exploration, >= 1.
        explore_max_interval (`int`, defaults to 4096): the interval's ceiling, >= `explore_every`.
        lookup_prior (`float`, defaults to 0.5): prior acceptance of a span's first lookup token, in [0, 1]
            (`LookupAcceptance`).
        lookup_prior_strength (`float`, defaults to 4.0): pseudo-observations of each lookup prior, > 0.
        lookup_memory (`float`, *optional*, defaults to 64.0): lookup rounds over which lookup counts fade (> 1);
            `None` keeps them forever.
        curve_weight (`float`, defaults to 0.2): weight of a round's timing in `CostCurve.observe`, in (0, 1].

    Raises:
        ValueError: for an unknown mode, out-of-range arguments, or adaptive mode without `verify_curve`.
    """

    def __init__(
        self,
        verify_curve: CostCurve | None = None,
        draft_curve: CostCurve | None = None,
        calibrator: AcceptanceCalibrator | None = None,
        max_drafts: int = 15,
        mode: str | int = "adaptive",
        *,
        tie_tolerance: float = 0.02,
        explore_every: int | None = 256,
        explore_backoff: float = 2.0,
        explore_max_interval: int = 4096,
        lookup_prior: float = 0.5,
        lookup_prior_strength: float = 4.0,
        lookup_memory: float | None = 64.0,
        curve_weight: float = 0.2,
    ) -> None:
        if not _is_int(max_drafts) or max_drafts < 0:
            raise ValueError(f"`max_drafts` must be an int >= 0 (block_size - 1), got {max_drafts!r}.")
        if _is_int(mode):
            if not 0 <= mode <= max_drafts:
                raise ValueError(
                    f"A fixed `mode` must be a number of drafts in [0, max_drafts={max_drafts}], got {mode}."
                )
        elif mode not in ("adaptive", "off"):
            raise ValueError(f"`mode` must be 'adaptive', 'off' or an int in [0, {max_drafts}], got {mode!r}.")
        if mode == "adaptive" and verify_curve is None:
            raise ValueError("The adaptive mode needs `verify_curve` (see `measure_cost_curves`).")
        if not 0 <= tie_tolerance < 1:
            raise ValueError(f"`tie_tolerance` must be in [0, 1), got {tie_tolerance!r}.")
        if explore_every is not None and (not _is_int(explore_every) or explore_every < 1):
            raise ValueError(f"`explore_every` must be an int >= 1 or None, got {explore_every!r}.")
        if not explore_backoff >= 1:
            raise ValueError(f"`explore_backoff` must be >= 1, got {explore_backoff!r}.")
        if not _is_int(explore_max_interval) or explore_max_interval < (explore_every or 1):
            raise ValueError(f"`explore_max_interval` must be an int >= explore_every, got {explore_max_interval!r}.")
        if not 0 <= lookup_prior <= 1 or not lookup_prior_strength > 0:
            raise ValueError("`lookup_prior` must be in [0, 1] and `lookup_prior_strength` > 0.")
        if lookup_memory is not None and not lookup_memory > 1:
            raise ValueError(f"`lookup_memory` must be > 1 (or None), got {lookup_memory!r}.")
        self.lookup = LookupAcceptance(lookup_prior, lookup_prior_strength, lookup_memory)
        if not 0 < curve_weight <= 1:
            raise ValueError(f"`curve_weight` must be in (0, 1], got {curve_weight!r}.")
        self.verify_curve = verify_curve
        self.draft_curve = draft_curve
        self.calibrator = calibrator if calibrator is not None else AcceptanceCalibrator()
        #: in memory only: per `(node budget, branching)`, the running ratio of a draft tree's expected accepted
        #: drafts to its likeliest chain's (`D3DCandidateGenerator.get_tree`), the `gain` of `decide(tree=...)`
        self.tree_gains: dict[tuple[int, int], float] = {}
        self.max_drafts = max_drafts
        self.mode: str | int = "off" if mode == 0 else mode
        self.tie_tolerance = float(tie_tolerance)
        self.explore_every = explore_every
        self.explore_backoff = float(explore_backoff)
        self.explore_max_interval = explore_max_interval
        self.curve_weight = float(curve_weight)
        # exploration state (advanced by `decide`)
        self.rounds = 0
        self._drafter_rounds = 0
        self._lookup_rounds = 0
        self._since_drafter = 0
        self._since_lookup = 0
        self._drafter_interval = explore_every or 0
        self._lookup_interval = explore_every or 0

    # ---- after the draft pass ------------------------------------------------------------------------------------

    def choose(
        self,
        confidences: Sequence[float] | torch.Tensor | Sequence[Sequence[float] | None],
        draft_seconds: float,
        decision: RoundDecision | None = None,
        *,
        batch: Sequence[SequenceState] | None = None,
    ) -> int:
        """Drafts to send after a draft pass: `k` in `[0, m]`, `m = len(confidences)`.

        Adaptive mode: `argmax_k expected_tokens(p, k) / (draft_seconds + t_verify(k + 1))` with `p` the calibrated
        probabilities of `confidences`; near-ties (`tie_tolerance`) to the smaller `t_verify`. Fixed mode `k`:
        `min(k, m)`; `"off"`: 0; an exploration round (`decision.explore`): `m` (everything computed).

        A batch (`batch`): one `k` for every sequence that drafts, by the same rule with the sequences' expected
        tokens summed and the verification over the longest sequence's rows (`verify_pending` + its drafts) read
        on the curves scaled by `batched_costs`; `m` is the most drafts of any sequence.

        Args:
            confidences (`Sequence[float]` or 1-D `torch.Tensor`): confidence of each draft the pass produced, in
                order (its probability under the distribution it was chosen from), in [0, 1]. Pass only drafts that
                may be sent (after cutting at eos / stop strings / `max_length`). With `batch`: one such list per
                sequence, or `None` for a sequence that sends its lookup match instead (`batch[i].lookup_tokens`
                tokens, all of them).
            draft_seconds (`float`): measured wall time of the pass (>= 0).
            decision (`RoundDecision`, *optional*): the round's decision from `decide` (for its `explore` flag).
            batch (sequence of `SequenceState`, *optional*): the batch's sequences, in the order of `confidences`.

        Returns:
            `int` in `[0, m]`.

        Raises:
            ValueError: for bad confidences or seconds, or a `batch` of another length than `confidences`.
        """
        if batch is not None:
            return self._choose_batch(confidences, draft_seconds, decision, batch)
        rates = self.choose_rates(confidences, draft_seconds) if self.mode == "adaptive" else None
        m = len(_as_floats(confidences))
        if self.mode == "off":
            return 0
        if _is_int(self.mode):
            return min(self.mode, m)
        if decision is not None and decision.explore and decision.source == "drafter":
            return m
        seconds = _check_seconds(draft_seconds, "`draft_seconds`")
        options = [_Option("drafter", k, r, seconds + self._verify(k + 1)) for k, r in enumerate(rates)]
        return _pick(options, self.tie_tolerance).count

    def _choose_batch(self, confidences, draft_seconds, decision, batch) -> int:
        if len(confidences) != len(batch):
            raise ValueError(f"`confidences` has {len(confidences)} sequences, `batch` {len(batch)}.")
        probabilities = [
            self.lookup.probabilities(s.lookup_tokens, s.lookup_ngram_size or None)
            if c is None
            else self.calibrator.probabilities(c)
            for c, s in zip(confidences, batch, strict=True)
        ]
        most = max((len(p) for c, p in zip(confidences, probabilities, strict=True) if c is not None), default=0)
        if self.mode == "off":
            return 0
        if _is_int(self.mode):
            return min(self.mode, most)
        if decision is not None and decision.explore and decision.source == "drafter":
            return most
        seconds = _check_seconds(draft_seconds, "`draft_seconds`")
        verify, _ = self._costs(len(batch))
        options = []
        for k in range(most + 1):
            tokens, rows = 0.0, 0
            for c, p, s in zip(confidences, probabilities, batch, strict=True):
                count = s.lookup_tokens if c is None else min(k, len(p))
                tokens += expected_tokens(p, count)
                rows = max(rows, s.verify_pending + count)
            total = seconds + verify(rows)
            options.append(_Option("drafter", k, _rate(tokens, total), total))
        return _pick(options, self.tie_tolerance).count

    def choose_tree_size(self, node_probabilities: Sequence[float], draft_seconds: float) -> int:
        """Nodes `n` of a best-first draft tree to verify (`d3d_tree_budget="adaptive"`): `argmax_n (1 + sum_{i < n}
        P_i) / (draft_seconds + t_verify(1 + n))`, `P_i` the probability that node `i` is accepted (its path's
        product, `DraftTree.probabilities`); near-ties (`tie_tolerance`) go to the smaller tree.

        Returns:
            `int` in `[0, len(node_probabilities)]`.
        """
        expected, rates = 1.0, []
        for n in range(len(node_probabilities) + 1):
            if n:
                expected += node_probabilities[n - 1]
            rates.append(expected / (draft_seconds + self.verify_curve(1 + n)))
        top = max(rates)
        return next(n for n, rate in enumerate(rates) if rate >= top * (1 - self.tie_tolerance))

    # ---- lookup --------------------------------------------------------------------------------------------------

    def observe_lookup(self, num_sent: int, num_accepted: int, ngram_size: int | None = None) -> None:
        """Updates the lookup estimate from one verified lookup round (`LookupAcceptance.observe`).

        Args:
            num_sent (`int`): lookup tokens sent, >= 0.
            num_accepted (`int`): of them accepted, in `[0, num_sent]`.
            ngram_size (`int`, *optional*): size of the n-gram that matched.

        Raises:
            ValueError: for inconsistent counts.
        """
        self.lookup.observe(num_sent, num_accepted, ngram_size)

    # ---- one round -----------------------------------------------------------------------------------------------

    def decide(
        self,
        num_pending: int = 1,
        lookup_tokens: int = 0,
        max_candidates: int | None = None,
        lookup_ngram_size: int | None = None,
        tree: tuple[int, float | None] | None = None,
        ready_masks: int = 0,
        *,
        batch: Sequence[SequenceState] | None = None,
        draft_pass: bool = True,
    ) -> RoundDecision:
        """Decides the next round, for one sequence (chain or tree rounds) or a batch: the one place a round is
        decided (call once per round, before drafting; one sequence's calls advance the exploration counters).

        Args:
            num_pending (`int`, defaults to 1): committed tokens the drafter has not cached (>= 1, the anchor
                included).
            lookup_tokens (`int`, defaults to 0): length of the prompt-lookup match available this round (0: none).
            max_candidates (`int`, *optional*): most candidates this round may send (room before `max_length`).
            lookup_ngram_size (`int`, *optional*): size of the n-gram the lookup tokens matched
                (`lookup_d3d.lookup_match`); the lookup estimate is kept per size.
            tree (`tuple[int, float | None]`, *optional*): the drafter round is a draft tree (D3D's own loop):
                `(nodes, gain)`, the nodes it verifies and its expected accepted drafts as a multiple of the chain's
                (both from the same calibrated estimates, `TreeRounds.get_tree`); the only drafter option is then a
                pass with every allowed mask, rated `(1 + gain * (expected_tokens(q, m) - 1)) / (t_draft(c + m) +
                t_verify(nodes + 1))`. `gain=None` (no tree of this size built yet): the round is decided as a chain,
                then made a warm-up drafter round with every allowed mask (`explore`) when a draft pass can run.
                Adaptive mode only.
            ready_masks (`int`, defaults to 0): a block of this many masks was drafted inside the previous
                verification (fused successor drafting): the drafter option is then that block, with no pass, rated
                `expected_tokens(ready_profile(k), k) / t_verify(k + 1)` for `k` of its drafts, and the decision is
                `ready` (its `num_masks` the block's size). In a fixed mode the ready block is the round's drafts.
            batch (sequence of `SequenceState`, *optional*): decide one round for these sequences together (D3D's
                batched loop) instead of the scalar arguments above, which must then keep their defaults: one draft
                pass of `m` masks for every sequence, a lookup round, or a plain step, rated by the same rule with
                the sequences' expected tokens summed and the curves scaled by `batched_costs`. A batch explores
                only to warm up (a drafter round while the calibrator has seen none): a periodic exploration round
                would cost every sequence.
            draft_pass (`bool`, defaults to True): `False` when no draft pass may run this round (e.g. the prefill
                of a batch whose drafter reads the target's cache: its pass would compute the prompts' keys and
                values a second time).

        Returns:
            `RoundDecision`. For `"drafter"`, run `draft_logits(committed, cache, num_masks=decision.pass_masks)`,
            then `choose(confidences, draft_seconds, decision)` among its first `num_masks` drafts; for `"lookup"`,
            send the first `decision.num_lookup` lookup tokens (a batch: each sequence marked in `lookup_rows`); for
            `"target"`, send no candidates.

        Raises:
            ValueError: for bad counts, or `batch` together with `tree` or `ready_masks`.
        """
        batched = batch is not None
        if batched:
            if (num_pending, lookup_tokens, max_candidates, lookup_ngram_size, tree, ready_masks) != (
                1,
                0,
                None,
                None,
                None,
                0,
            ):
                raise ValueError(
                    "`decide(batch=...)` takes each sequence's counts from `batch`: drop the scalar arguments."
                )
            sequences = self._check_batch(batch)
        else:
            sequences = [self._sequence(num_pending, lookup_tokens, max_candidates, lookup_ngram_size)]
        most = max(self._limit(s.limit) for s in sequences)
        lookup_limit = max(self._lookup_limits(sequences))
        pending = max(s.draft_pending for s in sequences)
        fixed = _is_int(self.mode)
        if self.mode == "off" or (fixed and (most == 0 or not draft_pass)):
            rate = self.target_rate() if self.verify_curve is not None else 0.0
            decision = RoundDecision("target", num_pending=pending, target_rate=rate, expected_rate=rate)
        elif fixed:
            decision = self._decide_fixed(sequences[0], min(self.mode, most), ready_masks, batched)
        else:
            decision = self._decide_adaptive(sequences, batched, tree, ready_masks, draft_pass)
        if not batched:
            self._advance(decision, lookup_limit > 0)
            if tree is not None and tree[1] is None and self.mode == "adaptive" and self.draft_curve is not None:
                decision = replace(decision, source="drafter", num_masks=most, num_lookup=0, explore=True)
        return decision

    def _decide_fixed(self, sequence: SequenceState, m: int, ready_masks: int, batched: bool) -> RoundDecision:
        """A fixed plan's drafter round: `m = min(k, limit)` drafts of the whole block's pass (or the ready block)."""
        rate = 0.0
        if not batched and self.draft_curve is not None and self.verify_curve is not None:
            rate = self._round_options([replace(sequence, limit=m)], False)[1][-1].rate
        target_rate = self.target_rate() if self.verify_curve is not None else 0.0
        ready = ready_masks > 0
        return RoundDecision(
            "drafter",
            num_masks=ready_masks if ready else m,
            num_pending=sequence.draft_pending,
            target_rate=target_rate,
            drafter_rate=rate,
            expected_rate=rate,
            ready=ready,
            block_masks=None if ready or self.mode == m else self.mode,
        )

    def _decide_adaptive(self, sequences, batched, tree, ready_masks, draft_pass) -> RoundDecision:
        most = max(self._limit(s.limit) for s in sequences)
        lookup_limit = max(self._lookup_limits(sequences))
        ready = ready_masks > 0 and most >= 1
        target, drafter, lookup = self._round_options(sequences, batched, tree, ready_masks, draft_pass)
        # one pick over every option, so that the tie rule does not depend on the order of comparison
        chosen = _pick([target, *drafter, *lookup], self.tie_tolerance)
        best_drafter = _pick(drafter, self.tie_tolerance) if drafter else None
        best_lookup = _pick(lookup, self.tie_tolerance) if lookup else None
        explore = False
        if batched:
            if drafter and self.calibrator.num_observations == 0:  # warm-up: see the drafter's acceptance once
                chosen, explore = drafter[-1], True
        elif self.explore_every is not None:
            chosen, explore = self._explore(chosen, drafter, lookup, ready, most, lookup_limit)
        source = chosen.source
        return RoundDecision(
            source=source,
            num_masks=(ready_masks if ready else chosen.count) if source == "drafter" else 0,
            num_lookup=chosen.count if source == "lookup" else 0,
            num_pending=max(s.draft_pending for s in sequences),
            explore=explore,
            target_rate=target.rate,
            drafter_rate=None if best_drafter is None else best_drafter.rate,
            lookup_rate=None if best_lookup is None else best_lookup.rate,
            expected_rate=chosen.rate,
            lookup_ngram_size=sequences[0].lookup_ngram_size if source == "lookup" and not batched else None,
            ready=ready and source == "drafter",
            lookup_rows=chosen.rows if batched else (),
        )

    def _explore(self, chosen, drafter, lookup, ready, limit, lookup_limit) -> tuple[_Option, bool]:
        """One sequence's exploration rule (class docstring): the option to take instead of `chosen`, if any, and
        whether it was forced; updates the exploration intervals."""
        drafter_usable = (self.draft_curve is not None or ready) and limit >= 1
        warm_drafter = self._drafter_rounds == 0 and self.calibrator.num_observations == 0
        warm_lookup = self._lookup_rounds == 0 and self.lookup.num_observations == 0
        if (
            chosen.source != "drafter"
            and drafter_usable
            and (warm_drafter or self._since_drafter + 1 >= self._drafter_interval)
        ):
            if not warm_drafter:
                self._drafter_interval = min(
                    int(self._drafter_interval * self.explore_backoff), self.explore_max_interval
                )
            return drafter[-1], True  # every allowed mask
        if (
            chosen.source != "lookup"
            and lookup_limit > 0
            and (warm_lookup or self._since_lookup + 1 >= self._lookup_interval)
        ):
            if not warm_lookup:
                self._lookup_interval = min(
                    int(self._lookup_interval * self.explore_backoff), self.explore_max_interval
                )
            return lookup[lookup_limit - 1], True  # every allowed lookup token
        if chosen.source == "drafter":
            self._drafter_interval = self.explore_every
        elif chosen.source == "lookup":
            self._lookup_interval = self.explore_every
        return chosen, False

    # ---- fused successor drafting --------------------------------------------------------------------------------

    def successor_plan(
        self, end_probabilities: Sequence[float], verify_rows: int, max_drafts: int | None = None
    ) -> tuple[list[int], int]:
        """Where this round's verification should draft the next round's block (fused successor drafting,
        `successor_d3d`), and how many masks each block gets. Adaptive mode, our design.

        A block after acceptance length `j` (`0..k` of the `k` candidates; 0 = right after the committed tokens)
        turns the next round, when the accepted path ends there (probability `P_j`), into a ready drafter round:
        its drafts cost no pass. Its worth is the time that round saves: with `m` masks (the `k*` a ready round
        would send, `ready_profile`) it makes `E = expected_tokens(ready_profile(m), m)` tokens in `t_verify(m + 1)`
        where the best round without it (a plain step, or a draft pass of the best size for one pending token)
        needs `E / R_alt`: `saved = E / R_alt - t_verify(m + 1)`. Blocks are added in decreasing `P_j` while `P_j *
        saved` exceeds what their `m` rows add to this verification (`t_verify(rows + m) - t_verify(rows)` on the
        measured curve).

        Args:
            end_probabilities (sequence of `float`): `P_j` for `j = 0..k`, the probability that exactly `j`
                candidates are accepted (they need not sum to 1).
            verify_rows (`int`): rows of this verification without blocks (committed rows + candidates), >= 1.
            max_drafts (`int`, *optional*): most drafts the next round may send (room before `max_length`).

        Returns:
            `(lengths, m)`: the acceptance lengths to draft after, increasing (empty when no block pays), and the
            masks per block. In a fixed mode `k`: a block of `k` masks after every length.

        Raises:
            ValueError: for a probability outside [0, 1] or `verify_rows < 1`.
        """
        probabilities = _check_probabilities(list(end_probabilities), "`end_probabilities`")
        if not _is_int(verify_rows) or verify_rows < 1:
            raise ValueError(f"`verify_rows` must be an int >= 1, got {verify_rows!r}.")
        limit = self._limit(max_drafts)
        if self.mode == "off" or limit < 1:
            return [], 0
        if _is_int(self.mode):
            return list(range(len(probabilities))), min(self.mode, limit)
        one = [SequenceState(limit=limit)]
        options = self._round_options(one, False, ready_masks=limit)[1]
        if not options:
            return [], 0
        best = _pick(options, self.tie_tolerance)
        m = best.count
        tokens = best.rate * best.seconds
        alternatives = [self.target_rate(), *(o.rate for o in self._round_options(one, False)[1])]
        saved = tokens / max(alternatives) - best.seconds
        if saved <= 0:
            return [], 0
        chosen, rows = [], verify_rows
        for j in sorted(range(len(probabilities)), key=lambda j: -probabilities[j]):
            cost = self._verify(rows + m) - self._verify(rows)
            if probabilities[j] * saved <= cost:
                break
            chosen.append(j)
            rows += m
        return sorted(chosen), m

    def _advance(self, decision: RoundDecision, had_lookup: bool) -> None:
        self.rounds += 1
        if decision.source == "drafter":
            self._drafter_rounds += 1
            self._since_drafter = 0
        else:
            self._since_drafter += 1
        if decision.source == "lookup":
            self._lookup_rounds += 1
            self._since_lookup = 0
        elif had_lookup:
            self._since_lookup += 1

    def observe_round(
        self,
        decision: RoundDecision,
        *,
        num_sent: int,
        num_accepted: int,
        confidences: Sequence[float] | torch.Tensor | None = None,
        draft_seconds: float | None = None,
        verify_seconds: float | None = None,
        verify_rows: int | None = None,
    ) -> None:
        """Learns from one verified round: acceptance (calibrator or lookup estimate) and the cost curves.

        Updates: for a drafter round, `calibrator.observe(confidences, num_accepted, num_sent)` and
        `draft_curve.observe(decision.draft_rows, draft_seconds)`; for a lookup round, `observe_lookup`; for every
        round, `verify_curve.observe(verify_rows, verify_seconds)`. Timings that are `None` are not learned (pass
        `None` for a round whose verification included the prompt's prefill, or give its real `verify_rows`).

        Args:
            decision (`RoundDecision`): what `decide` returned for this round.
            num_sent (`int`): candidates sent for verification (0 for a target step).
            num_accepted (`int`): of them accepted by the target, in `[0, num_sent]`.
            confidences (`Sequence[float]` or 1-D `torch.Tensor`, *optional*): a drafter round's draft confidences
                (all computed ones, at least `num_sent`).
            draft_seconds (`float`, *optional*): the draft pass's wall time.
            verify_seconds (`float`, *optional*): the verification forward's wall time.
            verify_rows (`int`, *optional*): rows of that forward; defaults to `num_sent + 1`.

        Raises:
            ValueError: for inconsistent counts or bad timings.
        """
        if decision.source not in SOURCES:
            raise ValueError(f"Unknown decision source {decision.source!r}.")
        if not _is_int(num_sent) or not _is_int(num_accepted) or not 0 <= num_accepted <= num_sent:
            raise ValueError(f"Need ints 0 <= num_accepted <= num_sent, got {num_accepted!r}, {num_sent!r}.")
        if decision.source == "target" and num_sent != 0:
            raise ValueError(f"A target round sends no candidates, got num_sent={num_sent}.")
        if decision.source == "drafter":
            if confidences is not None:
                self.calibrator.observe(confidences, num_accepted, num_sent, position_offset=int(decision.ready))
            if draft_seconds is not None and self.draft_curve is not None:
                self.draft_curve.observe(decision.draft_rows, draft_seconds, self.curve_weight)
        elif decision.source == "lookup":
            self.observe_lookup(num_sent, num_accepted, decision.lookup_ngram_size)
        if verify_seconds is not None and self.verify_curve is not None:
            rows = num_sent + 1 if verify_rows is None else verify_rows
            self.verify_curve.observe(rows, verify_seconds, self.curve_weight)

    # ---- state ---------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The learned state (cost curves, calibrator, lookup estimate) as a JSON-safe dict; settings not included."""
        return {
            "verify_curve": None if self.verify_curve is None else self.verify_curve.to_dict(),
            "draft_curve": None if self.draft_curve is None else self.draft_curve.to_dict(),
            "calibrator": self.calibrator.to_dict(),
            "lookup": self.lookup.to_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what `state_dict` returned (all or nothing).

        Raises:
            ValueError: if `state` is malformed (the policy is then unchanged).
        """
        try:
            verify = state["verify_curve"]
            draft = state["draft_curve"]
            verify_curve = None if verify is None else CostCurve.from_dict(verify)
            draft_curve = None if draft is None else CostCurve.from_dict(draft)
            calibrator = AcceptanceCalibrator.from_dict(state["calibrator"])
            lookup = LookupAcceptance.from_dict(state["lookup"])
        except (KeyError, TypeError):
            raise ValueError("Not a DraftPolicy state.") from None
        if self.mode == "adaptive" and verify_curve is None:
            raise ValueError("DraftPolicy state without a verify curve cannot drive the adaptive mode.")
        self.verify_curve, self.draft_curve, self.calibrator = verify_curve, draft_curve, calibrator
        self.lookup = lookup

    def save_to(self, store, key: str, parts: Mapping[str, Any] | None = None) -> str | None:
        """`store.save(key, self.state_dict(), parts)`; returns the file written (None if it could not be)."""
        return store.save(key, self.state_dict(), parts)

    def restore_from(self, store, key: str) -> bool:
        """Loads the state saved under `key`; an absent or malformed state is ignored.

        Returns:
            `bool`: whether a state was restored.
        """
        state = store.load(key)
        if state is None:
            return False
        try:
            self.load_state_dict(state)
        except ValueError as err:
            logger.info("Ignoring the stored calibration %s: %s", key, err)
            return False
        return True


__all__ = [
    "SOURCES",
    "AcceptanceCalibrator",
    "BatchedCosts",
    "CostCurve",
    "DraftPolicy",
    "LookupAcceptance",
    "RoundDecision",
    "SequenceState",
    "expected_tokens",
]
