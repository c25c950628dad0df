"""Drafter-invariant sampling: the Gumbel noise that fixes, for a seed, the token the target commits at each position.

Part of the self-contained remote-code bundle: imports only the standard library and torch.

Method (Daliri, Musco, Suresh, arXiv 2408.07978, "Coupling without communication and drafter-invariant speculative
decoding"; for several drafts per position, Gumbel-max list sampling, Rowan, Phan, Khisti, arXiv 2506.05632): under
`do_sample=True` the target's token at absolute position `t` (the index the token will have in the output sequence)
is `argmax_v(log p_t(v) + G_t(v))`, where `p_t` is the target's distribution after the logits processors and warpers
and `G_t` is i.i.d. standard Gumbel noise over the vocabulary drawn from a counter-based stream keyed by `(call seed,
t)`. By the Gumbel-max trick this token is distributed exactly as `p_t` given everything before it (the noise of
position `t` is independent of the noise that chose the earlier tokens), so the committed text is a sample of the
target's own distribution. A draft token at `t` (from the drafter, prompt lookup, a tree node or a pre-drafted
block) is accepted exactly when it equals that token, and the drafter chooses its drafts with the same noise on its
own distribution (`argmax_v(log q_t(v) + G_t(v))`), so it agrees with the target as often as the coupling allows
(at least `(1 - TV) / (1 + TV)` per position, against `1 - TV` for the optimal coupling of speculative sampling).
The output therefore depends only on the seed, the prompt and the target: no plan of the engine (drafts per round,
lookup, tree, asynchronous rounds, timing) can change it.

Choices (ours): the call seed is one draw from torch's default generator when D3D's loop starts, so
`torch.manual_seed(s)` before `generate` fixes the text; the stream for position `t` is a CPU `torch.Generator`
(MT19937) seeded with a SplitMix64 mix of `(seed, t)` (identical on every machine and device: the noise is drawn on
the CPU and moved), float64 uniforms `u` and `G = -log(-log(u))`; the noise of a position is drawn once and kept
until the committed text passes it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """SplitMix64 finaliser of `seed + (position + 1) * golden`: a 63-bit seed per `(seed, position)`."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class GumbelNoise:
    """Gumbel noise `G_t` of shape `(vocab_size,)` for each absolute position `t` of one `generate` call.

    Args:
        seed (`int`): the call seed (`from_default_generator` draws it from torch's default generator).
        vocab_size (`int`): the number of logits per position.

    Raises:
        ValueError: for a `vocab_size` < 1 or a negative position.
    """

    def __init__(self, seed: int, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"`vocab_size` must be >= 1, got {vocab_size}.")
        self.seed = int(seed) & _MASK64
        self.vocab_size = int(vocab_size)
        self._rows: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # the asynchronous rounds' worker thread draws too

    @classmethod
    def from_default_generator(cls, vocab_size: int) -> GumbelNoise:
        """Noise for a call whose seed is one draw from torch's default CPU generator (`torch.manual_seed`)."""
        return cls(int(torch.randint(0, 2**62, (1,), dtype=torch.long)), vocab_size)

    def __call__(self, position: int) -> torch.Tensor:
        """`G_position`: `torch.float64` tensor of shape `(vocab_size,)` on the CPU (drawn once, then kept)."""
        if position < 0:
            raise ValueError(f"Positions are >= 0, got {position}.")
        with self._lock:
            row = self._rows.get(position)
            if row is None:
                generator = torch.Generator().manual_seed(_mix(self.seed, position))
                uniform = torch.rand(self.vocab_size, generator=generator, dtype=torch.float64)
                row = self._rows[position] = -torch.log(-torch.log(uniform))
            return row

    def rows(self, positions: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
        """The noise of `positions`, `torch.float64` of shape `(len(positions), vocab_size)` on `device`."""
        stacked = torch.stack([self(int(p)) for p in positions]) if positions else torch.empty(0, self.vocab_size)
        return stacked.to(device=device, dtype=torch.float64) if device is not None else stacked.double()

    def perturb(self, scores: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """`scores + G` in float64: `scores` of shape `(len(positions), vocab_size)` (processed logits or
        log-probabilities of row `i` for the token at `positions[i]`); `-inf` stays `-inf`."""
        if scores.shape[0] != len(positions) or scores.shape[-1] != self.vocab_size:
            raise ValueError(
                f"`scores` must be (len(positions) = {len(positions)}, vocab_size = {self.vocab_size}), got "
                f"{tuple(scores.shape)}."
            )
        return scores.double() + self.rows(positions, scores.device)

    def choose(self, scores: torch.Tensor, positions: Sequence[int]) -> torch.LongTensor:
        """The Gumbel-max token of each row: `argmax_v(scores[i, v] + G_{positions[i]}(v))`, shape `(len(positions),)`.

        Row `i` of `scores` may be processed logits or log-probabilities (a per-row constant does not change the
        argmax), `(len(positions), vocab_size)`."""
        return self.perturb(scores, positions).argmax(dim=-1)

    def forget_before(self, position: int) -> None:
        """Drops the noise of positions before `position` (committed: never drawn on again)."""
        with self._lock:
            for old in [p for p in self._rows if p < position]:
                del self._rows[old]


class ShiftedNoise:
    """One sequence's Gumbel noise, read at positions of its padded row (`position - offset` is the token's index
    in the unpadded sequence)."""

    def __init__(self, noise: GumbelNoise, offset: int) -> None:
        self.noise, self.offset = noise, offset

    def choose(self, scores: torch.Tensor, positions) -> torch.LongTensor:
        return self.noise.choose(scores, [int(p) - self.offset for p in positions])

    def forget_before(self, position: int) -> None:
        self.noise.forget_before(position - self.offset)


def sequence_noise(call_noise: GumbelNoise, index: int) -> GumbelNoise:
    """The noise of sequence `index` of a batch: the call's own for sequence 0, else keyed by a SplitMix64 mix of the
    call seed and `index` (`batched_decoding_d3d`'s docstring, "Seeds")."""
    if index == 0:
        return call_noise
    return GumbelNoise(_mix(call_noise.seed, (1 << 62) + index), call_noise.vocab_size)


__all__ = ["GumbelNoise", "ShiftedNoise", "sequence_noise"]
