"""The rank of a drafter's block adapters, changed in place: lowered by truncated SVD (`truncate_block_adapters`) or
raised without changing a draft (`expand_block_adapters`, a warm start with more capacity). Both are re-exported by
`d3d_hf.pruning`; the trainer grows a saved drafter's adapters with `expand_block_adapters` (`--block_lora_rank`)."""

from __future__ import annotations

import torch
from torch import nn

from .modeling import D3DForDiffusionDrafting
from .modeling.adapters_d3d import D3DLinear


def _adapted_modules(drafter: D3DForDiffusionDrafting, none_message: str) -> list[tuple[str, D3DLinear]]:
    """The drafter's adapted projections, after refusing a drafter without adapters (`none_message`) or with a
    projection wrapped by PEFT, whose factors these functions cannot reach."""
    if drafter.config.block_lora_rank <= 0:
        raise ValueError(f"This drafter has no block adapters (`block_lora_rank` is 0): {none_message}")
    wrapped = [n for n, m in drafter.named_modules() if n.endswith("_proj") and not isinstance(m, D3DLinear)]
    if wrapped:
        raise ValueError(f"Projections {wrapped[:3]} are wrapped (e.g. by PEFT): call `merge_and_unload()` first.")
    return [(n, m) for n, m in drafter.named_modules() if isinstance(m, D3DLinear) and m.rank > 0]


