"""Every patch D3D applies to a model from outside, with one patch helper (`Patches`): the fast paths of a `generate`
call (`apply_fast_paths`: the drafter's projection groups, LM head and attention, and the target's attention) and the
target's block rows of fused successor drafting (`block_rows_on_target`). The models' own forwards are the plain
path; each patch here is an instance-level replacement that the handle undoes, in reverse order, also on an
exception. (The library's experiments patch through the same helper: `d3d_hf.experiments`.)

Part of the self-contained remote-code bundle: imports only torch, the public transformers API and its siblings
(`adapters_d3d`, `fast_paths_d3d`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch
from torch import nn

from .adapters_d3d import D3DLinear
from .fast_paths_d3d import _SDPA_HAS_ENABLE_GQA, GQA_SDPA, matmul_layouts, project, register_gqa_sdpa


class Patches:
    """Instance-level replacements of attributes (a module's `forward`, a config's attention implementation) and
    registered hooks, undone in reverse order by `undo()` (idempotent) or on leaving the `with` block.

    Example:
        >>> with Patches() as patches:
        ...     patches.set(module, "forward", routed_forward)
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, obj, name: str, value) -> None:
        """Sets `obj.name = value` until `undo`, which restores what `obj` had: its own previous value, or none (the
        class's attribute shows through again); a property of the class is set back to its previous value."""
        if isinstance(inspect.getattr_static(type(obj), name, None), property):
            previous = getattr(obj, name)
            self._undo.append(lambda: setattr(obj, name, previous))
        elif name in vars(obj):
            previous = vars(obj)[name]
            self._undo.append(lambda: setattr(obj, name, previous))
        else:
            self._undo.append(lambda: vars(obj).pop(name, None))
        setattr(obj, name, value)

    def hook(self, handle) -> None:
        """Removes `handle` (a `torch.utils.hooks.RemovableHandle`) at `undo`."""
        self._undo.append(handle.remove)

    def undo(self) -> None:
        """Undoes every patch, the last first."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def switch_attention(patches: Patches, model: nn.Module) -> bool:
    r"""Switches a model on CPU whose attention is `"sdpa"` with grouped-query attention (a transformers target, or a
    D3D drafter) to `fast_paths_d3d.gqa_sdpa_attention_forward` until `patches` are undone: it is registered with
    transformers' `AttentionInterface` and `AttentionMaskInterface` as `GQA_SDPA` (with the `"sdpa"` mask function)
    and set as the config's `_attn_implementation`. Its forwards of more than one row outside autograd (draft passes,
    verifications) then no longer copy each layer's cached keys and values per query head, with bit-identical
    outputs; everything else runs transformers' own `"sdpa"` function. Other models, and models whose config has
    sub-configs (e.g. multimodal ones), are left alone.

    Returns:
        `bool`: whether the model's attention is on `GQA_SDPA` (switched now, or already).
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == GQA_SDPA:  # already switched: whoever did restores it
        return True
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    parameter = next(iter(model.parameters()), None)
    switch = (
        _SDPA_HAS_ENABLE_GQA
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and not getattr(config, "sub_configs", None)
        and isinstance(heads, int)
        and isinstance(kv_heads, int)
        and kv_heads < heads
        and parameter is not None
        and parameter.device.type == "cpu"
    )
    if switch:
        register_gqa_sdpa()
        patches.set(config, "_attn_implementation", GQA_SDPA)
    return switch


def route_projection_groups(patches: Patches, groups, rows_of: Callable) -> None:
    """Routes groups of projections that read one input (q/k/v, o, gate/up, down) through `fast_paths_d3d.project`
    until `patches` are undone.

    Each group is `(modules, projections, cache)`: `modules[i].forward` is replaced; the first module of a group
    computes the whole group with `project(projections, x, rows_of(x, *args), cache)` and hands the others their
    outputs (recognised by the very same input tensor); a later module called on another input computes its own.
    `modules` are the drafter's own `projections` (its fast paths) or the target's linears of the same weights
    (`block_rows_on_target`).
    """
    for modules, projections, cache in groups:
        handed: dict = {}
        for index, module in enumerate(modules):
            patches.set(module, "forward", _group_forward(projections, cache, index, handed, rows_of))


