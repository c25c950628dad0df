"""Triton kernels of d3d-hf, each with a plain PyTorch reference (`*_naive`) and an `auto` dispatcher.

Triton is optional (`pip install 'd3d-hf[kernels]'`) and imported only when a Triton backend runs, so this package
imports with torch alone. On CPU the kernels run under Triton's interpreter (`TRITON_INTERPRET=1`) for testing.
"""

from .packed_attention import (
    BACKENDS,
    packed_attention,
    packed_attention_kernel,
    packed_attention_naive,
    packed_attention_triton,
    reference_mask,
    triton_unavailable_reason,
)

__all__ = [
    "BACKENDS",
    "packed_attention",
    "packed_attention_kernel",
    "packed_attention_naive",
    "packed_attention_triton",
    "reference_mask",
    "triton_unavailable_reason",
]
