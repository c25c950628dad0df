"""The verifier: which drafted tokens the target accepts and what a round commits, written once for the chain, tree
and batched rounds of D3D's own loops (`decoding_d3d`, `batched_decoding_d3d`).

Part of the self-contained remote-code bundle: imports only torch, the public transformers API (plus
`transformers.generation.utils._speculative_sampling`, the chain rule of transformers' own loop, so that chain rounds
draw exactly what transformers' loop draws; when it is missing a copy of the same rule in our own words is used) and
its siblings.

A round's target forward scores `k + 1` rows (the committed tokens' last row, then one per candidate). The verifier
runs the logits processors on each row with that row's own history (`process_rows`), then accepts:

- **greedy** (`do_sample=False`): the longest prefix of drafts equal to the target's argmax (a tree: the longest path
  of nodes that are the target's choice at their parent, `tree_d3d.greedy_tree_path`), plus the target's next token;
- **drafter-invariant sampling** (`d3d_sampling="invariant"`, `sampling_d3d.GumbelNoise`): as greedy, on the
  Gumbel-max of each row under the call's noise at its absolute position (arXiv 2408.07978);
- **speculative sampling** (`d3d_sampling="speculative"`): transformers' chain rule (arXiv 2211.17192); a tree:
  recursive rejection over each reached node's children (`tree_d3d.sample_tree_path`).

The committed tokens are then cut at `max_length` and after the first eos (`cut_committed`), as transformers' loop
does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sampling_d3d import GumbelNoise
from .tree_d3d import DraftTree, greedy_tree_path, sample_tree_path

try:  # the chain rule of transformers' own loop, so that chain rounds consume the random stream identically
    from transformers.generation.utils import _speculative_sampling
except ImportError:  # pragma: no cover - depends on the installed transformers
    _speculative_sampling = None


def _chain_sampling(candidate_ids, candidate_logits, num_candidates, new_logits):
    """Speculative sampling of a chain (arXiv 2211.17192, algorithm 1), for a transformers without
    `_speculative_sampling`: returns `(valid_tokens (1, n + 1), n)`."""
    drafts = candidate_ids[0, -num_candidates:]
    q = candidate_logits[0].softmax(dim=-1)
    p = new_logits[0].softmax(dim=-1)
    index = torch.arange(num_candidates, device=p.device)
    ratio = p[index, drafts] / q[index, drafts]
    accepted = torch.rand_like(ratio) <= ratio
    n = int((~accepted).cumsum(dim=-1).lt(1).sum())
    if n < num_candidates:
        residual = (p[n] - q[n]).clamp_min(0)
        residual = residual / residual.sum()
    else:
        residual = p[n]
    token = torch.multinomial(residual, 1)
    return torch.cat([drafts[:n], token]).view(1, -1), n


def process_rows(logits_processor, history: Callable[[int], torch.LongTensor], scores: torch.FloatTensor) -> None:
    """Runs `logits_processor` on each verified row of `scores` (`(rows, vocab_size)`, float32, changed in place),
    row `i` on `history(i)` (`(1, length)`: the sequence that row scores), built only when a processor needs it."""
    if len(logits_processor) > 0:
        for i in range(scores.shape[0]):
            scores[i : i + 1] = logits_processor(history(i), scores[i : i + 1])


def accept_chain(
    candidates: torch.LongTensor,
    cur_len: int,
    scores: torch.FloatTensor,
    *,
    do_sample: bool,
    noise: GumbelNoise | None = None,
    draft_scores: torch.FloatTensor | None = None,
) -> tuple[torch.LongTensor, int]:
    """The tokens a chain round commits (module docstring).

    Args:
        candidates (`torch.LongTensor` of shape `(1, cur_len + k)`): the committed tokens, then the `k` drafts.
        cur_len (`int`): committed tokens.
        scores (`torch.FloatTensor` of shape `(k + 1, vocab_size)`): the target's processed scores of the verified
            rows (`process_rows`), on `candidates`' device.
        do_sample (`bool`): sampling (`True`) or greedy decoding.
        noise (`GumbelNoise`, *optional*): the call's noise under drafter-invariant sampling.
        draft_scores (`torch.FloatTensor` of shape `(1, k, vocab_size)`, *optional*): the processed scores the drafts
            were drawn from; with `do_sample` and no `noise`, speculative sampling (`None` when `k == 0`).

    Returns:
        `(valid, n)`: the committed tokens `(1, n + 1)` (the `n` accepted drafts, then the target's token) and `n`.
    """
    k = candidates.shape[1] - cur_len
    if do_sample and noise is None and draft_scores is not None and k:
        rule = _speculative_sampling if _speculative_sampling is not None else _chain_sampling
        valid, n = rule(candidates, draft_scores, k, scores[None])
        return valid.to(candidates.device), int(n)
    if noise is not None:  # drafter-invariant: a draft is accepted iff it is the Gumbel-max token
        selected = noise.choose(scores, range(cur_len, cur_len + k + 1))[None]
    elif do_sample:
        selected = torch.multinomial(scores.softmax(dim=-1), num_samples=1).view(1, -1)
    else:
        selected = scores.argmax(dim=-1)[None]
    drafts = candidates[:, cur_len:]
    n = int(((~(drafts == selected[:, :-1])).cumsum(dim=-1) < 1).sum())
    return selected[:, : n + 1], n


def accept_tree(
    tree: DraftTree, cur_len: int, scores: torch.FloatTensor, *, do_sample: bool, noise: GumbelNoise | None = None
) -> tuple[list[int], int]:
    """The accepted path of a tree round (module docstring).

    Args:
        tree (`DraftTree`): the verified tree.
        cur_len (`int`): committed tokens.
        scores (`torch.FloatTensor` of shape `(len(tree) + 1, vocab_size)`): the target's processed scores at the
            root (row 0) and at each node (row `i + 1` for node `i`).
        do_sample (`bool`), noise (`GumbelNoise`, *optional*): as `accept_chain`.

    Returns:
        `(path, bonus)`: the accepted node indices from the root down and the token committed after them.
    """
    if noise is not None:  # drafter-invariant: each row's Gumbel-max at its own position, then greedy
        depths = [0] + [len(tree.path_tokens(node)) for node in range(len(tree))]
        choices = noise.choose(scores, [cur_len + depth for depth in depths])
        return greedy_tree_path(tree, choices.tolist())
    if do_sample:
        probabilities = scores.softmax(dim=-1)
        return sample_tree_path(tree, lambda node, p=probabilities: p[node + 1])
    return greedy_tree_path(tree, scores.argmax(dim=-1).tolist())


def cut_committed(valid: torch.LongTensor, room: int, eos_token_ids: set[int]) -> torch.LongTensor:
    """`valid` (`(1, n + 1)`) cut to the `room` tokens left before `max_length` and after its first eos."""
    valid = valid[:, :room]
    hits = [i for i, token in enumerate(valid[0].tolist()) if token in eos_token_ids]
    return valid[:, : hits[0] + 1] if hits else valid


__all__ = ["accept_chain", "accept_tree", "cut_committed", "process_rows"]
