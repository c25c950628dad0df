"""How a CPU runs the draft passes' (and the target's verifications') linears and attention fast, with the same
values as the plain path (d3d-hf issue 14; measured in benchmarks/results/engine/draft_pass.md):

- attention: `gqa_sdpa_attention_forward` (grouped-query SDPA without copying keys/values per query head), registered
  with transformers as `GQA_SDPA` when a model is switched to it (`patches_d3d.switch_attention`);
- matmuls: `MatmulLayouts` (the process-wide `MATMUL_LAYOUTS`) times equivalent layouts of `x W^T` per shape and
  row count and keeps the fastest; `MatmulLayouts.mark` answers whether any matmul was timed since;
- projections: `project` runs the projections of a layer that read the same input by the cheapest path that applies
  (`FusedProjections`, `add_block_adapters`, or each `D3DLinear` itself) on the `BlockRows` of a forward;
- `FastPathSettings`: a drafter's switches of these paths (`autotune_matmuls`, `fused_projections`) and the derived
  weights they hold (`D3DModel.fast_path_settings`; `D3DModel`'s properties of the same names forward to it).

The model's layers call plain linears; `patches_d3d.apply_fast_paths` routes them through these paths from outside.

Part of the self-contained remote-code bundle: imports only the Python standard library, torch, the public
transformers API and the block adapter (`adapters_d3d`).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .adapters_d3d import D3DLinear

_SDPA_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def gqa_sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    r"""transformers' `"sdpa"` attention function, except that outside autograd on CPU grouped-query attention runs
    `torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)` on the `H_kv` key/value heads instead
    of copying them `H / H_kv` times first (transformers' `repeat_kv`, which its CPU path does for queries of more
    than one row; one row it already runs without the copy, and that call is kept). Same kernel, same values:
    bit-identical outputs in the checks of tests/test_fast_paths.py. It saves the copy of every layer's cached keys
    and values in each draft pass (measured on an AMD EPYC, 2 threads, SmolLM2-135M's 9 query / 3 key-value heads,
    258 keys: 134-285 us -> 78-186 us per layer in bfloat16, 178-298 -> 73-175 us in float32 for 2-16 query rows;
    d3d-hf issue 14, benchmarks/results/engine/draft_pass.md).

    Args:
        module (`nn.Module`): the attention layer (its `num_key_value_groups`, `H / H_kv`).
        query (`torch.Tensor` of shape `(B, H, T, D)`), key and value (`(B, H_kv, S, D)`).
        attention_mask (`torch.BoolTensor` of shape `(B, 1, T, S)`, *optional*): `True` where a query may attend.
        dropout (`float`), scaling (`float`, *optional*), is_causal (`bool`, *optional*): as transformers' function.

    Returns:
        `(torch.Tensor of shape (B, T, H, D), None)`.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    fast = _SDPA_HAS_ENABLE_GQA and groups > 1 and query.device.type == "cpu" and not torch.is_grad_enabled()
    fast = fast and query.shape[2] > 1  # one query row: transformers already runs it copy-free (its `pack_gqa`)
    # a boolean mask (D3D's passes, the target's forwards over a cache) and nothing that transformers' function would
    # fold into it: otherwise that function, whose causal and position-bias handling this one does not repeat
    fast = fast and attention_mask is not None and attention_mask.dtype == torch.bool and not dropout
    if not fast or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


