"""The one declaration of D3D's generation options (`d3d_*`), their checks and how a call resolves them.

Part of the self-contained remote-code bundle: imports only the standard library, torch and the public transformers
API. Every option is a field of `D3DGenerationOptions` whose metadata holds its `generate` name, its default, the
values it accepts, a one-line doc and whether it is a user knob or internal (an ablation or experiment switch that
tests and benchmarks set; README lists only the knobs). The candidate generator validates from it, the bench and the
CLI read their flags and recorded settings from it, and `options_markdown_table` renders the README's table.

A call's options come, highest priority first, from `generate`'s keyword arguments (`d3d_tree_budget=16`, moved into
the call's `GenerationConfig` by the hook), the `GenerationConfig` passed to `generate`, and
`drafter.generation_config` (as transformers reads `num_assistant_tokens` from the assistant). A `d3d_*` name that is
not an option is refused with the nearest option's name; transformers' own assisted-generation options that a D3D
drafter does not use are mapped (`num_assistant_tokens`) or refused with the D3D option to use.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import torch

from .runtime_d3d import default_worker_threads

PREFIX = "d3d_"


def _is_boolean(value: Any) -> bool:
    """A Python `bool`, or numpy's or a 0-d torch tensor's boolean scalar."""
    return (
        isinstance(value, bool)
        or type(value).__name__ in ("bool", "bool_")
        or getattr(value, "dtype", None) == torch.bool
    )


def _whole_number(value: Any) -> int | None:
    """`value` as an `int` when it is a whole number (an `int`, a numpy or 0-d torch integer, or a float such as `2.0`;
    never a boolean), else None."""
    if _is_boolean(value):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return operator.index(value)
    except TypeError:
        return None


class _Invalid(ValueError):
    """Raised by a check; `resolve` turns it into a `ValueError` that names the option and what it accepts."""


def _boolean(value: Any, block_size: int) -> bool:
    if not _is_boolean(value) or getattr(value, "ndim", 0) != 0:
        raise _Invalid
    return bool(value)


def _num_drafts(value: Any, block_size: int) -> int | str:
    if value in ("adaptive", "full"):
        return value
    number = _whole_number(value)
    if number is None or not 0 <= number <= block_size - 1:
        raise _Invalid
    return number


def _auto_or_boolean(value: Any, block_size: int) -> bool | str:
    if isinstance(value, str) and value == "auto":
        return value
    return _boolean(value, block_size)


def _num_hypotheses(value: Any, block_size: int) -> int:
    number = _whole_number(value)
    if number is None or not 1 <= number <= block_size:
        raise _Invalid
    return number


def _most_worker_threads() -> int:
    return max(os.cpu_count() or 1, torch.get_num_threads())


def _worker_threads(value: Any, block_size: int) -> int:
    number = _whole_number(value)
    if number is None or not 1 <= number <= _most_worker_threads():
        raise _Invalid
    return number


def _tree_budget(value: Any, block_size: int) -> int | str:
    if value == "adaptive":
        return value
    number = _whole_number(value)
    if number is None or number < 1:
        raise _Invalid
    return number


def _positive(value: Any, block_size: int) -> int:
    number = _whole_number(value)
    if number is None or number < 1:
        raise _Invalid
    return number


def _sampling(value: Any, block_size: int) -> str:
    if value not in ("invariant", "speculative"):
        raise _Invalid
    return value


def _decoding_loop(value: Any, block_size: int) -> str:
    if value not in ("d3d", "transformers"):
        raise _Invalid
    return value


def _option(
    name: str,
    default: Any,
    accepts: str,
    doc: str,
    check: Callable[[Any, int], Any],
    internal: bool = False,
    default_doc: str | None = None,
    experiment: Callable[[Any], bool] | None = None,
) -> Any:
    """A `D3DGenerationOptions` field: `default` is the value when no source sets the option (`None` where the
    default depends on the call: `default_doc` says on what). `experiment(value)`: whether a value set by a source
    asks for an experiment or ablation that the d3d-hf library provides (`experiment`), not the checkpoint's
    bundle."""
    metadata = {
        "option": PREFIX + name,
        "accepts": accepts,
        "doc": doc,
        "check": check,
        "internal": internal,
        "default_doc": default_doc if default_doc is not None else repr(default),
        "experiment": experiment,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class D3DGenerationOptions:
    """The `d3d_*` options of one `generate` call with a D3D drafter, checked and with defaults filled in.

    Build one with `D3DGenerationOptions.resolve(generation_config, drafter)`; a field's metadata is its declaration
    (`option_fields()`). Fields (the `generate` name is `d3d_` + the field name):

    Attributes:
        num_drafts (`int` or `str`, default `"adaptive"`): drafts sent per round. `"adaptive"`: the cost-aware engine
            chooses per round between a plain target step, a prompt-lookup round and a draft pass of `k` drafts, by
            expected tokens per second on the machine's measured cost curves; a whole number in `[0, block_size -
            1]`: that many every round (as far as the remaining length allows); `"full"`: `block_size - 1`.
        prompt_lookup (`bool`, default `True`): n-gram matches in the prompt and the generated text as a free
            candidate source (adaptive engine only).
        asynchronous (`bool` or `"auto"`, default `"auto"`): packed successor drafting during verification (arXiv
            2611.06425). `"auto"`: on where the drafter runs on CUDA (the pass overlaps on a side stream), off on
            CPU (it shares the cores with verification, measured slower); `True` / `False`: always on / off.
        num_hypotheses (`int` in `[1, block_size]`, default `min(4, block_size)`): successor blocks per packed pass.
        reuse_on_miss (`bool`, default `False`): on a wrong bonus guess, still use the block drafted for the real
            acceptance length (with the real bonus token).
        worker_threads (`int` in `[1, max(CPU count, torch threads)]`, default half of torch's threads, at least 1):
            intra-op threads of the CPU worker that runs the packed pass.
        tree_budget (`int` >= 1 or `"adaptive"`, *optional*): verify a draft tree of at most this many nodes per
            drafter round in D3D's own loop (`None`: chain verification; `"adaptive"`: the node count that maximises
            expected tokens per second, at most the block size).
        tree_branching (`int` >= 1, default 4): drafter candidates per tree depth.
        fused_drafting (`bool` or `"auto"`, default `"auto"`): fused successor drafting (`successor_d3d`): the
            verification forward also computes, after each acceptance length where the accepted path is likely to
            end, the drafter's block that would follow (mask rows with the block adapters, on the target's own
            weights); when the path ends there, the next round's drafts are ready without a draft pass. `"auto"`: on
            in D3D's own loop with chain verification, the adaptive engine and a drafter that runs on all of the
            target's own layers (the blocks are then placed by the cost-aware policy), except on CPU, where the
            block rows measured dearer than the pass they save (benchmarks/results/fused/); `True`: also with a fixed
            `d3d_num_drafts` (a block after every candidate, so every round after the first drafts in the previous
            verification); refused where it cannot run; `False`: off.
        sampling (`str`, default `"invariant"`): how `do_sample=True` verifies. `"invariant"`: drafter-invariant
            sampling (`sampling_d3d`, arXiv 2408.07978): the target's token at each position is the Gumbel-max of its
            processed distribution under noise keyed by a call seed drawn from torch's default generator, so the
            text depends only on the seed, the prompt and the target, whatever the engine plans; `"speculative"`:
            standard speculative sampling (arXiv 2211.17192), whose random draws depend on the plan.
        decoding_loop (`str`, default `"d3d"`; internal): `"d3d"` (D3D's own loop) or `"transformers"`
            (transformers' assisted-generation loop: the ablation of D3D's loop, chain verification only).
        share_target_cache (`bool`, default `True`; internal): a drafter on the target's own first layers attends to
            the target's cache instead of re-running committed tokens in its own (`False`: the ablation). A drafter
            over the target's cache (`D3DConfig.shares_target_cache`) always shares it, whatever this says.
        draft_passes (`bool`, default `True`; internal): `False` keeps the adaptive engine from drafting (plain
            steps and prompt-lookup rounds only, same calibration): what the drafter adds is `d3d` against this.
        target_matmul_layouts (`bool`, default `False`; internal): the target's 2-32 row verification forwards on
            the faster matmul layout of the machine (`d3d_hf.experiments.route_target_linears`; CPU experiment).
        explicit (`frozenset[str]`): the fields some source set (the others are defaults).
    """

    num_drafts: int | str = _option(
        "num_drafts",
        "adaptive",
        "'adaptive', 'full' or a whole number in [0, block_size - 1]",
        "Drafts per round: `'adaptive'` lets the cost-aware engine choose per round (0 = a plain target step); a "
        "number or `'full'` fixes the plan (reproducible round structure, ablations).",
        _num_drafts,
    )
    prompt_lookup: bool = _option(
        "prompt_lookup",
        True,
        "True or False",
        "N-gram matches in the prompt and the output as free candidates (adaptive engine); `False` to measure the "
        "drafter alone.",
        _boolean,
    )
    asynchronous: bool | str = _option(
        "async",
        "auto",
        "'auto', True or False",
        "Packed successor drafting while the target verifies: `'auto'` = on CUDA only; `True` forces it (warns once "
        "on CPU, where it measured slower).",
        _auto_or_boolean,
    )
    num_hypotheses: int | None = _option(
        "num_hypotheses",
        None,
        "a whole number in [1, block_size]",
        "Successor blocks drafted per packed pass (asynchronous): more raises the hit rate and the pass's cost.",
        _num_hypotheses,
        default_doc="min(4, block_size)",
    )
    reuse_on_miss: bool = _option(
        "reuse_on_miss",
        False,
        "True or False",
        "Asynchronous: on a wrong bonus guess, still use the block drafted for the real acceptance length.",
        _boolean,
    )
    worker_threads: int | None = _option(
        "worker_threads",
        None,
        "a whole number in [1, max(CPU count, torch threads)]",
        "Asynchronous on CPU: torch threads of the packed-pass worker (it runs beside the verification).",
        _worker_threads,
        default_doc="half of torch's threads, at least 1",
        experiment=lambda value: True,
    )
    tree_budget: int | str | None = _option(
        "tree_budget",
        None,
        "None, 'adaptive' or a whole number of nodes >= 1",
        "Verify a best-first draft tree of at most this many nodes per drafter round (`None`: one chain).",
        _tree_budget,
    )
    tree_branching: int = _option(
        "tree_branching",
        4,
        "a whole number >= 1",
        "Tree verification: drafter candidates per depth.",
        _positive,
    )
    fused_drafting: bool | str = _option(
        "fused_drafting",
        "auto",
        "'auto', True or False",
        "Draft the next round's block inside this round's verification forward (no draft pass after a hit): "
        "`'auto'` = off on CPU (measured slower there), else where the drafter runs on the target's own weights.",
        _auto_or_boolean,
    )
    sampling: str = _option(
        "sampling",
        "invariant",
        "'invariant' or 'speculative'",
        "`do_sample=True`: `'invariant'` gives the same text for a seed whatever the engine plans (Gumbel-max "
        "coupling); `'speculative'` is standard speculative sampling (its draws depend on the plan).",
        _sampling,
    )
    decoding_loop: str = _option(
        "decoding_loop",
        "d3d",
        "'d3d' or 'transformers'",
        "Which loop verifies: D3D's own or transformers' assisted-generation loop (the ablation).",
        _decoding_loop,
        internal=True,
        experiment=lambda value: value == "transformers",
    )
    share_target_cache: bool = _option(
        "share_target_cache",
        True,
        "True or False",
        "A drafter on the target's first layers reads the target's cache (`False`: its own cache, the ablation).",
        _boolean,
        internal=True,
        experiment=lambda value: value is False,
    )
    draft_passes: bool = _option(
        "draft_passes",
        True,
        "True or False",
        "`False`: the adaptive engine never runs a draft pass (plain target steps and its sized prompt-lookup rounds "
        "only, same calibration): the ablation that measures what the drafter adds (bench method `engine-lookup`).",
        _boolean,
        internal=True,
        experiment=lambda value: value is False,
    )
    target_matmul_layouts: bool = _option(
        "target_matmul_layouts",
        False,
        "True or False",
        "The target's verification forwards on the machine's faster matmul layout (CPU experiment).",
        _boolean,
        internal=True,
        experiment=lambda value: value is True,
    )
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    @classmethod
    def option_fields(cls, internal: bool | None = None) -> list[dataclasses.Field]:
        """The declared options in table order (`internal=False`: user knobs only; `True`: internal only)."""
        chosen = [f for f in dataclasses.fields(cls) if "option" in f.metadata]
        return [f for f in chosen if internal is None or f.metadata["internal"] == internal]

    @classmethod
    def option_names(cls) -> list[str]:
        """The `generate` names of every option (`d3d_num_drafts`, ...)."""
        return [f.metadata["option"] for f in cls.option_fields()]

    @classmethod
    def resolve(
        cls, generation_config: Any = None, drafter: Any = None, block_size: int | None = None, **overrides: Any
    ) -> D3DGenerationOptions:
        """The options of one call, checked.

        Args:
            generation_config (`GenerationConfig`, *optional*): the call's config (`generate`'s keyword arguments
                already in it).
            drafter (`D3DForDiffusionDrafting`, *optional*): its `generation_config` gives the values the call does
                not set, its `config.block_size` the ranges.
            block_size (`int`, *optional*): the block size (default: the drafter's).
            **overrides: option values by `generate` name (`d3d_num_drafts=3`), highest priority.

        Returns:
            `D3DGenerationOptions` with every default filled in (`num_hypotheses` and `worker_threads` resolved).

        Raises:
            ValueError: for a `d3d_*` name that is not an option (naming the nearest one), a value outside what the
                option accepts, options that cannot be combined, or a transformers assisted-generation option that a
                D3D drafter does not use (naming the D3D option to use).
        """
        if block_size is None:
            block_size = int(drafter.config.block_size) if drafter is not None else 16
        drafter_config = getattr(drafter, "generation_config", None)
        for source in (overrides, generation_config, drafter_config):
            check_option_names(source)
        values, explicit = {}, set()
        mapped = assisted_generation_options(generation_config, block_size)
        for f in cls.option_fields():
            name = f.metadata["option"]
            value = overrides.get(name)
            for source in (mapped, generation_config, drafter_config):
                if value is None and source is not None:
                    value = source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)
            if value is None:
                values[f.name] = f.default
                continue
            try:
                values[f.name] = f.metadata["check"](value, block_size)
            except _Invalid:
                accepts = f.metadata["accepts"].replace("block_size - 1", f"block_size - 1 = {block_size - 1}")
                accepts = accepts.replace("block_size]", f"block_size = {block_size}]")
                accepts = accepts.replace("torch threads)]", f"torch threads) = {_most_worker_threads()}]")
                raise ValueError(f"`{name}` must be {accepts} (or None for the default), got {value!r}.") from None
            explicit.add(f.name)
        if values["num_hypotheses"] is None:
            values["num_hypotheses"] = min(4, block_size)
        if values["worker_threads"] is None:
            values["worker_threads"] = default_worker_threads()
        options = cls(**values, explicit=frozenset(explicit))
        options._check_combinations()
        for f in cls.option_fields():
            asks = f.metadata["experiment"]
            if asks is not None and f.name in explicit and asks(values[f.name]):
                experiment(f.metadata["option"][len(PREFIX) :], f"`{f.metadata['option']}={values[f.name]!r}`")
        return options

    def is_explicit(self, name: str) -> bool:
        """Whether some source set field `name` (rather than the default)."""
        return name in self.explicit

    def _check_combinations(self) -> None:
        asynchronous = self.asynchronous is True
        loop = self.decoding_loop
        if self.target_matmul_layouts and loop == "transformers":
            raise ValueError(
                "`d3d_target_matmul_layouts` applies to D3D's own decoding loop: drop "
                "`d3d_decoding_loop='transformers'` (or the option)."
            )
        if self.target_matmul_layouts and asynchronous:
            raise ValueError(
                "`d3d_target_matmul_layouts` times the target's matmuls, which asynchronous drafting would disturb on "
                "the same cores: it cannot be combined with `d3d_async=True`. Set one of them to its default."
            )
        if self.sampling == "invariant" and self.is_explicit("sampling") and loop == "transformers":
            raise ValueError(
                "`d3d_sampling='invariant'` needs D3D's own decoding loop: transformers' assisted-generation loop "
                "samples with speculative sampling. Drop `d3d_decoding_loop='transformers'` (or the option)."
            )
        if self.tree_budget is not None and loop == "transformers":
            raise ValueError(
                "`d3d_tree_budget` needs D3D's own decoding loop: transformers' assisted-generation loop verifies one "
                "chain. Drop `d3d_decoding_loop='transformers'` (or set `d3d_tree_budget=None`)."
            )
        if self.fused_drafting is True and (loop == "transformers" or asynchronous or self.tree_budget is not None):
            raise ValueError(
                "`d3d_fused_drafting=True` drafts inside the chain verifications of D3D's own loop: it cannot be "
                "combined with `d3d_decoding_loop='transformers'`, `d3d_async=True` or `d3d_tree_budget`. Drop one "
                "of them."
            )
        if self.fused_drafting is True and not self.draft_passes:
            raise ValueError(
                "`d3d_fused_drafting=True` drafts with the drafter, which `d3d_draft_passes=False` keeps out of the "
                "engine. Drop one of them."
            )
        if self.tree_budget is not None and asynchronous:
            raise ValueError(
                "Tree verification drafts synchronously: `d3d_tree_budget` cannot be combined with `d3d_async=True`. "
                "Set one of them to its default."
            )
        if asynchronous and self.num_drafts == "adaptive" and self.is_explicit("num_drafts"):
            raise ValueError(
                "Asynchronous rounds draft a fixed number of tokens (the packed pass pre-drafts whole successor "
                "blocks): `d3d_num_drafts='adaptive'` cannot be combined with `d3d_async=True`. Drop one of them, "
                "or give `d3d_num_drafts` a number or 'full'."
            )
        if not self.draft_passes and (self.num_drafts != "adaptive" or asynchronous or self.tree_budget is not None):
            raise ValueError(
                "`d3d_draft_passes=False` is the adaptive engine without its drafter: it cannot be combined with a "
                "fixed `d3d_num_drafts`, `d3d_async=True` or `d3d_tree_budget`. Drop one of them."
            )
        if self.prompt_lookup and self.is_explicit("prompt_lookup") and self.num_drafts != "adaptive":
            raise ValueError(
                f"`d3d_prompt_lookup=True` is a candidate source of the adaptive engine, but `d3d_num_drafts="
                f"{self.num_drafts!r}` fixes every round to drafter drafts. Drop one of them."
            )
        if self.prompt_lookup and self.is_explicit("prompt_lookup") and asynchronous:
            raise ValueError(
                "`d3d_prompt_lookup=True` cannot be combined with `d3d_async=True`: asynchronous rounds take their "
                "candidates from the packed pass. Drop one of them."
            )

    def to_dict(self) -> dict[str, Any]:
        """`{generate name: value}` of every option, plus `"explicit"` (the names some source set), for JSON."""
        out = {f.metadata["option"]: getattr(self, f.name) for f in self.option_fields()}
        out["explicit"] = sorted(f.metadata["option"] for f in self.option_fields() if f.name in self.explicit)
        return out


