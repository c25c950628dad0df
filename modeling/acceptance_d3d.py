"""The acceptance estimates the cost-aware drafting policy (`policy_d3d.py`) decides from: the calibration of the
drafter's confidences against real acceptance, with a per-position profile (`AcceptanceCalibrator`), and the learned
acceptance of prompt-lookup spans by position and matched n-gram size (`LookupAcceptance`); d3d-hf docs/DESIGN.md
section 9, our design.

Part of the self-contained remote-code bundle: imports only the Python standard library, torch and its siblings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .estimates_d3d import _check_probabilities, _is_int


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
        self,
        confidences: Sequence[float] | torch.Tensor,
        num_accepted: int,
        num_sent: int | None = None,
        position_offset: int = 0,
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
            position_offset (`int`, defaults to 0): the position-profile index of the first draft (1 for a block
                drafted inside a verification, whose first draft plays a pass's second: `DraftPolicy.ready_profile`).

        Raises:
            ValueError: for inconsistent counts or bad confidences.
        """
        if not _is_int(position_offset) or position_offset < 0:
            raise ValueError(f"`position_offset` must be an int >= 0, got {position_offset!r}.")
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
        o = position_offset
        self._grow_profile(len(conf) + o)
        for j in range(num_accepted):
            self._profile_accepted[j + o] += 1.0
            self._profile_total[j + o] += 1.0
        if rejected:
            self._profile_total[num_accepted + o] += 1.0
        else:
            reach = 1.0
            for j in range(sent, len(conf)):
                self._profile_total[j + o] += reach
                self._profile_accepted[j + o] += reach * probs[j]
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