@dataclass
class BlockRows:
    """The rows of one forward where the block adapters apply (`D3DModel.forward` builds it once per forward).

    Attributes:
        gate (`torch.Tensor` of shape `(batch_size, seq_len, 1)` or `None`): 1 at block rows, 0 elsewhere, in the
            hidden dtype; `None` for a forward without block rows (then only `layouts` counts)
        fused (`bool`): whether the decoder layers run `FusedProjections` (outside autograd) in this forward.
        layouts (`MatmulLayouts` or `None`): what runs the projections' matmuls outside autograd
            (`D3DModel.autotune_matmuls`); `None`: `nn.functional.linear`.
        start (`int` or `None`): when the block rows are exactly rows `start..seq_len-1` of every sequence (every
            synchronous draft pass: committed tokens first, then the masks), their first row; `None` otherwise.
            Then the adapters run on those rows only instead of on gated copies of all rows (same values, less work).
    """

    gate: torch.Tensor | None
    start: int | None = None
    fused: bool = False
    layouts: MatmulLayouts | None = None

    @classmethod
    def of(
        cls,
        block_positions: torch.BoolTensor,
        dtype: torch.dtype,
        fused: bool = False,
        layouts: MatmulLayouts | None = None,
    ) -> BlockRows:
        """Builds the rows from a `(batch_size, seq_len)` boolean mask. The suffix test reads the mask on the host,
        so it is made only for CPU tensors outside autograd (elsewhere `start` stays `None`: no device sync).
        `fused`: whether this forward runs the fused projection weights (`D3DModel.fused_projections`); `layouts`:
        the `MatmulLayouts` that run its projections' matmuls (`D3DModel.autotune_matmuls`), `None` for
        `nn.functional.linear`."""
        gate = block_positions[..., None].to(dtype)
        start = None
        if block_positions.device.type == "cpu" and not torch.is_grad_enabled():
            seq_len = block_positions.shape[1]
            counts = block_positions.sum(-1)
            count = int(counts[0])
            if bool((counts == count).all()) and bool(block_positions[:, seq_len - count :].all()):
                start = seq_len - count
        return cls(gate, start, fused, layouts)

    @classmethod
    def of_gate(cls, gate: torch.Tensor, fused: bool = False, layouts: MatmulLayouts | None = None) -> BlockRows:
        """`of` for the gate a forward hands its projections (`(batch_size, seq_len, 1)`, 1 at block rows)."""
        rows = cls.of(gate[..., 0] != 0, gate.dtype, fused, layouts)
        rows.gate = gate
        return rows


def add_block_adapters(
    projections: list[D3DLinear], x: torch.Tensor, outputs: list[torch.Tensor], rows: BlockRows, cache: dict
) -> None:
    """Adds the block adapters of `projections`, which all read the same input `x`, to their base outputs in place.

    The fused inference path of `D3DLinear`'s adapter (the same values up to float rounding; checked in
    tests/test_fast_paths.py against the per-projection path): one matmul with the stacked `lora_A` of all the
    projections (q/k/v, or gate/up) instead of one each, then one `baddbmm_` per projection that multiplies by `lora_B`
    and adds into the output (no separate add), on the block rows only when they are a suffix (`rows.start`).
    Only for use outside autograd (in-place updates); `cache` holds the stacked weights between calls, keyed by the
    parameters' storage and version counters, so an optimiser step or a `.to()` rebuilds them.

    Args:
        projections (`list[D3DLinear]`): the projections (those with `rank == 0` are skipped; the others have
            `config.block_lora_rank`, or full ranks that differ by projection in `block_lora_full_layers`).
        x (`torch.Tensor` of shape `(batch_size, seq_len, in_features)`): their common input.
        outputs (`list[torch.Tensor]`): their base outputs `x W^T + b`, `(batch_size, seq_len, out_features_i)`.
        rows (`BlockRows`): where the adapters apply.
        cache (`dict`): the caller's store for the stacked weights (one per group of projections).
    """
    pairs = [(proj, out) for proj, out in zip(projections, outputs, strict=True) if proj.rank > 0]
    if not pairs:
        return
    projections, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    if rows.start is not None:
        if rows.start >= x.shape[1]:
            return  # no block rows (a pass with no masks)
        x = x[:, rows.start :]
    else:
        x = x * rows.gate
    key = _weights_key(projections, x)
    if cache.get("key") != key:
        cache["key"] = key
        cache["At"] = torch.cat([proj.lora_A for proj in projections]).t().to(x.dtype)
        cache["Bt"] = [proj.lora_B.t().to(x.dtype) for proj in projections]
    ends = list(itertools.accumulate(proj.rank for proj in projections))  # ranks differ in full-rank layers
    if x.shape[0] == 1:  # 2-D matmuls: the common case, and cheaper than batched ones for a few rows
        down = torch.mm(x[0], cache["At"])
        for i, (proj, out) in enumerate(pairs):
            rows_out = out[0] if rows.start is None else out[0, rows.start :]
            rows_out.addmm_(down[:, ends[i] - proj.rank : ends[i]], cache["Bt"][i], alpha=proj.lora_scaling)
        return
    down = torch.matmul(x, cache["At"])
    for i, (proj, out) in enumerate(pairs):
        rows_out = out if rows.start is None else out[:, rows.start :]
        b_t = cache["Bt"][i].expand(x.shape[0], -1, -1)
        rows_out.baddbmm_(down[..., ends[i] - proj.rank : ends[i]], b_t, alpha=proj.lora_scaling)