#: the entry-point group through which the d3d-hf library offers the bundle its experiments and ablations (its
#: pyproject.toml declares them): each entry is named after its option's field (`target_matmul_layouts`,
#: `draft_passes`, `share_target_cache`, `decoding_loop`, `worker_threads`; `D3DGenerationOptions`, the
#: `experiment` of each field's declaration) and is what the bundle calls for it (`d3d_hf.experiments`)
EXPERIMENTS_GROUP = "d3d.experiments"


def experiment(name: str, asked: str | None = None) -> Any:
    """The installed `d3d.experiments` entry `name` (what the bundle calls for that experiment).

    Raises:
        ValueError: when no installed package provides it (a checkpoint loaded with `trust_remote_code=True` alone),
            naming what asked for it (`asked`) and how to get it: install d3d-hf.
    """
    for entry in entry_points(group=EXPERIMENTS_GROUP):
        if entry.name == name:
            try:
                return entry.load()
            except ImportError:
                break
    what = asked or f"the `{PREFIX}{name}` experiment"
    raise ValueError(
        f"{what} is an experiment (or ablation) of the d3d-hf library, not of the drafter's remote-code bundle, and "
        "d3d-hf is not installed here: install the d3d-hf library (in a clone of its repository, `pip install -e .`, "
        "as its README does), then `import d3d_hf` (or load the drafter with `d3d_hf.drafters.load_drafter`); or "
        "drop the option."
    )


