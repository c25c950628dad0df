"""The block adapter of D3D drafters: `D3DLinear`, a linear layer with a low-rank adapter that applies only at
draft-block rows ("block LoRA"; d3d-hf docs/DESIGN.md section 8, lesson 3), and its training path.

Part of the self-contained remote-code bundle: imports only torch. Its fused inference paths (`add_block_adapters`,
`FusedProjections`) are in `fast_paths_d3d`, applied from outside (`patches_d3d.apply_fast_paths`).
"""

from __future__ import annotations

import torch
from torch import nn


class D3DLinear(nn.Linear):
    """`nn.Linear` with an optional low-rank adapter applied only at draft-block positions ("block LoRA").

    `forward(x, block_gate)` returns `x W^T + b + block_gate * (alpha / r) * x A^T B^T`, where `block_gate` is
    `(batch_size, seq_len, 1)` (1 at draft-block positions, 0 at committed-context positions) or `None` (no adapter).
    Design choice (d3d-hf docs/DESIGN.md section 8, lesson 3): the committed context and the anchor go through
    the unmodified weights, so an adapted drafter keeps the source model's exact first-token prediction and a KV
    cache identical to the source model's, while the mask positions learn to denoise the block. `lora_B` starts
    at zero, so a fresh adapter leaves the drafter unchanged. Outside autograd the fast paths run the adapters of
    projections that share an input together (`add_block_adapters`, routed by `patches_d3d.apply_fast_paths`); this
    `forward` is the plain path (training's).
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


__all__ = ["D3DLinear"]