def _weights_key(modules: list[nn.Module], x: torch.Tensor) -> tuple:
    """What weights derived from the parameters of `modules` (for inputs like `x`) are valid for: each parameter's
    storage and version counter (an optimiser step, `.to()`, an in-place edit or a replaced parameter changes them),
    and `x`'s dtype and device. Reads the modules' parameter dicts directly (`nn.Module.__getattr__` is slow, and this
    runs for every projection group of every draft pass). Inference tensors (made under `torch.inference_mode()`)
    keep no version counter: for them the storage alone counts."""
    params = [p for m in modules for p in m._parameters.values() if p is not None]
    try:
        return (*((p.data_ptr(), p._version) for p in params), x.dtype, x.device)
    except RuntimeError:  # an inference tensor
        return (*((p.data_ptr(), -1 if p.is_inference() else p._version) for p in params), x.dtype, x.device)


class MatmulLayouts:
    r"""Chooses, on this machine, the fastest of equivalent ways to compute `x W^T + b` for an `x` of a few rows:
    `nn.Linear`'s `x W^T`, `(W x^T)^T`, and, for bfloat16/float16 where oneDNN runs them, `x W^T` on a copy of `W`
    prepacked once into oneDNN's blocked layout (`"packed"`), by timing them on real calls ("explore, then commit",
    the idea of Triton's and `torch.compile`'s autotuning, without a separate benchmark run).

    All read the same weight values and give the same results up to float rounding (the packed product is oneDNN's
    own `x W^T` kernel without the per-call weight reorder: bit-identical to `nn.functional.linear` in the checks of
    tests/test_matmul_layouts.py), but libraries pick different kernels for them. Measured on an AMD EPYC (Zen 4,
    AVX-512-BF16, no AMX, MKL 2024.2 / oneDNN 3.12, 2 threads; d3d-hf issue 14, benchmarks/results/engine/): float32
    with 2-4 rows ran 1.3-5x faster as `W x^T` (the tied LM head of SmolLM2, 2 rows: 25.5 ms against 6.3 ms), 6-16
    rows either way by shape; bfloat16 up to 50% faster as `x W^T` than as `W x^T`, and `x W^T` on prepacked weights
    25-60% faster still (the LM head, 8 rows: 6.7 ms against 2.7 ms in a draft pass). Other CPUs and libraries differ,
    hence the measurement. Used outside autograd on CPU for at most `max_rows` rows (the draft passes:
    `FusedProjections`, the drafter's projections and LM head; the target's forwards under `target_matmul_layouts`);
    everything else runs `nn.functional.linear`.

    The choice is made per `(weight shape, rows, dtype, bias, threads)` from the first `n * (samples + 1)` calls with
    that key (`n` candidates in turn, every result used; the first call of each is not counted, as it may pay
    one-time costs such as oneDNN building its kernel for the shape; packing a weight is done outside the clock, as
    the calls with one key run many weights, e.g. every layer's q/k/v), by the median times
    (`margin`), and kept for the process (`choices`). A call on a chosen layout costs about 2 us of Python more than
    `nn.functional.linear`. A packed copy costs the memory of its weight (`packed_bytes`); it is kept while its weight
    lives and is unchanged (its version counter), and dropped as soon as no key of its shape uses or times it.

    Attributes:
        max_rows (`int`, defaults to 32): inputs with more rows always run `x W^T`.
        samples (`int`, defaults to 3): counted calls per layout before the choice.
        margin (`float`, defaults to 0.1): another layout is chosen only when its median time is at least this fraction
            below `x W^T`'s (timing noise must not move a shape off `nn.Linear`'s call for nothing).
        clock (`Callable[[], float]`, defaults to `time.perf_counter`): the timer (seconds).
        choices (`dict`): key -> `"x W^T"`, `"W x^T"` or `"packed"`, the layouts chosen so far.
    """

    LAYOUTS = ("x W^T", "W x^T")
    PACKED = "packed"

    def __init__(
        self,
        max_rows: int = 32,
        samples: int = 3,
        margin: float = 0.1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_rows, self.samples, self.margin, self.clock = max_rows, samples, margin, clock
        self.choices: dict[tuple, str] = {}
        self._trials: dict[tuple, tuple[list[float], ...]] = {}
        self._timed_calls = 0
        self._packed = WeakIdKeyDictionary()  # weight -> (its version, its oneDNN-packed copy)

    @staticmethod
    def candidates(dtype: torch.dtype) -> tuple[str, ...]:
        """The layouts timed for inputs of `dtype`: `LAYOUTS`, plus `PACKED` for bfloat16 and float16 where this
        build of torch runs them on oneDNN with native support on this CPU (and has oneDNN's private prepacking
        ops, which `torch.compile`'s CPU backend uses)."""
        mkldnn = torch.backends.mkldnn
        supported = {
            torch.bfloat16: getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None),
            torch.float16: getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None),
        }.get(dtype)
        ops = all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise"))
        if supported is not None and ops and mkldnn.is_available() and mkldnn.enabled and supported():
            return (*MatmulLayouts.LAYOUTS, MatmulLayouts.PACKED)
        return MatmulLayouts.LAYOUTS

    def packed_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` reordered into oneDNN's blocked layout for `x W^T` (`torch.ops.mkldnn._reorder_linear_weight`,
        the weight prepacking of `torch.compile`'s CPU freezing pass), made on the first call and kept while `weight`
        lives and is unchanged (its version counter; an inference tensor keeps none, then its storage counts).

        Args:
            weight (`torch.Tensor` of shape `(out_features, in_features)`, bfloat16 or float16, on CPU).

        Returns:
            `torch.Tensor`: an opaque oneDNN tensor (`layout == torch._mkldnn`) with `weight`'s shape and dtype.
        """
        try:
            version = weight._version
        except RuntimeError:  # an inference tensor
            version = weight.data_ptr()
        entry = self._packed.get(weight)
        if entry is None or entry[0] != version:
            self._packed.pop(weight, None)  # free the stale copy first
            entry = self._packed[weight] = (version, torch.ops.mkldnn._reorder_linear_weight(weight.detach()))
        return entry[1]

    @property
    def packed_bytes(self) -> int:
        """Bytes held now by packed weight copies (each is the size of its weight)."""
        return sum(packed.numel() * packed.element_size() for _, packed in self._packed.values())

    def release_packed(self, weights) -> None:
        """Drops the packed copies of `weights` (an iterable of tensors; those without one are skipped), e.g. when a
        model stops using the layouts (`D3DModel.autotune_matmuls = False`). A later packed call packs afresh."""
        for weight in weights:
            self._packed.pop(weight, None)

    def _release_packed(self) -> None:
        """Drops the packed copies that no key uses or is timing (keys are per weight shape and dtype)."""
        needed = {(k[0], k[2]) for k, layout in self.choices.items() if layout == self.PACKED}
        needed |= {(k[0], k[2]) for k in self._trials}
        for weight in [w for w in self._packed.keys() if (w.shape, w.dtype) not in needed]:
            self._packed.pop(weight, None)

    def _run(self, layout: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layout == "x W^T":
            return nn.functional.linear(x, weight, bias)
        if layout == self.PACKED:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(weight), bias, "none", [], "")
        # contiguous like `x W^T`'s result: what reads it next (e.g. SDPA's flash kernel) depends on the strides
        if bias is None:
            return torch.mm(weight, x.t()).t().contiguous()
        return torch.addmm(bias[:, None], weight, x.t()).t().contiguous()

    def settled(self) -> bool:
        """Whether no key is still being timed."""
        return not self._trials

    @property
    def timed_calls(self) -> int:
        """Calls so far that ran while their key was being timed (a call that leaves it unchanged ran only on
        chosen layouts)."""
        return self._timed_calls

    def mark(self) -> LayoutMark:
        """A mark in this object's timing: `mark.timed()` says whether any matmul was timed since (a forward that
        timed candidate layouts ran some matmuls slower than it will from then on, so its time is not learned)."""
        return LayoutMark(self, self._timed_calls)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T + b` (`nn.functional.linear`'s values) by the layout chosen for this key, timing the candidates
        while none is chosen.

        Args:
            x (`torch.Tensor` of shape `(..., in_features)`): the input; its leading dimensions together are the rows.
            weight (`torch.Tensor` of shape `(out_features, in_features)`), bias (`(out_features,)`, *optional*): in
                `x`'s dtype.

        Returns:
            `torch.Tensor` of shape `(..., out_features)`, contiguous, in `x`'s dtype.
        """
        if torch.is_grad_enabled() or x.device.type != "cpu":
            return nn.functional.linear(x, weight, bias)
        rows = math.prod(x.shape[:-1])
        if rows > self.max_rows or rows == 0:
            return nn.functional.linear(x, weight, bias)
        key = (weight.shape, rows, x.dtype, bias is not None, torch.get_num_threads())
        layout = self.choices.get(key)
        if layout == "x W^T":  # the common case first, with the least Python in the way
            return nn.functional.linear(x, weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        if layout is None:
            layouts = self.candidates(x.dtype)
            trials = self._trials.setdefault(key, tuple([] for _ in layouts))
            which = min(range(len(layouts)), key=lambda i: len(trials[i]))  # in turn
            if layouts[which] == self.PACKED:
                self.packed_weight(weight)  # a one-time cost per weight (a key's weights: e.g. every layer's q/k/v)
            start = self.clock()
            out = self._run(layouts[which], flat, weight, bias)
            trials[which].append(self.clock() - start)
            self._timed_calls += 1
            if min(len(t) for t in trials) > self.samples:  # the first call of each is not counted
                medians = [statistics.median(t[1:]) for t in trials]
                best = min(range(1, len(layouts)), key=medians.__getitem__)
                self.choices[key] = layouts[best] if medians[best] < (1.0 - self.margin) * medians[0] else "x W^T"
                self._trials.pop(key, None)
                if self._packed:
                    self._release_packed()
        else:
            out = self._run(layout, flat, weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])


@dataclass(frozen=True)
class LayoutMark:
    """A point in a `MatmulLayouts`' timing (`MatmulLayouts.mark`)."""

    layouts: MatmulLayouts
    calls: int

    def timed(self) -> bool:
        """Whether a matmul was timed (ran on a candidate layout) since the mark."""
        return self.layouts.timed_calls != self.calls

    def learned(self, seconds: float | None) -> float | None:
        """`seconds` of what ran since the mark, or `None` when it timed candidate layouts (not to be learned)."""
        return None if self.timed() else seconds


MATMUL_LAYOUTS = MatmulLayouts()
"""The process's layout choices (a property of the machine, shared by every drafter)."""


def matmul_layouts() -> MatmulLayouts:
    """The process's `MATMUL_LAYOUTS` (read when called)."""
    return MATMUL_LAYOUTS


def layout_mark() -> LayoutMark:
    """`MATMUL_LAYOUTS.mark()`: the one query of whether the process's matmul layouts were still being timed over
    a stretch of work (`mark.timed()`, `mark.learned(seconds)` at its end)."""
    return MATMUL_LAYOUTS.mark()


GQA_SDPA = "d3d_gqa_sdpa"
"""The name under which `register_gqa_sdpa` registers `gqa_sdpa_attention_forward` with transformers."""


def register_gqa_sdpa() -> None:
    """Registers `gqa_sdpa_attention_forward` with transformers' `AttentionInterface` (and the `"sdpa"` mask function
    with its `AttentionMaskInterface`) as `GQA_SDPA` (`patches_d3d.switch_attention` does before switching)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention_forward)
    AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


class FusedProjections:
    r"""One weight for the projections of a layer that read the same input, with their block adapters folded in:
    the inference layout of `D3DModel.fused_projections` (d3d-hf issue 14: bring a draft pass's cost to the target's
    own forward over the same rows).

    For projections `W_1..W_n` (q/k/v, or gate/up, or one of o/down) with adapters `(A_i, B_i, s_i)`, `weight` is
    `[W_1; ..; W_n; A_1; ..; A_n]` (the adapters' down-projections stacked below the base rows, the layout of
    vLLM-style fused QKV / gate-up weights) and `block_b` the block-diagonal `diag(s_1 B_1^T, .., s_n B_n^T)` of
    shape `(n * rank, sum(out_i))`. One matmul then gives every base output and every `x A_i^T`, and one more adds
    `(x A^T) block_b` on the block rows: two calls per group instead of `2n + 1`, which is what costs at the few rows
    of a draft pass on CPU (measured: benchmarks/results/engine/draft_pass.md). Same values as the per-projection
    path up to float rounding (tests/test_fast_paths.py). It is a copy of the weights (`memory_bytes`): the layers'
    weights are held twice while it exists.

    Args:
        projections (`list[D3DLinear]`): projections reading the same input (rank 0 ones get no adapter rows).
        dtype (`torch.dtype`), device (`torch.device`): of the copy (the input's).
    """

    def __init__(self, projections: list[D3DLinear], dtype: torch.dtype, device: torch.device) -> None:
        adapted = [p for p in projections if p.rank > 0]
        self.widths = [p.out_features for p in projections]
        self.base_width = sum(self.widths)
        with torch.no_grad():
            weight = torch.cat([p.weight for p in projections] + [p.lora_A for p in adapted])
            self.weight = weight.to(device=device, dtype=dtype).contiguous()
            self.bias = None
            if any(p.bias is not None for p in projections):
                parts = [p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections]
                parts.append(self.weight.new_zeros(sum(p.rank for p in adapted)))
                self.bias = torch.cat([b.to(device=device, dtype=dtype) for b in parts])
            self.block_b = None
            if adapted:
                block_b = torch.zeros(sum(p.rank for p in adapted), self.base_width, device=device, dtype=dtype)
                starts = torch.tensor([0, *self.widths[:-1]]).cumsum(0).tolist()
                row, offsets = 0, dict(zip(map(id, projections), starts, strict=True))
                for p in adapted:
                    col = offsets[id(p)]
                    block_b[row : row + p.rank, col : col + p.out_features] = (p.lora_B * p.lora_scaling).t()
                    row += p.rank
                self.block_b = block_b

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the copy."""
        tensors = [t for t in (self.weight, self.bias, self.block_b) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __call__(self, x: torch.Tensor, rows: BlockRows) -> list[torch.Tensor]:
        """The projections' outputs `x W_i^T + b_i`, plus their adapters on `rows`: a list of views of one
        `(batch_size, seq_len, sum(out_i) + n * rank)` tensor, `(batch_size, seq_len, out_i)` each."""
        linear = rows.layouts.linear if rows.layouts is not None else nn.functional.linear
        y = linear(x, self.weight, self.bias)
        base, down = y[..., : self.base_width], y[..., self.base_width :]
        if self.block_b is not None:
            if rows.start is not None:
                if rows.start < x.shape[1]:
                    if x.shape[0] == 1:  # 2-D: in place on the block rows (row stride > width is BLAS-compatible)
                        base[0, rows.start :].addmm_(down[0, rows.start :], self.block_b)
                    else:
                        block_b = self.block_b.expand(x.shape[0], -1, -1)
                        base[:, rows.start :].baddbmm_(down[:, rows.start :], block_b)
            else:
                base.baddbmm_(down * rows.gate, self.block_b.expand(x.shape[0], -1, -1))
        outputs, start = [], 0
        for width in self.widths:
            outputs.append(base[..., start : start + width])
            start += width
        return outputs


def project(projections: list[nn.Module], x: torch.Tensor, rows: BlockRows | None, cache: dict) -> list[torch.Tensor]:
    """The outputs of `projections` (which all read `x`) with their block adapters on `rows`, by the cheapest path
    that applies: `FusedProjections` (when `rows.fused`), `add_block_adapters`, or each projection's own `forward`
    (training, PEFT-wrapped projections, forwards without block rows). `cache` holds the derived weights of this
    group between calls (rebuilt when a weight changes: `_weights_key`)."""
    if not _fused_adapters_apply(projections, rows):
        gate = rows.gate if rows is not None else None
        adapted = gate is not None and any(getattr(p, "rank", 0) > 0 for p in projections)
        layouts = rows.layouts if rows is not None else None
        if not adapted and layouts is not None and all(type(p) is D3DLinear for p in projections):
            return [layouts.linear(x, proj.weight, proj.bias) for proj in projections]
        return [_own_forward(proj)(x, gate, x * gate if adapted else None) for proj in projections]
    if rows.fused and (rows.start is None or rows.start < x.shape[1]):  # not for a pass without block rows
        key = _weights_key(projections, x)
        fused = cache.get("fused_projections")
        if fused is None or fused[0] != key:
            cache.pop("fused_projections", None)  # free the old copy before building the new one
            fused = cache["fused_projections"] = (key, FusedProjections(projections, x.dtype, x.device))
        return fused[1](x, rows)
    if rows.layouts is not None:
        outputs = [rows.layouts.linear(x, proj.weight, proj.bias) for proj in projections]
    else:
        outputs = [_own_forward(proj)(x) for proj in projections]
    add_block_adapters(projections, x, outputs, rows, cache)
    return outputs


def _own_forward(module: nn.Module) -> Callable:
    """How `project` calls a projection itself: its class's `forward` when an instance-level one routes it through
    `project` (`patches_d3d.route_projection_groups`), else the module (its hooks included)."""
    if "forward" in module.__dict__:
        return functools.partial(type(module).forward, module)
    return module


def _fused_adapters_apply(projections: list[nn.Module], rows: BlockRows | None) -> bool:
    """Whether `add_block_adapters` runs these projections' adapters; otherwise the per-projection path does, which
    serves training (autograd), wrapped projections (e.g. PEFT's LoRA layers, which pass the gate on to the
    `D3DLinear` inside) and forwards without block rows."""
    return (
        rows is not None
        and rows.gate is not None
        and not torch.is_grad_enabled()
        and all(type(p) is D3DLinear for p in projections)
        and any(p.rank > 0 for p in projections)
    )



class FastPathSettings:
    """A drafter's switches of the fast paths above and what they hold (not saved): `autotune_matmuls`
    (`MatmulLayouts`), `fused_projections` (`FusedProjections`) and the derived weights of each projection group
    (`group_cache`). `D3DModel.fast_path_settings` holds one; `D3DModel`'s properties of the same names forward to it,
    and `patches_d3d.apply_fast_paths` reads it for every forward it routes (`block_rows`).
    """

    def __init__(self) -> None:
        self._autotune_matmuls = True
        self._fused_projections: str | bool = "auto"
        self.caches: dict[str, dict] = {}  # projection group (module path) -> its derived weights (`project`)
        self._auto_fused_decision = None

    @property
    def autotune_matmuls(self) -> bool:
        """Whether forwards outside autograd on CPU run their projections' and the LM head's matmuls of at most 32
        rows (the draft passes) through `MatmulLayouts`, which times the equivalent layouts of each shape on this
        machine and keeps the fastest (not saved; default `True`). On the machine of d3d-hf issue 14 it made the
        shipped drafter's float32 pass over 2-4 rows 1.7x faster, and in bfloat16 the LM head's matmul 2.5x faster
        on prepacked oneDNN weights (benchmarks/results/engine/draft_pass.md). In bfloat16/float16 a packed copy of
        every weight whose shape chose the packed layout is held in memory (`MATMUL_LAYOUTS.packed_bytes`; about
        the size of the drafter's fused weights plus its LM head). `False` runs `nn.functional.linear` everywhere,
        e.g. for bit-reproducible drafts across processes (the layouts round differently and are chosen by timing),
        or to hold no packed copies (`set_autotune_matmuls` frees the model's).

        Raises:
            ValueError: (on assignment) for a value that is not a `bool`.
        """
        return self._autotune_matmuls

    @autotune_matmuls.setter
    def autotune_matmuls(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"`autotune_matmuls` must be True or False, got {value!r}.")
        self._autotune_matmuls = value

    def set_autotune_matmuls(self, value: bool, model: nn.Module) -> None:
        """Sets `autotune_matmuls`; `False` also frees the packed copies of `model`'s weights (a `D3DModel`), its
        LM head's (the drafter's, whose `_output_embeddings` it is) and the fused weights built so far."""
        self.autotune_matmuls = value
        if value is False:
            weights = [*model.parameters()]
            weights += [c["fused_projections"][1].weight for c in self.caches.values() if "fused_projections" in c]
            owner = model.__dict__.get("_output_embeddings")
            if owner is not None and owner() is not None:  # the LM head (the target's, once attached)
                weights.append(owner().lm_head.weight)
            MATMUL_LAYOUTS.release_packed(weights)

    @property
    def fused_projections(self) -> str | bool:
        """Whether forwards with block rows run outside autograd on `FusedProjections` (not saved).

        `"auto"` (the default): on CPU, where a pass over a few rows is bound by the number of matmul calls (the
        shipped drafter's bfloat16 pass: 1.10-1.14x the target's own forward over the same rows with them, 1.36-1.45x
        without; float32 about the same either way; benchmarks/results/engine/draft_pass.md), as long as the copy
        takes at most 10% of the machine's physical memory (with its packed copy, where `autotune_matmuls` may make
        one: bfloat16/float16 on oneDNN); `True`: on every device; `False`: never. The fused
        weights are a second copy of the layers' weights (e.g. about 460 MB for SmolLM2-135M in float32, half that in
        bfloat16), built at the first such forward and rebuilt when a weight changes; setting `False` frees them.

        Raises:
            ValueError: (on assignment) for any other value.
        """
        return self._fused_projections

    @fused_projections.setter
    def fused_projections(self, value: str | bool) -> None:
        if value not in ("auto", True, False) or isinstance(value, int) and not isinstance(value, bool):
            raise ValueError(f"`fused_projections` must be 'auto', True or False, got {value!r}.")
        self._fused_projections = value
        if value is False:
            for cache in self.caches.values():
                cache.pop("fused_projections", None)

    def group_cache(self, name: str) -> dict:
        """The store of derived weights of the projection group `name` (`project`'s `cache`)."""
        return self.caches.setdefault(name, {})

    def fused_projections_bytes(self) -> int:
        """Bytes held by the fused projection weights built so far (0 when none)."""
        return sum(c["fused_projections"][1].memory_bytes for c in self.caches.values() if "fused_projections" in c)

    def auto_fused(self, model: nn.Module, device: torch.device) -> bool:
        """`fused_projections="auto"`'s rule for `model` (a `D3DModel`): CPU, and the copies it may add at most 10%
        of physical memory: the fused weights (the layers' size), and with `autotune_matmuls` in a dtype that has
        the packed layout (`MatmulLayouts.candidates`), a packed copy of them too."""
        if device.type != "cpu":
            return False
        dtype = model.embed_tokens.weight.dtype
        key = (len(model.layers), dtype, self.autotune_matmuls)  # the decision is cached: this runs every forward
        cached = self._auto_fused_decision
        if cached is not None and cached[0] == key:
            return cached[1]
        layer_bytes = sum(p.numel() * p.element_size() for p in model.layers.parameters())
        try:
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):  # not a POSIX system: assume it fits
            memory = float("inf")
        copies = 2 if self.autotune_matmuls and MatmulLayouts.PACKED in MatmulLayouts.candidates(dtype) else 1
        self._auto_fused_decision = (key, copies * layer_bytes <= 0.1 * memory)
        return self._auto_fused_decision[1]

    def block_rows(self, model: nn.Module, gate: torch.Tensor | None, device: torch.device) -> BlockRows | None:
        """The `BlockRows` of one forward of `model` whose projections get `gate` (`None`: no block rows): the
        matmul layouts outside autograd with `autotune_matmuls`, and with block adapters, the gate's rows (fused per
        `fused_projections`); `None`: every projection runs its own `forward`."""
        layouts = MATMUL_LAYOUTS if self.autotune_matmuls and not torch.is_grad_enabled() else None
        block_rows = None if layouts is None else BlockRows(gate=None, layouts=layouts)
        if model.config.block_lora_rank > 0 and gate is not None:
            fused = self.fused_projections is True or (
                self.fused_projections == "auto" and self.auto_fused(model, device)
            )
            block_rows = BlockRows.of_gate(gate, fused and not torch.is_grad_enabled(), layouts)
        return block_rows


__all__ = [
    "GQA_SDPA",
    "MATMUL_LAYOUTS",
    "BlockRows",
    "FastPathSettings",
    "FusedProjections",
    "LayoutMark",
    "MatmulLayouts",
    "add_block_adapters",
    "gqa_sdpa_attention_forward",
    "layout_mark",
    "matmul_layouts",
    "project",
    "register_gqa_sdpa",
]