def _names_in(source: Any) -> list[str]:
    if source is None:
        return []
    if isinstance(source, Mapping):
        return list(source)
    return list(vars(source))


def nearest_option(name: str) -> str | None:
    """The declared option nearest to `name` (a misspelling), or `None` when none is close."""
    matches = difflib.get_close_matches(name, D3DGenerationOptions.option_names(), n=1, cutoff=0.6)
    return matches[0] if matches else None


def check_option_names(source: Any) -> None:
    """Refuses a `d3d_*` name in `source` (a mapping of keyword arguments or a `GenerationConfig`) that is not an
    option.

    Raises:
        ValueError: naming the unknown option and the nearest declared one.
    """
    known = set(D3DGenerationOptions.option_names())
    for name in _names_in(source):
        if name.startswith(PREFIX) and name not in known:
            near = nearest_option(name)
            hint = f" Did you mean `{near}`?" if near else ""
            raise ValueError(
                f"`{name}` is not a D3D generation option.{hint} The options are: {', '.join(sorted(known))}."
            )


#: transformers' assisted-generation options and what a D3D drafter does with each: a D3D option it maps to, or
#: the message of its refusal (a value equal to transformers' default counts as unset)
ASSISTED_GENERATION_OPTIONS = {
    "num_assistant_tokens": "d3d_num_drafts",
    "num_assistant_tokens_schedule": "a D3D drafter chooses its drafts per round with `d3d_num_drafts='adaptive'` "
    "(the default) or sends a fixed number (`d3d_num_drafts=k`)",
    "assistant_confidence_threshold": "the adaptive engine (`d3d_num_drafts='adaptive'`) stops drafts by their "
    "calibrated acceptance, not by a threshold",
    "prompt_lookup_num_tokens": "with a D3D drafter, prompt lookup is a candidate source of the adaptive engine: "
    "`d3d_prompt_lookup=True` (the default) sizes each lookup round by its measured cost",
    "max_matching_ngram_size": "the D3D engine's prompt lookup matches n-grams of 1 to 3 tokens and learns their "
    "acceptance per size (`d3d_prompt_lookup`)",
    "assistant_early_exit": "a D3D drafter is a model of its own: pass it as `assistant_model`",
    "assistant_lookbehind": "a D3D drafter shares the target's tokenizer",
    "target_lookbehind": "a D3D drafter shares the target's tokenizer",
}


