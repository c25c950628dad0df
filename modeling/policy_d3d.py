"""Cost-aware drafting policy: how many drafts a round should verify, and from which source.

Part of the self-contained remote-code bundle: imports only the Python standard library, torch and the public
transformers API (and, inside `measure_cost_curves` only, the sibling `modeling_d3d`), so a checkpoint loaded with
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
- `DraftPolicy`: `decide` (before a round: target step, drafter pass with `m` masks, or `k` lookup tokens),
  `choose` (after a draft pass: how many drafts to send), `observe_round` (after verification: learn).
- `calibration_key`, `CalibrationStore`, `cpu_model`: the learned state kept per machine, model pair and dtype, in
  memory and as JSON files under the user's cache folder.
- `measure_cost_curves`: a short calibration of both curves for a target and a D3D drafter.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: Version of the JSON files `CalibrationStore` writes; a file of another version is ignored (and replaced).
CALIBRATION_FORMAT_VERSION = 1
#: Environment variable that overrides the cache folder of `CalibrationStore`.
CACHE_ENV = "D3D_HF_CACHE"
#: The sources a round can take its candidates from.
SOURCES = ("target", "drafter", "lookup")
#: CPU flags that change forward speed (recorded by `cpu_model` and in calibration keys).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
#: Seconds below which a round's time is clamped when computing a rate (a zero-cost curve would divide by zero).
_MIN_SECONDS = 1e-9
#: Slack allowed on confidences just outside [0, 1] (float rounding of a softmax).
_PROB_SLACK = 1e-4


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_seconds(seconds: Any, what: str) -> float:
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {seconds!r}.") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be finite and >= 0 seconds, got {seconds!r}.")
    return value


def _as_floats(values: Sequence[float] | torch.Tensor) -> list[float]:
    if isinstance(values, torch.Tensor):
        return [float(v) for v in values.detach().flatten().tolist()]
    return [float(v) for v in values]


def _check_probabilities(values: Sequence[float] | torch.Tensor, what: str) -> list[float]:
    """Floats in [0, 1] (values within `_PROB_SLACK` outside are clipped); ValueError otherwise."""
    out = []
    for value in _as_floats(values):
        if not math.isfinite(value) or value < -_PROB_SLACK or value > 1 + _PROB_SLACK:
            raise ValueError(f"{what} must be probabilities in [0, 1], got {value!r}.")
        out.append(min(max(value, 0.0), 1.0))
    return out


# --------------------------------------------------------------------------------------------------------------------
# Cost curves
# --------------------------------------------------------------------------------------------------------------------


class CostCurve:
    r"""
    Wall time (seconds) of one forward pass as a function of the number of new rows `q` it computes.

    Built from measured points `{q: seconds}`. Between points the curve is piecewise linear; below the first point
    it is flat (the first point's value); beyond the last point it is extrapolated linearly from the last two points
    but never below the last point's value (more rows never cost less than the last measurement). A single point
    gives a flat curve.

    Args:
        points (`Mapping[int, float]`):
            Rows `q` (int >= 1) -> seconds (finite, >= 0).

    Raises:
        ValueError: if `points` is empty, a `q` is not an int >= 1, or a time is negative or not finite.

    Example:
        >>> curve = CostCurve({1: 0.0587, 2: 0.0960, 4: 0.1034, 8: 0.0977, 16: 0.1099})
        >>> round(curve(3), 4)
        0.0997
    """

    def __init__(self, points: Mapping[int, float]) -> None:
        if not points:
            raise ValueError("A CostCurve needs at least one measured point {rows: seconds}.")
        self._points: dict[int, float] = {}
        for q, seconds in points.items():
            self._points[self._check_rows(q)] = _check_seconds(seconds, f"The time at q={q}")
        self._xs = sorted(self._points)

    @staticmethod
    def _check_rows(q: Any) -> int:
        if isinstance(q, float) and q.is_integer():
            q = int(q)
        if not _is_int(q) or q < 1:
            raise ValueError(f"Rows `q` must be an int >= 1, got {q!r}.")
        return q

    @property
    def points(self) -> dict[int, float]:
        """A copy of the points `{q: seconds}`, sorted by `q`."""
        return {q: self._points[q] for q in sorted(self._points)}

    def __call__(self, q: float) -> float:
        """Seconds of a forward over `q` new rows.

        Args:
            q (`float`): rows, >= 1 (fractional values interpolate).

        Returns:
            `float`: seconds, >= 0.

        Raises:
            ValueError: if `q` is below 1 or not finite.
        """
        q = float(q)
        if not math.isfinite(q) or q < 1:
            raise ValueError(f"Rows `q` must be finite and >= 1, got {q!r}.")
        xs = self._xs
        ys = [self._points[x] for x in xs]
        if q <= xs[0]:
            return ys[0]
        if q >= xs[-1]:
            if len(xs) == 1:
                return ys[-1]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return max(ys[-1], ys[-1] + slope * (q - xs[-1]))
        for i in range(1, len(xs)):
            if q <= xs[i]:
                lo, hi = i - 1, i
                break
        return ys[lo] + (ys[hi] - ys[lo]) * (q - xs[lo]) / (xs[hi] - xs[lo])

    def observe(self, q: int, seconds: float, weight: float = 0.2) -> None:
        """Updates the curve with one measured forward (a real round's timing).

        An existing point moves by an exponential moving average, `new = (1 - weight) * old + weight * seconds`; a new
        `q` becomes a point with value `seconds`.

        Args:
            q (`int`): rows of the measured forward, >= 1.
            seconds (`float`): its wall time, finite and >= 0.
            weight (`float`, defaults to 0.2): weight of the new measurement, in (0, 1].

        Raises:
            ValueError: for a bad `q`, `seconds` or `weight`.
        """
        q = self._check_rows(q)
        seconds = _check_seconds(seconds, "`seconds`")
        weight = float(weight)
        if not 0 < weight <= 1:
            raise ValueError(f"`weight` must be in (0, 1], got {weight!r}.")
        old = self._points.get(q)
        self._points[q] = seconds if old is None else (1 - weight) * old + weight * seconds
        if old is None:
            self._xs = sorted(self._points)

    def monotone(self) -> CostCurve:
        """The running maximum of the points over increasing `q` (a curve on which more rows never cost less)."""
        out, best = {}, 0.0
        for q, seconds in self.points.items():
            best = max(best, seconds)
            out[q] = best
        return CostCurve(out)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state: `{"points": [[q, seconds], ...]}` sorted by `q`."""
        return {"points": [[q, s] for q, s in self.points.items()]}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> CostCurve:
        """Inverse of `to_dict`.

        Raises:
            ValueError: if `state` is malformed.
        """
        try:
            pairs = state["points"]
            points = {pair[0]: pair[1] for pair in pairs}
        except (KeyError, TypeError, IndexError):
            raise ValueError(f"Not a CostCurve state: {state!r}.") from None
        return cls(points)

    def __repr__(self) -> str:
        inner = ", ".join(f"{q}: {s * 1e3:.2f} ms" for q, s in self.points.items())
        return f"CostCurve({{{inner}}})"


# --------------------------------------------------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------------------------------------------------


def expected_tokens(probabilities: Sequence[float] | torch.Tensor, k: int) -> float:
    r"""
    Committed tokens expected from a round that sends the first `k` drafts:

        E[tokens] = 1 + sum_{j=1..k} prod_{i=1..j} p_i,

    where `p_i` is the probability that draft `i` is accepted given drafts `1..i-1` were; the 1 is the target's
    bonus token, which every round commits. Follows d3d-hf docs/DESIGN.md section 9 (our design).

    Args:
        probabilities (`Sequence[float]` or 1-D `torch.Tensor`): `p_1, p_2, ...`, each in [0, 1].
        k (`int`): drafts sent, `0 <= k <= len(probabilities)`.

    Returns:
        `float` in `[1, k + 1]`.

    Raises:
        ValueError: if `k` is out of range or a probability is outside [0, 1].

    Example:
        >>> expected_tokens([0.5, 0.5], 2)
        1.75
    """
    probs = _check_probabilities(probabilities, "`probabilities`")
    if not _is_int(k) or not 0 <= k <= len(probs):
        raise ValueError(f"`k` must be an int in [0, {len(probs)}], got {k!r}.")
    total, reach = 1.0, 1.0
    for p in probs[:k]:
        reach *= p
        total += reach
    return total


class AcceptanceCalibrator:
    r"""
    Maps a draft token's confidence to the probability that the target accepts it, and keeps a per-position profile
    of acceptance for planning a draft pass before it runs (our design, d3d-hf docs/DESIGN.md section 9).

    **Calibration.** The confidence `c` of a draft is its probability under the distribution it was chosen from (the
    drafter's processed scores), in [0, 1]. Confidences fall into `num_bins` equal-width bins; bin `b` counts
    accepted (`a_b`) and rejected (`r_b`) drafts, each observed given all earlier drafts of its round were accepted.
    The calibrated probability is the posterior mean under a Beta prior centred on the draft's own confidence with
    `prior_strength` pseudo-observations `s`:

        p(c) = (a_b + s * c) / (a_b + r_b + s),

    which is the identity before anything is observed and tends to the bin's observed acceptance rate. (Centring the
    prior on `c` rather than on the bin's centre keeps the start exactly the identity.)

    **Position profile.** Before a draft pass there are no confidences yet, so the number of masks to compute is
    planned from `position_profile`: for draft position `j`, the probability that draft `j` is accepted given drafts
    `1..j-1` were, without looking at confidences. It is a Beta-smoothed rate per position,

        q_j = (A_j + s * q0_j) / (N_j + s),        q0_j = profile_prior * profile_decay ** (j - 1),

    where `N_j` counts rounds that reached position `j` (drafts `1..j-1` accepted) and `A_j` those that also accepted
    draft `j`. Observed outcomes count 1. Drafts that were computed but not sent after an all-accepted prefix (the
    policy cut the round short) count *softly*, with the calibrated probabilities: reaching `j` with weight
    `w = prod_{i<j} p(c_i)` over the unsent drafts before it, accepting with `w * p(c_j)`. This keeps the profile
    unbiased by the cut (otherwise a later position would be seen only in confident rounds and look better than it
    is). Counts fade by a factor `1 - 1 / profile_memory` per observed round, so the profile follows the text.

    Args:
        num_bins (`int`, defaults to 10): equal-width confidence bins.
        prior_strength (`float`, defaults to 4.0): pseudo-observations `s` of both priors, > 0.
        profile_prior (`float`, defaults to 0.6): prior acceptance of draft 1, in [0, 1].
        profile_decay (`float`, defaults to 0.9): prior factor per further position, in [0, 1].
        profile_memory (`float`, *optional*, defaults to 256.0): rounds over which profile counts fade (> 1);
            `None` keeps them forever.

    Raises:
        ValueError: for out-of-range arguments.
    """

    def __init__(
        self,
        num_bins: int = 10,
        prior_strength: float = 4.0,
        profile_prior: float = 0.6,
        profile_decay: float = 0.9,
        profile_memory: float | None = 256.0,
    ) -> None:
        if not _is_int(num_bins) or num_bins < 1:
            raise ValueError(f"`num_bins` must be an int >= 1, got {num_bins!r}.")
        if not (math.isfinite(prior_strength) and prior_strength > 0):
            raise ValueError(f"`prior_strength` must be > 0, got {prior_strength!r}.")
        for name, value in (("profile_prior", profile_prior), ("profile_decay", profile_decay)):
            if not (math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"`{name}` must be in [0, 1], got {value!r}.")
        if profile_memory is not None and not (math.isfinite(profile_memory) and profile_memory > 1):
            raise ValueError(f"`profile_memory` must be > 1 (or None), got {profile_memory!r}.")
        self.num_bins = num_bins
        self.prior_strength = float(prior_strength)
        self.profile_prior = float(profile_prior)
        self.profile_decay = float(profile_decay)
        self.profile_memory = None if profile_memory is None else float(profile_memory)
        self._accepted = [0.0] * num_bins
        self._total = [0.0] * num_bins
        self._profile_accepted: list[float] = []
        self._profile_total: list[float] = []
        self.num_observations = 0

    def _bin(self, confidence: float) -> int:
        return min(int(confidence * self.num_bins), self.num_bins - 1)

    def probabilities(self, confidences: Sequence[float] | torch.Tensor) -> list[float]:
        """Calibrated acceptance probabilities of drafts with these confidences.

        Args:
            confidences (`Sequence[float]` or 1-D `torch.Tensor`): each in [0, 1].

        Returns:
            `list[float]` of the same length, each in [0, 1].

        Raises:
            ValueError: if a confidence is outside [0, 1] or not finite.
        """
        out = []
        s = self.prior_strength
        for c in _check_probabilities(confidences, "Confidences"):
            b = self._bin(c)
            out.append((self._accepted[b] + s * c) / (self._total[b] + s))
        return out

    def _grow_profile(self, length: int) -> None:
        while len(self._profile_total) < length:
            self._profile_accepted.append(0.0)
            self._profile_total.append(0.0)

    def observe(
        self, confidences: Sequence[float] | torch.Tensor, num_accepted: int, num_sent: int | None = None
    ) -> None:
        """Learns from one verified round.

        The first `num_accepted` sent drafts were accepted; the next sent one (if any) was rejected; later drafts are
        unobserved. Drafts beyond `num_sent` (computed, not sent) feed only the position profile, softly, when every
        sent draft was accepted (see the class docstring).

        Args:
            confidences (`Sequence[float]` or 1-D `torch.Tensor`): confidences of the drafts the pass computed, in
                order (at least the `num_sent` sent ones).
            num_accepted (`int`): drafts the target accepted, `0 <= num_accepted <= num_sent`.
            num_sent (`int`, *optional*): drafts sent for verification; defaults to `len(confidences)`.

        Raises:
            ValueError: for inconsistent counts or bad confidences.
        """
        conf = _check_probabilities(confidences, "Confidences")
        sent = len(conf) if num_sent is None else num_sent
        if not _is_int(sent) or not 0 <= sent <= len(conf):
            raise ValueError(f"`num_sent` must be an int in [0, {len(conf)}] (the confidences given), got {sent!r}.")
        if not _is_int(num_accepted) or not 0 <= num_accepted <= sent:
            raise ValueError(f"`num_accepted` must be an int in [0, num_sent={sent}], got {num_accepted!r}.")
        probs = self.probabilities(conf)  # the calibration before this round, for the soft counts
        rejected = num_accepted < sent
        for c in conf[:num_accepted]:
            b = self._bin(c)
            self._accepted[b] += 1.0
            self._total[b] += 1.0
        if rejected:
            self._total[self._bin(conf[num_accepted])] += 1.0
        if self.profile_memory is not None:
            keep = 1.0 - 1.0 / self.profile_memory
            self._profile_accepted = [a * keep for a in self._profile_accepted]
            self._profile_total = [n * keep for n in self._profile_total]
        self._grow_profile(len(conf))
        for j in range(num_accepted):
            self._profile_accepted[j] += 1.0
            self._profile_total[j] += 1.0
        if rejected:
            self._profile_total[num_accepted] += 1.0
        else:
            reach = 1.0
            for j in range(sent, len(conf)):
                self._profile_total[j] += reach
                self._profile_accepted[j] += reach * probs[j]
                reach *= probs[j]
        self.num_observations += 1

    def position_profile(self, max_drafts: int) -> list[float]:
        """Per-position acceptance `q_1 .. q_max_drafts` for planning before a draft pass (class docstring).

        Args:
            max_drafts (`int`): positions wanted, >= 0.

        Returns:
            `list[float]` of length `max_drafts`, each in [0, 1].

        Raises:
            ValueError: if `max_drafts` is negative.
        """
        if not _is_int(max_drafts) or max_drafts < 0:
            raise ValueError(f"`max_drafts` must be an int >= 0, got {max_drafts!r}.")
        s = self.prior_strength
        out = []
        for j in range(max_drafts):
            prior = self.profile_prior * self.profile_decay**j
            a = self._profile_accepted[j] if j < len(self._profile_accepted) else 0.0
            n = self._profile_total[j] if j < len(self._profile_total) else 0.0
            out.append((a + s * prior) / (n + s))
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state (settings and counts)."""
        return {
            "num_bins": self.num_bins,
            "prior_strength": self.prior_strength,
            "profile_prior": self.profile_prior,
            "profile_decay": self.profile_decay,
            "profile_memory": self.profile_memory,
            "accepted": list(self._accepted),
            "total": list(self._total),
            "profile_accepted": list(self._profile_accepted),
            "profile_total": list(self._profile_total),
            "num_observations": self.num_observations,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> AcceptanceCalibrator:
        """Inverse of `to_dict`.

        Raises:
            ValueError: if `state` is malformed (missing fields, wrong lengths, negative counts).
        """
        try:
            out = cls(
                num_bins=state["num_bins"],
                prior_strength=state["prior_strength"],
                profile_prior=state["profile_prior"],
                profile_decay=state["profile_decay"],
                profile_memory=state["profile_memory"],
            )
            names = ("accepted", "total", "profile_accepted", "profile_total")
            lists = [[float(x) for x in state[name]] for name in names]
            num_observations = int(state["num_observations"])
        except (KeyError, TypeError):
            raise ValueError("Not an AcceptanceCalibrator state.") from None
        accepted, total, profile_accepted, profile_total = lists
        if len(accepted) != out.num_bins or len(total) != out.num_bins or len(profile_accepted) != len(profile_total):
            raise ValueError("AcceptanceCalibrator state: count lists of inconsistent lengths.")
        for a, n in zip(accepted + profile_accepted, total + profile_total, strict=True):
            if not (math.isfinite(a) and math.isfinite(n) and 0 <= a <= n + 1e-9):
                raise ValueError("AcceptanceCalibrator state: counts must be finite with 0 <= accepted <= total.")
        out._accepted, out._total = accepted, total
        out._profile_accepted, out._profile_total = profile_accepted, profile_total
        out.num_observations = max(num_observations, 0)
        return out


# --------------------------------------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundDecision:
    """What one round does, decided by `DraftPolicy.decide` before it starts.

    Attributes:
        source (`str`): `"target"` (a plain target step: no drafts), `"drafter"` (run a draft pass with `num_masks`
            masks, then `DraftPolicy.choose` how many of its drafts to send) or `"lookup"` (send the first
            `num_lookup` prompt-lookup tokens, no draft pass).
        num_masks (`int`): masks of the draft pass (`draft_logits(committed, cache, num_masks=num_masks)`); 0 unless
            `source == "drafter"`.
        num_lookup (`int`): lookup tokens to send; 0 unless `source == "lookup"`.
        num_pending (`int`): committed tokens the drafter had not cached (the pass ingests them).
        explore (`bool`): the round was forced by the exploration rule (`DraftPolicy`), not chosen by the rates.
        target_rate (`float`): expected tokens per second of a plain target step, `1 / t_verify(1)`.
        drafter_rate (`float`, *optional*): of the best drafter plan (`None` when the drafter cannot be used).
        lookup_rate (`float`, *optional*): of the best lookup round (`None` without lookup tokens).
        expected_rate (`float`): of the option taken (under exploration, not the best one).
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

    @property
    def draft_rows(self) -> int:
        """Rows of the draft pass, `num_pending + num_masks` (0 when there is no pass)."""
        return self.num_pending + self.num_masks if self.source == "drafter" else 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-safe dict (for logs)."""
        return asdict(self)


@dataclass(frozen=True)
class _Option:
    source: str
    count: int  # masks (drafter), tokens (lookup) or drafts to send (choose)
    rate: float
    seconds: float


def _pick(options: Sequence[_Option], tolerance: float) -> _Option:
    """The best rate; among options within `tolerance` of it, the cheapest (fewest seconds, then higher rate)."""
    best = max(o.rate for o in options)
    near = [o for o in options if o.rate >= best * (1.0 - tolerance)]
    return min(near, key=lambda o: (o.seconds, -o.rate))


def _rate(tokens: float, seconds: float) -> float:
    return tokens / max(seconds, _MIN_SECONDS)


class DraftPolicy:
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
    - prompt lookup with `L` matched tokens and per-token acceptance `p` (a running estimate): for `k <= L`,
      `R_lookup(k) = expected_tokens([p] * k, k) / t_verify(k + 1)` (no draft pass).

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
      drafter round (so one round in `interval` drafts); `interval` starts at `explore_every` (32), is multiplied
      by `explore_backoff` (2) after each periodic exploration, up to `explore_max_interval` (1024), and returns to
      `explore_every` whenever the rates choose the drafter by themselves. Lookup has its own counter, counting
      only rounds that had lookup tokens.

    An exploration drafter round computes every allowed mask and `choose` sends all of them (so the calibrator
    sees outcomes at every position); an exploration lookup round sends all allowed lookup tokens. The drafter
    warm-up is taken before lookup exploration when both are due.

    **Masks and drafts.** A pass with `m` masks is `drafter.draft_logits(committed, cache, num_masks=m)` over
    `num_pending + m` rows; it returns `m + 1` score rows, and the policy counts the first `m` as the round's drafts
    (the last row, the guess one past the block, is left unused, as in the synchronous generator).

    Example (one round of a candidate generator; `lookup` from `lookup_d3d.lookup_candidates`):

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
        explore_every (`int`, *optional*, defaults to 32): base exploration interval in rounds, >= 1; `None`
            disables exploration (warm-up included).
        explore_backoff (`float`, defaults to 2.0): interval growth per periodic exploration, >= 1.
        explore_max_interval (`int`, defaults to 1024): the interval's ceiling, >= `explore_every`.
        lookup_prior (`float`, defaults to 0.5): prior per-token acceptance of lookup tokens, in [0, 1].
        lookup_prior_strength (`float`, defaults to 4.0): its pseudo-observations, > 0.
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
        explore_every: int | None = 32,
        explore_backoff: float = 2.0,
        explore_max_interval: int = 1024,
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
        if not 0 < curve_weight <= 1:
            raise ValueError(f"`curve_weight` must be in (0, 1], got {curve_weight!r}.")
        self.verify_curve = verify_curve
        self.draft_curve = draft_curve
        self.calibrator = calibrator if calibrator is not None else AcceptanceCalibrator()
        self.max_drafts = max_drafts
        self.mode: str | int = "off" if mode == 0 else mode
        self.tie_tolerance = float(tie_tolerance)
        self.explore_every = explore_every
        self.explore_backoff = float(explore_backoff)
        self.explore_max_interval = explore_max_interval
        self.lookup_prior = float(lookup_prior)
        self.lookup_prior_strength = float(lookup_prior_strength)
        self.lookup_memory = None if lookup_memory is None else float(lookup_memory)
        self.curve_weight = float(curve_weight)
        self._lookup_accepted = 0.0
        self._lookup_trials = 0.0
        self._lookup_observations = 0
        # exploration state (advanced by `decide`)
        self.rounds = 0
        self._drafter_rounds = 0
        self._lookup_rounds = 0
        self._since_drafter = 0
        self._since_lookup = 0
        self._drafter_interval = explore_every or 0
        self._lookup_interval = explore_every or 0

    # ---- rates ---------------------------------------------------------------------------------------------------

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

    def _drafter_options(self, num_pending: int, limit: int) -> list[_Option]:
        if self.draft_curve is None or limit < 1:
            return []
        profile = self.calibrator.position_profile(limit)
        out = []
        for m in range(1, limit + 1):
            seconds = self.draft_curve(num_pending + m) + self._verify(m + 1)
            out.append(_Option("drafter", m, _rate(expected_tokens(profile, m), seconds), seconds))
        return out

    def plan_rates(self, num_pending: int, max_candidates: int | None = None) -> list[float]:
        """Expected rates `[R_target, R_draft(1), ..., R_draft(m_max)]` of `plan`'s options (for logs and tests).

        Args:
            num_pending (`int`): committed tokens the drafter has not cached, >= 1.
            max_candidates (`int`, *optional*): most drafts this round may send (room left before `max_length`).

        Returns:
            `list[float]`: index `m` is the rate with `m` masks (index 0 the plain target step); only index 0
            without a draft curve.
        """
        num_pending = self._check_pending(num_pending)
        limit = self._limit(max_candidates)
        return [self.target_rate()] + [o.rate for o in self._drafter_options(num_pending, limit)]

    def _best_plan(self, num_pending: int, limit: int) -> _Option:
        target = _Option("target", 0, self.target_rate(), self._verify(1))
        return _pick([target, *self._drafter_options(num_pending, limit)], self.tie_tolerance)

    def plan(self, num_pending: int, max_candidates: int | None = None) -> int:
        """Masks `m` to compute in the next draft pass (0 = no pass: a plain target step), before any draft.

        Adaptive mode: `argmax_m` of `R_target` (m = 0) and `R_draft(m)` (class docstring), near-ties to the cheaper
        option; no exploration (that is `decide`'s). Fixed mode `k`: `min(k, limit)`. `"off"`: 0.

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
        num_pending = self._check_pending(num_pending)
        limit = self._limit(max_candidates)
        if self.mode == "off":
            return 0
        if _is_int(self.mode):
            return min(self.mode, limit)
        best = self._best_plan(num_pending, limit)
        return best.count if best.source == "drafter" else 0

    # ---- after the draft pass ------------------------------------------------------------------------------------

    def choose_rates(self, confidences: Sequence[float] | torch.Tensor, draft_seconds: float) -> list[float]:
        """`[expected_tokens(p, k) / (draft_seconds + t_verify(k + 1)) for k in 0..m]` with calibrated `p`."""
        draft_seconds = _check_seconds(draft_seconds, "`draft_seconds`")
        probs = self.calibrator.probabilities(confidences)
        return [
            _rate(expected_tokens(probs, k), draft_seconds + self._verify(k + 1)) for k in range(len(probs) + 1)
        ]

    def choose(
        self,
        confidences: Sequence[float] | torch.Tensor,
        draft_seconds: float,
        decision: RoundDecision | None = None,
    ) -> int:
        """Drafts to send after a draft pass: `k` in `[0, m]`, `m = len(confidences)`.

        Adaptive mode: `argmax_k expected_tokens(p, k) / (draft_seconds + t_verify(k + 1))` with `p` the calibrated
        probabilities of `confidences`; near-ties (`tie_tolerance`) to the smaller `t_verify`. Fixed mode `k`:
        `min(k, m)`; `"off"`: 0; an exploration round (`decision.explore`): `m` (everything computed).

        Args:
            confidences (`Sequence[float]` or 1-D `torch.Tensor`): confidence of each draft the pass produced, in
                order (its probability under the distribution it was chosen from), in [0, 1]. Pass only drafts that
                may be sent (after cutting at eos / stop strings / `max_length`).
            draft_seconds (`float`): measured wall time of the pass (>= 0).
            decision (`RoundDecision`, *optional*): the round's decision from `decide` (for its `explore` flag).

        Returns:
            `int` in `[0, len(confidences)]`.

        Raises:
            ValueError: for bad confidences or seconds.
        """
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

    # ---- lookup --------------------------------------------------------------------------------------------------

    @property
    def lookup_probability(self) -> float:
        """Running per-token acceptance of lookup tokens: `(accepted + s * prior) / (trials + s)`, where a round with
        `a` accepted of `n` sent adds `a` to accepted and `a + (1 if a < n else 0)` to trials (a geometric model)."""
        s = self.lookup_prior_strength
        return (self._lookup_accepted + s * self.lookup_prior) / (self._lookup_trials + s)

    def observe_lookup(self, num_sent: int, num_accepted: int) -> None:
        """Updates the lookup estimate from one verified lookup round.

        Args:
            num_sent (`int`): lookup tokens sent, >= 0.
            num_accepted (`int`): of them accepted, in `[0, num_sent]`.

        Raises:
            ValueError: for inconsistent counts.
        """
        if not _is_int(num_sent) or not _is_int(num_accepted) or not 0 <= num_accepted <= num_sent:
            raise ValueError(f"Need ints 0 <= num_accepted <= num_sent, got {num_accepted!r}, {num_sent!r}.")
        if num_sent == 0:
            return
        if self.lookup_memory is not None:
            keep = 1.0 - 1.0 / self.lookup_memory
            self._lookup_accepted *= keep
            self._lookup_trials *= keep
        self._lookup_accepted += num_accepted
        self._lookup_trials += num_accepted + (1 if num_accepted < num_sent else 0)
        self._lookup_observations += 1

    def lookup_rates(self, num_lookup_tokens: int, lookup_probability: float | None = None) -> list[float]:
        """`[expected_tokens([p] * k, k) / t_verify(k + 1) for k in 0..L]` (index 0 is the plain target step)."""
        if not _is_int(num_lookup_tokens) or num_lookup_tokens < 0:
            raise ValueError(f"`num_lookup_tokens` must be an int >= 0, got {num_lookup_tokens!r}.")
        p = self.lookup_probability if lookup_probability is None else lookup_probability
        probs = _check_probabilities([p] * num_lookup_tokens, "`lookup_probability`")
        return [_rate(expected_tokens(probs, k), self._verify(k + 1)) for k in range(num_lookup_tokens + 1)]

    def choose_lookup(
        self, num_lookup_tokens: int, lookup_probability: float | None = None, max_candidates: int | None = None
    ) -> tuple[int, float]:
        """The best lookup round: `k* = argmax_{1 <= k <= L} expected_tokens([p] * k, k) / t_verify(k + 1)`.

        Args:
            num_lookup_tokens (`int`): length `L` of the lookup match, >= 0.
            lookup_probability (`float`, *optional*): per-token acceptance `p`; defaults to the running estimate
                `lookup_probability`.
            max_candidates (`int`, *optional*): most tokens this round may send.

        Returns:
            `(k, rate)`: tokens to send (near-ties to fewer) and the round's expected tokens per second; `(0,
            R_target)` when `L` (after the cap) is 0.
        """
        limit = num_lookup_tokens if max_candidates is None else min(num_lookup_tokens, max(max_candidates, 0))
        options = self._lookup_options(limit, lookup_probability)
        if not options:
            return 0, self.target_rate()
        best = _pick(options, self.tie_tolerance)
        return best.count, best.rate

    def _lookup_options(self, limit: int, lookup_probability: float | None = None) -> list[_Option]:
        rates = self.lookup_rates(limit, lookup_probability)
        return [_Option("lookup", k, rates[k], self._verify(k + 1)) for k in range(1, limit + 1)]

    # ---- one round -----------------------------------------------------------------------------------------------

    def decide(
        self, num_pending: int, lookup_tokens: int = 0, max_candidates: int | None = None
    ) -> RoundDecision:
        """Decides the next round (call once per round, before drafting; advances the exploration counters).

        Args:
            num_pending (`int`): committed tokens the drafter has not cached (>= 1, the anchor included).
            lookup_tokens (`int`, defaults to 0): length of the prompt-lookup match available this round (0: none).
            max_candidates (`int`, *optional*): most candidates this round may send (room before `max_length`).

        Returns:
            `RoundDecision`. For `"drafter"`, run `draft_logits(committed, cache, num_masks=decision.num_masks)`,
            then `choose(confidences, draft_seconds, decision)`; for `"lookup"`, send the first
            `decision.num_lookup` lookup tokens; for `"target"`, send no candidates.

        Raises:
            ValueError: for bad counts.
        """
        num_pending = self._check_pending(num_pending)
        if not _is_int(lookup_tokens) or lookup_tokens < 0:
            raise ValueError(f"`lookup_tokens` must be an int >= 0, got {lookup_tokens!r}.")
        limit = self._limit(max_candidates)
        lookup_limit = lookup_tokens if max_candidates is None else min(lookup_tokens, max_candidates)
        target_rate = self.target_rate() if self.verify_curve is not None else 0.0
        if self.mode == "off" or (_is_int(self.mode) and limit == 0):
            decision = RoundDecision("target", num_pending=num_pending, target_rate=target_rate,
                                     expected_rate=target_rate)
        elif _is_int(self.mode):
            m = min(self.mode, limit)
            rate = 0.0
            if self.draft_curve is not None and self.verify_curve is not None:
                rate = self._drafter_options(num_pending, m)[-1].rate
            decision = RoundDecision("drafter", num_masks=m, num_pending=num_pending, target_rate=target_rate,
                                     drafter_rate=rate, expected_rate=rate)
        else:
            decision = self._decide_adaptive(num_pending, limit, lookup_limit)
        self._advance(decision, lookup_limit > 0)
        return decision

    def _decide_adaptive(self, num_pending: int, limit: int, lookup_limit: int) -> RoundDecision:
        target = _Option("target", 0, self.target_rate(), self._verify(1))
        drafter = self._drafter_options(num_pending, limit)
        lookup = self._lookup_options(lookup_limit)
        # one pick over every option, so that the tie rule does not depend on the order of comparison
        chosen = _pick([target, *drafter, *lookup], self.tie_tolerance)
        best_drafter = _pick(drafter, self.tie_tolerance) if drafter else None
        best_lookup = _pick(lookup, self.tie_tolerance) if lookup else None
        explore = False
        if self.explore_every is not None:
            drafter_usable = self.draft_curve is not None and limit >= 1
            warm_drafter = self._drafter_rounds == 0 and self.calibrator.num_observations == 0
            warm_lookup = self._lookup_rounds == 0 and self._lookup_observations == 0
            if chosen.source != "drafter" and drafter_usable and (
                warm_drafter or self._since_drafter + 1 >= self._drafter_interval
            ):
                chosen = drafter[limit - 1]  # every allowed mask
                explore = True
                if not warm_drafter:
                    self._drafter_interval = min(
                        int(self._drafter_interval * self.explore_backoff), self.explore_max_interval
                    )
            elif chosen.source != "lookup" and lookup_limit > 0 and (
                warm_lookup or self._since_lookup + 1 >= self._lookup_interval
            ):
                chosen = lookup[lookup_limit - 1]  # every allowed lookup token
                explore = True
                if not warm_lookup:
                    self._lookup_interval = min(
                        int(self._lookup_interval * self.explore_backoff), self.explore_max_interval
                    )
        if not explore and self.explore_every is not None:
            if chosen.source == "drafter":
                self._drafter_interval = self.explore_every
            elif chosen.source == "lookup":
                self._lookup_interval = self.explore_every
        return RoundDecision(
            source=chosen.source,
            num_masks=chosen.count if chosen.source == "drafter" else 0,
            num_lookup=chosen.count if chosen.source == "lookup" else 0,
            num_pending=num_pending,
            explore=explore,
            target_rate=target.rate,
            drafter_rate=None if best_drafter is None else best_drafter.rate,
            lookup_rate=None if best_lookup is None else best_lookup.rate,
            expected_rate=chosen.rate,
        )

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
                self.calibrator.observe(confidences, num_accepted, num_sent)
            if draft_seconds is not None and self.draft_curve is not None:
                self.draft_curve.observe(decision.draft_rows, draft_seconds, self.curve_weight)
        elif decision.source == "lookup":
            self.observe_lookup(num_sent, num_accepted)
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
            "lookup": {
                "accepted": self._lookup_accepted,
                "trials": self._lookup_trials,
                "observations": self._lookup_observations,
            },
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
            accepted = float(state["lookup"]["accepted"])
            trials = float(state["lookup"]["trials"])
            observations = int(state["lookup"]["observations"])
        except (KeyError, TypeError):
            raise ValueError("Not a DraftPolicy state.") from None
        if not (math.isfinite(accepted) and math.isfinite(trials) and 0 <= accepted <= trials):
            raise ValueError("DraftPolicy state: lookup counts must be finite with 0 <= accepted <= trials.")
        if self.mode == "adaptive" and verify_curve is None:
            raise ValueError("DraftPolicy state without a verify curve cannot drive the adaptive mode.")
        self.verify_curve, self.draft_curve, self.calibrator = verify_curve, draft_curve, calibrator
        self._lookup_accepted, self._lookup_trials, self._lookup_observations = accepted, trials, observations

    def save_to(self, store: CalibrationStore, key: str, parts: Mapping[str, Any] | None = None) -> str | None:
        """`store.save(key, self.state_dict(), parts)`; returns the file written (None if it could not be)."""
        return store.save(key, self.state_dict(), parts)

    def restore_from(self, store: CalibrationStore, key: str) -> bool:
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


# --------------------------------------------------------------------------------------------------------------------
# Calibration storage
# --------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cpu_model_cached() -> tuple[str, frozenset[str]]:
    name, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                field, _, value = line.partition(":")
                field = field.strip()
                if field == "model name" and not name:
                    name = value.strip()
                elif field in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "unknown", flags


def cpu_model() -> dict[str, Any]:
    """The CPU's model name and the instruction-set flags that change forward speed.

    Reads `/proc/cpuinfo` on Linux (first `model name` and `flags` lines), else `platform.processor()`; flags it
    cannot read are reported absent. Cached for the process.

    Returns:
        `dict`: `{"model": str, "avx2": bool, "avx512f": bool, "avx512_bf16": bool, "amx_bf16": bool,
        "amx_tile": bool}`.
    """
    name, flags = _cpu_model_cached()
    return {"model": name, **{flag: flag in flags for flag in SPEED_FLAGS}}


def _cpu_string() -> str:
    info = cpu_model()
    present = [flag for flag in SPEED_FLAGS if info[flag]]
    return f"{info['model']} [{' '.join(present)}]"


def config_fingerprint(config: Any) -> str:
    """A short stable hash of a model config (a transformers `PretrainedConfig` or a dict).

    Fields that do not change the computation are left out: names and paths (`_name_or_path`, `name_or_path`),
    `transformers_version`, `_commit_hash`, `architectures`, and `dtype`/`torch_dtype` (the dtype is its own part of
    `calibration_key`).

    Returns:
        `str`: 16 hex digits.
    """
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    ignored = {"_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "architectures", "dtype",
               "torch_dtype"}
    data = {k: v for k, v in data.items() if k not in ignored}
    blob = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def calibration_key(
    *,
    target: str,
    target_config: str = "",
    drafter: str = "",
    drafter_config: str = "",
    dtype: Any = "float32",
    threads: int | None = None,
    device: Any = "cpu",
    cpu: str | None = None,
    torch_version: str | None = None,
    **extra: Any,
) -> str:
    """A stable key for one calibration: the same models, numerics and machine give the same key.

    Args:
        target (`str`): the target's name (e.g. its hub id or `name_or_path`).
        target_config (`str`): a fingerprint of its config (`config_fingerprint`).
        drafter (`str`): the drafter's name ("" without a drafter).
        drafter_config (`str`): a fingerprint of its config (block size, layers, adapters, ...).
        dtype (`str` or `torch.dtype`, defaults to `"float32"`): the compute dtype.
        threads (`int`, *optional*): torch's intra-op threads; defaults to `torch.get_num_threads()`.
        device (`str` or `torch.device`, defaults to `"cpu"`): the device the models run on (e.g. `"cuda:0"`).
        cpu (`str`, *optional*): the CPU model and speed flags; defaults to `cpu_model()`'s.
        torch_version (`str`, *optional*): defaults to `torch.__version__`.
        **extra: further parts (JSON-serialisable or `str()`-able), e.g. a kernel setting.

    Returns:
        `str`: 24 hex digits (a SHA-256 prefix of the parts as sorted JSON), safe as a file name.
    """
    parts = {
        "target": target,
        "target_config": target_config,
        "drafter": drafter,
        "drafter_config": drafter_config,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads() if threads is None else int(threads),
        "device": str(device),
        "cpu": _cpu_string() if cpu is None else cpu,
        "torch": torch.__version__ if torch_version is None else torch_version,
        **extra,
    }
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def default_cache_dir() -> str:
    """`$D3D_HF_CACHE/cost_curves` if set, else `$XDG_CACHE_HOME/d3d_hf/cost_curves` or
    `~/.cache/d3d_hf/cost_curves` (resolved on each call)."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "d3d_hf")
    return os.path.join(base, "cost_curves")


#: In-memory states, `(folder, key) -> JSON text` (shared by every `CalibrationStore` of the process).
_MEMORY: dict[tuple[str, str], str] = {}


class CalibrationStore:
    """Learned policy states (cost curves, calibrator, lookup estimate) by `calibration_key`, in memory and on disk.

    Each key is one JSON file `<folder>/<key>.json`:
    `{"format_version": 1, "key": ..., "parts": {...}, "saved_at": <unix seconds>, "state": {...}}`, written
    atomically (a temporary file in the same folder, then `os.replace`). Loading prefers the in-memory copy (a
    module-level dict keyed by folder and key), then the file. A file that cannot be read or parsed, or that has
    another `format_version` or key, is ignored (and replaced by the next `save`): never an error. A failed write
    warns through `logging` and returns `None`: calibration is an optimisation, never a reason to stop decoding.

    Args:
        folder (`str`, *optional*): defaults to `default_cache_dir()` (resolved when the store is created).
    """

    def __init__(self, folder: str | None = None) -> None:
        self.folder = os.path.abspath(folder or default_cache_dir())

    def path(self, key: str) -> str:
        """The file of `key`.

        Raises:
            ValueError: if `key` is not a plain file-name-safe string.
        """
        if not key or not all(ch.isalnum() or ch in "-_" for ch in key):
            raise ValueError(
                f"A calibration key must be letters, digits, '-' or '_' (see calibration_key), got {key!r}."
            )
        return os.path.join(self.folder, f"{key}.json")

    def load(self, key: str) -> dict[str, Any] | None:
        """The state saved under `key` (a fresh copy), or `None` if there is none usable."""
        path = self.path(key)
        text = _MEMORY.get((self.folder, key))
        if text is not None:
            return json.loads(text)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if (
            not isinstance(record, dict)
            or record.get("format_version") != CALIBRATION_FORMAT_VERSION
            or record.get("key") != key
            or not isinstance(record.get("state"), dict)
        ):
            logger.info("Ignoring %s: not a calibration file of format version %d.", path, CALIBRATION_FORMAT_VERSION)
            return None
        _MEMORY[(self.folder, key)] = json.dumps(record["state"])
        return record["state"]

    def save(self, key: str, state: Mapping[str, Any], parts: Mapping[str, Any] | None = None) -> str | None:
        """Keeps `state` in memory and writes it to disk atomically.

        Args:
            key (`str`): from `calibration_key`.
            state (`Mapping`): JSON-serialisable (e.g. `DraftPolicy.state_dict()`).
            parts (`Mapping`, *optional*): the key's parts, stored for people reading the file.

        Returns:
            `str`: the file written, or `None` if writing failed (the state is still kept in memory).

        Raises:
            ValueError: for a bad key, or a state that is not JSON-serialisable.
        """
        path = self.path(key)
        try:
            text = json.dumps(dict(state))
        except TypeError as err:
            raise ValueError(f"The calibration state is not JSON-serialisable: {err}") from None
        _MEMORY[(self.folder, key)] = text
        record = {
            "format_version": CALIBRATION_FORMAT_VERSION,
            "key": key,
            "parts": {k: str(v) for k, v in (parts or {}).items()},
            "saved_at": time.time(),
            "state": json.loads(text),
        }
        tmp = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.folder)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, path)
        except OSError as err:
            logger.warning("Could not save the calibration to %s: %s", path, err)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return None
        return path

    def forget(self, key: str | None = None) -> None:
        """Drops the in-memory copy of `key` (every key of this folder when `None`); files are kept."""
        for mem_key in list(_MEMORY):
            if mem_key[0] == self.folder and (key is None or mem_key[1] == key):
                del _MEMORY[mem_key]


# --------------------------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------------------------


def _median_seconds(fn, reset, repeats: int, sync) -> float:
    fn()  # warm-up
    reset()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        reset()
    return statistics.median(times)


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def measure_cost_curves(
    target,
    drafter,
    rows: Iterable[int] = (1, 2, 4, 8, 16),
    context_length: int = 128,
    repeats: int = 3,
    device: torch.device | str | None = None,
    *,
    seed: int = 0,
    monotone: bool = True,
) -> tuple[CostCurve, CostCurve]:
    r"""
    A short calibration of `t_verify` and `t_draft` on the machine at hand (seconds by new rows).

    Builds a random context of `context_length` token ids (timing does not depend on their values), then:

    - target: prefills a `transformers.DynamicCache` with the context once, and times forwards of `q` new rows
      (`target(input_ids, cache=cache, use_cache=True)`, as a verification of `q - 1` drafts; transformers 5.24
      deprecates the older name `past_key_values`), cropping the cache back to the context after each (transformers
      5.24 crops by a negative count of tokens to remove: `cache.crop(context_length)` raises);
    - drafter: prefills a `D3DCache` with the context, and times draft passes of `q` rows, 1 committed token plus
      `q - 1` masks (`drafter.draft_logits(committed_ids, cache, num_masks=q - 1)`), cropping back after each.

    Each time is the median of `repeats` after one warm-up call, under `torch.no_grad()` with both models in eval
    mode (their previous modes are restored). On CUDA the device is synchronised around each call. A drafter that
    shares its target's weights gets them attached first. Rows above the drafter's block size time a longer block.

    Args:
        target (`PreTrainedModel`): the causal LM to verify with.
        drafter (`D3DForDiffusionDrafting`): the D3D drafter.
        rows (`Iterable[int]`, defaults to `(1, 2, 4, 8, 16)`): the `q` to time, each >= 1.
        context_length (`int`, defaults to 128): cached tokens before each timed forward, >= 1.
        repeats (`int`, defaults to 3): timed calls per point, >= 1.
        device (`torch.device` or `str`, *optional*): where the token ids are created; defaults to each model's
            own device.
        seed (`int`, defaults to 0): seed of the random context.
        monotone (`bool`, defaults to `True`): return `CostCurve.monotone()` of the measurements (more rows never
            cheaper), which removes timing noise of a few repeats at the price of hiding a real dip (a faster
            kernel path for some row counts, docs/DESIGN.md section 9); `False` returns the raw medians.

    Returns:
        `tuple[CostCurve, CostCurve]`: `(verify_curve, draft_curve)`.

    Raises:
        ValueError: for empty or bad `rows`, `context_length < 1` or `repeats < 1`.
    """
    from transformers import DynamicCache

    from .modeling_d3d import D3DCache  # deferred: no sibling import at module import time

    rows = sorted({CostCurve._check_rows(q) for q in rows})
    if not rows:
        raise ValueError("`rows` must name at least one row count.")
    if not _is_int(context_length) or context_length < 1:
        raise ValueError(f"`context_length` must be an int >= 1, got {context_length!r}.")
    if not _is_int(repeats) or repeats < 1:
        raise ValueError(f"`repeats` must be an int >= 1, got {repeats!r}.")
    if getattr(drafter.config, "shares_target_weights", False) and getattr(drafter, "_attached_target", None) is None:
        drafter.attach_target_weights(target)
    target_device = torch.device(device) if device is not None else _device_of(target)
    drafter_device = torch.device(device) if device is not None else _device_of(drafter)
    cuda = [d for d in (target_device, drafter_device) if d.type == "cuda"]

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    generator = torch.Generator().manual_seed(seed)
    vocab = min(target.config.get_text_config().vocab_size, drafter.config.vocab_size)

    def random_ids(length: int) -> torch.LongTensor:
        return torch.randint(0, vocab, (1, length), generator=generator)

    context = random_ids(context_length)
    modes = (target.training, drafter.training)
    target.eval()
    drafter.eval()
    verify, draft = {}, {}
    try:
        with torch.no_grad():
            cache = DynamicCache(config=target.config)
            target(input_ids=context.to(target_device), cache=cache, use_cache=True)

            def crop_target() -> None:
                extra = cache.get_seq_length() - context_length
                if extra > 0:
                    cache.crop(-extra)

            drafter_cache = D3DCache()
            drafter.draft_logits(context.to(drafter_device), drafter_cache, num_masks=0)
            for q in rows:
                ids = random_ids(q).to(target_device)
                verify[q] = _median_seconds(
                    lambda ids=ids: target(input_ids=ids, cache=cache, use_cache=True),
                    crop_target,
                    repeats,
                    sync,
                )
                committed = random_ids(1).to(drafter_device)
                draft[q] = _median_seconds(
                    lambda committed=committed, q=q: drafter.draft_logits(committed, drafter_cache, num_masks=q - 1),
                    lambda: drafter_cache.crop(context_length),
                    repeats,
                    sync,
                )
    finally:
        target.train(modes[0])
        drafter.train(modes[1])
    verify_curve, draft_curve = CostCurve(verify), CostCurve(draft)
    if monotone:
        verify_curve, draft_curve = verify_curve.monotone(), draft_curve.monotone()
    return verify_curve, draft_curve


__all__ = [
    "CACHE_ENV",
    "CALIBRATION_FORMAT_VERSION",
    "SOURCES",
    "SPEED_FLAGS",
    "AcceptanceCalibrator",
    "CalibrationStore",
    "CostCurve",
    "DraftPolicy",
    "RoundDecision",
    "calibration_key",
    "config_fingerprint",
    "cpu_model",
    "default_cache_dir",
    "expected_tokens",
    "measure_cost_curves",
]
