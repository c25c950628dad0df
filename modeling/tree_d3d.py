"""Draft trees for D3D: building them from a block pass, the target's tree-attention inputs, the accepted path.

Part of the self-contained remote-code bundle: imports only the Python standard library and torch.

A block pass of a D3D drafter gives one distribution per block position (row `j` scores the token at depth `j + 1`
after the anchor), independent of which tokens are chosen at the other positions. A *draft tree* spends a node budget
on the likeliest paths through those distributions (best-first, as DDTree does for DFlash, arXiv 2604.12989), plus
optional extra chains (prompt-lookup matches), and the target verifies every node in one forward with an
ancestor-only attention mask (SpecInfer, arXiv 2305.09781). The target's cache then keeps only the accepted path.

Acceptance keeps the target's output exact:

- greedy: the longest path whose every token is the target's (processed) argmax at its parent, then the target's
  argmax after it;
- sampling: at each reached node, its children are tried in order, each against the target's residual distribution
  `r` (initially the target's processed distribution `p` at that node). A child proposed by a *sample* `x ~ q` from a
  drafter distribution `q` is accepted with probability `min(1, r(x) / q(x))`, after which `r` becomes `norm(max(0,
  r - q))` (speculative sampling, arXiv 2211.17192); a *fixed* child `t` (chosen without sampling, e.g. a top token
  or a lookup token) is a point-mass proposal, accepted with probability `r(t)`, after which `r` becomes `r` with
  `t` removed, renormalised. If no child is accepted the next token is drawn from `r`. Each step draws exactly from
  the target's distribution at the reached node whatever the candidates are, provided the candidates were chosen
  without the target's randomness and a sampled child was drawn from `q` independently of whether its parent is
  reached (here: only the root's children are ever sampled), so the whole output is distributed as target-only
  sampling.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """A tree of draft tokens below the last committed token (the root, not stored).

    Nodes are listed parents-first (every parent index is smaller than its child's), the order of the target's
    verification rows.

    Attributes:
        tokens (`list[int]`): token id of each node.
        parents (`list[int]`): index of each node's parent, `-1` for a child of the root.
        depths (`list[int]`): depth of each node, 1 for a child of the root.
        probabilities (`list[float]`): estimated probability that the target accepts the whole path to each node
            (what the budget was spent on; not used by acceptance).
        proposals (`dict[int, torch.Tensor]`): for a node whose token was *sampled*, the distribution it was sampled
            from (`(vocab_size,)` probabilities, float32); every other node is a fixed (point-mass) proposal.
        sources (`list[str]`): `"drafter"` or `"lookup"` per node (a node both would have proposed is `"drafter"`).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    probabilities: list[float] = field(default_factory=list)
    proposals: dict[int, torch.Tensor] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, probability: float, source: str = "drafter") -> int:
        """Appends a node below `parent` (`-1`: the root) and returns its index.

        Raises:
            ValueError: if `parent` is not an existing node or `-1`.
        """
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"Parent {parent} is not a node of this tree of {len(self.tokens)} nodes (or -1).")
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.probabilities.append(float(probability))
        self.sources.append(source)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        """Indices of the children of `node` (`-1`: the root), in node order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for `-1`)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's child down to `node`."""
        return [self.tokens[i] for i in self.path(node)]

    def is_chain(self) -> bool:
        """Whether the nodes form one chain in order (node `i`'s parent is `i - 1`)."""
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    @property
    def expected_accepted(self) -> float:
        """Expected accepted nodes, the sum of the path probabilities (each node is accepted iff its path is)."""
        return float(sum(self.probabilities))

    def prefix(self, num_nodes: int) -> DraftTree:
        """The tree of the first `num_nodes` nodes (a tree again: parents come first)."""
        kept = DraftTree(
            tokens=self.tokens[:num_nodes],
            parents=self.parents[:num_nodes],
            depths=self.depths[:num_nodes],
            probabilities=self.probabilities[:num_nodes],
            proposals={i: q for i, q in self.proposals.items() if i < num_nodes},
            sources=self.sources[:num_nodes],
        )
        return kept


