"""Packed successor-drafting attention (d3d_hf.kernels): Triton kernel against the PyTorch reference.

Without a GPU the Triton kernel runs under Triton's CPU interpreter: `TRITON_INTERPRET=1` is set while this module
imports the kernel module (Triton decides interpreter or compiler when a kernel is defined) and again for each test,
and restored in between so no other test module sees it. With a GPU the same tests run the compiled kernel on CUDA.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"

_saved_interpret = os.environ.get("TRITON_INTERPRET")
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton", reason="Triton is not installed (pip install -e '.[kernels]')")
    _kernels = importlib.import_module("d3d_hf.kernels._packed_attention_triton")
finally:
    if _saved_interpret is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved_interpret

from d3d_hf.modeling.drafting_d3d import packed_metadata  # noqa: E402

from d3d_hf.kernels import packed_attention, packed_attention_naive, packed_attention_triton  # noqa: E402

if INTERPRET and not _kernels.INTERPRETED:
    pytest.skip(
        "the Triton kernels were defined for the GPU before this module set TRITON_INTERPRET=1", allow_module_level=True
    )


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(batch, heads, kv_heads, head_dim, prefix, block, chain, hypotheses, dtype, seed=0, transposed=False):
    """Random q/k/v (N(0, 1)) and the metadata of `packed_metadata(chain, hypotheses, block)`."""
    meta = tuple(m.to(DEVICE) for m in packed_metadata(chain, hypotheses, block))
    tokens = meta[0].shape[0]
    gen = torch.Generator().manual_seed(seed)

    def make(h, length):
        if transposed:  # [B, S, H, D] storage seen as [B, H, S, D], as attention layers produce it
            return torch.randn(batch, length, h, head_dim, generator=gen).to(DEVICE, dtype).transpose(1, 2)
        return torch.randn(batch, h, length, head_dim, generator=gen).to(DEVICE, dtype)

    return make(heads, tokens), make(kv_heads, prefix + tokens), make(kv_heads, prefix + tokens), meta


def _rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _hyps(count, chain):
    """`count` hypotheses' chain lengths, the longest first (count == block: every outcome 0..block-1 drafts)."""
    return [max(chain - i, 0) for i in range(count)]


# (batch, heads, kv_heads, head_dim, prefix, block, chain, hypothesis count, tuning knobs); chain = committed
# tokens since the last call + the block - 1 drafts being verified.
CASES = [
    (1, 4, 2, 64, 0, 1, 1, 1, {}),
    (2, 4, 2, 64, 1, 4, 3, 3, {}),
    (1, 3, 1, 96, 37, 4, 5, 4, {}),
    (1, 4, 2, 80, 130, 16, 17, 3, {}),
    (1, 3, 1, 64, 37, 32, 31, 1, {}),
    (1, 4, 2, 64, 130, 16, 15, 16, {"block_m": 32}),
    (1, 4, 2, 80, 130, 4, 3, 4, {"block_m": 16, "block_n": 16, "num_splits": 3}),
    (2, 3, 1, 96, 37, 16, 15, 3, {"block_n": 16, "num_splits": 2}),
]


def _case_id(case):
    batch, heads, kv_heads, head_dim, prefix, block, chain, count, knobs = case
    extra = "".join(f"-{k.replace('_', '')}{v}" for k, v in knobs.items())
    return f"B{batch}-H{heads}x{kv_heads}-D{head_dim}-P{prefix}-bs{block}-C{chain}-N{count}{extra}"


# Relative error vs a float32 reference: float32 differs only by summation order; bfloat16/float16 round the output
# and, as flash attention does, the probabilities before the second product.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_triton_matches_naive(case, dtype):
    batch, heads, kv_heads, head_dim, prefix, block, chain, count, knobs = case
    q, k, v, meta = _inputs(batch, heads, kv_heads, head_dim, prefix, block, chain, _hyps(count, chain), dtype)
    reference = packed_attention_naive(q.float(), k.float(), v.float(), *meta)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    result = packed_attention_triton(q, k, v, *meta, out=out, **knobs)
    assert result is out and result.dtype == dtype and result.shape == q.shape
    assert not out.isnan().any()
    assert _rel_err(out, reference) < TOLERANCE[dtype]
    if dtype != torch.float32:  # no worse than a few times the naive backend's own rounding
        naive = packed_attention_naive(q, k, v, *meta)
        assert _rel_err(out, reference) < 4 * _rel_err(naive, reference) + 1e-3


