"""Attention of a packed successor-drafting pass: plain PyTorch reference, Triton kernel and `auto` dispatcher.

The packed pass (d3d-hf docs/DESIGN.md section 2) drafts the successor block of several verification outcomes
(hypotheses) in one forward: a causal chain of tokens followed by one successor block per hypothesis, after the
drafter's cached prefix. Its attention mask is a function of three small per-token tensors
(`d3d_hf.modeling.drafting_d3d.packed_metadata`), so the Triton kernel computes it on the fly instead of reading a
dense `[T, P + T]` mask (DESIGN.md section 5). The Triton kernel is forward (inference) only; the naive reference is
differentiable.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "naive", "triton")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_TRITON_HEAD_DIM = 256
_TRITON_MODULE = __package__ + "._packed_attention_triton"


def interpreter_requested() -> bool:
    """Whether `TRITON_INTERPRET` asks for Triton's CPU interpreter (the one parser of the switch in d3d-hf)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def _check_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_ids: torch.Tensor,
    positions: torch.Tensor,
    chain_lengths: torch.Tensor,
    scale: float | None,
) -> tuple[int, int, float]:
    """Validates the arguments; returns `(prefix_length, num_key_value_groups, scale)`."""
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"`{name}` must be a 4-D tensor [batch, heads, seq_len, head_dim], got {shape}.")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"`{name}` must be float32, bfloat16 or float16, got {tensor.dtype}.")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(
            f"`query`, `key` and `value` must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}."
        )
    if not query.device == key.device == value.device:
        raise ValueError(
            f"`query`, `key` and `value` must be on one device, got {query.device}, {key.device}, {value.device}."
        )
    if key.shape != value.shape:
        raise ValueError(
            f"`key` and `value` must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}."
        )
    batch_size, num_heads, num_tokens, head_dim = query.shape
    kv_batch, num_kv_heads, total_keys, kv_head_dim = key.shape
    if kv_batch != batch_size:
        raise ValueError(f"`key`/`value` batch size {kv_batch} differs from `query`'s {batch_size}.")
    if kv_head_dim != head_dim:
        raise ValueError(f"`key`/`value` head_dim {kv_head_dim} differs from `query`'s {head_dim}.")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"`query`'s {num_heads} heads must be a multiple of the {num_kv_heads} key/value heads (grouped-query "
            "attention: query head h uses key/value head h // (num_heads // num_kv_heads))."
        )
    if total_keys < num_tokens:
        raise ValueError(
            f"`key`/`value` hold {total_keys} positions but there are {num_tokens} query tokens; they must hold the "
            "cached prefix followed by the packed tokens (seq_len = prefix_length + T)."
        )
    for name, tensor in (("segment_ids", segment_ids), ("positions", positions), ("chain_lengths", chain_lengths)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.shape[0] != num_tokens:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(
                f"`{name}` must be a 1-D tensor of the T={num_tokens} packed tokens (see packed_metadata), got {shape}."
            )
        if tensor.dtype == torch.bool or tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            raise ValueError(f"`{name}` must be an integer tensor, got {tensor.dtype}.")
        if tensor.device != query.device:
            raise ValueError(f"`{name}` is on {tensor.device} but `query` is on {query.device}.")
    if scale is None:
        scale = head_dim**-0.5
    elif not math.isfinite(float(scale)):
        raise ValueError(f"`scale` must be a finite number, got {scale}.")
    return total_keys - num_tokens, num_heads // num_kv_heads, float(scale)


def reference_mask(
    segment_ids: torch.Tensor, positions: torch.Tensor, chain_lengths: torch.Tensor, prefix_length: int
) -> torch.BoolTensor:
    """The kernel's mask rule, materialised: `[T, prefix_length + T]` booleans, `True` where query `t` may attend key
    `s` (keys: the `prefix_length` cached tokens, then packed token `j` at index `prefix_length + j`).

    The rule, in the kernel's terms (what `_packed_attention_fwd_kernel` evaluates per tile): every query sees the
    whole cached prefix; a chain key (`segment_ids[s] == 0`) is seen by queries whose `chain_lengths` exceed its
    position; a key of successor block `b > 0` is seen by the queries of block `b` only, and a block's first token
    (`positions == 0`, the bonus guess) sees no other token of its block. Kept here, independent of the drafter's own
    `drafting_d3d.packed_attention_mask`, so that the tests check one against the other.
    """
    query_segment, key_segment = segment_ids.view(-1, 1), segment_ids.view(1, -1)
    query_position, key_position = positions.view(-1, 1), positions.view(1, -1)
    sees_chain_key = (key_segment == 0) & (key_position < chain_lengths.view(-1, 1))
    in_own_block = (key_segment > 0) & (key_segment == query_segment)
    anchor_sees_only_itself = (query_position == 0) & (key_position != 0)
    packed = sees_chain_key | (in_own_block & ~anchor_sees_only_itself)
    cached = packed.new_ones((segment_ids.numel(), prefix_length))
    return torch.cat([cached, packed], dim=1)


def packed_attention_kernel():
    """The `d3d.packed_attention_kernels` entry point d3d_hf declares: `(packed_attention_triton,
    triton_unavailable_reason)`, which the drafter's packed passes use through
    `d3d_hf.modeling.drafting_d3d.resolve_packed_attention_kernel`."""
    return packed_attention_triton, triton_unavailable_reason


def packed_attention_naive(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_ids: torch.Tensor,
    positions: torch.Tensor,
    chain_lengths: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain PyTorch reference of `packed_attention`: the dense mask of `reference_mask`, key/value heads repeated
    for grouped-query attention, and
    `torch.nn.functional.scaled_dot_product_attention` in the inputs' dtype. Arguments, returns and errors are those
    of `packed_attention`. Builds a `[T, prefix_length + T]` boolean mask and `num_heads`-head copies of `key` and
    `value`; meant for testing and CPU use.
    """
    prefix_length, group, scale = _check_inputs(query, key, value, segment_ids, positions, chain_lengths, scale)
    mask = reference_mask(segment_ids, positions, chain_lengths, prefix_length)
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    # Rows that may attend to nothing (never produced by packed_metadata) are zeros, as in the Triton kernel.
    return out.masked_fill(~mask.any(dim=-1)[:, None], 0.0)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """Why the Triton kernel cannot run on tensors of `device`, or `None` when it can.

    It runs on CUDA tensors, and on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1` in the environment
    before the kernel is first used in the process; slow, for tests).
    """
    device = torch.device(device)
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"Triton is not installed ({error}); install it with `pip install 'd3d-hf[kernels]'` (needs a GPU)."
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"the Triton kernel runs on CUDA tensors (or on CPU under TRITON_INTERPRET=1), got {device.type}."
    if not interpreter_requested():
        return (
            "the tensors are on CPU and TRITON_INTERPRET is not set to 1: the Triton kernel needs CUDA tensors, or "
            "Triton's CPU interpreter (set TRITON_INTERPRET=1 before the first Triton call); use backend='naive' or "
            "'auto' on CPU."
        )
    module = sys.modules.get(_TRITON_MODULE)
    if module is not None and not module.INTERPRETED:
        return (
            "TRITON_INTERPRET=1 was set after the Triton kernels were compiled for the GPU in this process; Triton "
            "chooses interpreter or compiler when a kernel is defined, so set it before the first Triton call."
        )
    return None


def packed_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_ids: torch.Tensor,
    positions: torch.Tensor,
    chain_lengths: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton version of `packed_attention` with its tuning knobs exposed (benchmarks and tests).

    Arguments, returns and errors are those of `packed_attention`, plus:

    Args:
        out (`torch.Tensor`, *optional*): `[B, H, T, D]` tensor in `query`'s dtype and device to write the result
            into (any strides); a new contiguous tensor by default.
        block_m (`int`, *optional*): query rows per program, a power of two >= 16. A row is one (token, query head)
            pair of a grouped-query group, so each key/value tile is read once for the whole group. Default:
            `min(64, next_power_of_2(T * num_heads // num_kv_heads))`, at least 16.
        block_n (`int`, *optional*): keys per tile, a power of two >= 16. Default 64 (32 for head_dim > 128).
        num_splits (`int`, *optional*): programs that share one query tile's prefix (flash-decoding); their partial
            results are merged by a second kernel. Default: 1, or enough for about two programs per streaming
            multiprocessor when there are fewer query tiles than that (CUDA only).
        num_warps, num_stages (`int`, *optional*): Triton launch options (Triton's defaults when `None`).

    Raises:
        RuntimeError: if Triton cannot run on these tensors (`triton_unavailable_reason` says why), or if autograd
            would need gradients through it (the kernel is forward only).
    """
    _check_inputs(query, key, value, segment_ids, positions, chain_lengths, scale)
    reason = triton_unavailable_reason(query.device)
    if reason is not None:
        raise RuntimeError(f"packed_attention(backend='triton') cannot run: {reason}")
    if _needs_grad(query, key, value):
        raise RuntimeError(
            "The Triton packed-attention kernel is forward only (no backward); run it under torch.no_grad() or "
            "torch.inference_mode(), or use backend='naive' (or 'auto', which does) when gradients are needed."
        )
    head_dim = query.shape[-1]
    if head_dim > _MAX_TRITON_HEAD_DIM:
        raise ValueError(f"The Triton kernel supports head_dim <= {_MAX_TRITON_HEAD_DIM}, got {head_dim}.")
    scale = head_dim**-0.5 if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"`out` must be a {tuple(query.shape)} {query.dtype} tensor on {query.device}, got {tuple(out.shape)} "
            f"{out.dtype} on {out.device}."
        )
    kernels = importlib.import_module(_TRITON_MODULE)
    with torch.no_grad():
        kernels.launch(
            query,
            key,
            value,
            segment_ids,
            positions,
            chain_lengths,
            out,
            scale,
            block_m=block_m,
            block_n=block_n,
            num_splits=num_splits,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    return out


def packed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_ids: torch.Tensor,
    positions: torch.Tensor,
    chain_lengths: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of a packed successor-drafting pass over `[cached prefix | packed tokens]` (d3d-hf
    docs/DESIGN.md sections 2 and 5).

    Query `t` attends key `s` iff `s < P` (the cached prefix), or `s` is a chain token (`segment_ids[s] == 0`) with
    `positions[s] < chain_lengths[t]`, or `s` is in `t`'s own successor block (`segment_ids[s] == segment_ids[t] >
    0`) and `positions[t] > 0 or positions[s] == 0`: exactly `packed_attention_mask(segment_ids, positions,
    chain_lengths, P)` of `d3d_hf.modeling.drafting_d3d` (key index `P + j` is packed token `j`). The Triton kernel
    computes this rule from the metadata on the fly, flash-attention style (online softmax, arXiv 2205.14135), and
    never materialises the dense mask. The Triton kernel is forward only (inference): with grad mode on and an input
    that requires grad, `"auto"` uses the naive backend (differentiable) and `"triton"` raises.

    Args:
        query (`torch.Tensor` of shape `(batch_size, num_heads, T, head_dim)`): queries of the `T` packed tokens.
            float32, bfloat16 or float16.
        key (`torch.Tensor` of shape `(batch_size, num_kv_heads, P + T, head_dim)`): the `P` cached-prefix keys,
            then the packed tokens' keys in packed order; `query`'s dtype and device. Grouped-query attention:
            `num_heads % num_kv_heads == 0` and query head `h` uses key/value head `h // (num_heads // num_kv_heads)`.
        value (`torch.Tensor`, shaped like `key`): the matching values.
        segment_ids, positions, chain_lengths (`torch.LongTensor` (any integer dtype) of shape `(T,)`): the
            per-token metadata returned by `d3d_hf.modeling.drafting_d3d.packed_metadata`, shared across the batch,
            on `query`'s device.
        scale (`float`, *optional*): softmax scale; defaults to `head_dim ** -0.5`.
        backend (`str`, *optional*, defaults to `"auto"`): `"naive"` (dense mask + PyTorch SDPA,
            `packed_attention_naive`), `"triton"` (`packed_attention_triton`: CUDA tensors, or CPU tensors under
            `TRITON_INTERPRET=1`) or `"auto"` (Triton for CUDA tensors when Triton imports and no gradient is needed,
            else naive).

    Returns:
        `torch.Tensor` of shape `(batch_size, num_heads, T, head_dim)` in `query`'s dtype. Softmax statistics and
        accumulation are float32 in the Triton kernel (and in SDPA's fused kernels; the naive backend runs SDPA in the
        inputs' dtype). The Triton kernel supports head_dim up to 256 (non-powers of two such as 80 or 96 are padded
        inside the kernel) and uses full float32 products (no TF32) for float32 inputs.

    Raises:
        ValueError: on an unknown `backend`; shapes, dtypes or devices that do not match the description above;
            metadata that is not a 1-D integer tensor of length `T`; a non-finite `scale`.
        RuntimeError: with `backend="triton"`, when Triton cannot run (not installed, or the tensors are not on CUDA
            and `TRITON_INTERPRET` is not set to 1), or when an input requires grad with grad mode on (forward only).

    Example:
        >>> from d3d_hf.modeling.drafting_d3d import packed_metadata
        >>> meta = packed_metadata(chain_length=3, hypothesis_chain_lengths=[1, 3], block_size=4)  # T = 3 + 2 * 4
        >>> q = torch.randn(1, 4, 11, 64)
        >>> k, v = torch.randn(2, 1, 2, 20 + 11, 64)  # 2 key/value heads, 20 cached positions
        >>> packed_attention(q, k, v, *meta).shape
        torch.Size([1, 4, 11, 64])
    """
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}.")
    if backend == "auto":
        use_triton = (
            query.device.type == "cuda"
            and not _needs_grad(query, key, value)
            and triton_unavailable_reason(query.device) is None
        )
        backend = "triton" if use_triton else "naive"
    if backend == "triton":
        return packed_attention_triton(query, key, value, segment_ids, positions, chain_lengths, scale=scale)
    return packed_attention_naive(query, key, value, segment_ids, positions, chain_lengths, scale=scale)


__all__ = [
    "BACKENDS",
    "packed_attention_kernel",
    "reference_mask",
    "packed_attention",
    "packed_attention_naive",
    "packed_attention_triton",
    "triton_unavailable_reason",
]