def build_draft_tree(
    probabilities: torch.Tensor,
    budget: int,
    *,
    acceptance: Callable[[Sequence[float]], Sequence[float]] | None = None,
    exact_first: bool = False,
    sample_first: bool = False,
    extra_chains: Sequence[tuple[Sequence[int], Sequence[float]]] = (),
    branching: int = 4,
    stop_tokens: Sequence[int] = (),
    allow: Callable[[list[int]], bool] | None = None,
    generator: torch.Generator | None = None,
    ranking: torch.Tensor | None = None,
) -> DraftTree:
    r"""
    Best-first draft tree under a node budget from per-depth draft distributions (DDTree's construction, arXiv
    2604.12989, for a standalone block-diffusion drafter; d3d-hf docs/DESIGN.md section 2).

    A node at depth `j` with token `t` below a parent of path probability `P` has path probability `P * a_j(t)`, where
    `a_j(t)` is the estimated acceptance of `t` at depth `j`: `acceptance([probabilities[j - 1, t]])` (identity when
    `acceptance` is None). Candidates are each depth's `branching` likeliest tokens and the tokens of
    `extra_chains` (each a token path from the root with its per-token acceptance; a token both propose takes the
    larger estimate). Nodes are added in decreasing path probability (ties: earlier depth, then token order), so
    every prefix of the result is the best tree of its size under these estimates and `tree.prefix(n)` is a tree.

    Args:
        probabilities (`torch.Tensor` of shape `(num_depths, vocab_size)`): the drafter's (processed) probabilities
            of the token at each depth, row `j` for depth `j + 1`; bounds the depth of drafter nodes.
        budget (`int`): most nodes, >= 0.
        acceptance (`Callable`, *optional*): maps draft probabilities to estimated acceptance probabilities (e.g.
            `AcceptanceCalibrator.probabilities`).
        exact_first (`bool`, defaults to `False`): depth 1 is exact (a drafter whose anchor row is the target's own
            computation): its only node is the top token (or a sample, with `sample_first`), with acceptance 1.
        sample_first (`bool`, defaults to `False`): sampling mode with `exact_first`: the depth-1 node is a sample of
            `probabilities[0]` (recorded in `proposals`) instead of its top token.
        extra_chains (sequence of `(tokens, acceptances)`): extra paths from the root (prompt-lookup matches), each
            acceptance in [0, 1]; may be deeper than `num_depths`.
        branching (`int`, defaults to 4): drafter candidates per depth, >= 1.
        stop_tokens (sequence of `int`): tokens after which nothing is added (eos).
        allow (`Callable[[list[int]], bool]`, *optional*): called with a candidate node's token path; `False`
            leaves the node (and its subtree) out (e.g. a token that completes a stop string).
        generator (`torch.Generator`, *optional*): for `sample_first`.
        ranking (`torch.Tensor` of shape `(num_depths, vocab_size)`, *optional*): scores whose order chooses each
            depth's `branching` candidates instead of `probabilities` (which still give their acceptance estimates):
            the Gumbel-perturbed drafter scores under drafter-invariant sampling (`sampling_d3d`; the candidates are
            then Gumbel top-k, a list sample without replacement, arXiv 2506.05632), so depth 1 of an `exact_first`
            drafter is its top token, the target's own token at that position.

    Returns:
        `DraftTree`: at most `budget` nodes, parents first.

    Raises:
        ValueError: for a negative budget, `branching < 1`, a `probabilities` tensor that is not 2-D, or
            `sample_first` without `exact_first`.
    """
    if budget < 0:
        raise ValueError(f"The node budget must be >= 0, got {budget}.")
    if branching < 1:
        raise ValueError(f"`branching` must be >= 1, got {branching}.")
    if probabilities.dim() != 2:
        raise ValueError(f"`probabilities` must be (num_depths, vocab_size), got shape {tuple(probabilities.shape)}.")
    if sample_first and not exact_first:
        raise ValueError("`sample_first` samples the exact depth-1 token: it needs `exact_first=True`.")
    tree = DraftTree()
    num_depths = probabilities.shape[0]
    if budget == 0:
        return tree
    stops = {int(t) for t in stop_tokens}
    estimate = acceptance if acceptance is not None else (lambda values: list(values))
    width = min(branching, probabilities.shape[1])
    if ranking is not None and ranking.shape != probabilities.shape:
        raise ValueError(f"`ranking` must have the shape of `probabilities` {tuple(probabilities.shape)}, got "
                         f"{tuple(ranking.shape)}.")
    if ranking is not None and num_depths:
        top_ids = ranking.topk(width, dim=-1).indices.to(probabilities.device)
        top_p = probabilities.gather(1, top_ids)
    else:
        top_p, top_ids = probabilities.topk(width, dim=-1) if num_depths else (None, None)
    top_accept = [estimate(row) for row in top_p.float().tolist()] if num_depths else []
    top_ids = top_ids.tolist() if num_depths else []
    first_sample = None
    if exact_first and num_depths:
        if sample_first:
            first_sample = int(torch.multinomial(probabilities[0].float(), 1, generator=generator))
        else:
            first_sample = int(top_ids[0][0])
    chains = [([int(t) for t in tokens], [float(a) for a in accepts]) for tokens, accepts in extra_chains]

    def candidates(node: int, path: list[int]) -> dict[int, tuple[float, str]]:
        """Children of `node` (`-1`: root) with their acceptance estimates and sources."""
        depth = len(path) + 1
        out: dict[int, tuple[float, str]] = {}
        if depth == 1 and first_sample is not None:
            return {first_sample: (1.0, "drafter")}
        if depth <= num_depths:
            for token, accept in zip(top_ids[depth - 1], top_accept[depth - 1], strict=True):
                out[int(token)] = (float(accept), "drafter")
        for tokens, accepts in chains:
            if len(tokens) >= depth and tokens[: depth - 1] == path:
                token, accept = tokens[depth - 1], accepts[depth - 1]
                if token not in out or out[token][0] < accept:
                    out[token] = (accept, out[token][1] if token in out else "lookup")
        return out

    heap: list[tuple[float, int, int, int, int, str]] = []
    order = 0

    def push_children(node: int, path: list[int], path_probability: float) -> None:
        nonlocal order
        if path and path[-1] in stops:
            return
        for token, (accept, source) in candidates(node, path).items():
            heapq.heappush(heap, (-path_probability * accept, len(path) + 1, order, node, token, source))
            order += 1

    push_children(-1, [], 1.0)
    while heap and len(tree) < budget:
        negative, _, _, parent, token, source = heapq.heappop(heap)
        path = (tree.path_tokens(parent) if parent >= 0 else []) + [token]
        if allow is not None and not allow(path):
            continue
        node = tree.add(token, parent, -negative, source)
        if parent < 0 and sample_first:  # the one depth-1 node, sampled from the processed depth-1 scores
            tree.proposals[node] = probabilities[0].float()
        push_children(node, path, -negative)
    return tree


