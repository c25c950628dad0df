"""The checks D3D makes before any forward pass that do not depend on transformers' hooks: the prompt and the drafter
(`check_prompt_and_drafter`), the drafter's bundle version against the installed hook's (`check_bundle_version`) and
`generate`'s inputs (`check_generate_inputs`). Called by the generate hook (`hooks_d3d`) and by the call's generator
(`generation_d3d`).

Part of the self-contained remote-code bundle: imports only torch, the public transformers API and its siblings.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .configuration_d3d import BUNDLE_VERSION, validate_config


def check_prompt_and_drafter(drafter: PreTrainedModel, prompt_length: int, target=None) -> None:
    """Raises a `ValueError` that says what to change when D3D cannot decode this prompt with this drafter."""
    if prompt_length < 1:
        raise ValueError(
            "The prompt is empty (0 tokens): D3D drafts after the last committed token, so it needs at least one. "
            "Pass a prompt of one token or more (for example `[[tokenizer.bos_token_id]]`)."
        )
    limits = [("drafter", drafter.config)]
    if target is not None:
        limits.insert(0, ("target", target.config.get_text_config()))
    for name, config in limits:
        context = getattr(config, "max_position_embeddings", None)
        if context is not None and prompt_length > context:
            raise ValueError(
                f"The prompt has {prompt_length} tokens but the {name}'s context is {context} tokens "
                f"(`max_position_embeddings`): shorten the prompt to at most {context} tokens, for example by "
                "keeping its last tokens."
            )
    if drafter.config.mask_token_id is None and getattr(drafter.model, "mask_embedding", None) is None:
        raise ValueError(
            "This drafter has no mask token: `config.mask_token_id` is None and it has no `mask_embedding`. Set "
            "`drafter.config.mask_token_id` to the spare vocabulary id it was built with, or re-create it with "
            "`D3DForDiffusionDrafting.from_autoregressive(target)`."
        )


def check_bundle_version(drafter) -> None:
    """Refuses to drive a D3D drafter whose class comes from a bundle copy of another version than this hook's.

    One process has one generate hook, installed by the first copy of the bundle that asks: `import d3d_hf`, or a
    drafter loaded with `trust_remote_code=True` (transformers imports the checkpoint folder's own copy of these
    files; after `import d3d_hf` it loads d3d_hf's registered class instead, so the two copies meet when such a
    drafter was loaded first). That hook builds the candidate generator and runs the loop for every D3D drafter of
    the process, so the drafter's bundle must speak the same contract: its class's `_d3d_bundle_version` must equal
    this module's `BUNDLE_VERSION` (`configuration_d3d`).

    Raises:
        ValueError: naming both versions, the drafter's module and the fix, when the stamps differ or the drafter's
            bundle has none (saved before bundles were stamped).
    """
    version = getattr(type(drafter), "_d3d_bundle_version", None)
    if version == BUNDLE_VERSION:
        return
    found = "no version stamp (saved before bundles were stamped)" if version is None else f"version {version!r}"
    raise ValueError(
        f"This D3D drafter's code is a d3d-hf bundle with {found} (its class is in `{type(drafter).__module__}`), "
        f"but the generate hook installed in this process is bundle version {BUNDLE_VERSION!r} "
        f"(`{__package__}.hooks_d3d`), and it drives only drafters of its own version. Load every drafter of the "
        "process with the installed d3d-hf, "
        "`d3d_hf.drafters.load_drafter(folder)` (or `AutoModel.from_pretrained(folder)` after `import d3d_hf`) "
        "instead of `trust_remote_code=True`, in a new process (or after `d3d_hf.remove_generation_hook()` and "
        "`d3d_hf.install_generation_hook()`); or re-save the checkpoint with the installed d3d-hf "
        "(`load_drafter(folder).save_pretrained(folder)`) so that its bundle is current."
    )


def check_generate_inputs(drafter: PreTrainedModel, input_ids: torch.Tensor, model_kwargs: dict | None) -> None:
    """Refuses, before any forward pass, the prompts D3D cannot decode exactly as the target alone would.

    Args:
        drafter (`D3DForDiffusionDrafting`): the assistant.
        input_ids (`torch.Tensor` of shape `(batch_size, seq_len)`): the prompt as `generate` prepared it.
        model_kwargs (`dict`, *optional*): `generate`'s model keyword arguments (`inputs_embeds`, ...).

    Raises:
        ValueError: if `inputs_embeds` was given (with or without `input_ids`: the drafter drafts from token ids, so
            embeddings that are not exactly the ids' own would make the drafts and the target disagree), if
            `input_ids` is not an integer tensor (`torch.long` or `torch.int32`), if an id is outside `[0,
            drafter.config.vocab_size)`, or (`validate_config`) for an invalid drafter config field.
    """
    validate_config(drafter.config)
    if model_kwargs is not None and model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "D3D speculative decoding does not take `inputs_embeds`: the drafter drafts from token ids. Pass the "
            "prompt as `input_ids` (a `torch.long` tensor of shape `(1, seq_len)`) and drop `inputs_embeds`; for "
            "embeddings that are not a tokenised prompt, call `generate` without `assistant_model`."
        )
    if input_ids.dtype not in (torch.long, torch.int32):
        raise ValueError(
            f"`input_ids` must hold token ids as integers (`torch.long`), got a {input_ids.dtype} tensor. Pass the "
            "tokenizer's ids (`tokenizer(..., return_tensors='pt').input_ids`) or convert them with "
            "`input_ids.long()` if they are whole numbers."
        )
    if input_ids.numel() > 0:
        low, high, vocab = int(input_ids.min()), int(input_ids.max()), int(drafter.config.vocab_size)
        if low < 0 or high >= vocab:
            raise ValueError(
                f"`input_ids` holds ids outside the vocabulary [0, {vocab}) (min {low}, max {high}): pass ids of the "
                "target's own tokenizer."
            )


__all__ = ["check_bundle_version", "check_generate_inputs", "check_prompt_and_drafter"]