def test_triton_float16_strided_inputs_and_scale():
    q, k, v, meta = _inputs(1, 4, 2, 64, 37, 4, 3, [3, 1], torch.float16, seed=1, transposed=True)
    assert not q.is_contiguous()
    reference = packed_attention_naive(q.float(), k.float(), v.float(), *meta, scale=0.3)
    out = torch.full((1, q.shape[2], 4, 64), float("nan"), dtype=torch.float16, device=DEVICE).transpose(1, 2)
    packed_attention_triton(q, k, v, *(m.to(torch.int32) for m in meta), scale=0.3, out=out)
    assert _rel_err(out, reference) < TOLERANCE[torch.float16]


def _loop_attention(q, k, v, segment_ids, positions, chain_lengths, scale):
    """Attention written out one (batch, head, query) at a time, with the rule of packed_attention_mask restated."""
    batch, heads, tokens, _ = q.shape
    prefix = k.shape[2] - tokens
    group = heads // k.shape[1]
    out = torch.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            for t in range(tokens):
                keys = list(range(prefix))
                for j in range(tokens):
                    in_chain = segment_ids[j] == 0 and positions[j] < chain_lengths[t]
                    own_block = segment_ids[j] == segment_ids[t] > 0 and (positions[t] > 0 or positions[j] == 0)
                    if in_chain or own_block:
                        keys.append(prefix + j)
                scores = [float(q[b, h, t] @ k[b, h // group, s]) * scale for s in keys]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                for w, s in zip(weights, keys, strict=True):
                    out[b, h, t] += w / sum(weights) * v[b, h // group, s]
    return out


def test_naive_matches_loop_attention():
    q, k, v, meta = _inputs(2, 4, 2, 8, 3, 3, 4, [4, 1, 0], torch.float32, seed=2)
    scale = 0.5
    expected = _loop_attention(q.cpu(), k.cpu(), v.cpu(), *(m.tolist() for m in meta), scale)
    torch.testing.assert_close(packed_attention_naive(q, k, v, *meta, scale=scale).cpu(), expected)


def test_auto_backend():
    q, k, v, meta = _inputs(1, 2, 1, 16, 5, 2, 2, [2, 0], torch.float32)
    naive = packed_attention_naive(q, k, v, *meta)
    auto = packed_attention(q, k, v, *meta)
    if DEVICE == "cpu":  # auto never uses the interpreter
        assert torch.equal(auto, naive)
    else:
        torch.testing.assert_close(auto, packed_attention(q, k, v, *meta, backend="triton"))


def test_rows_without_keys_are_zero():
    # Not packed_metadata's output: a chain token that may see no chain token and no prefix (P = 0).
    segment_ids, positions, chain_lengths = (torch.tensor(x, device=DEVICE) for x in ([0, 0], [0, 1], [0, 2]))
    q, k, v = (torch.randn(1, 2, 2, 16, device=DEVICE) for _ in range(3))
    for backend in ("naive", "triton"):
        out = packed_attention(q, k, v, segment_ids, positions, chain_lengths, backend=backend)
        assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
        assert not out.isnan().any()


def _bad_inputs(**changes):
    q, k, v, meta = _inputs(1, 4, 2, 16, 3, 2, 1, [1, 0], torch.float32)
    args = {"query": q, "key": k, "value": v, "segment_ids": meta[0], "positions": meta[1], "chain_lengths": meta[2]}
    args.update({name: change(args) for name, change in changes.items()})
    return args


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"query": lambda a: a["query"][0]}, "4-D"),
        ({"key": lambda a: a["key"][:, :, :2], "value": lambda a: a["value"][:, :, :2]}, "packed tokens"),
        ({"value": lambda a: a["value"][:, :1]}, "same shape"),
        (
            {
                "key": lambda a: a["key"][:, :1].repeat(1, 3, 1, 1),
                "value": lambda a: a["value"][:, :1].repeat(1, 3, 1, 1),
            },
            "multiple",
        ),
        ({"query": lambda a: a["query"][..., :8]}, "head_dim"),
        ({"key": lambda a: a["key"].double(), "value": lambda a: a["value"].double()}, "float32, bfloat16"),
        ({"query": lambda a: a["query"].half()}, "share a dtype"),
        ({"positions": lambda a: a["positions"][:-1]}, "positions"),
        ({"chain_lengths": lambda a: a["chain_lengths"].float()}, "integer"),
        ({"segment_ids": lambda a: a["segment_ids"][None]}, "1-D"),
    ],
    ids=[
        "query-3d",
        "key-too-short",
        "value-shape",
        "heads-not-multiple",
        "head-dim",
        "float64",
        "mixed-dtype",
        "metadata-length",
        "float-metadata",
        "2d-metadata",
    ],
)
@pytest.mark.parametrize("backend", ["naive", "triton"])
def test_invalid_inputs_raise(changes, match, backend):
    with pytest.raises(ValueError, match=match):
        packed_attention(**_bad_inputs(**changes), backend=backend)


