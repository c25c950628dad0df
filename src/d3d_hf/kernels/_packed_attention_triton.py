"""Triton kernels of packed successor-drafting attention (d3d-hf docs/DESIGN.md sections 2 and 5).

Private module: call `d3d_hf.kernels.packed_attention` (or `packed_attention_triton`), which validates the inputs and
checks that Triton can run before importing this file. Importing it imports `triton` and decorates the kernels, and
Triton decides at decoration time whether a kernel is compiled or run by its CPU interpreter: `INTERPRETED` records
which one this process got (the value of `TRITON_INTERPRET` when this module was first imported).

Algorithm: flash-attention forward (online softmax with float32 running max/sum, arXiv 2205.14135), one program per
tile of `BLOCK_M` query rows of one key/value head. A row is one (query token, query head) pair of that head's
grouped-query group, so each key/value tile is loaded once for all heads that share it. The cached prefix is read
without a mask (only the last, partial tile is bounds-checked); for the packed keys the tree mask is computed from the
per-token metadata (`segment_ids`, `positions`, `chain_lengths`) tile by tile, and key tiles that no row of the
program may attend to are skipped. The prefix can be split over several programs (flash-decoding style) when there are
too few query tiles to fill the GPU; a second kernel then merges the partial results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .packed_attention import interpreter_requested

#: Whether the kernels below run in Triton's CPU interpreter (`TRITON_INTERPRET` was on at import).
INTERPRETED = interpreter_requested()

# Running max before any key is seen: finite, so a row that has seen only masked keys gives exp2(-inf - m) = 0 and
# exp2(m - m) = 1 instead of NaN; real scores never come near it.
_NO_MAX = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    allowed,
    qk_scale,
    MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One key tile: scores `q @ k` (`k` is `[BLOCK_D, BLOCK_N]`), online-softmax rescale, `acc += p @ v`."""
    if DOT_FP32:
        k = k.to(tl.float32)
    qk = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if MASKED:
        qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # Probabilities are rounded to the value dtype before the second product, as in flash attention.
    p = p.to(v.dtype)
    if DOT_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _packed_attention_fwd_kernel(
    Q,
    K,
    V,
    Out,
    SegmentIds,
    Positions,
    ChainLengths,
    PartialAcc,
    PartialMax,
    PartialSum,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    batch_size,
    num_kv_heads,
    num_tokens,
    prefix_length,
    tiles_per_split,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kv_head = (pid_bh % num_kv_heads).to(tl.int64)

    # Rows of this program: (token, head-in-group) pairs, row = token * GROUP + head-in-group.
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens * GROUP
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + tok[:, None] * stride_qt + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kv_head * stride_kh
    v_base = V + b * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], _NO_MAX, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Placeholder for the unmasked steps (MASKED=False ignores it).
    no_mask = tl.full([BLOCK_M, BLOCK_N], 1, dtype=tl.int1)

    # 1. This split's share of the cached prefix: every query attends every prefix key.
    num_prefix_tiles = tl.cdiv(prefix_length, BLOCK_N)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_prefix_tiles)
    full_hi = tl.minimum(tile_hi, prefix_length // BLOCK_N)
    for tile in range(tile_lo, full_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd, mask=d_ok[:, None], other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=d_ok[None, :], other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, no_mask, qk_scale, False, DOT_FP32, PRECISION)
    for tile in range(tl.maximum(full_hi, tile_lo), tile_hi):  # the partial last prefix tile, if this split has it
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < prefix_length
        k_mask = n_ok[None, :] & d_ok[:, None]
        k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd, mask=k_mask, other=0.0)
        v_mask = n_ok[:, None] & d_ok[None, :]
        v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=v_mask, other=0.0)
        allowed = n_ok[None, :] & row_ok[:, None]
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, allowed, qk_scale, True, DOT_FP32, PRECISION)

    # 2. The packed tokens (last split only), under the tree mask computed from the metadata.
    if split == num_splits - 1:
        seg_q = tl.load(SegmentIds + tok, mask=row_ok, other=-1).to(tl.int32)
        pos_q = tl.load(Positions + tok, mask=row_ok, other=0).to(tl.int32)
        chain_q = tl.load(ChainLengths + tok, mask=row_ok, other=0).to(tl.int32)
        for start in range(0, num_tokens, BLOCK_N):
            offs_s = start + tl.arange(0, BLOCK_N)
            s_ok = offs_s < num_tokens
            seg_k = tl.load(SegmentIds + offs_s, mask=s_ok, other=-1).to(tl.int32)
            pos_k = tl.load(Positions + offs_s, mask=s_ok, other=0).to(tl.int32)
            # packed_attention_mask (drafting_d3d.py): chain keys below the query's chain length, or the query's
            # own successor block, where the block's first token (position 0) attends only to itself.
            chain = (seg_k[None, :] == 0) & (pos_k[None, :] < chain_q[:, None])
            same_block = (seg_k[None, :] == seg_q[:, None]) & (seg_q[:, None] > 0)
            block = same_block & ((pos_q[:, None] > 0) | (pos_k[None, :] == 0))
            allowed = (chain | block) & s_ok[None, :] & row_ok[:, None]
            if tl.max(allowed.to(tl.int32)) > 0:
                offs_n = prefix_length + offs_s
                k_mask = s_ok[None, :] & d_ok[:, None]
                k = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None] * stride_kd, mask=k_mask, other=0.0)
                v_mask = s_ok[:, None] & d_ok[None, :]
                v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd, mask=v_mask, other=0.0)
                acc, m_i, l_i = _online_softmax_step(
                    acc, m_i, l_i, q, k, v, allowed, qk_scale, True, DOT_FP32, PRECISION
                )

    if SPLIT:
        # Partial results, merged by _packed_attention_merge_kernel: float32 [splits, batch, heads, tokens, (D)].
        num_heads = num_kv_heads * GROUP
        flat = ((split * batch_size + b) * num_heads + head) * num_tokens + tok
        tl.store(PartialMax + flat, m_i, mask=row_ok)
        tl.store(PartialSum + flat, l_i, mask=row_ok)
        acc_ptrs = PartialAcc + flat[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        # A row that may attend to nothing (impossible for packed_metadata's metadata) gives zeros, not NaN.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = (
            Out + b * stride_ob + head[:, None] * stride_oh + tok[:, None] * stride_ot + offs_d[None, :] * stride_od
        )
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _packed_attention_merge_kernel(
    PartialAcc,
    PartialMax,
    PartialSum,
    Out,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    num_splits,
    num_rows,
    num_heads,
    num_tokens,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Merges the per-split (max, sum, unnormalised output) of every (batch, head, token) row."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m = tl.full([BLOCK_R], _NO_MAX, dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for split in range(0, num_splits):
        flat = split * num_rows + rows
        m_s = tl.load(PartialMax + flat, mask=row_ok, other=_NO_MAX)
        l_s = tl.load(PartialSum + flat, mask=row_ok, other=0.0)
        acc_s = tl.load(PartialAcc + flat[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :])
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        l_sum = l_sum * alpha + l_s * beta
        m = m_new
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    b = (rows // (num_heads * num_tokens)).to(tl.int64)
    head = (rows // num_tokens) % num_heads
    tok = rows % num_tokens
    o_ptrs = Out + b[:, None] * stride_ob + head[:, None] * stride_oh + tok[:, None] * stride_ot
    tl.store(o_ptrs + offs_d[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def default_num_splits(
    device: torch.device, num_programs: int, num_prefix_tiles: int, min_tiles_per_split: int = 4
) -> int:
    """How many programs share the prefix of one query tile: enough for about two programs per streaming
    multiprocessor when there are fewer query tiles than that, at least `min_tiles_per_split` key tiles each.
    Always 1 off CUDA (the interpreter runs programs one after another)."""
    if device.type != "cuda" or num_prefix_tiles < 2 * min_tiles_per_split:
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    if num_programs >= sm_count:
        return 1
    wanted = -(-2 * sm_count // num_programs)
    return max(1, min(wanted, num_prefix_tiles // min_tiles_per_split, 64))


def launch_config(
    batch_size: int,
    num_heads: int,
    num_kv_heads: int,
    num_tokens: int,
    prefix_length: int,
    head_dim: int,
    device: torch.device,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> dict[str, int]:
    """Tile sizes and prefix splits `launch` uses for these sizes: `block_m`, `block_n`, `block_d`, `num_splits`,
    `tiles_per_split` (prefix key tiles per split; the last split also takes the packed keys). `None` picks the
    default; tile sizes must be powers of two >= 16 (a `tl.dot` operand needs 16 rows/columns)."""
    group = num_heads // num_kv_heads
    block_d = max(16, _next_power_of_2(head_dim))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    if block_m is None:
        block_m = min(64, max(16, _next_power_of_2(num_tokens * group)))
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"`{name}` must be a power of two >= 16, got {size}.")
    num_m_tiles = triton.cdiv(num_tokens * group, block_m)
    num_prefix_tiles = triton.cdiv(prefix_length, block_n)
    if num_splits is None:
        num_splits = default_num_splits(device, num_m_tiles * batch_size * num_kv_heads, num_prefix_tiles)
    if num_splits < 1:
        raise ValueError(f"`num_splits` must be >= 1, got {num_splits}.")
    # No empty splits: every split but the last gets `tiles_per_split` prefix tiles.
    tiles_per_split = max(1, triton.cdiv(num_prefix_tiles, num_splits))
    num_splits = max(1, min(num_splits, triton.cdiv(num_prefix_tiles, tiles_per_split)))
    return {
        "block_m": block_m,
        "block_n": block_n,
        "block_d": block_d,
        "num_m_tiles": num_m_tiles,
        "num_splits": num_splits,
        "tiles_per_split": tiles_per_split,
    }


def launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_ids: torch.Tensor,
    positions: torch.Tensor,
    chain_lengths: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> int:
    """Runs the kernels on validated inputs, writing `out` (`[B, H, T, D]`, any strides); the knobs are those of
    `launch_config`. Returns the number of prefix splits used."""
    batch_size, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    prefix_length = key.shape[2] - num_tokens
    group = num_heads // num_kv_heads
    config = launch_config(
        batch_size,
        num_heads,
        num_kv_heads,
        num_tokens,
        prefix_length,
        head_dim,
        query.device,
        block_m=block_m,
        block_n=block_n,
        num_splits=num_splits,
    )
    block_m, block_n, block_d = config["block_m"], config["block_n"], config["block_d"]
    num_splits, tiles_per_split = config["num_splits"], config["tiles_per_split"]
    split = num_splits > 1
    if split:
        rows = batch_size * num_heads * num_tokens
        partial_acc = torch.empty(num_splits * rows * head_dim, device=query.device, dtype=torch.float32)
        partial_max = torch.empty(num_splits * rows, device=query.device, dtype=torch.float32)
        partial_sum = torch.empty(num_splits * rows, device=query.device, dtype=torch.float32)
    else:
        partial_acc = partial_max = partial_sum = out  # unused
    launch_options = {}
    if num_warps is not None:
        launch_options["num_warps"] = num_warps
    if num_stages is not None:
        launch_options["num_stages"] = num_stages
    grid = (config["num_m_tiles"], batch_size * num_kv_heads, num_splits)
    _packed_attention_fwd_kernel[grid](
        query,
        key,
        value,
        out,
        segment_ids,
        positions,
        chain_lengths,
        partial_acc,
        partial_max,
        partial_sum,
        *query.stride(),
        *key.stride(),
        *value.stride(),
        *out.stride(),
        batch_size,
        num_kv_heads,
        num_tokens,
        prefix_length,
        tiles_per_split,
        scale * _LOG2E,
        HEAD_DIM=head_dim,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        SPLIT=split,
        # Triton's interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584): there the
        # operands are converted to float32 first. Products of bf16/fp16 values are exact in float32, so this changes
        # only the summation order, not what is rounded.
        DOT_FP32=INTERPRETED,
        # float32 inputs: full-precision products, not TF32.
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        **launch_options,
    )
    if split:
        rows = batch_size * num_heads * num_tokens
        block_r = 32
        _packed_attention_merge_kernel[(triton.cdiv(rows, block_r),)](
            partial_acc,
            partial_max,
            partial_sum,
            out,
            *out.stride(),
            num_splits,
            rows,
            num_heads,
            num_tokens,
            HEAD_DIM=head_dim,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
        )
    return num_splits
