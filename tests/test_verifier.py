"""Tests of the verifier (`modeling/verifier_d3d.py`): acceptance, cuts and per-row processing for chain and tree
rounds, the one copy the chain, tree and batched loops share."""

from __future__ import annotations

import torch
from _tiny import chi_square_p_value
from d3d_hf.modeling import verifier_d3d
from d3d_hf.modeling.sampling_d3d import GumbelNoise
from d3d_hf.modeling.tree_d3d import build_draft_tree
from d3d_hf.modeling.verifier_d3d import accept_chain, accept_tree, cut_committed, process_rows
from transformers import LogitsProcessorList


def _scores(choices: list[int], vocab: int = 12) -> torch.Tensor:
    scores = torch.zeros(len(choices), vocab)
    scores[torch.arange(len(choices)), torch.tensor(choices)] = 5.0
    return scores


def test_greedy_chain_accepts_the_longest_matching_prefix_then_the_targets_token():
    candidates = torch.tensor([[1, 2, 3, 5, 8, 4]])  # 3 committed tokens, then drafts 5, 8, 4
    valid, n = accept_chain(candidates, 3, _scores([5, 7, 9, 11]), do_sample=False)
    assert (valid.tolist(), n) == ([[5, 7]], 1)
    valid, n = accept_chain(candidates, 3, _scores([5, 8, 4, 11]), do_sample=False)
    assert (valid.tolist(), n) == ([[5, 8, 4, 11]], 3)
    valid, n = accept_chain(candidates[:, :3], 3, _scores([6]), do_sample=False)  # no drafts: a plain step
    assert (valid.tolist(), n) == ([[6]], 0)


def test_invariant_sampling_accepts_a_draft_iff_it_is_the_gumbel_max_at_its_position():
    noise = GumbelNoise(seed=7, vocab_size=12)
    scores = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    chosen = noise.choose(scores, range(3, 7)).tolist()
    wrong = (chosen[2] + 1) % 12
    candidates = torch.tensor([[1, 2, 3, chosen[0], chosen[1], wrong]])
    valid, n = accept_chain(candidates, 3, scores, do_sample=True, noise=noise)
    assert (valid.tolist(), n) == ([chosen[:3]], 2)


def test_the_fallback_chain_rule_keeps_the_targets_distribution(monkeypatch):
    """Without transformers' `_speculative_sampling` the verifier's own copy of the rule is used: the first committed
    token is distributed as the target's processed distribution, whatever the drafter proposed."""
    monkeypatch.setattr(verifier_d3d, "_speculative_sampling", None)
    torch.manual_seed(0)
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]).log()
    drafter = torch.tensor([[0.1, 0.1, 0.7, 0.1]]).log()
    counts, n = torch.zeros(4), 4000
    for _ in range(n):
        draft = int(torch.multinomial(drafter[0].exp(), 1))
        valid, _ = accept_chain(
            torch.tensor([[0, draft]]), 1, target.clone(), do_sample=True, draft_scores=drafter[None]
        )
        counts[valid[0, 0]] += 1
    assert chi_square_p_value(counts, target[0].exp(), n) > 1e-3


def test_greedy_tree_acceptance_follows_the_targets_choices():
    probabilities = torch.full((2, 12), 0.01)
    probabilities[0, 5], probabilities[0, 6], probabilities[1, 7] = 0.6, 0.3, 0.9
    tree = build_draft_tree(probabilities, 3, branching=2)
    by_token = {token: node for node, token in enumerate(tree.tokens)}
    scores = torch.zeros(len(tree) + 1, 12)
    scores[0, 6] = 5.0  # the target takes the second candidate at depth 1
    for node in range(len(tree)):
        scores[node + 1, 3] = 5.0
    path, bonus = accept_tree(tree, 4, scores, do_sample=False)
    assert path == [by_token[6]] and bonus == 3


def test_cut_committed_stops_at_max_length_and_after_the_first_eos():
    valid = torch.tensor([[4, 2, 9, 2]])
    assert cut_committed(valid, 10, {2}).tolist() == [[4, 2]]
    assert cut_committed(valid, 1, {2}).tolist() == [[4]]
    assert cut_committed(valid, 10, set()).tolist() == [[4, 2, 9, 2]]


def test_each_row_is_processed_on_its_own_history():
    seen = []

    def record(ids, scores):
        seen.append(ids.shape[1])
        return scores * 2

    scores = torch.ones(3, 5)
    process_rows(LogitsProcessorList([record]), lambda i: torch.zeros(1, 4 + i, dtype=torch.long), scores)
    assert seen == [4, 5, 6] and bool((scores == 2).all())
    process_rows(LogitsProcessorList(), lambda i: 1 / 0, scores)  # no processor: no history is built