def assisted_generation_options(generation_config: Any, block_size: int) -> dict[str, Any]:
    """The D3D options implied by transformers' assisted-generation options set on `generation_config`.

    `num_assistant_tokens=k` means `d3d_num_drafts=k` (at most `block_size - 1`); the others have no D3D meaning and
    are refused. A value equal to transformers' global default is treated as unset (transformers fills those in).

    Raises:
        ValueError: for an option that a D3D drafter does not use (naming the D3D option to use), or
            `num_assistant_tokens` outside `[0, block_size - 1]` or given together with `d3d_num_drafts`.
    """
    if generation_config is None or isinstance(generation_config, Mapping):
        return {}
    defaults = _assisted_defaults(type(generation_config))
    mapped = {}
    for name, meaning in ASSISTED_GENERATION_OPTIONS.items():
        value = getattr(generation_config, name, None)
        if value is None or value == defaults.get(name):
            continue
        if name == "num_assistant_tokens":
            number = _whole_number(value)
            if number is None or not 0 <= number <= block_size - 1:
                raise ValueError(
                    f"`num_assistant_tokens={value!r}`: a D3D drafter drafts at most block_size - 1 = "
                    f"{block_size - 1} tokens per round. Pass `d3d_num_drafts` (a number in [0, {block_size - 1}], "
                    "'full' or 'adaptive') instead."
                )
            if getattr(generation_config, "d3d_num_drafts", None) is not None:
                raise ValueError(
                    "`num_assistant_tokens` and `d3d_num_drafts` both set the drafts per round: pass only "
                    "`d3d_num_drafts`."
                )
            mapped["d3d_num_drafts"] = number
            continue
        raise ValueError(f"`{name}={value!r}` does not apply to a D3D drafter: {meaning}. Drop `{name}`.")
    return mapped


