"""The experiments and ablations of D3D's generation options, which the library offers the remote-code bundle through
the `d3d.experiments` entry points (pyproject.toml; the bundle looks them up with `options_d3d.experiment` when a
call asks for one, and a checkpoint loaded with `trust_remote_code=True` alone refuses them, saying to install
d3d-hf). Each entry is named after its option's field:

- `target_matmul_layouts` (`d3d_target_matmul_layouts=True`): the target's linears on `MatmulLayouts`
  (`route_target_linears`, applied with the call's fast paths);
- `draft_passes` (`d3d_draft_passes=False`): the adaptive engine without its drafter (`without_draft_passes`);
- `worker_threads` (`d3d_worker_threads`, and `d3d_async=True` on CPU): the CPU worker thread of asynchronous
  drafting (`cpu_worker`);
- `share_target_cache` (`d3d_share_target_cache=False`) and `decoding_loop` (`d3d_decoding_loop="transformers"`):
  switches of the bundle's own code, offered here so that they run only where the library that measures them is
  installed (`ablation`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy

import torch
from torch import nn

from .modeling import fast_paths_d3d
from .modeling.fast_paths_d3d import MatmulLayouts
from .modeling.patches_d3d import Patches


def route_target_linears(
    patches: Patches, model: nn.Module, layouts: MatmulLayouts | None = None, min_rows: int = 2
) -> list[nn.Linear]:
    r"""Until `patches` are undone, every plain `nn.Linear` of `model` (a target; the LM head included) runs its
    forwards of `min_rows` to `MatmulLayouts.max_rows` rows outside autograd on CPU through `layouts` (the faster of
    `x W^T` and `(W x^T)^T` on this machine): D3D's opt-in `d3d_target_matmul_layouts` for the target's verification
    forwards (d3d-hf issue 14).

    Forwards of fewer rows (one-row decoding steps: default 2) and of more rows (the prompt's prefill) keep
    `nn.Linear`'s call, so a plain target step computes exactly what target-only decoding computes. A verification
    forward may round differently from `nn.Linear`'s multi-row kernel, as that one already rounds differently from
    the one-row kernel of target-only decoding; greedy output stays the target's own unless two logits tie within
    float rounding (checked on the bench prompts: docs/RESULTS.md, "The draft pass"). Modules that already have an
    instance-level `forward` (e.g. accelerate's hooks) and subclasses of `nn.Linear` (e.g. PEFT's or quantised
    layers) are left alone.

    Args:
        patches (`Patches`): the call's patches (`patches_d3d.apply_fast_paths`' handle).
        model (`nn.Module`): the model whose linears to route.
        layouts (`MatmulLayouts`, *optional*): the drafter's bundle's `MATMUL_LAYOUTS` (its timing marks count these
            calls); defaults to `d3d_hf.modeling`'s.
        min_rows (`int`, defaults to 2): the fewest rows that use `layouts`.

    Returns:
        `list[nn.Linear]`: the modules routed.
    """
    layouts = layouts if layouts is not None else fast_paths_d3d.MATMUL_LAYOUTS
    routed = [m for m in model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]
    for module in routed:
        patches.set(module, "forward", _LinearOnLayouts(module, layouts, min_rows))
    return routed


class _LinearOnLayouts:
    """A routed `nn.Linear.forward`: `layouts.linear` from `min_rows` rows, `nn.Linear`'s own call below."""

    def __init__(self, module: nn.Linear, layouts: MatmulLayouts, min_rows: int) -> None:
        self.module, self.layouts, self.min_rows = module, layouts, min_rows

    def __call__(self, x):
        module = self.module
        if x.numel() < self.min_rows * x.shape[-1]:  # fewer rows: `nn.Linear`'s own call
            return nn.functional.linear(x, module.weight, module.bias)
        return self.layouts.linear(x, module.weight, module.bias)


@contextlib.contextmanager
def target_matmul_layouts(model: nn.Module, min_rows: int = 2):
    """`route_target_linears` as a context manager on the process's `MATMUL_LAYOUTS` (benchmarks, tests): yields the
    modules routed and restores them when it closes, also on an exception."""
    with Patches() as patches:
        yield route_target_linears(patches, model, None, min_rows)


_LOOKUP_ONLY_POLICIES: dict = {}


def without_draft_passes(policy, key: str):
    """The process's drafter-less twin of the calibrated `policy` (`d3d_draft_passes=False`): a copy made when first
    asked for, with no draft curve (so a draft pass is never an option), that then learns on its own.

    Args:
        policy (`DraftPolicy`): the calibrated policy of the (target, drafter) pair.
        key (`str`): its calibration key (one twin per key).
    """
    twin = _LOOKUP_ONLY_POLICIES.get(key)
    if twin is None:
        twin = _LOOKUP_ONLY_POLICIES[key] = copy.deepcopy(policy)
        twin.draft_curve = None
    return twin


_EXECUTORS: dict[int, concurrent.futures.ThreadPoolExecutor] = {}


def cpu_worker(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The worker thread that runs packed passes on CPU (`d3d_async=True` there; `d3d_worker_threads`) with `threads`
    torch intra-op threads (torch ops release the GIL); one per thread count, created once
    (`runtime_d3d.PackedPassWorker` submits to it).

    torch's thread count is per OS thread once a thread has run torch ops, but `torch.set_num_threads` also sets the
    default that threads created later start with. So the new worker sets its own count first, and the caller, once
    that is done, sets its own (unchanged) count again, which puts the default back; no pass changes it afterwards.
    """
    if threads not in _EXECUTORS:
        executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"d3d-packed-draft-{threads}"
        )
        executor.submit(_set_worker_threads, threads).result()
        torch.set_num_threads(torch.get_num_threads())
        _EXECUTORS[threads] = executor
    return _EXECUTORS[threads]


def _set_worker_threads(threads: int) -> None:
    # torch initialises a thread's count from the process default on the thread's first parallel op; doing that
    # before setting it keeps the later reset of the default (by the caller) from overriding this thread's count
    torch.get_num_threads()
    torch.set_num_threads(threads)


def ablation() -> bool:
    """The entry of an option that only switches the bundle's own code (`d3d_share_target_cache=False`,
    `d3d_decoding_loop="transformers"`): its presence is what the bundle asks for."""
    return True


__all__ = ["ablation", "cpu_worker", "route_target_linears", "target_matmul_layouts", "without_draft_passes"]
