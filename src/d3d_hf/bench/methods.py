"""The benchmark's method registry: `BenchMethod`, `METHODS` and `register_method`, the methods d3d-hf registers
(`target`, `pld`, `ar-assist`, `d3d` and its variants), and the checks of a method list against the resources."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..modeling.options_d3d import D3DGenerationOptions
from .recording import RoundRecorder, RoundStats, d3d_round_stats


@dataclass(frozen=True)
class BenchMethod:
    """One decoding method of the benchmark (an entry of `METHODS`).

    Attributes:
        name (`str`): the method's name (`--methods`).
        description (`str`): one line for tables and `--help`.
        generate_kwargs (`Callable[[Mapping], dict]`): given the resources (drafter, assistant, settings), the
            extra keyword arguments of `target.generate` (greedy decoding, `max_new_tokens` and the attention mask
            are added by the harness).
        read_stats (`Callable[[Mapping, RoundRecorder], RoundStats]`, *optional*): reads the per-round statistics
            after the call; `None` for plain decoding (one round per token, nothing split).
        requires (`tuple[str, ...]`): resource names that must be given (e.g. `("drafter",)`).
        settings (`Callable[[Mapping], dict]`, *optional*): method settings to record in the results.
        cost_model (`str`, *optional*): which speed-up formula of `d3d_hf.costmodel` predicts this method:
            `"sync"` (D3D drafter timings), `"async"` (D3D timings and the hit rate), `"rounds"` (the measured
            draft time per round), or `None` (no prediction).
        batches (`bool`, defaults to `False`): whether one `generate` call decodes a left-padded batch of prompts
            (`run_benchmark(batch_size > 1)`); otherwise a batch's prompts run one at a time.
    """

    name: str
    description: str
    generate_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]]
    read_stats: Callable[[Mapping[str, Any], RoundRecorder], RoundStats] | None = None
    requires: tuple[str, ...] = ()
    settings: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    cost_model: str | None = None
    batches: bool = False


def _assistant_settings(resources: Mapping[str, Any]) -> dict[str, Any]:
    assistant = resources["assistant"]
    gen = assistant.generation_config
    defaults = {
        "num_assistant_tokens": 20,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.4,
    }  # transformers 5.24 defaults when unset
    out = {k: getattr(gen, k, None) if getattr(gen, k, None) is not None else v for k, v in defaults.items()}
    out.update(
        assistant=resources.get("assistant_name") or getattr(assistant, "name_or_path", None),
        assistant_layers=getattr(assistant.config.get_text_config(), "num_hidden_layers", None),
        assistant_parameters=sum(p.numel() for p in assistant.parameters()),
    )
    return out


def _d3d_settings(resources: Mapping[str, Any]) -> dict[str, Any]:
    """A D3D method's recorded settings: the drafter, and the options and overrides of its last call as the
    generator resolved them (`D3DGenerationOptions`, `D3DGenerationStats.overrides`)."""
    drafter = resources["drafter"]
    stats = getattr(drafter, "last_generation_stats", None)
    options = getattr(stats, "options", None) or D3DGenerationOptions.resolve(None, drafter)
    return {
        "drafter": resources.get("drafter_name"),
        "block_size": drafter.config.block_size,
        "drafter_layers": drafter.config.num_hidden_layers,
        "num_drafts": getattr(stats, "policy", None),
        "prompt_lookup": options.prompt_lookup,
        "asynchronous": getattr(stats, "asynchronous", None),
        "options": options.to_dict(),
        "overrides": dict(getattr(stats, "overrides", {}) or {}),
        # the cost curves the adaptive engine decided with, as they stood at the last call's start (ms by rows)
        "cost_curves_ms": getattr(stats, "cost_curves_ms", None),
    }


METHODS: dict[str, BenchMethod] = {}
"""The method registry: name -> `BenchMethod`, in table order (`list(METHODS)` gives the names)."""

DEFAULT_METHODS = ("target", "d3d")
"""Methods `run_benchmark` runs when none are given."""

RESOURCE_HINTS = {"drafter": "--drafter DIR", "assistant": "--assistant ar-smollm2-135m-instruct (shipped) or DIR"}
"""How a user supplies each resource on the command line (for error messages)."""


def register_method(method: BenchMethod, overwrite: bool = False) -> BenchMethod:
    """Adds `method` to `METHODS`.

    Raises:
        ValueError: if a method of that name exists and `overwrite` is `False`.
    """
    if method.name in METHODS and not overwrite:
        raise ValueError(f"A benchmark method named {method.name!r} is already registered.")
    METHODS[method.name] = method
    return method


register_method(BenchMethod("target", "target alone (greedy generate)", lambda r: {}, batches=True))
register_method(
    BenchMethod(
        "pld",
        "transformers prompt-lookup decoding",
        lambda r: {
            "prompt_lookup_num_tokens": int(r.get("prompt_lookup_num_tokens", 10)),
            "max_matching_ngram_size": int(r.get("max_matching_ngram_size", 2)),
        },
        read_stats=lambda r, recorder: recorder.stats(),
        settings=lambda r: {
            "prompt_lookup_num_tokens": int(r.get("prompt_lookup_num_tokens", 10)),
            "max_matching_ngram_size": int(r.get("max_matching_ngram_size", 2)),
        },
        cost_model="rounds",
    )
)
register_method(
    BenchMethod(
        "ar-assist",
        "transformers assisted generation, autoregressive assistant",
        lambda r: {"assistant_model": r["assistant"]},
        read_stats=lambda r, recorder: recorder.stats(),
        requires=("assistant",),
        settings=_assistant_settings,
        cost_model="rounds",
    )
)
register_method(
    BenchMethod(
        "d3d",
        "D3D drafting (the cost-aware engine; `num_drafts` fixes the drafts per round)",
        lambda r: _d3d_kwargs(r),
        read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
        requires=("drafter",),
        settings=_d3d_settings,
        cost_model="sync",
        batches=True,
    )
)


#: the options each D3D method takes from the resources (the command line's flags, by field name)
_METHOD_OPTIONS = {
    "d3d": ("num_drafts", "prompt_lookup"),
    "d3d-async": ("num_drafts", "num_hypotheses", "reuse_on_miss", "worker_threads"),
    "d3d-tree": ("num_drafts", "prompt_lookup", "tree_budget", "tree_branching"),
}


def _given_options(resources: Mapping[str, Any], method: str) -> dict[str, Any]:
    """`{generate name: value}` of the declared options that `method` takes and the resources give."""
    names = {f.name: f.metadata["option"] for f in D3DGenerationOptions.option_fields()}
    return {
        names[name]: resources[name] for name in _METHOD_OPTIONS[method] if resources.get(name) is not None
    }


def _d3d_kwargs(resources: Mapping[str, Any]) -> dict[str, Any]:
    return _d3d_kwargs_with(resources)


def _tree_budget(resources: Mapping[str, Any]) -> int | str:
    """`d3d_tree_budget` of the `d3d-tree` method (`--tree-budget`): a node count (default 16) or "adaptive"."""
    value = resources.get("tree_budget") or 16
    return int(value) if str(value).isdigit() else str(value)


def _d3d_kwargs_with(resources: Mapping[str, Any], method: str = "d3d", **options: Any) -> dict[str, Any]:
    """`generate` arguments of a D3D method: the drafter and the options the method takes from the resources,
    plus `options`, as keyword arguments of `generate` (the hook moves them into the call's config)."""
    return {"assistant_model": resources["drafter"], **_given_options(resources, method), **options}


def _d3d_tree_kwargs(resources: Mapping[str, Any]) -> dict[str, Any]:
    return _d3d_kwargs_with(resources, "d3d-tree", d3d_tree_budget=_tree_budget(resources))


def _d3d_tree_settings(resources: Mapping[str, Any]) -> dict[str, Any]:
    return {**_d3d_settings(resources), "tree_budget": _tree_budget(resources)}


def _d3d_async_settings(resources: Mapping[str, Any]) -> dict[str, Any]:
    settings = _d3d_settings(resources)
    options = settings["options"]
    stats = getattr(resources["drafter"], "last_generation_stats", None)
    return {
        **settings,
        "hypotheses": options["d3d_num_hypotheses"],
        "reuse_on_miss": options["d3d_reuse_on_miss"],
        "worker_threads": getattr(stats, "worker_threads", None) or options["d3d_worker_threads"],
    }


def _d3d_async_kwargs(resources: Mapping[str, Any]) -> dict[str, Any]:
    # `d3d_async=True`: the packed pass runs on every device (on CPU with one warning per process)
    return _d3d_kwargs_with(resources, "d3d-async", d3d_async=True)


register_method(
    BenchMethod(
        "d3d-async",
        "asynchronous D3D drafting (packed successor blocks during verification)",
        _d3d_async_kwargs,
        read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
        requires=("drafter",),
        settings=_d3d_async_settings,
        cost_model="async",
    )
)


register_method(
    BenchMethod(
        "d3d-tree",
        "D3D with tree verification in D3D's own loop (best-first draft trees; `tree_budget` nodes at most)",
        _d3d_tree_kwargs,
        read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
        requires=("drafter",),
        settings=_d3d_tree_settings,
        cost_model="sync",
    )
)


def _register_d3d_variant(name: str, description: str, **options: Any) -> None:
    """Registers a synchronous D3D method that is `d3d` with extra `GenerationConfig` options (an ablation or an
    opt-in): same statistics, settings and cost model."""
    register_method(
        BenchMethod(
            name,
            description,
            lambda r: _d3d_kwargs_with(r, **options),
            read_stats=lambda r, recorder: d3d_round_stats(r["drafter"].last_generation_stats),
            requires=("drafter",),
            settings=_d3d_settings,
            cost_model="sync",
            batches=True,
        )
    )


_register_d3d_variant(
    "engine-lookup",
    "the default D3D engine with its drafter never drafting (plain target steps and the engine's sized prompt-lookup "
    "rounds, same calibration): what `d3d` adds over it is the drafter's contribution",
    d3d_draft_passes=False,
)
_register_d3d_variant(
    "d3d-no-fused",
    "the default D3D engine with fused successor drafting off (every drafter round runs its own draft pass): what "
    "`d3d` adds over it is what drafting inside the verifications adds",
    d3d_fused_drafting=False,
)
_register_d3d_variant(
    "d3d-fused",
    "the default D3D engine with fused successor drafting forced on (`d3d_fused_drafting=True`; its default 'auto' "
    "is off on CPU): the next round's block drafted inside each verification where the policy places one",
    d3d_fused_drafting=True,
)
_register_d3d_variant(
    "d3d-own-cache",
    "D3D (chain rounds) with the drafter's own cache: committed tokens re-run by the drafter (the ablation of "
    "`d3d_share_target_cache`)",
    d3d_share_target_cache=False,
)
_register_d3d_variant(
    "d3d-target-layouts",
    "D3D with the target's verification forwards on the faster matmul layout of the machine "
    "(`d3d_target_matmul_layouts=True`; CPU)",
    d3d_target_matmul_layouts=True,
)


def unknown_methods(methods: Sequence[str]) -> list[str]:
    """The names in `methods` that are not registered in `METHODS`, in the order given."""
    return [m for m in methods if m not in METHODS]


def missing_resource(methods: Sequence[str], resources: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first `(method, resource)` such that a (registered) method of `methods` requires a resource that
    `resources` lacks (absent or `None`), in the order of `methods` and of each method's `requires`; `None` when
    every method has what it needs."""
    for m in methods:
        for name in METHODS[m].requires:
            if resources.get(name) is None:
                return m, name
    return None


def _check_methods(methods: Sequence[str], resources: Mapping[str, Any]) -> list[str]:
    unknown = unknown_methods(methods)
    if unknown:
        raise ValueError(f"Unknown method(s) {unknown}; choose from {list(METHODS)}.")
    missing = missing_resource(methods, resources)
    if missing is not None:
        m, name = missing
        hint = f" (`{RESOURCE_HINTS[name]}`)" if name in RESOURCE_HINTS else ""
        raise ValueError(f"Method `{m}` needs a {name}{hint}.")
    return ["target"] + [m for m in dict.fromkeys(methods) if m != "target"]


__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "RESOURCE_HINTS",
    "BenchMethod",
    "missing_resource",
    "register_method",
    "unknown_methods",
]