def _assisted_defaults(config_class: type) -> dict[str, Any]:
    """transformers' global defaults of the assisted-generation options (what `generate` fills in when unset)."""
    try:
        defaults = config_class()._get_default_generation_params()
    except (AttributeError, TypeError):
        defaults = {}
    return {name: defaults.get(name) for name in ASSISTED_GENERATION_OPTIONS}


def parse_option_text(text: str) -> Any:
    """An option value from command-line text: `none` -> `None`, `true` / `false` -> `bool`, digits -> `int`,
    anything else the text itself (checked when the options are resolved)."""
    lowered = text.strip().lower()
    if lowered == "none":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered.isdigit():
        return int(lowered)
    return text.strip()


def options_markdown_table(internal: bool = False) -> str:
    """The Markdown table of the user options (`internal=True`: the internal ones), for README.md."""
    lines = ["| option | default | accepts | what it does |", "|---|---|---|---|"]
    for f in D3DGenerationOptions.option_fields(internal=internal):
        meta = f.metadata
        lines.append(f"| `{meta['option']}` | `{meta['default_doc']}` | {meta['accepts']} | {meta['doc']} |")
    return "\n".join(lines)


#: attribute of a `generate` call's own `GenerationConfig` that keeps the call's resolved options (`call_options`)
CALL_OPTIONS_ATTRIBUTE = "_d3d_options"