def test_unknown_backend_and_bad_knobs_raise():
    with pytest.raises(ValueError, match="backend"):
        packed_attention(**_bad_inputs(), backend="flash")
    with pytest.raises(ValueError, match="block_n"):
        packed_attention_triton(**_bad_inputs(), block_n=24)
    with pytest.raises(ValueError, match="`out`"):
        packed_attention_triton(**_bad_inputs(), out=torch.empty(1, 4, 4, 8, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-only error")
def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        packed_attention(**_bad_inputs(), backend="triton")
    assert torch.equal(packed_attention(**_bad_inputs()), packed_attention(**_bad_inputs(), backend="naive"))


def test_triton_is_forward_only():
    args = _bad_inputs()
    args["query"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="forward only"):
        packed_attention(**args, backend="triton")
    packed_attention(**args).sum().backward()  # auto picks the differentiable naive backend
    assert args["query"].grad is not None
    with torch.no_grad():
        torch.testing.assert_close(
            packed_attention(**args, backend="triton"), packed_attention(**args, backend="naive")
        )


def test_triton_not_installed_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    with pytest.raises(RuntimeError, match="not installed"):
        packed_attention(**_bad_inputs(), backend="triton")
    assert packed_attention(**_bad_inputs()).shape == (1, 4, 5, 16)  # auto falls back to naive


def test_drafter_packed_pass_uses_the_kernel_and_matches_the_dense_mask(monkeypatch):
    """`packed_draft_logits` through the registered kernel (`packed_attention_implementation="kernel"`; on CPU under
    the interpreter) equals the dense-mask path; "auto" takes the kernel on CUDA only."""
    from d3d_hf.modeling import drafting_d3d
    from d3d_hf.modeling.drafting_d3d import D3DCache

    from d3d_hf import D3DForDiffusionDrafting

    sys.path.insert(0, os.path.dirname(__file__))
    from _tiny import random_prompt, tiny_target

    drafter = D3DForDiffusionDrafting.from_autoregressive(tiny_target("qwen3"), block_size=4).to(DEVICE)
    cache = D3DCache()
    drafter.draft_logits(random_prompt(9).to(DEVICE), cache)
    chain = torch.tensor([[5, 6, 7]], device=DEVICE)
    kernel, _ = drafting_d3d._registered_kernel()  # found through the d3d.packed_attention_kernels entry point
    assert kernel is packed_attention_triton
    calls = []
    monkeypatch.setitem(
        drafting_d3d._PACKED_ATTENTION_KERNEL, "kernel", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    drafter.model.packed_attention_implementation = "kernel"
    with_kernel = drafter.packed_draft_logits(chain, cache, [0, 2, 3], [11, 12, 13])
    assert len(calls) == drafter.config.num_hidden_layers
    drafter.model.packed_attention_implementation = "auto"
    drafter.packed_draft_logits(chain, cache, [0, 2, 3], [11, 12, 13])
    assert len(calls) == (2 if DEVICE == "cuda" else 1) * drafter.config.num_hidden_layers
    drafter.model.packed_attention_implementation = "dense"
    dense = drafter.packed_draft_logits(chain, cache, [0, 2, 3], [11, 12, 13])
    assert len(calls) == (2 if DEVICE == "cuda" else 1) * drafter.config.num_hidden_layers
    torch.testing.assert_close(with_kernel.logits, dense.logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(with_kernel.key_states, dense.key_states, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("seed", range(6))
def test_kernel_reference_mask_equals_the_drafters_mask_rule(seed):
    """The kernel's own `reference_mask` and the drafter's `packed_attention_mask` are written independently; they
    must agree on random packed layouts (odd chain lengths, repeated and empty hypotheses, block size 1)."""
    from d3d_hf.modeling.drafting_d3d import packed_attention_mask

    from d3d_hf.kernels import reference_mask

    gen = torch.Generator().manual_seed(seed)
    chain = int(torch.randint(1, 12, (1,), generator=gen))
    block = int(torch.randint(1, 6, (1,), generator=gen))
    hypotheses = torch.randint(0, chain + 1, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
    meta = packed_metadata(chain, hypotheses.tolist(), block)
    prefix = int(torch.randint(0, 7, (1,), generator=gen))
    assert torch.equal(reference_mask(*meta, prefix), packed_attention_mask(*meta, prefix))


def test_packed_attention_implementation_refuses_what_cannot_run():
    from d3d_hf.modeling.drafting_d3d import resolve_packed_attention_kernel

    with pytest.raises(ValueError, match="packed_attention_implementation"):
        resolve_packed_attention_kernel("triton", torch.device(DEVICE), 1)
    with pytest.raises(RuntimeError, match="batch"):
        resolve_packed_attention_kernel("kernel", torch.device(DEVICE), 2)
    assert resolve_packed_attention_kernel("dense", torch.device(DEVICE), 1) is None
