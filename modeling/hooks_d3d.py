"""The transformers integration: one narrow, reversible patch of `generate`'s candidate-generator factory, plus the
checks D3D makes before any forward pass and the passage of `d3d_*` keyword arguments into the call's config.

Part of the self-contained remote-code bundle: imports only torch, the public transformers API and its siblings.
transformers has no registry for candidate generators (d3d-hf docs/DESIGN.md section 2): `install_generation_hook`
wraps `GenerationMixin._get_candidate_generator` (defers to any assistant with a `build_candidate_generator` method),
`_validate_generation_mode` (checks a D3D assistant's config, options and `use_cache` first),
`_prepare_generation_config` (moves `d3d_*` keyword arguments of `generate` into the call's `GenerationConfig`, as
transformers does with its own options) and `_assisted_decoding` (`decoding_d3d`); `remove_generation_hook` undoes
all four. The hook is installed once per process, by whichever copy of the bundle asks first (`d3d_hf.modeling` or a
checkpoint's copy loaded with `trust_remote_code=True`), and drives the drafters of every copy: it refuses, before
any forward pass, a drafter from a bundle of another version (`check_bundle_version`, `BUNDLE_VERSION`).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import transformers
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin

from .configuration_d3d import BUNDLE_VERSION, validate_config
from .decoding_d3d import install_decoding_hook, remove_decoding_hook
from .options_d3d import PREFIX, check_option_names, resolve_call_options

SUPPORTED_TRANSFORMERS = ("5.24.0", "5.30.0")
_HOOK_ATTRIBUTE = "_d3d_generation_hook"
#: `GenerationMixin._validate_generation_mode`, the first step of `generate` that sees the assistant and the final
#: generation config, is wrapped too, when it has these parameters (see `install_generation_hook`)
_EXPECTED_VALIDATION_PARAMETERS = ("generation_mode", "generation_config", "generation_mode_kwargs")
_EXPECTED_FACTORY_PARAMETERS = (
    "generation_config",
    "input_ids",
    "inputs_tensor",
    "logits_processor",
    "model_kwargs",
    "assistant_model",
    "target_tokenizer",
    "assistant_tokenizer",
)


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
        f"but the generate hook installed in this process is bundle version {BUNDLE_VERSION!r} (`{__name__}`), and "
        "it drives only drafters of its own version. Load every drafter of the process with the installed d3d-hf, "
        "`d3d_hf.drafters.load_drafter(folder)` (or `AutoModel.from_pretrained(folder)` after `import d3d_hf`) "
        "instead of `trust_remote_code=True`, in a new process (or after `d3d_hf.remove_generation_hook()` and "
        "`d3d_hf.install_generation_hook()`); or re-save the checkpoint with the installed d3d-hf "
        "(`load_drafter(folder).save_pretrained(folder)`) so that its bundle is current."
    )


def check_generate_call(drafter: PreTrainedModel, generation_config) -> None:
    """What D3D checks at the start of `target.generate(..., assistant_model=drafter)`, before transformers' own checks
    of the assistant and before any forward pass: the drafter's config (`validate_config`, for fields set by hand such
    as `drafter.config.block_size = 0`) and the options of the call that assisted decoding cannot honour. The
    options are resolved here once for the whole call and kept on its config (`options_d3d.resolve_call_options`).

    Args:
        drafter (`D3DForDiffusionDrafting`): the assistant.
        generation_config (`GenerationConfig`): the call's generation config (after `generate`'s keyword arguments).

    Raises:
        ValueError: for a drafter from a bundle of another version (`check_bundle_version`, checked first), naming
            the drafter config field (`validate_config`), an option `D3DGenerationOptions.resolve`
            refuses (an unknown `d3d_*` name, a value out of range, a transformers assisted-generation option a D3D
            drafter does not use), or `use_cache=False`.
    """
    check_bundle_version(drafter)
    validate_config(drafter.config)
    resolve_call_options(generation_config, drafter)  # once per call: the later steps read them (`call_options`)
    if generation_config.use_cache is False:
        raise ValueError(
            "`use_cache=False` cannot be used with an assistant model: speculative decoding keeps the target's KV "
            "cache and crops it to the accepted tokens after every verification. Drop `use_cache=False` (or pass "
            "`use_cache=True`), or call `generate` without `assistant_model`."
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


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def install_generation_hook() -> None:
    """Makes `GenerationMixin._get_candidate_generator` defer to assistants that build their own candidate
    generator (any assistant model with a `build_candidate_generator` method, such as a D3D drafter).

    transformers has no registry for candidate generators (d3d-hf docs/DESIGN.md section 2), so this is one
    narrow, idempotent patch of the target's candidate-generator factory; every other assistant keeps
    transformers' own behaviour. For a D3D assistant the factory first refuses the inputs D3D cannot decode exactly
    (`check_generate_inputs`: `inputs_embeds`, non-integer or out-of-vocabulary `input_ids`), and a second wrapper,
    of `GenerationMixin._validate_generation_mode` (the first step of `generate` that sees the assistant), checks the
    drafter's config, the call's options and `use_cache` (`check_generate_call`) before transformers' own checks, and
    a third, of `_prepare_generation_config`, lets the `d3d_*` options be keyword arguments of `generate`.
    Undo all with `remove_generation_hook()`.

    Raises:
        RuntimeError: if the installed transformers has no candidate-generator factory with the expected signature
            (supported range: `SUPPORTED_TRANSFORMERS`).
    """
    current = GenerationMixin._get_candidate_generator
    if getattr(current, _HOOK_ATTRIBUTE, False):
        _install_validation_hook()
        _install_keyword_hook()
        install_decoding_hook()
        return
    parameters = inspect.signature(current).parameters
    if any(name not in parameters for name in _EXPECTED_FACTORY_PARAMETERS):
        raise RuntimeError(
            f"transformers {transformers.__version__} changed `GenerationMixin._get_candidate_generator`; D3D "
            f"supports transformers >= {SUPPORTED_TRANSFORMERS[0]}, < {SUPPORTED_TRANSFORMERS[1]}. Install a "
            "version in that range."
        )
    low, high = (_version_tuple(v) for v in SUPPORTED_TRANSFORMERS)
    if not low <= _version_tuple(transformers.__version__) < high:
        warnings.warn(
            f"D3D was tested with transformers >= {SUPPORTED_TRANSFORMERS[0]}, < {SUPPORTED_TRANSFORMERS[1]}; "
            f"found {transformers.__version__}.",
            stacklevel=2,
        )
    original = current

    @functools.wraps(original)
    def _get_candidate_generator(
        self,
        generation_config,
        input_ids,
        inputs_tensor,
        logits_processor,
        model_kwargs,
        assistant_model=None,
        target_tokenizer=None,
        assistant_tokenizer=None,
    ):
        build = getattr(assistant_model, "build_candidate_generator", None)
        if build is not None:
            check_bundle_version(assistant_model)  # also here: the validation hook is skipped on some transformers
            check_generate_inputs(assistant_model, input_ids, model_kwargs)
            return build(
                input_ids=input_ids,
                generation_config=generation_config,
                logits_processor=logits_processor,
                target_tokenizer=target_tokenizer,
                target=self,
                model_kwargs=model_kwargs,
            )
        return original(
            self,
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            target_tokenizer=target_tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )

    setattr(_get_candidate_generator, _HOOK_ATTRIBUTE, True)
    _get_candidate_generator._d3d_original = original
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    _install_validation_hook()
    _install_keyword_hook()
    install_decoding_hook()


def _install_validation_hook() -> None:
    """Wraps `GenerationMixin._validate_generation_mode` so that a D3D assistant's `check_generate_call` runs first:
    transformers refuses `use_cache=False` in `_assisted_decoding` before it asks for a candidate generator, and
    compares the assistant's `vocab_size` here. Skipped (those cases keep transformers' own errors) when the method
    is missing or its parameters changed; idempotent."""
    current = getattr(GenerationMixin, "_validate_generation_mode", None)
    if current is None or getattr(current, _HOOK_ATTRIBUTE, False):
        return
    if any(name not in inspect.signature(current).parameters for name in _EXPECTED_VALIDATION_PARAMETERS):
        return

    @functools.wraps(current)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant_model = generation_mode_kwargs.get("assistant_model")
        if getattr(assistant_model, "build_candidate_generator", None) is not None:
            check_generate_call(assistant_model, generation_config)
            mode = getattr(generation_mode, "value", generation_mode)
            if mode != "assisted_generation":  # transformers would silently decode without the drafter
                assistant_model.last_generation_stats = None
                raise ValueError(
                    f"A D3D drafter speeds up greedy search and sampling only, but this call's settings select "
                    f"{mode!r} (e.g. `num_beams > 1`), which transformers runs without an assistant. Drop "
                    "`assistant_model=` for that mode, or use `num_beams=1` (and no `penalty_alpha` / `dola_layers`)."
                )
        elif getattr(generation_config, _KWARGS_ATTRIBUTE, None):
            names = ", ".join(f"`{name}`" for name in getattr(generation_config, _KWARGS_ATTRIBUTE))
            raise ValueError(
                f"{names} are options of a D3D drafter: pass `assistant_model=` a D3D drafter, or drop them."
            )
        return current(self, generation_mode, generation_config, generation_mode_kwargs)

    setattr(_validate_generation_mode, _HOOK_ATTRIBUTE, True)
    _validate_generation_mode._d3d_original = current
    GenerationMixin._validate_generation_mode = _validate_generation_mode


#: attribute of a call's `GenerationConfig` that lists the `d3d_*` options that came as keyword arguments
_KWARGS_ATTRIBUTE = "_d3d_keyword_options"
_EXPECTED_PREPARE_PARAMETERS = ("generation_config",)


def _install_keyword_hook() -> None:
    """Wraps `GenerationMixin._prepare_generation_config` so that `generate(..., d3d_tree_budget=16)` works like
    transformers' own `prompt_lookup_num_tokens=10`: the `d3d_*` keyword arguments move from the model keyword
    arguments (which `generate` would refuse as unused) into the call's `GenerationConfig`, after a check of their
    names (`check_option_names`: a misspelt name is refused with the nearest option). Their values are checked with
    the other options when the generator resolves them. Skipped when the method is missing or its parameters
    changed (the options then travel only in a `GenerationConfig`); idempotent."""
    current = getattr(GenerationMixin, "_prepare_generation_config", None)
    if current is None or getattr(current, _HOOK_ATTRIBUTE, False):
        return
    if any(name not in inspect.signature(current).parameters for name in _EXPECTED_PREPARE_PARAMETERS):
        return

    @functools.wraps(current)
    def _prepare_generation_config(self, generation_config, *args, **kwargs):
        generation_config, model_kwargs = current(self, generation_config, *args, **kwargs)
        names = [name for name in model_kwargs if name.startswith(PREFIX)]
        if names:
            options = {name: model_kwargs.pop(name) for name in names}
            check_option_names(options)
            for name, value in options.items():
                setattr(generation_config, name, value)
            setattr(generation_config, _KWARGS_ATTRIBUTE, tuple(names))
        return generation_config, model_kwargs

    setattr(_prepare_generation_config, _HOOK_ATTRIBUTE, True)
    _prepare_generation_config._d3d_original = current
    GenerationMixin._prepare_generation_config = _prepare_generation_config


def remove_generation_hook() -> None:
    """Restores transformers' own candidate-generator factory, `_validate_generation_mode`,
    `_prepare_generation_config` and `_assisted_decoding` (a no-op when the hook is not installed)."""
    remove_decoding_hook()
    for name in ("_get_candidate_generator", "_validate_generation_mode", "_prepare_generation_config"):
        current = getattr(GenerationMixin, name, None)
        if getattr(current, _HOOK_ATTRIBUTE, False):
            setattr(GenerationMixin, name, current._d3d_original)




__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "check_bundle_version",
    "check_generate_call",
    "check_generate_inputs",
    "check_prompt_and_drafter",
    "install_generation_hook",
    "remove_generation_hook",
]