def call_options(generation_config: Any, drafter: Any, keep: bool = False) -> D3DGenerationOptions:
    """The options of one `generate` call, resolved once per call.

    `generate` hands one `GenerationConfig` of its own (a copy made for the call) to every step: the first check of
    a D3D assistant (`hooks_d3d.check_generate_call`), the loops, the candidate-generator factory. The first check
    resolves the options (`resolve_call_options`) and keeps them on that config, as transformers keeps
    `_eos_token_tensor` there; the later steps read them here.

    Args:
        generation_config (`GenerationConfig`): the call's config.
        drafter (`D3DForDiffusionDrafting`): the assistant.
        keep (`bool`, defaults to `False`): when no check kept them (a step reached without it), resolve and keep
            them, for a step that runs inside `generate` (never on a config the caller owns and may reuse).

    Raises:
        ValueError: when they are resolved here, as `D3DGenerationOptions.resolve`.
    """
    kept = getattr(generation_config, CALL_OPTIONS_ATTRIBUTE, None)
    if isinstance(kept, D3DGenerationOptions):
        return kept
    if keep:
        return resolve_call_options(generation_config, drafter)
    return D3DGenerationOptions.resolve(generation_config, drafter)


def resolve_call_options(generation_config: Any, drafter: Any) -> D3DGenerationOptions:
    """Resolves the options of a `generate` call (`D3DGenerationOptions.resolve`) and keeps them on the call's
    `GenerationConfig` for its later steps (`call_options`)."""
    options = D3DGenerationOptions.resolve(generation_config, drafter)
    setattr(generation_config, CALL_OPTIONS_ATTRIBUTE, options)
    return options


