"""D3D block-diffusion drafter (arXiv 2611.06425): Llama/Qwen3-family decoder stack with a mask token.

Part of the self-contained remote-code bundle uploaded next to every checkpoint: imports only torch, the public
transformers API and its sibling files.

Attention convention: every attention mask handled here is boolean, `True` where a query may attend to a key, of
shape `(batch_size, 1, query_len, key_len)`; `key_len` counts the cached tokens first, then the current ones.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers import GenerationConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .checkpoint_d3d import check_weight_files, push_handler, save_folder_atomically, save_hooks
from .configuration_d3d import D3DConfig, validate_config
from .drafting_d3d import (
    D3DCache,
    D3DPackedDraft,
    causal_attention_mask,
    draft_attention_mask,
    draft_logits,
    packed_attention_mask,
    packed_draft_logits,
    packed_metadata,
    resolve_packed_attention_kernel,
)
from .generation_d3d import D3DCandidateGenerator
from .hooks_d3d import install_generation_hook
from .initialization_d3d import from_autoregressive


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of `x` (RoPE helper)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies RoPE to `q`/`k` of shape `[B, H, T, D]` with `cos`/`sin` of shape `[B, T, D]`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[B, H_kv, S, D]` -> `[B, H_kv * n_rep, S, D]` (grouped-query attention)."""
    if n_rep == 1:
        return hidden_states
    b, h, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention. `query` `[B, H, T, D]`, `key`/`value` `[B, H_kv, S, D]`, boolean mask `[B, 1, T, S]`.

    Returns the output `[B, T, H, D]` and the attention probabilities `[B, H, T, S]`.
    """
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights


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
    bit-identical outputs in the checks of tests/test_modeling.py. It saves the copy of every layer's cached keys
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


def kernel_attention_interface(kernel: Callable) -> Callable:
    """A transformers-style attention function (`(module, query, key, value, attention_mask, scaling, ...)` ->
    `(output [B, T, H, D], None)`) that runs a registered packed-attention kernel: `attention_mask` is then the
    packed pass's metadata `(segment_ids, positions, chain_lengths)`, from which the kernel computes the tree mask
    (`drafting_d3d.packed_attention_mask` states the rule)."""

    def packed_kernel_attention(module, query, key, value, attention_mask, scaling, **kwargs):
        return kernel(query, key, value, *attention_mask, scale=scaling).transpose(1, 2), None

    return packed_kernel_attention


class D3DLinear(nn.Linear):
    """`nn.Linear` with an optional low-rank adapter applied only at draft-block positions ("block LoRA").

    `forward(x, block_gate)` returns `x W^T + b + block_gate * (alpha / r) * x A^T B^T`, where `block_gate` is
    `(batch_size, seq_len, 1)` (1 at draft-block positions, 0 at committed-context positions) or `None` (no adapter).
    Design choice (d3d-hf docs/DESIGN.md section 8, lesson 3): the committed context and the anchor go through
    the unmodified weights, so an adapted drafter keeps the source model's exact first-token prediction and a KV
    cache identical to the source model's, while the mask positions learn to denoise the block. `lora_B` starts
    at zero, so a fresh adapter leaves the drafter unchanged. Outside autograd the decoder layers run the adapters
    of projections that share an input together (`add_block_adapters`); this `forward` is the training path.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, rank: int = 0, alpha: float = 16.0):
        super().__init__(in_features, out_features, bias=bias)
        self.rank = int(rank)
        if self.rank > 0:
            self.lora_A = nn.Parameter(torch.zeros(self.rank, in_features))
            self.lora_B = nn.Parameter(torch.zeros(out_features, self.rank))
            self.lora_scaling = float(alpha) / self.rank

    def add_adapter(self, rank: int, alpha: float) -> None:
        """Creates a fresh block adapter (`lora_A` ~ N(0, 1/in_features), `lora_B` = 0) of the given rank."""
        self.rank = int(rank)
        ref = self.weight
        self.lora_A = nn.Parameter(
            torch.randn(self.rank, self.in_features, device=ref.device, dtype=ref.dtype) / self.in_features**0.5
        )
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, self.rank, device=ref.device, dtype=ref.dtype))
        self.lora_scaling = float(alpha) / self.rank

    def forward(
        self, x: torch.Tensor, block_gate: torch.Tensor | None = None, gated_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`gated_input` (optional) is `block_gate * x`, when the caller computed it once for several projections of
        the same input; the gate is 0 or 1, so gating the input is exact and the same as gating the output."""
        out = super().forward(x)
        if self.rank > 0 and block_gate is not None:
            if gated_input is None:
                gated_input = x * block_gate
            lora_a, lora_b = self.lora_A, self.lora_B
            if lora_a.dtype != x.dtype:
                lora_a, lora_b = lora_a.to(x.dtype), lora_b.to(x.dtype)
            delta = nn.functional.linear(nn.functional.linear(gated_input, lora_a), lora_b)
            out = torch.add(out, delta, alpha=self.lora_scaling)
        return out


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


def add_block_adapters(
    projections: list[D3DLinear], x: torch.Tensor, outputs: list[torch.Tensor], rows: BlockRows, cache: dict
) -> None:
    """Adds the block adapters of `projections`, which all read the same input `x`, to their base outputs in place.

    The fused inference path of `D3DLinear`'s adapter (the same values up to float rounding; checked in
    tests/test_modeling.py against the per-projection path): one matmul with the stacked `lora_A` of all the
    projections (q/k/v, or gate/up) instead of one each, then one `baddbmm_` per projection that multiplies by `lora_B`
    and adds into the output (no separate add), on the block rows only when they are a suffix (`rows.start`).
    Only for use outside autograd (in-place updates); `cache` holds the stacked weights between calls, keyed by the
    parameters' storage and version counters, so an optimiser step or a `.to()` rebuilds them.

    Args:
        projections (`list[D3DLinear]`): the projections (those with `rank == 0` are skipped; the others share one
            rank, `config.block_lora_rank`).
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
    rank = projections[0].rank
    if x.shape[0] == 1:  # 2-D matmuls: the common case, and cheaper than batched ones for a few rows
        down = torch.mm(x[0], cache["At"])
        for i, (proj, out) in enumerate(pairs):
            rows_out = out[0] if rows.start is None else out[0, rows.start :]
            rows_out.addmm_(down[:, i * rank : (i + 1) * rank], cache["Bt"][i], alpha=proj.lora_scaling)
        return
    down = torch.matmul(x, cache["At"])
    for i, (proj, out) in enumerate(pairs):
        rows_out = out if rows.start is None else out[:, rows.start :]
        b_t = cache["Bt"][i].expand(x.shape[0], -1, -1)
        rows_out.baddbmm_(down[..., i * rank : (i + 1) * rank], b_t, alpha=proj.lora_scaling)


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


