"""The cost estimates the cost-aware drafting policy (`policy_d3d.py`) decides from: forward cost curves
(`CostCurve`), what batched forwards cost against them (`BatchedCosts`), and the expected committed tokens of a round
(`expected_tokens`); d3d-hf docs/DESIGN.md section 9, our design. How likely drafts are to be accepted is the sibling
`acceptance_d3d.py`.

Part of the self-contained remote-code bundle: imports only the Python standard library and torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

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

    def observe(self, q: int, seconds: float, weight: float = 0.2, max_ratio: float | None = 1.5) -> None:
        """Updates the curve with one measured forward (a real round's timing).

        The measurement is first clamped to `[c / max_ratio, c * max_ratio]` around the curve's current value `c =
        self(q)`, so that one disturbed round (a page fault, another process taking a core) moves the curve by at most
        `weight * (max_ratio - 1)` (10% with the defaults) while a lasting change is still followed within a few
        rounds. Without the clamp, a rarely chosen row count pushed up by one slow round would stay too dear for good:
        the policy stops choosing it, so no later round corrects it (seen in a recorded bfloat16 run). Then an
        existing point moves by an exponential moving average, `new = (1 - weight) * old + weight * seconds`; a new
        `q` becomes a point with the clamped value.

        Args:
            q (`int`): rows of the measured forward, >= 1.
            seconds (`float`): its wall time, finite and >= 0.
            weight (`float`, defaults to 0.2): weight of the new measurement, in (0, 1].
            max_ratio (`float`, *optional*, defaults to 1.5): the clamp, >= 1; `None` takes the measurement as is.

        Raises:
            ValueError: for a bad `q`, `seconds`, `weight` or `max_ratio`.
        """
        q = self._check_rows(q)
        seconds = _check_seconds(seconds, "`seconds`")
        weight = float(weight)
        if not 0 < weight <= 1:
            raise ValueError(f"`weight` must be in (0, 1], got {weight!r}.")
        if max_ratio is not None:
            if not (math.isfinite(max_ratio) and max_ratio >= 1):
                raise ValueError(f"`max_ratio` must be >= 1 (or None), got {max_ratio!r}.")
            current = self(q)
            seconds = min(max(seconds, current / max_ratio), current * max_ratio)
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


class BatchedCosts:
    r"""
    What forwards over a batch cost, learned from the rounds of batched decoding (`batched_decoding_d3d`).

    The calibrated curves are of one sequence. A forward over `b` sequences of `w` new rows each is not what one
    sequence's curve says at `b x w` rows: every sequence attends to its own cache (with the holes ragged acceptance
    leaves), and the round's per-sequence work grows with `b`. So per curve (`"verify"`, `"draft"`) and batch size
    `b`, the ratio of a measured batched forward to the single-sequence curve at `b x w` is kept as a `CostCurve`
    over `w` (an exponential moving average per `w`, clamped per update as `CostCurve.observe`; between and beyond
    the measured `w` as that curve reads). Until a `(curve, b)` pair has been measured, the ratio is 1 (the
    single-sequence curve at `b x w`). Our design (d3d-hf docs/DESIGN.md section 2, "Batches"; issue 28).

    Args:
        weight (`float`, defaults to 0.2): weight of a new measurement, in (0, 1] (`DraftPolicy.curve_weight`).

    Example:
        >>> costs = BatchedCosts()
        >>> curve = CostCurve({1: 0.030, 4: 0.032, 16: 0.045})
        >>> costs.seconds("verify", curve, batch=4, rows=1)  # never measured: the curve at 4 rows
        0.032
        >>> costs.observe("verify", curve, batch=4, rows=1, seconds=0.048)
        >>> round(costs.seconds("verify", curve, batch=4, rows=1), 4)
        0.048
    """

    KINDS = ("verify", "draft")
    #: The learned ratio is read within these bounds (a stray measurement never makes a plan free or unaffordable).
    RATIO_BOUNDS = (0.125, 8.0)

    def __init__(self, weight: float = 0.2) -> None:
        weight = float(weight)
        if not 0 < weight <= 1:
            raise ValueError(f"`weight` must be in (0, 1], got {weight!r}.")
        self.weight = weight
        self._ratios: dict[tuple[str, int], CostCurve] = {}

    def _key(self, kind: str, batch: int, rows: int) -> tuple[str, int]:
        if kind not in self.KINDS:
            raise ValueError(f"`kind` must be one of {self.KINDS}, got {kind!r}.")
        if not _is_int(batch) or batch < 1 or not _is_int(rows) or rows < 1:
            raise ValueError(f"`batch` and `rows` must be ints >= 1, got {batch!r} and {rows!r}.")
        return kind, batch

    def ratio(self, kind: str, batch: int, rows: int) -> float:
        """The learned ratio of a batched forward to the single-sequence curve at `batch x rows` (1.0 unmeasured)."""
        curve = self._ratios.get(self._key(kind, batch, rows))
        low, high = self.RATIO_BOUNDS
        return 1.0 if curve is None else min(max(curve(rows), low), high)

    def seconds(self, kind: str, curve: CostCurve, batch: int, rows: int) -> float:
        """Seconds of a forward over `batch` sequences of `rows` new rows each.

        Args:
            kind (`str`): `"verify"` (the target's forward) or `"draft"` (the drafter's pass).
            curve (`CostCurve`): the single-sequence curve of that forward.
            batch (`int`), rows (`int`): sequences and new rows per sequence (padded width), >= 1 each.

        Returns:
            `float`: `curve(batch * rows) * ratio(kind, batch, rows)`.

        Raises:
            ValueError: for an unknown `kind` or a `batch` or `rows` below 1.
        """
        return curve(batch * rows) * self.ratio(kind, batch, rows)

    def observe(self, kind: str, curve: CostCurve, batch: int, rows: int, seconds: float) -> None:
        """Learns one measured batched forward (`seconds`, wall time) of `batch` sequences of `rows` rows each.

        Raises:
            ValueError: as `seconds`, and for a negative or non-finite `seconds`.
        """
        key = self._key(kind, batch, rows)
        seconds = _check_seconds(seconds, "`seconds`")
        base = curve(batch * rows)
        if base <= 0:
            return
        ratios = self._ratios.get(key)
        if ratios is None:
            self._ratios[key] = CostCurve({rows: seconds / base})
        else:
            ratios.observe(rows, seconds / base, self.weight)

    def to_dict(self) -> dict[str, dict[int, dict[int, float]]]:
        """The learned ratios, `{kind: {batch: {rows: ratio}}}`."""
        out: dict[str, dict[int, dict[int, float]]] = {}
        for (kind, batch), curve in sorted(self._ratios.items()):
            out.setdefault(kind, {})[batch] = curve.points
        return out

    @classmethod
    def from_dict(cls, ratios: Mapping[str, Mapping[int, Mapping[int, float]]], weight: float = 0.2) -> BatchedCosts:
        """Costs with the ratios `{kind: {batch: {rows: ratio}}}` (as `to_dict` gives them).

        Raises:
            ValueError: for an unknown kind, a batch or rows below 1, or a ratio that is negative or not finite.
        """
        costs = cls(weight)
        for kind, by_batch in ratios.items():
            for batch, points in by_batch.items():
                for rows in points:
                    costs._key(kind, int(batch), int(rows))
                costs._ratios[kind, int(batch)] = CostCurve({int(rows): ratio for rows, ratio in points.items()})
        return costs


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


__all__ = ["BatchedCosts", "CostCurve", "expected_tokens"]