class LookupAcceptance:
    r"""
    Acceptance of prompt-lookup tokens by their position in the copied span and by the size of the n-gram that
    matched (our design, d3d-hf docs/DESIGN.md section 9).

    A lookup span is copied text. Once its first tokens are accepted the text is usually being repeated, so a later
    token is accepted more often than the first one: one geometric rate undervalues long spans and cuts rounds short.
    And a match on a longer suffix n-gram is more reliable than a one-token match. For position `j` (1-based) of a
    span, and matched n-gram size `n`:

        q_j   = (A_j   + s * q_{j-1}) / (N_j   + s),   q_0 = prior          (pooled over n-gram sizes)
        q_n,j = (A_n,j + s * q_j)     / (N_n,j + s)                         (matches of size n)

    where `N` counts rounds that reached position `j` (tokens `1..j-1` accepted) and `A` those that also accepted
    token `j`: `q` is the probability that token `j` is accepted given that the ones before it were (as
    `expected_tokens` takes it). Each position's prior is the estimate at the position before it, so with nothing
    observed every position has `prior` (a geometric model), and a deep position seen rarely borrows from its
    neighbour instead of from a fixed guess. Counts fade by a factor `1 - 1 / memory` per observed round.

    Args:
        prior (`float`, defaults to 0.5): prior acceptance of the first token, in [0, 1].
        prior_strength (`float`, defaults to 4.0): pseudo-observations `s` of each prior, > 0.
        memory (`float`, *optional*, defaults to 64.0): rounds over which counts fade (> 1); `None` keeps them.

    Raises:
        ValueError: for out-of-range arguments.
    """

    def __init__(self, prior: float = 0.5, prior_strength: float = 4.0, memory: float | None = 64.0) -> None:
        if not (math.isfinite(prior) and 0 <= prior <= 1) or not (math.isfinite(prior_strength) and prior_strength > 0):
            raise ValueError(f"`prior` must be in [0, 1] and `prior_strength` > 0, got {prior!r}, {prior_strength!r}.")
        if memory is not None and not (math.isfinite(memory) and memory > 1):
            raise ValueError(f"`memory` must be > 1 (or None), got {memory!r}.")
        self.prior = float(prior)
        self.prior_strength = float(prior_strength)
        self.memory = None if memory is None else float(memory)
        # key 0: pooled; key n >= 1: matches of n-gram size n. Value: (accepted per position, reached per position).
        self._counts: dict[int, tuple[list[float], list[float]]] = {}
        self.num_observations = 0

    @staticmethod
    def _check_ngram(ngram_size: int | None) -> int:
        if ngram_size is None:
            return 0
        if not _is_int(ngram_size) or ngram_size < 1:
            raise ValueError(f"`ngram_size` must be an int >= 1 or None, got {ngram_size!r}.")
        return ngram_size

    def _rates(self, key: int, priors: list[float]) -> list[float]:
        accepted, reached = self._counts.get(key, ([], []))
        s, out, prev = self.prior_strength, [], self.prior
        for j, prior in enumerate(priors):
            prior = prev if key == 0 else prior
            a = accepted[j] if j < len(accepted) else 0.0
            n = reached[j] if j < len(reached) else 0.0
            prev = (a + s * prior) / (n + s)
            out.append(prev)
        return out

    def probabilities(self, num_tokens: int, ngram_size: int | None = None) -> list[float]:
        """`q_1 .. q_num_tokens` for a span from a match of `ngram_size` (pooled over sizes when `None`).

        Args:
            num_tokens (`int`): positions wanted, >= 0.
            ngram_size (`int`, *optional*): the size of the matched n-gram (`lookup_d3d.lookup_match`).

        Returns:
            `list[float]` of length `num_tokens`, each in [0, 1].

        Raises:
            ValueError: for a negative `num_tokens` or a bad `ngram_size`.
        """
        if not _is_int(num_tokens) or num_tokens < 0:
            raise ValueError(f"`num_tokens` must be an int >= 0, got {num_tokens!r}.")
        key = self._check_ngram(ngram_size)
        pooled = self._rates(0, [0.0] * num_tokens)
        return pooled if key == 0 else self._rates(key, pooled)

    def observe(self, num_sent: int, num_accepted: int, ngram_size: int | None = None) -> None:
        """Learns from one verified lookup round: tokens `1..num_accepted` accepted, the next one (if sent) rejected.

        Args:
            num_sent (`int`): lookup tokens sent, >= 0 (a round with none is ignored).
            num_accepted (`int`): of them accepted, in `[0, num_sent]`.
            ngram_size (`int`, *optional*): the size of the n-gram that matched.

        Raises:
            ValueError: for inconsistent counts or a bad `ngram_size`.
        """
        if not _is_int(num_sent) or not _is_int(num_accepted) or not 0 <= num_accepted <= num_sent:
            raise ValueError(f"Need ints 0 <= num_accepted <= num_sent, got {num_accepted!r}, {num_sent!r}.")
        key = self._check_ngram(ngram_size)
        if num_sent == 0:
            return
        keep = 1.0 if self.memory is None else 1.0 - 1.0 / self.memory
        for accepted, reached in self._counts.values():
            for j in range(len(reached)):
                accepted[j] *= keep
                reached[j] *= keep
        depth = min(num_accepted + 1, num_sent)  # positions this round reached
        for k in {0, key}:
            accepted, reached = self._counts.setdefault(k, ([], []))
            while len(reached) < depth:
                accepted.append(0.0)
                reached.append(0.0)
            for j in range(depth):
                reached[j] += 1.0
                accepted[j] += 1.0 if j < num_accepted else 0.0
        self.num_observations += 1

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe state (settings and counts)."""
        return {
            "prior": self.prior,
            "prior_strength": self.prior_strength,
            "memory": self.memory,
            "counts": {str(k): [list(a), list(n)] for k, (a, n) in sorted(self._counts.items())},
            "num_observations": self.num_observations,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> LookupAcceptance:
        """Inverse of `to_dict`.

        Raises:
            ValueError: if `state` is malformed (missing fields, lists of different lengths, bad counts).
        """
        try:
            out = cls(state["prior"], state["prior_strength"], state["memory"])
            counts = {int(k): ([float(x) for x in a], [float(x) for x in n]) for k, (a, n) in state["counts"].items()}
            num_observations = int(state["num_observations"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError("Not a LookupAcceptance state.") from None
        for k, (accepted, reached) in counts.items():
            if k < 0 or len(accepted) != len(reached):
                raise ValueError("LookupAcceptance state: bad n-gram key or count lists of different lengths.")
            for a, n in zip(accepted, reached, strict=True):
                if not (math.isfinite(a) and math.isfinite(n) and 0 <= a <= n + 1e-9):
                    raise ValueError("LookupAcceptance state: counts must be finite with 0 <= accepted <= reached.")
        out._counts = counts
        out.num_observations = max(num_observations, 0)
        return out


# --------------------------------------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------------------------------------


__all__ = ["AcceptanceCalibrator", "LookupAcceptance"]
