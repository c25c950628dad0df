"""N-gram prompt lookup: free draft tokens copied from earlier in the sequence.

Part of the self-contained remote-code bundle: imports only torch (nothing from d3d_hf, no sibling module), so a
checkpoint loaded with `trust_remote_code=True` can use it without d3d_hf installed.

A lookup round costs no draft pass at all, only the longer verification (`t_verify(k + 1)` instead of
`t_verify(1)`); on the project's CPUs that is what pays (d3d-hf docs/DESIGN.md section 9). Deciding *when* to use it
is `policy_d3d.DraftPolicy`'s job; this module only finds the candidates.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: Which earlier occurrence of the matching suffix n-gram supplies the continuation.
OCCURRENCES = ("first", "last")


def _eos_ids(eos_token_id: int | Iterable[int] | torch.Tensor | None) -> list[int]:
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, torch.Tensor):
        return [int(i) for i in eos_token_id.flatten().tolist()]
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(i) for i in eos_token_id]


def lookup_candidates(
    input_ids: torch.LongTensor,
    max_ngram_size: int = 3,
    num_tokens: int = 10,
    *,
    occurrence: str = "first",
    eos_token_id: int | Iterable[int] | torch.Tensor | None = None,
) -> torch.LongTensor:
    r"""
    The candidate tokens of `lookup_match` (same arguments, same errors), without the matched n-gram size.

    Example:
        >>> lookup_candidates(torch.tensor([[5, 6, 7, 8, 5, 6]]), max_ngram_size=2, num_tokens=3)
        tensor([[7, 8, 5]])
    """
    return lookup_match(input_ids, max_ngram_size, num_tokens, occurrence=occurrence, eos_token_id=eos_token_id)[0]


def lookup_match(
    input_ids: torch.LongTensor,
    max_ngram_size: int = 3,
    num_tokens: int = 10,
    *,
    occurrence: str = "first",
    eos_token_id: int | Iterable[int] | torch.Tensor | None = None,
) -> tuple[torch.LongTensor, int]:
    r"""
    Draft tokens by prompt lookup: the tokens that followed an earlier occurrence of the sequence's longest
    matching suffix n-gram.

    For `n = min(max_ngram_size, seq_len - 1), ..., 1` (largest first), the suffix `input_ids[0, -n:]` is searched
    among the windows `input_ids[0, i : i + n]` that have at least one token after them (`i + n < seq_len`); at the
    first `n` with a match, the continuation `input_ids[0, i + n : i + n + num_tokens]` of the chosen occurrence is
    returned (it may run into the suffix itself, as in transformers). With `eos_token_id`, the continuation is cut
    before its first end-of-sequence token (so that the target cannot accept an eos and then tokens after it).

    This is transformers' prompt-lookup rule (`transformers.generation.PromptLookupCandidateGenerator.
    get_candidates`, 5.24) written out: with the default `occurrence="first"` the result equals that method's
    candidates (tested). We do not call transformers' class because it is a `CandidateGenerator` bound to one
    `generate` call (it needs `max_length`, and `vocab_size` plus logits processors to filter forbidden tokens), not
    a function over a sequence, and because `occurrence="last"` has no counterpart there. Not reproduced: the
    logits-processor filtering of forbidden candidates and the `max_length` cap (the caller bounds the number of
    candidates it sends). Note that transformers' rule takes the *leftmost* occurrence (its source marks this as a
    TODO); `occurrence="last"` takes the most recent one instead, whose continuation reflects the latest context but
    may be shorter (it can reach the end of the sequence sooner).

    Args:
        input_ids (`torch.LongTensor` of shape `(1, seq_len)`):
            The committed sequence (prompt plus generated tokens); batch size 1, as transformers' assisted loop.
        max_ngram_size (`int`, defaults to 3):
            Longest suffix n-gram to match (transformers' `prompt_lookup_num_tokens` generator uses
            `max_matching_ngram_size`, default 2 there).
        num_tokens (`int`, defaults to 10):
            Most candidate tokens to return (transformers' `num_output_tokens`).
        occurrence (`str`, defaults to `"first"`):
            `"first"`: the leftmost occurrence (transformers' rule); `"last"`: the most recent one.
        eos_token_id (`int`, `list[int]` or `torch.Tensor`, *optional*):
            End-of-sequence id(s) to cut the continuation at.

    Returns:
        `(candidates, ngram_size)`: `torch.LongTensor` of shape `(1, n)` with `0 <= n <= num_tokens`, on
        `input_ids`' device (shape `(1, 0)` when nothing matches), and the size of the suffix n-gram that matched
        (0 when none did). The size tells how reliable the match is (`acceptance_d3d.LookupAcceptance`).

    Raises:
        ValueError: if `input_ids` is not of shape `(1, seq_len)`, `max_ngram_size` or `num_tokens` is below 1, or
            `occurrence` is unknown.

    Example:
        >>> lookup_match(torch.tensor([[5, 6, 7, 8, 5, 6]]), max_ngram_size=2, num_tokens=3)
        (tensor([[7, 8, 5]]), 2)
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"`input_ids` must have shape (1, seq_len), got {tuple(input_ids.shape)}.")
    if isinstance(max_ngram_size, bool) or not isinstance(max_ngram_size, int) or max_ngram_size < 1:
        raise ValueError(f"`max_ngram_size` must be an int >= 1, got {max_ngram_size!r}.")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"`num_tokens` must be an int >= 1, got {num_tokens!r}.")
    if occurrence not in OCCURRENCES:
        raise ValueError(f"`occurrence` must be one of {OCCURRENCES}, got {occurrence!r}.")
    sequence = input_ids[0]
    length = sequence.shape[0]
    empty = input_ids.new_empty((1, 0))
    for ngram_size in range(min(max_ngram_size, length - 1), 0, -1):
        # windows starting at 0 .. length - ngram_size - 1: each has at least one token after it
        windows = sequence[: length - 1].unfold(0, ngram_size, 1)
        starts = (windows == sequence[length - ngram_size :]).all(dim=1).nonzero().flatten()
        if starts.numel() == 0:
            continue
        start = int(starts[0 if occurrence == "first" else -1]) + ngram_size
        chosen = sequence[start : start + num_tokens]
        eos = _eos_ids(eos_token_id)
        if eos:
            is_eos = torch.isin(chosen, torch.tensor(eos, device=chosen.device, dtype=chosen.dtype))
            hits = is_eos.nonzero().flatten()
            if hits.numel() > 0:
                chosen = chosen[: int(hits[0])]
        # as in transformers: a match cut to nothing by eos ends the search (no fall-back to shorter n-grams)
        return (chosen[None], ngram_size) if chosen.numel() > 0 else (empty, 0)
    return empty, 0


__all__ = ["OCCURRENCES", "lookup_candidates", "lookup_match"]
