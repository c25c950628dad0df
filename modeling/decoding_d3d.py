"""D3D's own decoding loop: chain or tree verification behind `target.generate(..., assistant_model=drafter)`.

Part of the self-contained remote-code bundle: imports only torch and the public transformers API (plus
`transformers.generation.utils._speculative_sampling`, the chain rule, so that chain rounds draw exactly what
transformers' loop draws; when it is missing a copy of the same rule in our own words is used).

**How it is entered.** `generate` prepares the generation config, the logits processors (and warpers), the stopping
criteria (eos, max length, stop strings, the user's own), the streamer and the target's cache, then calls the
decoding method of its generation mode, `GenerationMixin._assisted_decoding` for an assistant.
`install_decoding_hook` wraps that one method (version-checked by its parameters, reversible with
`remove_decoding_hook`): for a D3D assistant it runs `d3d_assisted_decoding` with exactly the arguments transformers
prepared, so every `generate` argument keeps its meaning; every other assistant, and a D3D call with
`d3d_decoding_loop="transformers"`, runs transformers' own method. The wrapper is where a D3D call starts: it applies
the call's fast paths there (`patches_d3d.apply_fast_paths`) and undoes them when the call ends. transformers'
public `custom_generate` route was
not used: it needs an argument on every call (`target.generate(..., custom_generate=...)`), which the user's plain
`assistant_model=drafter` call does not have, and a callable there replaces the assistant and streamer arguments with
its own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
from transformers.generation import GenerationMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .batched_decoding_d3d import batched_assisted_decoding
from .fast_paths_d3d import matmul_layouts
from .generation_d3d import d3d_candidate_generator
from .options_d3d import call_options, experiment
from .patches_d3d import apply_fast_paths
from .prompt_masks_d3d import needs_batched_loop
from .tree_d3d import check_tree_cache, keep_cache_path, tree_attention_inputs
from .verifier_d3d import accept_chain, accept_tree, cut_committed, process_rows

_HOOK_ATTRIBUTE = "_d3d_decoding_hook"
_EXPECTED_PARAMETERS = (
    "input_ids",
    "logits_processor",
    "stopping_criteria",
    "generation_config",
    "synced_gpus",
    "streamer",
    "assistant_model",
)
#: model keyword arguments the loop knows how to honour; any other (a user's extra forward argument, encoder
#: outputs, multimodal inputs) sends the call to transformers' loop
_KNOWN_MODEL_KWARGS = frozenset(
    {"cache", "past_key_values", "attention_mask", "position_ids", "use_cache", "logits_to_keep", "inputs_tensor"}
)


def own_loop_blocker(target, generation_config, synced_gpus: bool, model_kwargs: dict[str, Any]) -> str | None:
    """Why this call cannot run in D3D's own loop (`None` when it can); such a call runs in transformers' loop
    with chain verification, or is refused when a tree was asked for."""
    if target.config.is_encoder_decoder:
        return "the target is an encoder-decoder model"
    if synced_gpus:
        return "`synced_gpus=True`"
    if model_kwargs.get("attention_mask") is not None:
        return "an `attention_mask` with padding was passed"
    if generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        return "`output_attentions` / `output_hidden_states` were asked for"
    if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        return "`assistant_ensemble_weight` was set"
    extra = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS and v is not None)
    if extra:
        return f"model keyword arguments {extra}"
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is None:
        return "no cache was prepared"
    return None


def d3d_assisted_decoding(
    target,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs: Any,
):
    r"""
    Speculative decoding with a D3D drafter, one sequence, in D3D's own loop (what `generate` runs for a D3D
    assistant; the arguments are those transformers prepares for `GenerationMixin._assisted_decoding`).

    Each round the candidate generator (`D3DCandidateGenerator`) proposes either a chain (`d3d_tree_budget=None`:
    the drafts of `get_candidates`, verified exactly as transformers' loop does: greedy prefix match, or
    `_speculative_sampling`, so chain mode commits the same tokens and records the same statistics) or a draft tree
    (`get_tree`), verified in one target forward with an ancestor-only attention mask and tree position ids
    (`tree_d3d.tree_attention_inputs`); the accepted path (`greedy_tree_path`, or `sample_tree_path`, which keeps
    the target's distribution) and one more token are committed, the target's cache keeps only that path
    (`keep_cache_path`), and the result is cut at the first eos and at `max_length` as in transformers' loop. The
    logits processors score every verified row on that row's own history; `return_dict_in_generate` returns
    `scores` / `logits` of the committed tokens, as transformers does; the streamer receives each round's
    committed tokens; the stopping criteria are checked after every round.

    A batch (or a padded prompt) runs `batched_decoding_d3d.batched_assisted_decoding` instead: chain rounds with
    per-sequence cache slots, masks and positions. Trees in a batch would add one tree per sequence (padded to a
    common node count) on the same slots; they are refused there for now.

    Args:
        target (`PreTrainedModel`): the target (decoder-only, with a `DynamicCache` for trees).
        input_ids (`torch.LongTensor` of shape `(1, seq_len)`): the prompt.
        logits_processor (`LogitsProcessorList`), stopping_criteria (`StoppingCriteriaList`),
        generation_config (`GenerationConfig`), streamer (`BaseStreamer`, *optional*): as transformers prepared them.
        assistant_model (`D3DForDiffusionDrafting`): the drafter.
        tokenizer (*optional*): the target's tokenizer (stop strings).
        model_kwargs: `generate`'s model keyword arguments; the target's cache is `model_kwargs["cache"]`.

    Returns:
        `torch.LongTensor` of shape `(1, total_len)`, or `GenerateDecoderOnlyOutput` (`sequences`, `scores`,
        `logits`, `cache`) with `return_dict_in_generate=True`.

    Raises:
        ValueError: for a tree (`d3d_tree_budget`) on a target whose cache cannot keep a path (not a `DynamicCache` of
            full-attention layers) or for a call that only transformers' loop can run (`own_loop_blocker`).
    """
    cache_key = "cache" if model_kwargs.get("cache") is not None else "past_key_values"
    cache = model_kwargs.get(cache_key)
    if cache is None:
        raise RuntimeError("Assisted decoding requires a cache")
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    generator = d3d_candidate_generator(  # the call's state, built here (no detour through transformers' factory)
        target, assistant_model, input_ids, generation_config, logits_processor, model_kwargs, tokenizer
    )
    keep_logits = target._supports_logits_to_keep() if hasattr(target, "_supports_logits_to_keep") else False
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    scores = () if return_dict and generation_config.output_scores else None
    raw_logits = () if return_dict and generation_config.output_logits else None
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos_ids = set() if eos is None else {int(t) for t in eos.flatten().tolist()}
    compute_dtype = next(target.parameters()).dtype
    device = target.device
    # the shared cache, the call's noise and fused drafting (the fast paths were applied where the call started)
    with generator.own_loop(target, cache) as tree_rounds:
        tree_mode = tree_rounds is not None
        noise = generator.proposer.noise  # `GumbelNoise` under drafter-invariant sampling, else None
        successors = generator.successors  # `SuccessorBlocks` under fused successor drafting, else None
        if tree_mode and getattr(cache, "layers", None):
            check_tree_cache(cache)
        unfinished, first_round = True, True
        while unfinished:
            cur_len = input_ids.shape[1]
            past = cache.get_seq_length()
            committed = input_ids[:, past:].to(device)
            num_committed = committed.shape[1]
            tree = None
            if tree_mode:
                tree = tree_rounds.get_tree(input_ids)
                nodes = torch.tensor([tree.tokens], dtype=input_ids.dtype, device=device)
                new_ids = torch.cat([committed, nodes], dim=1) if len(tree) else committed
                num_candidates = len(tree)
                if tree.is_chain():
                    attention_mask, positions = None, torch.arange(past, past + new_ids.shape[1], device=device)[None]
                else:
                    attention_mask, positions = tree_attention_inputs(tree, num_committed, past, compute_dtype, device)

                def history(row: int, tree=tree, prefix=input_ids) -> torch.LongTensor:
                    """The sequence verification row `row` scores: the committed tokens, then the path to its node."""
                    if row == 0:
                        return prefix
                    return torch.cat([prefix, prefix.new_tensor([tree.path_tokens(row - 1)])], 1)
            else:
                candidate_ids, candidate_logits = generator.get_candidates(input_ids)
                candidate_ids = candidate_ids.to(device)
                if candidate_logits is not None:
                    candidate_logits = candidate_logits.to(device)
                num_candidates = candidate_ids.shape[1] - cur_len
                new_ids = candidate_ids[:, past:]
                attention_mask, positions = None, torch.arange(past, past + new_ids.shape[1], device=device)[None]
                if successors is not None and successors.block_rows:  # the next round's blocks ride along
                    new_ids, attention_mask, positions = successors.verification_inputs(
                        new_ids, num_committed, past, compute_dtype
                    )

                def history(row: int, candidates=candidate_ids, cur_len=cur_len) -> torch.LongTensor:
                    return candidates[:, : cur_len + row]

            block_rows = successors.block_rows if successors is not None and not tree_mode else 0
            forward_kwargs = {"logits_to_keep": num_candidates + 1 + block_rows} if keep_logits else {}
            if generator.passes.reads_hidden_state:  # the drafter reads the state that chose its next anchor
                forward_kwargs["output_hidden_states"] = True
            with successors.context(new_ids.shape[1] - block_rows) if block_rows else contextlib.nullcontext():
                outputs = target(
                    input_ids=new_ids,
                    attention_mask=attention_mask,
                    position_ids=positions,
                    use_cache=True,
                    **{cache_key: cache},
                    **forward_kwargs,
                )
            block_logits = outputs.logits[0, outputs.logits.shape[1] - block_rows :] if block_rows else None
            if first_round:
                if not getattr(cache, "is_croppable", True):
                    raise ValueError(
                        "Assisted decoding requires a cache that can be cropped to restore the states after draft "
                        "verification"
                    )
                if tree_mode:
                    check_tree_cache(cache)
                first_round = False
            target_end = outputs.logits.shape[1] - block_rows
            new_logits = outputs.logits[:, target_end - num_candidates - 1 : target_end]
            new_logits = new_logits.to(dtype=torch.float32, device=input_ids.device)
            raw = new_logits.clone() if raw_logits is not None else None
            process_rows(logits_processor, lambda i, h=history, d=input_ids.device: h(i).to(d), new_logits[0])
            if tree_mode:
                path, bonus = accept_tree(tree, cur_len, new_logits[0], do_sample=do_sample, noise=noise)
                rows = [0] + [node + 1 for node in path]  # logits rows of the committed tokens, in order
                valid = input_ids.new_tensor([[tree.tokens[node] for node in path] + [bonus]])
            else:
                valid, n_matches = accept_chain(
                    candidate_ids.to(input_ids.device),
                    cur_len,
                    new_logits[0],
                    do_sample=do_sample,
                    noise=noise,
                    draft_scores=candidate_logits,
                )
                rows = list(range(n_matches + 1))
            valid = cut_committed(valid, generation_config.max_length - cur_len, eos_ids)
            n_matches = valid.shape[1] - 1
            rows = rows[: n_matches + 1]
            if generator.passes.reads_hidden_state:  # the row that chose the last committed token
                generator.passes.keep_hidden_state(outputs.hidden_states[-1], num_committed - 1 + rows[-1])
            input_ids = torch.cat([input_ids, valid.to(input_ids.device)], dim=-1)
            if streamer is not None:
                streamer.put(valid.cpu())
            if tree_mode:
                keep_cache_path(cache, past + num_committed, path[:n_matches])
                tree_rounds.update_tree_strategy(input_ids, tree, path[:n_matches])
            else:
                removed = num_candidates - n_matches + block_rows  # rejected candidates, then the blocks' rows
                if removed:
                    cache.crop(-removed)  # transformers' convention: a negative count is removed
                generator.update_candidate_strategy(input_ids, new_logits, n_matches)
                if successors is not None:
                    successors.outcome(n_matches, block_logits)
            if scores is not None:
                scores += tuple(new_logits[:, i, :] for i in rows)
            if raw_logits is not None:
                raw_logits += tuple(raw[:, i, :] for i in rows)
            unfinished = not bool(stopping_criteria(input_ids, scores)[0])
            if noise is not None:
                noise.forget_before(input_ids.shape[1])
    if streamer is not None:
        streamer.end()
    if return_dict:
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, cache=cache)
    return input_ids


def install_decoding_hook() -> None:
    """Wraps `GenerationMixin._assisted_decoding` so that a D3D assistant's call runs `d3d_assisted_decoding` (module
    docstring), or `batched_decoding_d3d.batched_assisted_decoding` for a batch or a padded prompt. Idempotent; undo
    with `remove_decoding_hook()`. Skipped (D3D then decodes in transformers' loop, chain verification only) when the
    method is missing or its parameters changed.
    """
    current = getattr(GenerationMixin, "_assisted_decoding", None)
    if current is None or getattr(current, _HOOK_ATTRIBUTE, False):
        return
    if any(name not in inspect.signature(current).parameters for name in _EXPECTED_PARAMETERS):
        return

    @functools.wraps(current)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs):
        assistant = kwargs.get("assistant_model")
        if getattr(assistant, "build_candidate_generator", None) is not None:
            options = call_options(generation_config, assistant, keep=True)  # resolved by the call's first check
            # where the call starts: its fast paths (the drafter's; the target's attention in D3D's own loop, and
            # its matmul layouts under the `d3d_target_matmul_layouts` experiment), undone when it ends
            own_loop = options.decoding_loop != "transformers"
            with apply_fast_paths(assistant, self if own_loop else None) as patches:
                if options.target_matmul_layouts:
                    experiment("target_matmul_layouts")(patches, self, matmul_layouts())
                return _decode(self, options, current, input_ids, logits_processor, stopping_criteria,
                               generation_config, *args, **kwargs)  # fmt: skip
        return current(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs)

    setattr(_assisted_decoding, _HOOK_ATTRIBUTE, True)
    _assisted_decoding._d3d_original = current
    GenerationMixin._assisted_decoding = _assisted_decoding


def _decode(self, options, current, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs):
    """The loop that decodes a D3D assistant's call: D3D's batched loop, its own loop, or transformers' (`current`)."""
    loop, budget = options.decoding_loop, options.tree_budget
    # several sequences, or padding: D3D's batched loop (one padded prompt may also run transformers' loop)
    if needs_batched_loop(input_ids, kwargs.get("attention_mask")) and (
        loop != "transformers" or input_ids.shape[0] > 1
    ):
        return batched_assisted_decoding(
            self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs
        )
    if loop != "transformers":
        model_kwargs = {k: v for k, v in kwargs.items() if k not in _LOOP_ARGUMENTS}
        blocker = own_loop_blocker(self, generation_config, bool(kwargs.get("synced_gpus")), model_kwargs)
        if blocker is None:
            return d3d_assisted_decoding(
                self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs
            )
        if options.fused_drafting is True:
            raise ValueError(
                f"Fused successor drafting (`d3d_fused_drafting=True`) runs in D3D's own decoding loop, which "
                f"cannot take this call: {blocker}. Drop that argument, or the option."
            )
        if budget is not None:
            raise ValueError(
                f"Tree verification (`d3d_tree_budget={budget!r}`) runs in D3D's own decoding loop, which "
                f"cannot take this call: {blocker}. Drop that argument, or set `d3d_tree_budget=None` (chain "
                "verification in transformers' loop)."
            )
    return current(self, input_ids, logits_processor, stopping_criteria, generation_config, *args, **kwargs)


#: `_assisted_decoding` arguments that are not model keyword arguments
_LOOP_ARGUMENTS = frozenset({"synced_gpus", "streamer", "assistant_model", "assistant_tokenizer", "tokenizer"})


def remove_decoding_hook() -> None:
    """Restores transformers' own `_assisted_decoding` (a no-op when the hook is not installed)."""
    current = getattr(GenerationMixin, "_assisted_decoding", None)
    if getattr(current, _HOOK_ATTRIBUTE, False):
        GenerationMixin._assisted_decoding = current._d3d_original


__all__ = ["d3d_assisted_decoding", "install_decoding_hook", "own_loop_blocker", "remove_decoding_hook"]
