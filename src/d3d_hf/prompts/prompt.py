"""`Prompt`, one chat prompt, and `encode_prompt`, which turns it into target input ids with the chat template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Prompt:
    """One prompt.

    Attributes:
        id: Stable identifier (HumanEval task id, the JSONL ``"id"``, or the 0-based line index).
        messages: Chat messages, each ``{"role": str, "content": str}``, to be rendered by the tokenizer's chat
            template (see :func:`encode_prompt`). Treat as read-only.
        raw: The bare text for completion-style use (no chat template), or ``None`` when there is none.
    """

    id: str
    messages: list[dict]
    raw: str | None = None


def _to_id_list(encoded: object) -> list[int]:
    """Pull a flat list of token ids out of whatever ``apply_chat_template`` returned."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:  # BatchEncoding / dict
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        if encoded.dim() == 2:
            if encoded.shape[0] != 1:
                raise ValueError(f"Expected one sequence from apply_chat_template, got shape {tuple(encoded.shape)}.")
            encoded = encoded[0]
        return [int(i) for i in encoded.tolist()]
    if hasattr(encoded, "tolist"):  # numpy
        encoded = encoded.tolist()
    if isinstance(encoded, Sequence) and encoded and isinstance(encoded[0], (list, tuple)):
        if len(encoded) != 1:
            raise ValueError(f"Expected one sequence from apply_chat_template, got {len(encoded)}.")
        encoded = encoded[0]
    if not isinstance(encoded, Sequence) or isinstance(encoded, str):
        raise TypeError(f"apply_chat_template returned {type(encoded).__name__}, expected token ids.")
    return [int(i) for i in encoded]


def encode_prompt(tokenizer, prompt: Prompt | str) -> torch.LongTensor:
    """Render a prompt with the tokenizer's chat template, ready for the assistant's answer.

    Uses ``tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)``; the
    template adds the special tokens itself (for SmolLM2 the ids start with ``<|im_start|>`` = 1 and end with
    ``<|im_start|>assistant\\n``). In transformers 5.x this call returns a ``BatchEncoding``; the ids are taken
    out of it.

    Args:
        tokenizer: A ``PreTrainedTokenizerBase`` with a chat template.
        prompt: The prompt to encode, or a plain string (sent as one user turn).

    Returns:
        ``torch.LongTensor`` of shape ``(1, seq_len)`` (int64, CPU) holding the input ids.

    Raises:
        TypeError: ``prompt`` is neither a ``Prompt`` nor a ``str``.
        ValueError: The tokenizer has no chat template (use a chat/instruct model, or tokenize ``prompt.raw``
            yourself for completion-style use), or the template produced no tokens.
    """
    if isinstance(prompt, str):
        prompt = Prompt(id="text", messages=[{"role": "user", "content": prompt}])
    elif not isinstance(prompt, Prompt):
        raise TypeError(f"`prompt` must be a d3d_hf.prompts.Prompt or a str, got {type(prompt).__name__}.")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"Tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat template: "
            "load an instruct/chat model (d3d_hf.targets.load_target fills in ChatML for ChatML vocabularies), or "
            "tokenize prompt.raw yourself for completion-style use."
        )
    encoded = tokenizer.apply_chat_template(
        list(prompt.messages), add_generation_prompt=True, tokenize=True, return_dict=True
    )
    ids = _to_id_list(encoded)
    if not ids:
        raise ValueError(f"The chat template produced no tokens for prompt {prompt.id!r}.")
    return torch.tensor([ids], dtype=torch.long)


__all__ = ["Prompt", "encode_prompt"]
