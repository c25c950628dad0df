"""Fused successor drafting: the next round's draft blocks computed inside this round's verification forward.

Part of the self-contained remote-code bundle: imports only the Python standard library, torch and its siblings.

A D3D drafter that shares its target's weights (`shares_target_weights`, every target layer in order) differs from
the target only at draft-block rows: there the input is the mask embedding and every adapted projection adds its
block adapter (`adapters_d3d.D3DLinear`); committed rows go through the target's own weights. So the target can
compute a draft block itself, in the forward that verifies the current candidates: after each *anchor* (a verified
row where the accepted path may end: the last committed token or a candidate), `m` mask rows that attend to the
anchor's own history (the cache, the committed rows, the anchor's ancestors and the anchor) and to each other, at the
positions that follow the anchor. These are exactly the rows of a synchronous draft pass anchored there
(`drafting_d3d.draft_logits`; the packed successor drafting of arXiv 2611.06425, without a second pass): if the
accepted path ends at an anchor, the target's row there gives the bonus token and the anchor's mask rows are the
next round's drafts, with no draft pass. The target's rows attend to no block row and their values are the target's
own (up to the rounding of a forward over more rows, as for any tree verification); the block rows' keys and values
are dropped from the cache with the rejected nodes (`tree_d3d.keep_cache_path`).

The pieces: `fused_drafting_unavailable` (whether a (target, drafter) pair can do it, and why not),
`successor_attention_inputs` (the verification's mask and positions with the blocks appended),
`patches_d3d.block_rows_on_target` (while open, the target's forwards treat their last rows as block rows) and
`SuccessorBlocks` (one call's state: the blocks planned for the verification under way, the block ready for the
next round). Where the blocks go is the policy's (`policy_d3d.DraftPolicy.successor_plan`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from .patches_d3d import block_rows_on_target, decoder_layers, drafter_projection_groups
from .tree_d3d import DraftTree, tree_attention_inputs


def fused_drafting_unavailable(drafter, target) -> str | None:
    """Why `target`'s verification forwards cannot compute `drafter`'s blocks (`None` when they can).

    They can when the drafter runs the target's own tensors (attached, `shares_target_weights`), on every target
    layer in order (a shallower drafter would have to leave the target's forward early), and its adapted
    projections are the target's own linear modules' weights.
    """
    config = drafter.config
    if not getattr(config, "shares_target_weights", False) or getattr(drafter, "_attached_target", None) is not target:
        return "the drafter does not run on the target's own weights (shares_target_weights)"
    layers = decoder_layers(target)
    if layers is None:
        return f"{type(target).__name__} has no decoder layer list to add the block adapters to"
    ids = list(config.source_layer_ids or range(config.num_hidden_layers))
    if ids != list(range(len(layers))):
        return f"the drafter runs {len(ids)} of the target's {len(layers)} layers (fused blocks need all, in order)"
    try:
        groups = drafter_projection_groups(drafter, decoder_layers(target))
    except (AttributeError, IndexError):
        return f"{type(target).__name__}'s layers do not have the drafter's projection names"
    for theirs, own, _ in groups:
        if any(not isinstance(t, nn.Linear) or t.weight is not o.weight for t, o in zip(theirs, own, strict=True)):
            return "the drafter's projections are not the target's own linear modules' weights"
    return None


def successor_attention_inputs(
    tree: DraftTree,
    num_committed: int,
    past_length: int,
    anchors: Sequence[int],
    num_masks: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.LongTensor]:
    r"""
    The verification forward's attention mask and positions with a successor block after each anchor.

    Rows: the `num_committed` committed tokens (the last is the root), the tree's nodes (`tree_attention_inputs`),
    then for each anchor in order a block of `num_masks` mask rows. A block row attends to everything its anchor
    attends to, to the anchor, and to every row of its own block (the masks of a draft pass attend to each other,
    `drafting_d3d.draft_attention_mask`); its position is the anchor's plus `1 + i` for mask `i`. No other row
    attends to a block row.

    Args:
        tree (`DraftTree`): the candidates (a chain is a tree whose node `i` has parent `i - 1`).
        num_committed (`int`): committed rows, >= 1.
        past_length (`int`): tokens in the target's cache, >= 0.
        anchors (sequence of `int`): the node each block follows, `-1` for the root (the last committed row).
        num_masks (`int`): mask rows per block, >= 1.
        dtype (`torch.dtype`): the mask's dtype (the target's compute dtype).
        device: where to build them.

    Returns:
        `(attention_mask, position_ids)`: an additive float mask `(1, 1, q, past_length + q)` with `q = num_committed
        + len(tree) + len(anchors) * num_masks` (0 where a row may attend, the dtype's lowest value elsewhere) and
        `torch.LongTensor` `(1, q)`.

    Raises:
        ValueError: for `num_masks < 1` or an anchor that is not a node of `tree` or -1.
    """
    if num_masks < 1:
        raise ValueError(f"`num_masks` must be >= 1, got {num_masks}.")
    if any(not -1 <= a < len(tree) for a in anchors):
        raise ValueError(f"Anchors must be nodes of the tree of {len(tree)} nodes or -1, got {list(anchors)}.")
    base_mask, base_positions = tree_attention_inputs(tree, num_committed, past_length, dtype, device)
    q0 = base_mask.shape[-2]
    extra = len(anchors) * num_masks
    q = q0 + extra
    allowed = torch.zeros((q, past_length + q), dtype=torch.bool, device=device)
    allowed[:q0, : past_length + q0] = base_mask[0, 0] == 0
    positions = torch.empty(q, dtype=torch.long, device=device)
    positions[:q0] = base_positions[0]
    offsets = torch.arange(1, num_masks + 1, device=device)
    for b, anchor in enumerate(anchors):
        row = num_committed - 1 if anchor < 0 else num_committed + anchor
        start = q0 + b * num_masks
        block = slice(start, start + num_masks)
        allowed[block, : past_length + q0] = allowed[row, : past_length + q0]
        allowed[block, past_length + start : past_length + start + num_masks] = True
        positions[block] = positions[row] + offsets
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None], positions[None]


def end_probabilities(acceptance: list[float]) -> list[float]:
    """`P_j`, the probability that exactly `j` of `k` chained candidates are accepted (`j = 0..k`), from each
    candidate's acceptance probability given its predecessors': `prod_{i <= j} p_i * (1 - p_{j+1})`, with
    `p_{k+1} = 0`."""
    out, reach = [], 1.0
    for p in acceptance:
        out.append(reach * (1.0 - p))
        reach *= p
    out.append(reach)
    return out


class SuccessorBlocks:
    """Fused successor drafting for one `generate` call in D3D's own loop (chain rounds): the blocks planned for
    the verification under way and the block ready for the next round.

    Per round: `plan` (after the candidates are chosen) asks the policy where blocks pay; the loop builds the
    verification with `verification_inputs` and runs it inside `context()`; `outcome` keeps the block after the
    real acceptance length when there is one (a hit), and `take_ready` hands it to the next round's candidate
    choice.

    Args:
        target (`PreTrainedModel`), drafter (`D3DForDiffusionDrafting`): a pair for which
            `fused_drafting_unavailable` is `None`.
        policy (`DraftPolicy`): decides where blocks go (`successor_plan`).
        stats (`D3DGenerationStats`): records blocks, masks and hits per round.
    """

    def __init__(self, target, drafter, policy, stats) -> None:
        self.target, self.drafter, self.policy, self.stats = target, drafter, policy, stats
        self.lengths: list[int] = []  # acceptance lengths of this round's blocks, increasing
        self.num_masks = 0
        self.ready: torch.Tensor | None = None

    @property
    def block_rows(self) -> int:
        """Rows the planned blocks add to this round's verification."""
        return len(self.lengths) * self.num_masks

    def take_ready(self) -> torch.Tensor | None:
        """The block drafted after the last round's real acceptance length, `(num_masks, vocab_size)` logits in the
        target's dtype (row `i` scores the token `i + 1` places after the bonus token), or `None`; handed out
        once."""
        ready, self.ready = self.ready, None
        return ready

    def plan(
        self, acceptance: list[float], drafts: list[int], verify_rows: int, room: int, stop_tokens: set[int]
    ) -> None:
        """Plans this round's blocks.

        Args:
            acceptance (`list[float]`): each candidate's estimated acceptance probability given its predecessors'.
            drafts (`list[int]`): the candidates' tokens.
            verify_rows (`int`): rows of the verification without blocks.
            room (`int`): tokens that may still be committed before `max_length` (this round's included).
            stop_tokens (`set[int]`): eos ids (no block after a candidate that ends the text).
        """
        lengths, m = self.policy.successor_plan(end_probabilities(acceptance), verify_rows, max(room - 2, 0))
        # a block after length j is used only if at least one token may follow the bonus token, and not after eos
        lengths = [j for j in lengths if room - j - 1 >= 1 and (j == 0 or drafts[j - 1] not in stop_tokens)]
        self.lengths, self.num_masks = (lengths, m) if lengths and m > 0 else ([], 0)
        self.stats.successor_blocks.append(len(self.lengths))
        self.stats.successor_masks.append(self.num_masks)

    def verification_inputs(
        self, new_ids: torch.LongTensor, num_committed: int, past: int, dtype: torch.dtype
    ) -> tuple[torch.LongTensor, torch.Tensor, torch.LongTensor]:
        """The verification's `(input_ids, attention_mask, position_ids)` with the planned blocks appended (filler
        ids 0 at the mask rows), for `new_ids` `(1, num_committed + k)`: committed rows, then the chain."""
        tree = DraftTree()
        for i, token in enumerate(new_ids[0, num_committed:].tolist()):
            tree.add(token, i - 1, 1.0)
        mask, positions = successor_attention_inputs(
            tree, num_committed, past, [j - 1 for j in self.lengths], self.num_masks, dtype, new_ids.device
        )
        ids = torch.cat([new_ids, new_ids.new_zeros((1, self.block_rows))], dim=1)
        return ids, mask, positions

    def context(self, first_block_row: int):
        """`block_rows_on_target` for this round's verification (a null context without blocks)."""
        if not self.lengths:
            return contextlib.nullcontext()
        return block_rows_on_target(self.target, self.drafter, first_block_row)

    def outcome(self, num_accepted: int, block_logits: torch.Tensor | None) -> None:
        """Keeps the block after `num_accepted` (the real acceptance length) as the next round's, if one was drafted.

        Args:
            num_accepted (`int`): candidates accepted this round.
            block_logits (`torch.Tensor` of shape `(block_rows, vocab_size)`, *optional*): the blocks' rows.
        """
        self.ready = None
        hit = num_accepted in self.lengths and block_logits is not None
        if hit:
            index = self.lengths.index(num_accepted)
            self.ready = block_logits[index * self.num_masks : (index + 1) * self.num_masks]
        self.stats.record_successor_outcome(hit)
        self.lengths, self.num_masks = [], 0


__all__ = [
    "SuccessorBlocks",
    "end_probabilities",
    "fused_drafting_unavailable",
    "successor_attention_inputs",
]