def _group_forward(projections: list[nn.Module], cache: dict, index: int, handed: dict, rows_of: Callable):
    def forward(x: torch.Tensor, *args) -> torch.Tensor:
        if index > 0:
            ready = handed.pop(index, None)
            if ready is not None and ready[0] is x:
                return ready[1]
            return project([projections[index]], x, rows_of(x, *args), {})[0]
        outputs = project(projections, x, rows_of(x, *args), cache)
        for later in range(1, len(projections)):
            handed[later] = (x, outputs[later])
        return outputs[0]

    forward.d3d_fast_path = True
    return forward


def drafter_projection_groups(drafter, target_layers=None) -> list[tuple[list[nn.Module], list[nn.Module], dict]]:
    """`(modules, drafter_projections, cache)` for every group of projections that read one input (q/k/v, o,
    gate/up, down) of every drafter layer; `modules` are the drafter's own, or with `target_layers` the target's
    modules of the same names in the layers the drafter's run; `cache` is the drafter's store of the group's derived
    weights (`FastPathSettings.group_cache`), so the target's forwards reuse the fused weights the drafter's passes
    built (no second copy)."""
    settings = drafter.model.fast_path_settings
    groups = []
    for index, layer in enumerate(drafter.model.layers):
        for parent, names in (
            ("self_attn", ("q_proj", "k_proj", "v_proj")),
            ("self_attn", ("o_proj",)),
            ("mlp", ("gate_proj", "up_proj")),
            ("mlp", ("down_proj",)),
        ):
            owner = layer.get_submodule(parent)
            own = [getattr(owner, name) for name in names]
            source = layer if target_layers is None else target_layers[index]
            theirs = [source.get_submodule(f"{parent}.{name}") for name in names]
            groups.append((theirs, own, settings.group_cache(f"layers.{index}.{parent}.{names[0]}")))
    return groups


def apply_fast_paths(drafter, target=None) -> Patches:
    r"""Routes `drafter` (and `target`'s attention) through the CPU fast paths of `fast_paths_d3d`, with the plain
    path's values, until the returned handle is undone (`handle.undo()`, or use it as a context manager). D3D's
    `generate` applies them for the call (`decoding_d3d`'s wrapper of `_assisted_decoding`, where a call starts),
    and `calibration_d3d.measure_cost_curves` for its draft passes. Idempotent: on a drafter whose fast paths are
    applied, it returns a handle with nothing to undo (the first handle restores them).

    - the drafter's projection groups (q/k/v, o, gate/up, down of each layer, when they are plain `D3DLinear`s, not
      e.g. PEFT-wrapped) run through `fast_paths_d3d.project` (`FusedProjections`, `add_block_adapters`,
      `MatmulLayouts`, as `drafter.model.fast_path_settings` says, read at each forward);
    - its LM head (a plain `nn.Linear`) runs on `MATMUL_LAYOUTS` while `autotune_matmuls` is on;
    - its attention, and `target`'s, switch to the copy-free grouped-query SDPA (`switch_attention`).

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        target (`PreTrainedModel`, *optional*): the target whose attention to switch (D3D's own loop only).

    Returns:
        `Patches`: the undo handle.
    """
    patches = Patches()
    model = drafter.model
    if not model.__dict__.get("fast_paths_applied", False):
        patches.set(model, "fast_paths_applied", True)
        settings = model.fast_path_settings
        last: dict = {}  # the `BlockRows` of the forward under way, by its gate (one per forward)

        def rows_of(x: torch.Tensor, block_gate: torch.Tensor | None = None, gated_input=None):
            key = (torch.is_grad_enabled(), x.dtype, x.device, settings.autotune_matmuls, settings.fused_projections)
            entry = last.get("entry")  # one tuple, replaced whole (a packed pass may run on a worker thread)
            if entry is not None and entry[0] is block_gate and entry[1] == key:
                return entry[2]
            rows = settings.block_rows(model, block_gate, x.device)
            last["entry"] = (block_gate, key, rows)
            return rows

        groups = drafter_projection_groups(drafter)
        route_projection_groups(patches, [g for g in groups if all(type(p) is D3DLinear for p in g[1])], rows_of)
        head = drafter.get_output_embeddings()
        if type(head) is nn.Linear:  # not a wrapped (e.g. PEFT) head

            def head_forward(x: torch.Tensor) -> torch.Tensor:
                if settings.autotune_matmuls:
                    return matmul_layouts().linear(x, head.weight, head.bias)
                return nn.functional.linear(x, head.weight, head.bias)

            patches.set(head, "forward", head_forward)
        switch_attention(patches, drafter)
    if target is not None:
        switch_attention(patches, target)
    return patches


