"""The transformers integration: reversible patches of four `GenerationMixin` methods, the checks of a call that
need them (`check_generate_call`) and the passage of `d3d_*` keyword arguments into the call's config. The checks
that need no hook are in `checks_d3d` (re-exported here).

Part of the self-contained remote-code bundle: imports only torch, the public transformers API and its siblings.
transformers has no registry for candidate generators (d3d-hf docs/DESIGN.md section 2): `install_generation_hook`
wraps `GenerationMixin._get_candidate_generator` (defers to any assistant with a `build_candidate_generator` method;
transformers' loop only, D3D's own loops build the call's generator directly: `generation_d3d.d3d_candidate_generator`),
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

import transformers
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin

from .checks_d3d import check_bundle_version, check_generate_inputs, check_prompt_and_drafter
from .configuration_d3d import validate_config
from .decoding_d3d import install_decoding_hook, remove_decoding_hook
from .generation_d3d import d3d_candidate_generator
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
        if getattr(assistant_model, "build_candidate_generator", None) is not None:  # transformers' own loop
            return d3d_candidate_generator(
                self, assistant_model, input_ids, generation_config, logits_processor, model_kwargs, target_tokenizer
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