def tree_attention_inputs(
    tree: DraftTree, num_committed: int, past_length: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.LongTensor]:
    r"""
    The target's attention mask and position ids for verifying `tree` in one forward.

    The forward's new rows are the `num_committed` committed tokens not in the target's cache (the last is the
    root), then the tree's nodes in order. Committed rows attend causally; a node attends to the whole cache, every
    committed row, its ancestors and itself. Positions: committed row `i` is at `past_length + i`, a node of depth
    `d` at `past_length + num_committed - 1 + d`.

    Args:
        tree (`DraftTree`): the nodes.
        num_committed (`int`): committed rows, >= 1.
        past_length (`int`): tokens already in the target's cache, >= 0.
        dtype (`torch.dtype`): the mask's dtype (the target's compute dtype).
        device: where to build them.

    Returns:
        `(attention_mask, position_ids)`: an additive float mask of shape `(1, 1, q, past_length + q)` with `q =
        num_committed + len(tree)` (0 where a row may attend, the dtype's lowest value elsewhere; transformers
        uses a 4-D mask as given, with any attention implementation that takes masks), and `torch.LongTensor` of
        shape `(1, q)`.

    Raises:
        ValueError: if `num_committed < 1` or `past_length < 0`.
    """
    if num_committed < 1 or past_length < 0:
        raise ValueError(f"Need num_committed >= 1 and past_length >= 0, got {num_committed}, {past_length}.")
    n = len(tree)
    q = num_committed + n
    allowed = torch.zeros((q, past_length + q), dtype=torch.bool, device=device)
    allowed[:, :past_length] = True
    allowed[:num_committed, past_length : past_length + num_committed] = torch.ones(
        num_committed, num_committed, dtype=torch.bool, device=device
    ).tril()
    allowed[num_committed:, past_length : past_length + num_committed] = True
    rows = torch.arange(n, device=device)
    ancestors = torch.zeros((n, n), dtype=torch.bool, device=device)
    ancestors[rows, rows] = True
    for i, parent in enumerate(tree.parents):
        if parent >= 0:
            ancestors[i] |= ancestors[parent]
    allowed[num_committed:, past_length + num_committed :] = ancestors
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    depths = torch.tensor(tree.depths, dtype=torch.long, device=device)
    positions = torch.cat(
        [
            torch.arange(past_length, past_length + num_committed, device=device),
            past_length + num_committed - 1 + depths,
        ]
    )
    return mask[None, None], positions[None]