def block_rows_on_target(target, drafter, start: int) -> Patches:
    r"""Until the returned handle is undone (a context manager), every forward of `target` treats its rows `start..`
    as the drafter's block rows: their input embedding is the drafter's mask embedding and each adapted projection
    adds the drafter's block adapter there (`out += scaling * (x A^T) B^T` on those rows only). The target's
    projections run the drafter's own projection path (`route_projection_groups`: the drafter's layers *are* the
    target's weights plus adapters): each group that reads one input (q/k/v, gate/up, and o, down alone) is one call
    of the drafter's `FusedProjections` `[W; A]` weight where the drafter runs those (`fused_projections`), and its
    `MatmulLayouts` with `autotune_matmuls`, so a block row costs what a plain row does (the forward hooks this
    replaced cost ~6 ms per block row in bfloat16: benchmarks/results/fused/rows_cost.md). The other rows are the
    target's own projections computed in one matmul with the adapter down-projection: the same values up to float
    rounding (tests/test_successor.py). Use only on a pair for which `successor_d3d.fused_drafting_unavailable` is
    `None`.

    Args:
        target (`PreTrainedModel`): the target.
        drafter (`D3DForDiffusionDrafting`): its weight-sharing drafter.
        start (`int`): the first block row of the forwards run while open.

    Returns:
        `Patches`: the undo handle.
    """
    model = drafter.model
    mask_vector = model.mask_token_embedding()
    rows_by_length: dict[tuple, object] = {}

    def rows_of(x: torch.Tensor, *args):
        key = (x.shape[0], x.shape[1], x.dtype, x.device)
        rows = rows_by_length.get(key)
        if rows is None:
            gate = torch.zeros((*x.shape[:2], 1), dtype=x.dtype, device=x.device)
            gate[:, start:] = 1
            rows = rows_by_length[key] = model.fast_path_settings.block_rows(model, gate, x.device)
        return rows

    def embed_hook(module, args, output):
        output[:, start:] = mask_vector.to(output.dtype)
        return output

    patches = Patches()
    try:
        patches.hook(target.get_input_embeddings().register_forward_hook(embed_hook))
        route_projection_groups(patches, drafter_projection_groups(drafter, decoder_layers(target)), rows_of)
    except BaseException:
        patches.undo()
        raise
    return patches


def decoder_layers(target) -> nn.ModuleList | None:
    """The decoder layers of a transformers causal LM (its decoder's `layers`), or `None`."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    return getattr(decoder, "layers", None)


@contextlib.contextmanager
def target_gqa_attention(model: nn.Module):
    """`switch_attention` as a context manager (benchmarks, tests). Yields whether the attention is switched."""
    with Patches() as patches:
        yield switch_attention(patches, model)


__all__ = [
    "Patches",
    "apply_fast_paths",
    "block_rows_on_target",
    "decoder_layers",
    "drafter_projection_groups",
    "route_projection_groups",
    "switch_attention",
    "target_gqa_attention",
]