MATMUL_LAYOUTS = MatmulLayouts()
"""The process's layout choices (a property of the machine, shared by every drafter)."""


def _linear_on_layouts(module: nn.Linear, min_rows: int, x: torch.Tensor) -> torch.Tensor:
    if x.numel() < min_rows * x.shape[-1]:  # fewer rows: `nn.Linear`'s own call
        return nn.functional.linear(x, module.weight, module.bias)
    return MATMUL_LAYOUTS.linear(x, module.weight, module.bias)


GQA_SDPA = "d3d_gqa_sdpa"
"""The name under which `target_gqa_attention` registers `gqa_sdpa_attention_forward` with transformers."""


@contextlib.contextmanager
def target_gqa_attention(model: nn.Module):
    r"""While open, a transformers `model` on CPU whose attention is `"sdpa"` with grouped-query attention runs its
    attention on `gqa_sdpa_attention_forward` (registered with transformers' `AttentionInterface` and
    `AttentionMaskInterface` as `GQA_SDPA`, with the `"sdpa"` mask function): its forwards of more than one row
    outside autograd (D3D's verifications) no longer copy each layer's cached keys and values per query head, with
    bit-identical outputs; everything else runs transformers' own `"sdpa"` function. D3D's own decoding loop opens
    it around the target's forwards (d3d-hf issue 14). The model's `config._attn_implementation` is set to
    `GQA_SDPA` while the context is open and restored when it closes, also on an exception. Other models, and
    models whose config has sub-configs (e.g. multimodal ones), are left alone.

    Args:
        model (`nn.Module`): the target.

    Yields:
        `bool`: whether the attention was switched (CPU, `"sdpa"`, fewer key/value heads than query heads, a torch
        with `enable_gqa`, a config without sub-configs).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == GQA_SDPA:  # opened around this one: the outer one restores
        yield True
        return
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
    if not switch:
        yield False
        return
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention_forward)
    AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = GQA_SDPA
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"


@contextlib.contextmanager
def target_matmul_layouts(model: nn.Module, min_rows: int = 2):
    r"""While open, every plain `nn.Linear` of `model` (a target; the LM head included) runs its forwards of
    `min_rows` to `MatmulLayouts.max_rows` rows outside autograd on CPU through `MATMUL_LAYOUTS` (the faster of
    `x W^T` and `(W x^T)^T` on this machine): D3D's opt-in `d3d_target_matmul_layouts` for the target's verification
    forwards (d3d-hf issue 14; docs/DESIGN.md section 9 names the multi-row float32 penalty of the default kernel).

    Forwards of fewer rows (one-row decoding steps: default 2) and of more rows (the prompt's prefill) keep
    `nn.Linear`'s call, so a plain target step computes exactly what target-only decoding computes. A verification
    forward may round differently from `nn.Linear`'s multi-row kernel, as that one already rounds differently from
    the one-row kernel of target-only decoding; greedy output stays the target's own unless two logits tie within
    float rounding (checked on the bench prompts: README, "The draft pass"). Modules that already have an
    instance-level `forward` (e.g. accelerate's hooks) and subclasses of `nn.Linear` (e.g. PEFT's or quantised
    layers) are left alone. The modules are restored when the context closes, also on an exception.

    Args:
        model (`nn.Module`): the model whose linears to route.
        min_rows (`int`, defaults to 2): the fewest rows that use `MATMUL_LAYOUTS`.

    Yields:
        `list[nn.Linear]`: the modules routed.
    """
    routed = []
    try:
        for module in model.modules():
            if type(module) is nn.Linear and "forward" not in module.__dict__:
                module.forward = functools.partial(_linear_on_layouts, module, min_rows)
                routed.append(module)
        yield routed
    finally:
        for module in routed:
            module.__dict__.pop("forward", None)


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
    path up to float rounding (tests/test_modeling.py). It is a copy of the weights (`memory_bytes`): the layers'
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
        return [proj(x, gate, x * gate if adapted else None) for proj in projections]
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
        outputs = [proj(x) for proj in projections]
    add_block_adapters(projections, x, outputs, rows, cache)
    return outputs


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


def _projection(config: D3DConfig, name: str, in_features: int, out_features: int, bias: bool) -> D3DLinear:
    """A `D3DLinear` with a block adapter when `name` is in `config.block_lora_modules` and the rank is > 0."""
    rank = config.block_lora_rank if name in config.block_lora_modules else 0
    return D3DLinear(in_features, out_features, bias, rank, config.block_lora_alpha)


class D3DMaskEmbedding(nn.Module):
    """The mask token's learned input embedding, `weight` of shape `(hidden_size,)`, kept outside the vocabulary.

    A module (not a bare parameter) so that PEFT can train and save it (`modules_to_save=["mask_embedding"]`).
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))


