"""Cost model of speculative decoding: measured forward times and the speed-up they imply for a given tau.

Two measurements on the machine at hand (same dtype and threads as the benchmark):

- `t_target(n)`: one target forward over `n` new tokens (the verification of `n - 1` drafts plus the token before
  them) on top of a KV cache of `prefix_length` tokens, for `n` in `verify_lengths` (default 1..64).
- `t_draft(L)`: one drafter draft pass (`D3DForDiffusionDrafting.draft_logits`) of packed length `L = B + T`: the
  block `[anchor, MASK x (B-1)]` plus `T` further committed tokens that extend the drafter's cache in the same
  pass, on top of a drafter cache of `prefix_length` tokens, for `T` in `extra_tokens`.

- `t_packed(L)`: one packed successor-drafting pass (`D3DForDiffusionDrafting.packed_draft_logits`) of packed
  length `L = T + (B - 1) + |H| * B`: a chain of `T` committed tokens and `B - 1` drafts, then one successor block
  per hypothesis, for `|H|` in `packed_hypotheses` and `T` in `packed_extra_tokens`.

Times are medians over `repeats` calls after `warmup` calls; in between, both caches are cropped back to the prefix.
Token values are random (timing does not depend on them). Between measured points times are interpolated linearly,
beyond the last point extrapolated from the last two.

Implied speed-ups over target-only decoding (one target forward per token, `t_target(1)`), with `T = tau - 1` (the
tokens committed in a round besides the anchor, which the next draft pass ingests):

- synchronous D3D (`sync_speedup`)::

      S_sync = tau * t_target(1) / (t_draft(B + T) + t_target(B))

- asynchronous D3D with hit rate `h` (`async_speedup`; docs/DESIGN.md section 2): while the target verifies a block,
  the drafter runs one packed pass of length `L_pack = (B - 1) + |H| * B + T` (the shared draft chain, one
  successor block per hypothesis; timed as the packed pass itself, `t_packed`; cost models recorded before
  `t_packed` was measured fall back to a draft pass of the same length). A hit means the next block is ready; a
  miss needs a synchronous draft first::

      S_async = tau * t_target(1) / (max(t_target(B), t_packed(L_pack)) + (1 - h) * t_draft(B + T))

  This assumes perfect overlap (drafter and target on separate compute: a CUDA side stream or a second device);
  on a CPU where both share the cores it is an upper bound.
- any method from its measured rounds (`rounds_speedup`; prompt lookup, an autoregressive assistant)::

      S = tau * t_target(1) / (draft_time_per_round + t_target(drafted_per_round + 1))

Not modelled: the prompt prefill, the work transformers does between forwards (sampling, cache bookkeeping,
stopping criteria), and the first-round costs; measured speed-ups over short outputs are therefore lower.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .modeling.drafting_d3d import timing_state

DEFAULT_VERIFY_LENGTHS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_EXTRA_TOKENS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 48)
DEFAULT_PACKED_HYPOTHESES = (1, 2, 4, 8, 16)
DEFAULT_PACKED_EXTRA_TOKENS = (0, 2, 4)


def _interpolate(points: Mapping[int, float], x: float) -> float:
    """Piecewise-linear interpolation through `points` (x -> y), linear extrapolation beyond either end."""
    xs = sorted(points)
    if not xs:
        raise ValueError("No measured points to interpolate.")
    if len(xs) == 1:
        return points[xs[0]]
    if x <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif x >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(p for p in xs if p >= x)
        lo = xs[xs.index(hi) - 1]
        if hi == x:
            return points[hi]
    slope = (points[hi] - points[lo]) / (hi - lo)
    return max(points[lo] + slope * (x - lo), 0.0)


@dataclass
class CostModel:
    """Measured forward times (milliseconds) and the speed-up formulas of the module docstring.

    Attributes:
        prefix_length (`int`): cached tokens before each timed forward.
        target_ms (`dict[int, float]`): new tokens `n` -> median target forward time.
        draft_ms (`dict[int, float]`): packed length `B + T` -> median draft-pass time (empty without a drafter).
        block_size (`int`, *optional*): the drafter's block size `B` when `draft_ms` was measured.
        settings (`dict`): how it was measured (repeats, dtype, threads, ...).
        packed_ms (`dict[int, float]`): packed length `T + (B - 1) + |H| * B` -> median packed-pass time (empty
            without a drafter, and in cost models recorded before it was measured).
    """

    prefix_length: int
    target_ms: dict[int, float]
    draft_ms: dict[int, float] = field(default_factory=dict)
    block_size: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    packed_ms: dict[int, float] = field(default_factory=dict)

    def t_target(self, tokens: float) -> float:
        """Target forward time (seconds) for `tokens` new tokens."""
        return _interpolate(self.target_ms, tokens) / 1e3

    def t_draft(self, packed_length: float) -> float:
        """Draft-pass time (seconds) at packed length `packed_length`.

        Raises:
            ValueError: if no drafter was measured.
        """
        if not self.draft_ms:
            raise ValueError("This cost model has no drafter measurements (measure it with a drafter).")
        return _interpolate(self.draft_ms, packed_length) / 1e3

    def t_packed(self, packed_length: float) -> float:
        """Packed-pass time (seconds) at packed length `packed_length` (a draft pass of that length when no packed
        pass was measured).

        Raises:
            ValueError: if no drafter was measured.
        """
        if not self.packed_ms:
            return self.t_draft(packed_length)
        return _interpolate(self.packed_ms, packed_length) / 1e3

    def _block(self, block_size: int | None) -> int:
        block = block_size or self.block_size
        if not block:
            raise ValueError("Give `block_size` (the cost model records none).")
        return int(block)

    def sync_speedup(self, tau: float, block_size: int | None = None) -> float:
        """`S_sync = tau * t_target(1) / (t_draft(B + tau - 1) + t_target(B))`."""
        b = self._block(block_size)
        extra = max(tau - 1.0, 0.0)
        return tau * self.t_target(1) / (self.t_draft(b + extra) + self.t_target(b))

    def async_speedup(self, tau: float, hit_rate: float, block_size: int | None = None, hypotheses: int = 1) -> float:
        """`S_async = tau * t_target(1) / (max(t_target(B), t_packed(L_pack)) + (1 - h) * t_draft(B + tau - 1))`
        with `L_pack = (B - 1) + hypotheses * B + tau - 1`.

        Raises:
            ValueError: if `hit_rate` is outside [0, 1] or `hypotheses < 1`.
        """
        if not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"`hit_rate` must be in [0, 1], got {hit_rate}.")
        if hypotheses < 1:
            raise ValueError(f"`hypotheses` must be >= 1, got {hypotheses}.")
        b = self._block(block_size)
        extra = max(tau - 1.0, 0.0)
        packed = (b - 1) + hypotheses * b + extra
        round_time = max(self.t_target(b), self.t_packed(packed)) + (1.0 - hit_rate) * self.t_draft(b + extra)
        return tau * self.t_target(1) / round_time

    def rounds_speedup(self, tau: float, draft_seconds_per_round: float, drafted_per_round: float) -> float:
        """`S = tau * t_target(1) / (draft_seconds_per_round + t_target(drafted_per_round + 1))`."""
        return tau * self.t_target(1) / (draft_seconds_per_round + self.t_target(drafted_per_round + 1))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (integer keys become strings)."""
        out = asdict(self)
        out["target_ms"] = {str(k): v for k, v in self.target_ms.items()}
        out["draft_ms"] = {str(k): v for k, v in self.draft_ms.items()}
        out["packed_ms"] = {str(k): v for k, v in self.packed_ms.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        """Inverse of `to_dict`."""
        return cls(
            prefix_length=int(data["prefix_length"]),
            target_ms={int(k): float(v) for k, v in data["target_ms"].items()},
            draft_ms={int(k): float(v) for k, v in data.get("draft_ms", {}).items()},
            block_size=data.get("block_size"),
            settings=dict(data.get("settings", {})),
            packed_ms={int(k): float(v) for k, v in data.get("packed_ms", {}).items()},
        )


def _median_ms(fn, repeats: int, warmup: int, reset) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        reset()
        if i >= warmup:
            times.append(elapsed)
    return 1e3 * statistics.median(times)


def _random_ids(vocab_size: int, length: int, generator: torch.Generator, device) -> torch.LongTensor:
    return torch.randint(0, vocab_size, (1, length), generator=generator).to(device)


@torch.inference_mode()
def measure_target(
    target,
    prefix_length: int = 256,
    verify_lengths: Sequence[int] = DEFAULT_VERIFY_LENGTHS,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> dict[int, float]:
    """Median time (ms) of one target forward over `n` new tokens on a KV cache of `prefix_length` tokens.

    Args:
        target (`PreTrainedModel`): a causal LM whose cache can be cropped (`DynamicCache`).
        prefix_length (`int`, defaults to 256): cached tokens before each timed forward.
        verify_lengths (`Sequence[int]`): the `n` to time.
        repeats (`int`, defaults to 5), warmup (`int`, defaults to 1): timed and untimed calls per `n`.
        seed (`int`, defaults to 0): seed of the random token ids.

    Returns:
        `dict[int, float]`: `n` -> milliseconds.

    Raises:
        ValueError: for a `prefix_length < 1`, a length `< 1`, or `repeats < 1`.
    """
    if prefix_length < 1 or repeats < 1 or any(n < 1 for n in verify_lengths):
        raise ValueError("`prefix_length`, `repeats` and every verify length must be >= 1.")
    device = target.device
    vocab = target.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(seed)
    cache = target(_random_ids(vocab, prefix_length, g, device), use_cache=True).cache

    def crop() -> None:  # transformers' caches crop by a negative count of tokens to remove
        extra = cache.get_seq_length() - prefix_length
        if extra > 0:
            cache.crop(-extra)

    out = {}
    for n in verify_lengths:
        ids = _random_ids(vocab, n, g, device)
        out[int(n)] = _median_ms(
            lambda ids=ids: target(input_ids=ids, cache=cache, use_cache=True), repeats, warmup, crop
        )
    return out


@torch.inference_mode()
def _prefilled_drafter_cache(drafter, prefix_length: int, block: int, generator: torch.Generator, target):
    """Attaches the target when needed and returns a drafter cache of `prefix_length` random committed tokens."""
    from .modeling import D3DCache

    if drafter.config.shares_target_weights and drafter._attached_target is None:
        if target is None:
            raise ValueError("This drafter shares its target's weights: pass `target=` to attach them.")
        drafter.attach_target_weights(target)
    device = drafter.model.embed_tokens.weight.device
    cache = D3DCache()
    ids = _random_ids(drafter.config.vocab_size, prefix_length, generator, device)
    drafter.draft_logits(ids, cache, block - 1, **timing_state(drafter))
    return cache


def measure_drafter(
    drafter,
    prefix_length: int = 256,
    extra_tokens: Sequence[int] = DEFAULT_EXTRA_TOKENS,
    block_size: int | None = None,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    target=None,
) -> dict[int, float]:
    """Median time (ms) of one D3D draft pass of packed length `B + T` on a drafter cache of `prefix_length` tokens.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        prefix_length (`int`, defaults to 256): committed tokens in the drafter's cache before each timed pass.
        extra_tokens (`Sequence[int]`): the `T` to time (committed tokens besides the anchor).
        block_size (`int`, *optional*): `B`; defaults to the drafter's.
        repeats, warmup, seed: as in `measure_target`.
        target (`PreTrainedModel`, *optional*): attached first when the drafter shares its target's weights.

    Returns:
        `dict[int, float]`: packed length `B + T` -> milliseconds.

    Raises:
        ValueError: for a drafter that shares its target's weights without `target`, or bad lengths.
    """
    if prefix_length < 1 or repeats < 1 or any(t < 0 for t in extra_tokens):
        raise ValueError("`prefix_length` and `repeats` must be >= 1 and every extra-token count >= 0.")
    block = int(block_size or drafter.config.block_size)
    device = drafter.model.embed_tokens.weight.device
    vocab = drafter.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    cache = _prefilled_drafter_cache(drafter, prefix_length, block, g, target)
    state = timing_state(drafter)
    out = {}
    for extra in extra_tokens:
        ids = _random_ids(vocab, extra + 1, g, device)
        out[block + int(extra)] = _median_ms(
            lambda ids=ids: drafter.draft_logits(ids, cache, num_masks=block - 1, **state),
            repeats,
            warmup,
            lambda: cache.crop(prefix_length),
        )
    return out


def measure_packed_pass(
    drafter,
    prefix_length: int = 256,
    hypotheses: Sequence[int] = DEFAULT_PACKED_HYPOTHESES,
    extra_tokens: Sequence[int] = DEFAULT_PACKED_EXTRA_TOKENS,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    target=None,
) -> dict[int, float]:
    """Median time (ms) of one packed successor-drafting pass (`packed_draft_logits`, the pass the asynchronous
    engine runs) on a drafter cache of `prefix_length` tokens.

    The chain holds `T` committed tokens and `B - 1` drafts; hypothesis `h` assumes `T + min(h, B - 1)` chain tokens
    committed (the attention pattern does not change the dense pass's cost; the kernel's differs little).

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        prefix_length (`int`, defaults to 256): committed tokens in the drafter's cache.
        hypotheses (`Sequence[int]`): the numbers of successor blocks `|H|` to time (each in 1..block size).
        extra_tokens (`Sequence[int]`): the `T` to time.
        repeats, warmup, seed, target: as in `measure_drafter`.

    Returns:
        `dict[int, float]`: packed length `T + (B - 1) + |H| * B` -> milliseconds (the later of two equal lengths
        wins).

    Raises:
        ValueError: for a drafter that shares its target's weights without `target`, or bad counts.
    """
    block = int(drafter.config.block_size)
    if prefix_length < 1 or repeats < 1 or any(t < 0 for t in extra_tokens) or any(h < 1 for h in hypotheses):
        raise ValueError("`prefix_length`, `repeats` and hypothesis counts must be >= 1, extra-token counts >= 0.")
    device = drafter.model.embed_tokens.weight.device
    g = torch.Generator().manual_seed(seed)
    cache = _prefilled_drafter_cache(drafter, prefix_length, block, g, target)
    out = {}
    for extra in extra_tokens:
        chain = _random_ids(drafter.config.vocab_size, int(extra) + block - 1, g, device)
        for count in hypotheses:
            lengths = [int(extra) + min(h, block - 1) for h in range(int(count))]
            guesses = [int(t) for t in _random_ids(drafter.config.vocab_size, int(count), g, device)[0]]
            out[int(extra) + block - 1 + int(count) * block] = _median_ms(
                lambda c=chain, n=lengths, b=guesses: drafter.packed_draft_logits(c, cache, n, b),
                repeats,
                warmup,
                lambda: None,  # the packed pass leaves the cache as it was
            )
    return out


def measure_cost_model(
    target,
    drafter=None,
    prefix_length: int = 256,
    verify_lengths: Sequence[int] = DEFAULT_VERIFY_LENGTHS,
    extra_tokens: Sequence[int] = DEFAULT_EXTRA_TOKENS,
    block_size: int | None = None,
    repeats: int = 5,
    warmup: int = 1,
) -> CostModel:
    """Measures `t_target` and (with a drafter) `t_draft`; see `measure_target` and `measure_drafter`."""
    target_ms = measure_target(target, prefix_length, verify_lengths, repeats, warmup)
    draft_ms, packed_ms, block = {}, {}, None
    if drafter is not None:
        block = int(block_size or drafter.config.block_size)
        draft_ms = measure_drafter(drafter, prefix_length, extra_tokens, block, repeats, warmup, target=target)
        packed_ms = measure_packed_pass(drafter, prefix_length, repeats=repeats, warmup=warmup, target=target)
    settings = {
        "repeats": repeats,
        "warmup": warmup,
        "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
    }
    return CostModel(prefix_length, target_ms, draft_ms, block, settings, packed_ms)


def predict_speedups(
    cost: CostModel,
    summary: Mapping[str, Mapping[str, Any]],
    kinds: Mapping[str, str | None],
    method_settings: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, float | None]:
    """The cost model's speed-up for each benchmarked method, from its measured tau (and hit rate).

    Args:
        cost (`CostModel`): the measured times.
        summary (`Mapping`): `run_benchmark(...)["summary"]`.
        kinds (`Mapping[str, str | None]`): method -> `"sync"`, `"async"`, `"rounds"` or `None` (see
            `BenchMethod.cost_model`); `None` gives 1.0 for the reference `target` and `None` otherwise.
        method_settings (`Mapping`, *optional*): per-method settings; `block_size` and `hypotheses` are read there.

    Returns:
        `dict` method -> predicted speed-up (or `None` when the method has no formula or lacks measurements).
    """
    out: dict[str, float | None] = {}
    for method, s in summary.items():
        kind = kinds.get(method)
        ms = (method_settings or {}).get(method, {})
        tau = float(s["tau"])
        try:
            if method == "target":
                out[method] = 1.0
            elif kind == "sync":
                out[method] = cost.sync_speedup(tau, ms.get("block_size"))
            elif kind == "async":
                hit = s.get("hit_rate") or 0.0
                out[method] = cost.async_speedup(tau, hit, ms.get("block_size"), int(ms.get("hypotheses", 1)))
            elif kind == "rounds" and s.get("rounds"):
                drafted = s.get("drafted_tokens", 0) / s["rounds"]
                out[method] = cost.rounds_speedup(tau, s["draft_ms"] / 1e3, drafted)
            else:
                out[method] = None
        except ValueError:
            out[method] = None
    return out


def format_cost_model(cost: CostModel, taus: Sequence[float] = (), hit_rates: Sequence[float] = ()) -> str:
    """Markdown tables of the measured times and, for each tau (and hit rate), the implied speed-ups."""
    lines = [f"Target forward over n new tokens (KV cache of {cost.prefix_length} tokens):", ""]
    lines += ["| n | ms |", "|---|---|"] + [f"| {n} | {ms:.2f} |" for n, ms in sorted(cost.target_ms.items())]
    if cost.draft_ms:
        lines += [
            "",
            f"Drafter pass of packed length B + T (B = {cost.block_size}; cache of {cost.prefix_length}):",
            "",
        ]
        lines += ["| B + T | ms |", "|---|---|"] + [f"| {n} | {ms:.2f} |" for n, ms in sorted(cost.draft_ms.items())]
    if cost.packed_ms:
        lines += ["", f"Packed pass of length T + (B - 1) + H * B (H hypotheses; cache of {cost.prefix_length}):", ""]
        lines += ["| length | ms |", "|---|---|"] + [f"| {n} | {ms:.2f} |" for n, ms in sorted(cost.packed_ms.items())]
    if taus and cost.draft_ms:
        header = "| tau | sync speed-up |" + "".join(f" async h={h:.2f} |" for h in hit_rates)
        lines += ["", header, "|---|---|" + "---|" * len(hit_rates)]
        for tau in taus:
            row = f"| {tau:.2f} | {cost.sync_speedup(tau):.2f}x |"
            row += "".join(f" {cost.async_speedup(tau, h):.2f}x |" for h in hit_rates)
            lines.append(row)
    return "\n".join(lines)


__all__ = [
    "CostModel",
    "format_cost_model",
    "measure_cost_model",
    "measure_drafter",
    "measure_packed_pass",
    "measure_target",
    "predict_speedups",
]
