"""The prompts' attention mask: which calls D3D's batched loop decodes, and the masks it accepts (left padding and
holes inside a prompt, never a masked last token). Part of the remote-code bundle: imports only torch."""

from __future__ import annotations

import torch


def needs_batched_loop(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether a D3D call decodes in the batched loop: more than one sequence, or an `attention_mask` with a zero
    (padding, or a hole: `check_prompt_mask`)."""
    return input_ids.shape[0] > 1 or (attention_mask is not None and not bool(attention_mask.bool().all()))


def check_prompt_mask(
    input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, pad_token_id: torch.Tensor | int | None = None
) -> torch.BoolTensor:
    """Checks the prompts' `attention_mask` for the batched loop, before any forward pass.

    The loop decodes any mask whose last column is all ones: zeros before a row's first real token are left padding,
    zeros after it are holes, tokens the target never attends to (transformers' target-only decoding hides them from
    every query and counts positions over the real tokens only, `cumsum - 1`; so does the loop). Holes come, for
    instance, from the mask transformers infers when `generate` gets no `attention_mask`: `input_ids != pad_token_id`
    (whenever `eos_token_id` is not the pad id), with a zero wherever the prompt holds the pad id; SmolLM2's pad id
    is `<|im_end|>`, which its chat template puts inside every prompt.

    Args:
        input_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`): the prompts.
        attention_mask (`torch.Tensor` of shape `(batch_size, seq_len)`, *optional*): 1 (or `True`) at real tokens;
            `None` for no padding.
        pad_token_id (`torch.Tensor` or `int`, *optional*): the call's pad id (`generation_config._pad_token_tensor`),
            only read to name the cause when a row's last token is masked.

    Returns:
        `torch.BoolTensor` of shape `(batch_size, seq_len)`: the mask (`True` = real token), all `True` for `None`.

    Raises:
        ValueError: for a mask of another shape; a row that is all padding; a row whose last token is masked (right
            padding, or a prompt that ends with the pad id under transformers' inferred mask: the message names which,
            and the fix; a mask of right padding's shape is named as right padding first, since a tokenizer's
            right-padded batch and its mask look the same as the inferred mask of prompts ending with the pad id).
    """
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    mask = attention_mask.bool()
    if mask.dim() != 2 or mask.shape != input_ids.shape:
        raise ValueError(
            f"`attention_mask` must have the prompts' shape {tuple(input_ids.shape)}, got {tuple(mask.shape)}."
        )
    empty = [i for i, row in enumerate(mask.tolist()) if not any(row)]
    if empty:
        raise ValueError(
            f"Prompt row(s) {empty} of the batch are all padding (`attention_mask` 0 everywhere): D3D drafts after the "
            "last committed token, so every prompt needs at least one. Drop those rows or give them a token."
        )
    ending = [i for i, real in enumerate(mask[:, -1].tolist()) if not real]
    if not ending:
        return mask
    pad = None if pad_token_id is None else torch.as_tensor(pad_token_id, device=input_ids.device).flatten()
    inferred = pad is not None and pad.numel() == 1 and torch.equal(mask, input_ids != pad)  # could be transformers'
    right_padded = bool((mask[:, :-1] >= mask[:, 1:]).all())  # every row: its tokens, then only zeros
    if inferred and not right_padded:
        pad_id = int(pad)
        raise ValueError(
            f"Prompt row(s) {ending} end with the pad token id {pad_id}, and the `attention_mask` is 0 exactly where "
            "the prompts hold that id: the mask transformers infers from `pad_token_id` when `generate` gets no "
            "`attention_mask` and `eos_token_id` is not the pad id. It hides the prompt's last token, after which D3D "
            "would decode. If the prompt is meant as it is (a chat template may emit the pad id, as SmolLM2's emits "
            "its `<|im_end|>`), pass the mask: `attention_mask=torch.ones_like(input_ids)` (or the tokenizer's). If "
            "the rows are right-padded, pad them on the left (`tokenizer.padding_side = 'left'`)."
        )
    also = (
        f" (If no `attention_mask` was passed and the prompts really end with the pad token id {int(pad)}: "
        "transformers inferred a mask that hides it; pass `attention_mask=torch.ones_like(input_ids)`.)"
        if inferred
        else ""
    )
    raise ValueError(
        f"Batched D3D decoding needs every prompt's last token to be real, and the `attention_mask` of row(s) {ending} "
        "is 0 in the last column: pad prompts on the left (padding first, then the tokens), as transformers' batched "
        "generation of decoder-only models does: set `tokenizer.padding_side = 'left'` before tokenizing the batch."
        + also
    )


__all__ = ["check_prompt_mask", "needs_batched_loop"]