def check_batch_options(options: D3DGenerationOptions, batch_size: int, padded: bool = False) -> None:
    """Refuses, before any forward pass, the options that the batched loop cannot run.

    Args:
        options (`D3DGenerationOptions`): the call's options.
        batch_size (`int`): sequences in the call.
        padded (`bool`, defaults to `False`): whether the prompts are padded (the batched loop runs them even for
            one sequence).

    Raises:
        ValueError: for a batch (or padded prompts) with a tree (`d3d_tree_budget`), `d3d_async=True`,
            `d3d_fused_drafting=True` or `d3d_decoding_loop="transformers"`, naming what to change.
    """
    if batch_size <= 1 and not padded:
        return
    what = f"a batch of {batch_size} prompts" if batch_size > 1 else "a padded prompt"
    if options.tree_budget is not None:
        raise ValueError(
            f"Tree verification (`d3d_tree_budget={options.tree_budget!r}`) decodes one sequence at a time, and this "
            f"call has {what}. Set `d3d_tree_budget=None` (batched chain rounds), or call `generate` once per "
            "unpadded prompt to verify trees."
        )
    if options.asynchronous is True:
        raise ValueError(
            f"Asynchronous drafting (`d3d_async=True`) decodes one sequence at a time, and this call has {what}. "
            "Drop `d3d_async=True` (batched rounds draft synchronously), or call `generate` once per unpadded prompt."
        )
    if options.fused_drafting is True:
        raise ValueError(
            f"Fused successor drafting (`d3d_fused_drafting=True`) decodes one sequence at a time, and this call has "
            f"{what}. Drop the option (a batch drafts with one pass per round), or call `generate` once per prompt."
        )
    if options.decoding_loop == "transformers":
        raise ValueError(
            f"transformers' assisted-generation loop decodes one sequence at a time, and this call has {what}. Drop "
            "`d3d_decoding_loop='transformers'` (D3D's own loop decodes batches), or call `generate` once per prompt."
        )


__all__ = [
    "ASSISTED_GENERATION_OPTIONS",
    "D3DGenerationOptions",
    "EXPERIMENTS_GROUP",
    "assisted_generation_options",
    "call_options",
    "check_batch_options",
    "check_option_names",
    "experiment",
    "nearest_option",
    "options_markdown_table",
    "parse_option_text",
    "resolve_call_options",
]