class D3DRMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension (computed in float32)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class D3DRotaryEmbedding(nn.Module):
    """Rotary position embedding; `forward(x, position_ids)` returns `cos`, `sin` of shape `[B, T, head_dim]`."""

    def __init__(self, config: D3DConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: D3DConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        """Inverse frequencies of the original RoPE (`base ** (-2i / head_dim)`) and a unit scaling."""
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class D3DAttention(nn.Module):
    """Grouped-query self-attention with RoPE and optional Qwen3-style per-head q/k RMSNorm."""

    def __init__(self, config: D3DConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False  # the mask is always explicit
        h, kv, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = _projection(config, "q_proj", config.hidden_size, h * self.head_dim, bias)
        self.k_proj = _projection(config, "k_proj", config.hidden_size, kv * self.head_dim, bias)
        self.v_proj = _projection(config, "v_proj", config.hidden_size, kv * self.head_dim, bias)
        self.o_proj = _projection(config, "o_proj", h * self.head_dim, config.hidden_size, bias)
        if config.use_qk_norm:
            self.q_norm = D3DRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = D3DRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self._adapter_cache, self._out_adapter_cache = {}, {}  # derived weights of each group (`project`)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        past_key_values: D3DCache | None = None,
        block_rows: BlockRows | None = None,
        attention_interface: Callable = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`attention_interface` is the attention function `D3DModel.forward` chose for this forward (transformers'
        signature: `(module, query, key, value, attention_mask, scaling=..., dropout=...)` -> `(output [B, T, H, D],
        weights or None)`); `eager_attention_forward` when `None`."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        outputs = project([self.q_proj, self.k_proj, self.v_proj], hidden_states, block_rows, self._adapter_cache)
        query_states, key_states, value_states = (o.view(hidden_shape) for o in outputs)
        if self.config.use_qk_norm:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface = attention_interface or eager_attention_forward
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.config.attention_dropout,
            scaling=self.scaling,
            is_causal=False,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return project([self.o_proj], attn_output, block_rows, self._out_adapter_cache)[0], attn_weights


class D3DMLP(nn.Module):
    """SwiGLU feed-forward block: `down(act(gate(x)) * up(x))`."""

    def __init__(self, config: D3DConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = _projection(config, "gate_proj", hidden, inner, bias)
        self.up_proj = _projection(config, "up_proj", hidden, inner, bias)
        self.down_proj = _projection(config, "down_proj", inner, hidden, bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self._adapter_cache, self._out_adapter_cache = {}, {}  # derived weights of each group (`project`)

    def forward(self, x: torch.Tensor, block_rows: BlockRows | None = None) -> torch.Tensor:
        gate_out, up_out = project([self.gate_proj, self.up_proj], x, block_rows, self._adapter_cache)
        hidden = self.act_fn(gate_out) * up_out
        return project([self.down_proj], hidden, block_rows, self._out_adapter_cache)[0]


class D3DDecoderLayer(nn.Module):
    """Pre-norm transformer layer (attention + SwiGLU MLP), identical in layout to Llama/Qwen3 decoder layers."""

    def __init__(self, config: D3DConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = D3DAttention(config, layer_idx)
        self.mlp = D3DMLP(config)
        self.input_layernorm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        past_key_values: D3DCache | None = None,
        block_rows: BlockRows | None = None,
        attention_interface: Callable = None,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings,
            attention_mask,
            past_key_values,
            block_rows,
            attention_interface,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states), block_rows)


@dataclass
class D3DModelOutput(ModelOutput):
    """Output of `D3DModel` / `D3DForDiffusionDrafting`.

    Args:
        logits (`torch.FloatTensor` of shape `(batch_size, num_kept, vocab_size)`, *optional*):
            LM-head scores of the kept positions (all positions unless `logits_to_keep` was given). Following the
            autoregressive model the drafter starts from, the output at position `i` predicts the token at `i + 1`.
        last_hidden_state (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`, *optional*):
            Final-norm hidden states.
        cache (`D3DCache`, *optional*):
            The cache, extended with the current tokens when `use_cache=True` (named `cache` as transformers 5
            names it in its outputs).
        hidden_states (`tuple(torch.FloatTensor)`, *optional*):
            Input embeddings and the output of every layer, each `(batch_size, seq_len, hidden_size)`, when
            `output_hidden_states=True`.
    """

    logits: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    cache: D3DCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


class D3DPreTrainedModel(PreTrainedModel):
    """Weight initialisation and loading glue shared by the D3D model classes."""

    config_class = D3DConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["D3DDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    card_data = None
    """Model-card data (`d3d_hf.hub.DrafterCardData` or a `dict` of its fields) rendered into `README.md` by
    `save_pretrained`; kept out of the config on purpose (measured numbers describe a run, not the model)."""

    def save_pretrained(self, save_directory, *args, tokenizer=None, model_card: bool = True, **kwargs):
        r"""
        `PreTrainedModel.save_pretrained` (weights, `config.json` with `auto_map`, the remote-code bundle), plus the
        tokenizer files and the model card.

        The save is atomic file by file: everything is written into a temporary sibling folder first (a hidden
        folder inside `save_directory` when its parent is read-only), then each file is moved into `save_directory`
        with `os.replace` (weights after the other files, `config.json` last), so an
        interrupted save leaves the previous checkpoint there complete and loadable, never a half-written
        `model.safetensors`. Files already in `save_directory` that this save does not write are kept (weight files
        of an earlier save that the new weights supersede are removed, as transformers does for stale shards).

        Args:
            save_directory (`str` or `os.PathLike`):
                Folder to write (created if needed).
            tokenizer (`PreTrainedTokenizerBase`, *optional*):
                Saved into the same folder, so that the folder (and a Hub repository pushed from it) is complete.
            model_card (`bool`, defaults to `True`):
                Run the installed `d3d.save_hooks` entry points after the save (`checkpoint_d3d.save_hooks`):
                with `d3d_hf` installed, `d3d_hf.hub.write_model_card` writes `README.md` rendered from
                `self.card_data` and the config, and that data as `d3d_card_data.json` (a `README.md` that d3d-hf
                did not generate is kept); with only torch + transformers there is none.
            push_to_hub (`bool`, defaults to `False`):
                After saving, upload with `self.push_to_hub` (`repo_id`, `commit_message`, `commit_description`,
                `private`, `create_pr`, `revision`, `tags` and `token` are passed on), so that the uploaded card is
                this drafter's card rather than transformers' generic one.
            Other arguments are those of `PreTrainedModel.save_pretrained`.

        Raises:
            NotADirectoryError: if `save_directory` is an existing file.
        """
        push_kwargs = None
        if kwargs.pop("push_to_hub", False):
            hub_keys = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision", "tags")
            push_kwargs = {key: kwargs.pop(key) for key in hub_keys if key in kwargs}
            push_kwargs["token"] = kwargs.get("token")
        if not kwargs.get("is_main_process", args[0] if args else True):
            return super().save_pretrained(save_directory, *args, **kwargs)

        def write(staging: str):
            result = super(D3DPreTrainedModel, self).save_pretrained(staging, *args, **kwargs)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            return result

        result = save_folder_atomically(write, save_directory, kwargs.get("variant"))
        if model_card:
            for hook in save_hooks():  # d3d_hf's renders the model card
                hook(self, save_directory)
        if push_kwargs is not None:
            repo_id = push_kwargs.pop("repo_id", os.path.basename(os.path.normpath(save_directory)))
            self.push_to_hub(repo_id, tokenizer=tokenizer, **push_kwargs)
        return result

    def push_to_hub(self, repo_id: str, *, tokenizer=None, **kwargs):
        r"""
        Uploads the folder `save_pretrained` writes (model card included) to the Hub.

        With `d3d_hf` installed this is its `d3d.push_handlers` entry point, `d3d_hf.hub.push_drafter` (keyword
        arguments of transformers' `push_to_hub`, plus `tokenizer` and `overwrite_card`); with only torch +
        transformers it is transformers' `push_to_hub` (generic card), followed by `tokenizer.push_to_hub` when a
        tokenizer is given.

        Returns:
            `huggingface_hub.CommitInfo` of the model upload.
        """
        handler = push_handler()
        if handler is not None:
            return handler(self, repo_id, tokenizer=tokenizer, **kwargs)
        result = super().push_to_hub(repo_id, **kwargs)
        if tokenizer is not None:
            tokenizer.push_to_hub(repo_id, token=kwargs.get("token"), revision=kwargs.get("revision"))
        return result

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, D3DMaskEmbedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, D3DLinear) and module.rank > 0:
            nn.init.normal_(module.lora_A, mean=0.0, std=module.in_features**-0.5)
            nn.init.zeros_(module.lora_B)


class D3DModel(D3DPreTrainedModel):
    """The bare D3D decoder stack (embeddings, layers, final norm), returning final hidden states."""

    def __init__(self, config: D3DConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(D3DDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = D3DRotaryEmbedding(config)
        # A vocabulary that fills every id (SmolLM2) has no spare row for the mask token: keep it separately so the
        # drafter's `vocab_size` stays equal to the target's (transformers' assisted generation requires it).
        self.mask_embedding = D3DMaskEmbedding(config.hidden_size) if config.mask_token_id is None else None
        # how packed passes attend (not saved): `drafting_d3d.PACKED_ATTENTION_IMPLEMENTATIONS`
        self.packed_attention_implementation = "auto"
        self.fused_projections = "auto"
        self.autotune_matmuls = True
        self.post_init()

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
        or to hold no packed copies.

        Raises:
            ValueError: (on assignment) for a value that is not a `bool`.
        """
        return self._autotune_matmuls

    @autotune_matmuls.setter
    def autotune_matmuls(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"`autotune_matmuls` must be True or False, got {value!r}.")
        self._autotune_matmuls = value
        if value is False:  # free this model's packed weight copies
            fused = [c["fused_projections"][1] for c in self._projection_caches() if "fused_projections" in c]
            weights = [*self.parameters(), *(f.weight for f in fused)]
            owner = self.__dict__.get("_output_embeddings")
            if owner is not None and owner() is not None:  # the LM head (the target's, once attached)
                weights.append(owner().lm_head.weight)
            MATMUL_LAYOUTS.release_packed(weights)

    def matmul_layout_trials(self) -> int:
        """`MatmulLayouts.timed_calls` of the layouts this model runs on: a forward that leaves it unchanged ran on
        chosen layouts only, so timing code (`calibration_d3d.measure_cost_curves`) warms up until one does."""
        return MATMUL_LAYOUTS.timed_calls

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
            for cache in self._projection_caches():
                cache.pop("fused_projections", None)

    def _projection_caches(self):
        """The per-group caches of derived weights (`project`) of every attention and MLP block."""
        for module in self.modules():
            for cache in (getattr(module, "_adapter_cache", None), getattr(module, "_out_adapter_cache", None)):
                if cache is not None:
                    yield cache

    def _auto_fused(self, device: torch.device) -> bool:
        """`fused_projections="auto"`'s rule: CPU, and the copies it may add at most 10% of physical memory: the
        fused weights (the layers' size), and with `autotune_matmuls` in a dtype that has the packed layout
        (`MatmulLayouts.candidates`), a packed copy of them too."""
        if device.type != "cpu":
            return False
        dtype = self.embed_tokens.weight.dtype
        key = (len(self.layers), dtype, self.autotune_matmuls)  # the decision is cached: this runs every forward
        cached = self.__dict__.get("_auto_fused_decision")
        if cached is not None and cached[0] == key:
            return cached[1]
        layer_bytes = sum(p.numel() * p.element_size() for p in self.layers.parameters())
        try:
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, OSError, ValueError):  # not a POSIX system: assume it fits
            memory = float("inf")
        copies = 2 if self.autotune_matmuls and MatmulLayouts.PACKED in MatmulLayouts.candidates(dtype) else 1
        self._auto_fused_decision = (key, copies * layer_bytes <= 0.1 * memory)
        return self._auto_fused_decision[1]

    def fused_projections_bytes(self) -> int:
        """Bytes held by the fused projection weights built so far (0 when none)."""
        caches = self._projection_caches()
        return sum(c["fused_projections"][1].memory_bytes for c in caches if "fused_projections" in c)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def mask_token_embedding(self) -> torch.Tensor:
        """The mask token's input embedding, shape `(hidden_size,)`."""
        if self.mask_embedding is not None:
            return self.mask_embedding.weight
        return self.embed_tokens.weight[self.config.mask_token_id]

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        masked_positions: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: D3DCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
        block_positions: torch.BoolTensor | None = None,
        packed_metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> D3DModelOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`):
                Token ids. Values at masked positions are ignored (any filler id may stand there).
            masked_positions (`torch.BoolTensor` of shape `(batch_size, seq_len)`, *optional*):
                `True` where the input is the mask token: its embedding replaces the token embedding.
            attention_mask (`torch.Tensor`, *optional*):
                Either a boolean `(batch_size, 1, seq_len, past_len + seq_len)` mask (`True` = may attend), used as
                is (see `draft_attention_mask` and the block-diffusion training mask), or a `(batch_size,
                past_len + seq_len)` padding mask (1 = real token) combined with causal attention. `None` means
                causal attention.
            position_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`, *optional*):
                Positions; defaults to `past_len + arange(seq_len)`.
            past_key_values (`D3DCache`, *optional*):
                Cache of earlier tokens; updated in place when `use_cache=True`.
            inputs_embeds (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`, *optional*):
                Embeddings to use instead of `input_ids`.
            use_cache (`bool`, defaults to `False`):
                Whether to append the current keys/values to `past_key_values` (created when `None`).
            output_hidden_states (`bool`, defaults to `False`):
                Whether to return the hidden states of every layer.
            block_positions (`torch.BoolTensor` of shape `(batch_size, seq_len)`, *optional*):
                Positions that belong to a draft block, where the block adapters (`block_lora_rank > 0`) apply;
                defaults to `masked_positions`.
            packed_metadata (`tuple` of three `torch.LongTensor` of shape `(seq_len,)`, *optional*):
                `(segment_ids, positions, chain_lengths)` of a packed successor-drafting pass (`packed_metadata`):
                the attention mask is then `packed_attention_mask` of them (pass no `attention_mask`), computed
                inside the registered packed-attention kernel (`d3d_hf` registers its Triton kernel) or
                materialised, as `self.packed_attention_implementation` says (`"auto"`: the kernel on CUDA, the
                dense mask elsewhere; `"dense"`; `"kernel"`: the kernel wherever it can run, e.g. on CPU under
                `TRITON_INTERPRET=1`), decided once for the whole forward.

        Returns:
            `D3DModelOutput` with `last_hidden_state` of shape `(batch_size, seq_len, hidden_size)`.

        Raises:
            ValueError: if neither or both of `input_ids` and `inputs_embeds` are given, or a mask has the wrong
                shape.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        if masked_positions is not None:
            if masked_positions.shape != (batch_size, seq_len):
                raise ValueError(
                    f"`masked_positions` must have shape {(batch_size, seq_len)}, got {tuple(masked_positions.shape)}."
                )
            mask_vec = self.mask_token_embedding().to(inputs_embeds.dtype)
            inputs_embeds = torch.where(masked_positions[..., None], mask_vec, inputs_embeds)

        if use_cache and past_key_values is None:
            past_key_values = D3DCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        device = inputs_embeds.device
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + seq_len, device=device)[None].expand(batch_size, -1)

        key_len = past_len + seq_len
        # the one decision of this forward about how attention runs
        attention_interface = eager_attention_forward
        if self.config._attn_implementation == "sdpa":
            attention_interface = gqa_sdpa_attention_forward
        elif self.config._attn_implementation not in (None, "eager"):
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        if packed_metadata is not None:
            if attention_mask is not None:
                raise ValueError("Pass either `packed_metadata` or `attention_mask`, not both.")
            kernel = resolve_packed_attention_kernel(self.packed_attention_implementation, device, batch_size)
            if kernel is not None:
                attention_interface = kernel_attention_interface(kernel)
                attention_mask = tuple(packed_metadata)  # the kernel computes the mask from the metadata
            else:
                attention_mask = packed_attention_mask(*packed_metadata, past_len)[None, None]
        if isinstance(attention_mask, tuple):
            pass
        elif attention_mask is None:
            attention_mask = causal_attention_mask(seq_len, past_len, device)
        elif attention_mask.dim() == 2:
            if attention_mask.shape[-1] != key_len:
                raise ValueError(
                    f"A 2-D `attention_mask` must cover past + current tokens ({key_len}), got "
                    f"{attention_mask.shape[-1]}."
                )
            attention_mask = causal_attention_mask(seq_len, past_len, device) & attention_mask.bool()[:, None, None]
        elif attention_mask.dim() != 4 or attention_mask.shape[-2:] != (seq_len, key_len):
            raise ValueError(
                f"A 4-D `attention_mask` must have shape (batch_size, 1, {seq_len}, {key_len}), got "
                f"{tuple(attention_mask.shape)}."
            )
        if not isinstance(attention_mask, tuple):
            attention_mask = attention_mask.to(device=device, dtype=torch.bool).expand(batch_size, -1, -1, -1)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        cache = past_key_values if use_cache else None
        if past_key_values is not None and not use_cache and past_len > 0:
            raise ValueError("Reading a cache without extending it is not supported: pass `use_cache=True`.")
        if block_positions is None:
            block_positions = masked_positions
        layouts = MATMUL_LAYOUTS if self.autotune_matmuls and not torch.is_grad_enabled() else None
        block_rows = None if layouts is None else BlockRows(gate=None, layouts=layouts)
        if self.config.block_lora_rank > 0 and block_positions is not None:
            fused = self.fused_projections is True or (self.fused_projections == "auto" and self._auto_fused(device))
            block_rows = BlockRows.of(
                block_positions, hidden_states.dtype, fused and not torch.is_grad_enabled(), layouts
            )
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, position_embeddings, attention_mask, cache, block_rows, attention_interface
            )
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        return D3DModelOutput(last_hidden_state=hidden_states, cache=cache, hidden_states=all_hidden_states)


class D3DForDiffusionDrafting(D3DPreTrainedModel):
    """D3D drafter: `D3DModel` plus an LM head. Pass it as `assistant_model` to a target's `generate`.

    The drafter is a standalone block-diffusion LM (arXiv 2611.06425): it keeps its own KV cache of the committed
    text and, in one forward pass over `[anchor, MASK x (B-1)]`, predicts `B-1` draft tokens. Alignment
    ("shifted, causal anchor", d3d-hf docs/DESIGN.md section 8): the anchor (last committed token) attends only to the
    committed prefix, and as in the autoregressive model the drafter starts from, the output at block position `j`
    predicts the token at `j + 1`: the anchor's output predicts `d1`, the first mask's output predicts `d2`, and the
    last mask's output predicts one token past the block. An untrained drafter initialised from its target
    therefore already drafts `d1` exactly as the target would.

    `target.generate(input_ids, assistant_model=drafter, ...)` uses `D3DCandidateGenerator` for it (greedy and
    lossless speculative sampling); the hook is installed when a drafter is created.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _is_d3d_drafter = True

    def __init__(self, config: D3DConfig) -> None:
        validate_config(config)  # a config edited by hand after it was built is checked here too
        super().__init__(config)
        if config.shares_target_weights:
            # embeddings and LM head are the target's tensors (`attach_target_weights`), not tied copies stored here
            self._tied_weights_keys = {}
        self.model = D3DModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.model._output_embeddings = weakref.ref(self)  # whose LM head runs on `autotune_matmuls` too
        self.post_init()
        install_generation_hook()
        # `d3d_*` options set here are read by `D3DCandidateGenerator` unless the call sets them (as transformers reads
        # `num_assistant_tokens` from an assistant's generation config); none is set: the declared defaults apply
        self.generation_config = GenerationConfig()
        self.last_generation_stats = None
        self._attached_target = None
        if config.shares_target_weights:
            # only drafter-specific weights are stored; the rest comes from the target (`attach_target_weights`)
            self._keys_to_ignore_on_load_missing = [r"^(?!.*(lora_A|lora_B|mask_embedding)).*$"]

    @staticmethod
    def is_drafter_specific(name: str) -> bool:
        """Whether a state-dict key belongs to the drafter itself (mask embedding, block adapters), not to the
        layers it shares with its target."""
        return "mask_embedding" in name or ".lora_A" in name or ".lora_B" in name

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """The drafter-specific part of `state_dict()` (what a `shares_target_weights` checkpoint stores)."""
        return {k: v for k, v in self.state_dict().items() if self.is_drafter_specific(k)}

    def add_block_adapter(self, rank: int, alpha: float = 16.0, modules: list[str] | None = None) -> None:
        """Adds fresh block adapters (see `D3DLinear`) to every decoder layer and records them in the config.

        Raises:
            ValueError: if `rank < 1` or the drafter already has adapters.
        """
        if rank < 1:
            raise ValueError(f"`rank` must be >= 1, got {rank}.")
        if self.config.block_lora_rank > 0:
            raise ValueError(f"The drafter already has block adapters of rank {self.config.block_lora_rank}.")
        modules = list(modules or self.config.block_lora_modules)
        self.config.block_lora_rank, self.config.block_lora_alpha = int(rank), float(alpha)
        self.config.block_lora_modules = modules
        for layer in self.model.layers:
            for name in modules:
                parent = layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp
                getattr(parent, name).add_adapter(rank, alpha)

    def attach_target_weights(self, target: PreTrainedModel) -> None:
        """Makes the drafter use the target's own tensors for everything but its drafter-specific weights.

        For `shares_target_weights` drafters: embeddings, the decoder layers `config.source_layer_ids`, the final
        norm and the LM head become references to the target's parameters (no copy, no extra memory), on the
        target's device and dtype. Called automatically by `target.generate(..., assistant_model=drafter)`.

        Raises:
            ValueError: if the target's shapes do not match the drafter's (a different model).
        """
        source = target.state_dict(keep_vars=True)
        layer_ids = self.config.source_layer_ids or list(range(self.config.num_hidden_layers))
        lm_head = target.get_output_embeddings().weight
        own = dict(self.named_parameters(remove_duplicate=False))
        for name in own:
            if self.is_drafter_specific(name):
                continue
            if name.startswith("model.layers."):
                idx, rest = name[len("model.layers.") :].split(".", 1)
                src_name = f"model.layers.{layer_ids[int(idx)]}.{rest}"
            elif name == "lm_head.weight":
                src_name = None
            else:
                src_name = name
            tensor = lm_head if src_name is None else source.get(src_name)
            if tensor is None or tensor.shape != own[name].shape:
                raise ValueError(
                    f"Cannot attach {type(target).__name__} weights to this drafter: `{src_name or 'lm_head.weight'}` "
                    f"is {'missing' if tensor is None else tuple(tensor.shape)}, the drafter expects "
                    f"{tuple(own[name].shape)}. Pass the target the drafter was made for "
                    f"({self.config.target_model})."
                )
            module_name, _, param_name = name.rpartition(".")
            module = self.get_submodule(module_name)
            module._parameters[param_name] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
        ref = lm_head
        for name, param in self.named_parameters():
            if self.is_drafter_specific(name):
                param.data = param.data.to(device=ref.device)
        self.model.rotary_emb.to(ref.device)
        # a plain reference, not a registered submodule: the target's parameters must not become the drafter's
        self._modules.pop("_attached_target", None)
        self.__dict__["_attached_target"] = target

    def _check_weights_attached(self) -> None:
        if self.config.shares_target_weights and self._attached_target is None:
            raise RuntimeError(
                "This drafter shares its layers with its target (`shares_target_weights=True`) and they are not "
                f"attached yet: call `drafter.attach_target_weights(target)` with {self.config.target_model}, or "
                "pass the drafter as `assistant_model` to `target.generate`, which attaches them."
            )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        r"""
        `PreTrainedModel.from_pretrained`, refusing checkpoints that would load as a different drafter than the one
        saved: before loading, the safetensors files of a local folder are checked whole (header and size); after
        loading, every weight the config requires must have come from the checkpoint (transformers would otherwise
        initialise missing ones at random, with only a warning) and no stored weight may be left unused. For a
        `shares_target_weights` drafter only the drafter-specific weights are required.

        Raises:
            OSError: if a weights file of a local folder is truncated or corrupt (naming the file).
            ValueError: if the weights hold no mask embedding while `config.json` sets no `mask_token_id` (a drafter
                without a mask token), lack other weights the config requires, or hold weights it has no place for
                (config and weights of different drafters); if `config.json` lacks a required field (see
                `D3DConfig.from_dict`).
        """
        if pretrained_model_name_or_path is not None:
            folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            if os.path.isdir(folder):
                check_weight_files(folder, kwargs.get("variant"))
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        missing = sorted(info.get("missing_keys") or [])
        unexpected = sorted(info.get("unexpected_keys") or [])
        source = pretrained_model_name_or_path
        if model.config.mask_token_id is None and any("mask_embedding" in key for key in missing):
            raise ValueError(
                f"The drafter at {source} has no mask token: its config.json sets no `mask_token_id` and its weights "
                "hold no `model.mask_embedding.weight`. Set `mask_token_id` in config.json to the spare vocabulary id "
                "the drafter was trained with, or create the drafter again (`d3d-hf init-drafter`, or "
                "`D3DForDiffusionDrafting.from_autoregressive(target)` then `save_pretrained`)."
            )
        if missing:
            raise ValueError(
                f"The weights at {source} lack {len(missing)} tensor(s) its config.json requires, e.g. {missing[:4]}: "
                "config.json and the weights belong to different drafters, or the save was incomplete. Save the "
                "drafter again with `save_pretrained`, or correct config.json (`num_hidden_layers`, "
                "`block_lora_rank`, `shares_target_weights`, ...)."
            )
        if unexpected:
            raise ValueError(
                f"The weights at {source} hold {len(unexpected)} tensor(s) its config.json has no place for, e.g. "
                f"{unexpected[:4]}: config.json and the weights belong to different drafters. Save the drafter again "
                "with `save_pretrained`, or correct config.json (`num_hidden_layers`, `block_lora_rank`, "
                "`use_qk_norm`, ...)."
            )
        return (model, info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`; a `shares_target_weights` drafter stores only its own weights."""
        if self.config.shares_target_weights:
            state_dict = kwargs.get("state_dict") or self.state_dict()
            kwargs["state_dict"] = {k: v for k, v in state_dict.items() if self.is_drafter_specific(k)}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        masked_positions: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: D3DCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        block_positions: torch.BoolTensor | None = None,
        packed_metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> D3DModelOutput:
        r"""
        Runs the drafter. Arguments as in `D3DModel.forward`, plus:

        Args:
            logits_to_keep (`int`, defaults to 0):
                Compute logits only for the last `logits_to_keep` positions (0 = all positions).

        Returns:
            `D3DModelOutput` with `logits` of shape `(batch_size, num_kept, vocab_size)` in the model dtype.

        Raises:
            RuntimeError: for a `shares_target_weights` drafter whose target weights are not attached.
        """
        self._check_weights_attached()
        outputs = self.model(
            input_ids=input_ids,
            masked_positions=masked_positions,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            block_positions=block_positions,
            packed_metadata=packed_metadata,
        )
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        if self.model.autotune_matmuls and type(self.lm_head) is nn.Linear:  # not a wrapped (e.g. PEFT) head
            outputs.logits = MATMUL_LAYOUTS.linear(hidden_states, self.lm_head.weight, self.lm_head.bias)
        else:
            outputs.logits = self.lm_head(hidden_states)
        return outputs

    def draft_logits(
        self, committed_ids: torch.LongTensor, cache: D3DCache, num_masks: int | None = None
    ) -> torch.FloatTensor:
        """One synchronous draft pass: `drafting_d3d.draft_logits(self, ...)` (arguments, returns and errors there)."""
        return draft_logits(self, committed_ids, cache, num_masks)

    def packed_draft_logits(
        self,
        chain_ids: torch.LongTensor,
        cache: D3DCache,
        hypothesis_chain_lengths: list[int],
        bonus_guesses: list[int],
    ) -> D3DPackedDraft:
        """Packed successor drafting: `drafting_d3d.packed_draft_logits(self, ...)` (arguments, returns and errors
        there)."""
        return packed_draft_logits(self, chain_ids, cache, hypothesis_chain_lengths, bonus_guesses)

    def build_candidate_generator(self, target=None, **kwargs) -> D3DCandidateGenerator:
        """Called by the patched `GenerationMixin._get_candidate_generator` of the target (see
        `hooks_d3d.install_generation_hook`): returns the `D3DCandidateGenerator` for one `generate` call
        (attaching the target's weights first for a `shares_target_weights` drafter).

        Raises:
            ValueError: if the target's vocabulary size differs from the drafter's, and for the prompts and drafters
                `D3DCandidateGenerator` refuses (all before any forward pass).
        """
        if target is not None:
            target_vocab = target.config.get_text_config().vocab_size
            if target_vocab != self.config.vocab_size:
                raise ValueError(
                    f"This D3D drafter has a vocabulary of {self.config.vocab_size} tokens but the target has "
                    f"{target_vocab}: a D3D drafter drafts in its target's own token ids (universal assisted "
                    "decoding across tokenizers is not supported). Make a drafter for this target with "
                    "`D3DForDiffusionDrafting.from_autoregressive(target)`."
                )
        if self.config.shares_target_weights and target is not None and self._attached_target is not target:
            self.attach_target_weights(target)
        return D3DCandidateGenerator(drafter=self, target=target, **kwargs)

    @classmethod
    def from_autoregressive(cls, model: PreTrainedModel, *args, **kwargs) -> D3DForDiffusionDrafting:
        """Initialises a drafter from an autoregressive causal LM of the same tokenizer:
        `initialization_d3d.from_autoregressive(cls, model, ...)` (keyword arguments `num_layers`, `layer_ids`,
        `block_size`, `mask_token_id`, `source_model`, `target_model`, `block_lora_rank`, `block_lora_alpha`,
        `shares_target_weights`; their meaning, the returns and the errors there)."""
        return from_autoregressive(cls, model, *args, **kwargs)


D3DConfig.register_for_auto_class()
D3DForDiffusionDrafting.register_for_auto_class("AutoModel")

__all__ = [
    "D3DCache",
    "D3DForDiffusionDrafting",
    "D3DModel",
    "D3DModelOutput",
    "D3DPackedDraft",
    "D3DPreTrainedModel",
    "causal_attention_mask",
    "draft_attention_mask",
    "gqa_sdpa_attention_forward",
    "kernel_attention_interface",
    "packed_attention_mask",
    "packed_metadata",
    "target_gqa_attention",
]