def greedy_tree_path(tree: DraftTree, target_choices: Sequence[int]) -> tuple[list[int], int]:
    """Greedy acceptance: the longest path of nodes that are the target's choice at their parent.

    Args:
        tree (`DraftTree`): the verified tree.
        target_choices (sequence of `int`): the target's (processed) argmax at the root (index 0) and at each node
            (index `i + 1` for node `i`).

    Returns:
        `(path, bonus)`: accepted node indices from the root down, and the target's token after the last one.
    """
    node, path = -1, []
    while True:
        choice = int(target_choices[node + 1])
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == choice), None)
        if nxt is None:
            return path, choice
        path.append(nxt)
        node = nxt


def sample_tree_path(
    tree: DraftTree,
    target_probabilities: Callable[[int], torch.Tensor],
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Sampling acceptance that keeps the target's distribution (module docstring: recursive rejection over each
    reached node's children, speculative sampling for a sampled child, point-mass rejection for a fixed one).

    Args:
        tree (`DraftTree`): the verified tree.
        target_probabilities (`Callable[[int], torch.Tensor]`): the target's processed next-token probabilities at
            the root (`-1`) or at a node, `(vocab_size,)` float.
        generator (`torch.Generator`, *optional*): random source.

    Returns:
        `(path, next_token)`: accepted node indices, and the token drawn after the last of them.
    """
    node, path = -1, []
    while True:
        residual = target_probabilities(node).float().clone()
        accepted = None
        for child in tree.children(node):
            token = tree.tokens[child]
            proposal = tree.proposals.get(child)
            u = float(torch.rand((), generator=generator))
            if proposal is not None:
                proposal = proposal.to(residual.device).float()
                q = float(proposal[token])
                if q > 0 and u * q <= float(residual[token]):
                    accepted = child
                    break
                updated = (residual - proposal).clamp_min_(0)
            else:
                if u < float(residual[token]):
                    accepted = child
                    break
                updated = residual.clone()
                updated[token] = 0.0
            total = float(updated.sum())
            if total <= 0:  # nothing left outside the rejected proposals: fall back to the target's own choice
                break
            residual = updated / total
        if accepted is None:
            return path, int(torch.multinomial(residual, 1, generator=generator))
        path.append(accepted)
        node = accepted


def keep_cache_path(cache, start: int, kept: Sequence[int]) -> None:
    """Keeps, of the target cache's entries from `start` on, only those at offsets `kept` (in that order).

    After a tree verification the cache holds the committed rows and every node; this leaves the committed rows and
    the accepted path, as if only they had been run.

    Args:
        cache (`transformers.DynamicCache`): every layer a full-attention layer with `keys` / `values` tensors of
            shape `(batch, heads, seq_len, head_dim)`.
        start (`int`): first entry that may move (cache length before the tree's nodes).
        kept (sequence of `int`): offsets from `start` of the entries to keep, increasing.

    Raises:
        ValueError: for a cache whose layers do not hold plain `keys` / `values` (sliding-window, quantised or linear
            attention layers cannot be reordered this way).
    """
    kept = [int(k) for k in kept]
    if kept == list(range(len(kept))):
        cache.crop(-(cache.get_seq_length() - start - len(kept)))  # a negative count of entries to remove
        return
    check_tree_cache(cache)
    for layer in cache.layers:
        device = layer.keys.device
        index = torch.cat([torch.arange(start, device=device), start + torch.tensor(kept, device=device)])
        layer.keys = layer.keys.index_select(2, index)
        layer.values = layer.values.index_select(2, index)


def check_tree_cache(cache) -> None:
    """Raises a `ValueError` unless every layer of `cache` is a plain full-attention layer (what tree verification
    reorders).
    """
    layers = getattr(cache, "layers", None)
    bad = (
        layers is None
        or any(getattr(layer, "is_sliding", False) for layer in layers)
        or any(type(layer).__name__ != "DynamicLayer" for layer in layers)
    )
    if bad:
        kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
        raise ValueError(
            f"Tree verification keeps the accepted path by reordering a DynamicCache of full-attention layers; this "
            f"target's cache has {kinds}. Use chain verification (`d3d_tree_budget=None`) with this target."
        )


__all__ = [
    "DraftTree",
    "build_draft_tree",
    "check_tree_cache",
    "greedy_tree_path",
    "keep_cache_path",
    "sample_tree_path",
    "tree_attention_inputs",
]