def _set_factors(module: D3DLinear, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> None:
    """Replaces `module`'s adapter by `scaling * lora_b @ lora_a`, keeping its dtype and `requires_grad`."""
    dtype = module.lora_A.dtype
    module.rank, module.lora_scaling = lora_a.shape[0], scaling
    module.lora_A = nn.Parameter(lora_a.to(dtype).contiguous(), requires_grad=module.lora_A.requires_grad)
    module.lora_B = nn.Parameter(lora_b.to(dtype).contiguous(), requires_grad=module.lora_B.requires_grad)


@torch.no_grad()
def truncate_block_adapters(drafter: D3DForDiffusionDrafting, rank: int) -> dict[str, float]:
    r"""Lowers the rank of every block adapter of `drafter`, in place, to `rank`: each adapter's update
    `s B A` (`s = block_lora_alpha / r`) is replaced by its best rank-`rank` approximation in the Frobenius norm
    (Eckart-Young: the truncated SVD), stored as new `lora_A` (`rank x in`) and `lora_B` (`out x rank`) with
    `s' = block_lora_alpha / rank`; `config.block_lora_rank` becomes `rank`. The SVD is taken of the small
    `r x r` core after QR factorisations of `B` and `A^T`, in float32, and the new factors keep the adapters' dtype.

    Args:
        drafter (`D3DForDiffusionDrafting`): a drafter with block adapters (`config.block_lora_rank > 0`), whose
            projections are not wrapped (merge or unload a PEFT model first).
        rank (`int`): the new rank, `1 <= rank <= config.block_lora_rank`.

    Returns:
        `dict[str, float]`: for each adapted module (its name in `drafter.named_modules()`), the fraction of the
        update's squared Frobenius norm that the truncation keeps (1.0 = nothing lost).

    Raises:
        ValueError: if the drafter has no block adapters, `rank` is out of range, or a projection is wrapped.
    """
    adapted = _adapted_modules(drafter, "there is no rank to lower.")
    current = drafter.config.block_lora_rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= current:
        raise ValueError(f"`rank` must be a whole number in [1, {current}] (the adapters' rank), got {rank!r}.")
    alpha = drafter.config.block_lora_alpha
    kept = {}
    for name, module in adapted:
        lora_a, lora_b = module.lora_A.float(), module.lora_B.float() * module.lora_scaling
        q_b, r_b = torch.linalg.qr(lora_b)  # B = Q_b R_b, A^T = Q_a R_a: s B A = Q_b (R_b R_a^T) Q_a^T
        q_a, r_a = torch.linalg.qr(lora_a.t())
        u, sigma, vh = torch.linalg.svd(r_b @ r_a.t(), full_matrices=False)
        energy = sigma.square()
        kept[name] = float(energy[:rank].sum() / energy.sum()) if float(energy.sum()) > 0 else 1.0
        scaling = alpha / rank
        k = sigma[:rank].numel()  # below `rank` when the update has lower rank (a projection narrower than it)
        new_b = (q_b @ u[:, :k]) * sigma[:k] / scaling
        new_a = vh[:k] @ q_a.t()
        if k < rank:  # padded with zeros to the drafter's one rank: the same update
            new_b = torch.cat([new_b, new_b.new_zeros(new_b.shape[0], rank - k)], dim=1)
            new_a = torch.cat([new_a, new_a.new_zeros(rank - k, new_a.shape[1])])
        _set_factors(module, new_a, new_b, scaling)
    drafter.config.block_lora_rank = rank
    drafter.config.block_lora_full_layers = 0  # the full-rank adapters of the last layers were lowered too
    return kept


@torch.no_grad()
def expand_block_adapters(
    drafter: D3DForDiffusionDrafting, rank: int, generator: torch.Generator | None = None
) -> D3DForDiffusionDrafting:
    r"""Raises the rank of every block adapter of `drafter`, in place, to `rank`, without changing what it drafts:
    the inverse direction of `truncate_block_adapters`, for training a saved drafter further with more capacity (a
    warm start at a higher rank). Each adapter's update `s B A` (`s = block_lora_alpha / r`) is kept exactly: the
    `rank - r` new rows of `lora_A` are drawn as for fresh adapters (N(0, 1/in_features)), the new columns of `lora_B`
    are zeros (as in LoRA's own initialisation, Hu et al. 2021, section 4.1), and the old columns of `lora_B` are
    multiplied by `s / s'` with `s' = block_lora_alpha / rank`. `config.block_lora_rank` becomes `rank`. The new
    factors keep the adapters' dtype and device, and their `requires_grad`.

    Args:
        drafter (`D3DForDiffusionDrafting`): a drafter with block adapters (`config.block_lora_rank > 0`) and no
            full-rank layers (`block_lora_full_layers = 0`), whose projections are not wrapped (merge or unload a
            PEFT model first).
        rank (`int`): the new rank, `> config.block_lora_rank`.
        generator (`torch.Generator`, *optional*): draws the new rows of `lora_A` (a CPU generator; default: the
            global one).

    Returns:
        `D3DForDiffusionDrafting`: `drafter` itself.

    Raises:
        ValueError: if the drafter has no block adapters or has full-rank layers, `rank` is not a whole number above
            the adapters' rank, or a projection is wrapped.
    """
    adapted = _adapted_modules(drafter, "add them with `add_block_adapter`.")
    current = drafter.config.block_lora_rank
    if getattr(drafter.config, "block_lora_full_layers", 0):
        raise ValueError(
            f"This drafter's last {drafter.config.block_lora_full_layers} layers have full-rank block adapters, whose "
            "rank cannot grow: train it at its own rank, or lower it first with `truncate_block_adapters`."
        )
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= current:
        raise ValueError(f"`rank` must be a whole number above {current} (the adapters' rank), got {rank!r}.")
    scaling = drafter.config.block_lora_alpha / rank
    for _, module in adapted:
        lora_a, lora_b = module.lora_A, module.lora_B
        extra = torch.randn(rank - module.rank, module.in_features, generator=generator) / module.in_features**0.5
        new_a = torch.cat([lora_a, extra.to(lora_a)])
        zeros = lora_b.new_zeros(lora_b.shape[0], rank - module.rank)
        new_b = torch.cat([lora_b * (module.lora_scaling / scaling), zeros], dim=1)
        _set_factors(module, new_a, new_b, scaling)
    drafter.config.block_lora_rank = rank
    return drafter


__all__ = ["expand_block_adapters", "truncate_block_adapters"]
