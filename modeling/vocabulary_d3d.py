"""A drafter's draft vocabulary (FR-Spec, Zhao et al., arXiv 2502.14856): an LM head over a subset of the target's ids.

The LM head over SmolLM2's 49,152 ids is the largest single matrix of a small drafter (49152 x 576), and most of its
rows are ids the target's answers rarely hold. With `D3DConfig.draft_vocab_size = N` the head has N rows, for the
target ids in the buffer `draft_vocab_ids` (the most frequent ids of the target's answers), and costs N / vocab_size
of a full head. The drafter's logits are expanded back to the full vocabulary with the other ids at the dtype's
lowest value, so every consumer (draft-token choice, logits processors, trees, sampling) works on target ids
unchanged: an id outside the draft vocabulary is never drafted, and verification stays exact.
"""

from __future__ import annotations

import torch


def set_draft_vocabulary(drafter, token_ids, source_head: torch.Tensor | None = None) -> None:
    """Sets the target ids the LM head of `drafter` (with `config.draft_vocab_size`) covers, and optionally its rows.

    Args:
        drafter (`D3DForDiffusionDrafting`): a drafter with a draft vocabulary.
        token_ids (`torch.LongTensor` or `list[int]` of shape `(draft_vocab_size,)`): distinct target ids in
            `[0, vocab_size)`, e.g. from `d3d_hf.drafters.draft_vocabulary`; row `i` of the head scores `token_ids[i]`.
        source_head (`torch.Tensor` of shape `(vocab_size, hidden_size)`, *optional*): a full-vocabulary LM head whose
            rows `token_ids` are copied into the head (the source model's head at initialisation).

    Raises:
        ValueError: the drafter has no draft vocabulary, or `token_ids` has the wrong length, repeats or out-of-range
            ids, or `source_head` the wrong shape.
    """
    config = drafter.config
    size = config.draft_vocab_size
    if not size:
        raise ValueError("This drafter has the full vocabulary (`config.draft_vocab_size` is None).")
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    if ids.numel() != size or ids.unique().numel() != size or ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(
            f"A draft vocabulary must be {size} distinct ids in [0, {config.vocab_size}); got {ids.numel()} ids (with "
            "repeats or ids out of range)."
        )
    if source_head is not None:
        if tuple(source_head.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"`source_head` must have shape ({config.vocab_size}, {config.hidden_size}), got "
                f"{tuple(source_head.shape)}."
            )
        with torch.no_grad():
            drafter.lm_head.weight.copy_(source_head[ids.to(source_head.device)].to(drafter.lm_head.weight))
    drafter.draft_vocab_ids.copy_(ids.to(drafter.draft_vocab_ids.device))


def expand_draft_logits(logits: torch.FloatTensor, draft_vocab_ids: torch.LongTensor, vocab_size: int):
    """Full-vocabulary logits from draft-vocabulary logits; ids outside get the dtype's lowest value (probability 0
    after a softmax, never the argmax while any draft id is finite).

    Args:
        logits (`torch.FloatTensor` of shape `(..., draft_vocab_size)`).
        draft_vocab_ids (`torch.LongTensor` of shape `(draft_vocab_size,)`): the target id of each logit.
        vocab_size (`int`): the target's vocabulary size.

    Returns:
        `torch.FloatTensor` of shape `(..., vocab_size)`, the dtype and device of `logits`.
    """
    full = logits.new_full((*logits.shape[:-1], vocab_size), torch.finfo(logits.dtype).min)
    return full.index_copy_(-1, draft_vocab_ids, logits)


__all__ = ["expand_draft_logits", "set_draft_vocabulary"]
