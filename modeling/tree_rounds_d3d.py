"""Tree rounds: one draft pass per drafter round and a best-first draft tree verified in one target forward (D3D's
own loop, `d3d_tree_budget`).

Part of the self-contained remote-code bundle: imports only torch and its siblings.
"""

from __future__ import annotations

import torch

from .estimates_d3d import expected_tokens
from .planner_d3d import DraftPasses, RoundPlanner
from .proposer_d3d import DraftProposer
from .runtime_d3d import RoundClock
from .stats_d3d import D3DGenerationStats
from .tree_d3d import DraftTree, build_draft_tree


class TreeRounds:
    """The tree builder of one call: what `decoding_d3d` asks for each round when `d3d_tree_budget` is set.

    The policy decides the round as for a chain (`DraftPolicy.decide`). A drafter round runs one draft pass with
    every mask the remaining length allows and spends the node budget best-first on the block's per-depth
    distributions (after the target's logits processors, on the likeliest chain's history), estimated by the policy's
    calibrated acceptance, with the prompt-lookup match (if any) as an extra branch (`tree_d3d.build_draft_tree`); a
    drafter that shares the target's weights drafts depth 1 exactly, so depth 1 does not branch. With
    `d3d_tree_budget="adaptive"` the tree is cut to the node count that maximises expected tokens per second, `(1 +
    sum of path probabilities) / (draft seconds + t_verify(1 + nodes))`. A lookup round is the lookup chain; a target
    round an empty tree.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        budget (`int` or `"adaptive"`): `d3d_tree_budget`.
        branching (`int`): `d3d_tree_branching`.
        planner (`RoundPlanner`), passes (`DraftPasses`), proposer (`DraftProposer`), stats (`D3DGenerationStats`),
            clock (`RoundClock`): the call's shared round machinery.
        max_length (`int`): the call's `max_length`.
    """

    def __init__(
        self,
        drafter,
        budget: int | str,
        branching: int,
        planner: RoundPlanner,
        passes: DraftPasses,
        proposer: DraftProposer,
        stats: D3DGenerationStats,
        clock: RoundClock,
        max_length: int,
    ) -> None:
        self.drafter = drafter
        self.block_size = int(drafter.config.block_size)
        self.budget = budget
        self.branching = branching
        self.planner = planner
        self.passes = passes
        self.proposer = proposer
        self.stats = stats
        self.clock = clock
        self.max_length = max_length
        self._round = None

    def get_tree(self, input_ids: torch.LongTensor) -> DraftTree:
        """One round of tree drafting: the nodes to verify after `input_ids` (`(1, seq_len)`).

        Returns:
            `DraftTree`: nodes parents first (empty for a plain target step). Greedy: every node is a fixed token;
            sampling: only the depth-1 node of an exact drafter is a sample (`tree.proposals`).
        """
        self.clock.start_draft()
        self._round = None
        planner, policy, proposer = self.planner, self.planner.policy, self.proposer
        adaptive = planner.mode == "adaptive"
        cur_len = input_ids.shape[1]
        limit = min(self.block_size - 1, self.max_length - cur_len - 1)
        tree = DraftTree()
        if limit <= 0:
            return self._finish(tree, "target", None, None, None)
        lookup, ngram_size = planner.lookup(input_ids, limit, proposer.eos_token_ids)
        cache = self.passes.pass_cache()
        if self.passes.awaits_prefill(cache):
            return self._finish(tree, "target", None, None, None)
        num_pending = cur_len - cache.get_seq_length()
        budget = self.block_size if self.budget == "adaptive" else self.budget
        if not hasattr(policy, "tree_gains"):  # a user's own policy object of an older kind
            policy.tree_gains = {}
        gains = policy.tree_gains
        gain_key = (budget, self.branching)
        decision = policy.decide(  # `gain=None`: no tree of this size built yet, a warm-up drafter round
            num_pending,
            0 if lookup is None else lookup.shape[1],
            max_candidates=limit,
            lookup_ngram_size=ngram_size or None,
            tree=(budget, gains.get(gain_key)) if adaptive else None,
        )
        allow = None
        if proposer.stop_string_criteria is not None:
            prefix = input_ids

            def allow(path: list[int]) -> bool:
                return not proposer.completes_stop_string(torch.cat([prefix, prefix.new_tensor([path])], dim=1))

        if decision.source == "lookup":
            tokens = lookup[0, : decision.num_lookup].tolist()
            chain = [(tokens, [1.0] * len(tokens))]
            tree = build_draft_tree(
                torch.zeros((0, 1)), len(tokens), extra_chains=chain, stop_tokens=proposer.eos_token_ids, allow=allow
            )
            return self._finish(tree, "lookup", decision, None, None)
        if decision.source != "drafter" or decision.num_masks == 0:
            return self._finish(tree, "target", decision, None, None)
        committed = input_ids[:, cache.get_seq_length() :].to(self.passes.device)
        num_masks = decision.pass_masks  # every allowed mask (adaptive) or the fixed plan's whole block
        block_logits, draft_seconds, learned_seconds = self.passes.timed_pass(committed, cache, num_masks)
        _, scores = proposer.choose(input_ids, block_logits.float()[:num_masks])
        if not scores:
            return self._finish(tree, "target", decision, None, learned_seconds)
        probabilities = torch.cat(scores, dim=0).softmax(dim=-1)
        extra = []
        if lookup is not None and adaptive:
            tokens = lookup[0].tolist()
            extra.append((tokens, policy.lookup.probabilities(len(tokens), ngram_size or None)))
        exact_first = bool(getattr(self.drafter.config, "shares_target_weights", False))
        ranking = None
        if proposer.do_sample and proposer.noise is not None:  # drafter-invariant sampling: Gumbel top-k per depth
            start = input_ids.shape[1]
            log_q = torch.cat(scores, dim=0).log_softmax(dim=-1)
            ranking = proposer.noise.perturb(log_q, range(start, start + len(scores)))
        tree = build_draft_tree(
            probabilities,
            budget,
            acceptance=policy.calibrator.probabilities,
            exact_first=exact_first,
            sample_first=exact_first and proposer.do_sample and ranking is None,
            ranking=ranking,
            extra_chains=extra,
            branching=self.branching,
            stop_tokens=proposer.eos_token_ids,
            allow=allow,
        )
        primary = self._primary_chain(tree, probabilities)
        chain_estimates = policy.calibrator.probabilities(primary[1])
        if exact_first and chain_estimates:
            chain_estimates[0] = 1.0  # as the tree counts it
        chain_expected = expected_tokens(chain_estimates, len(chain_estimates)) - 1.0
        if chain_expected > 0:  # the tree's expected accepted drafts over the chain's, for the next decisions
            ratio = tree.expected_accepted / chain_expected
            gains[gain_key] = ratio if gain_key not in gains else 0.8 * gains[gain_key] + 0.2 * ratio
        if self.budget == "adaptive" and policy.verify_curve is not None:
            tree = tree.prefix(policy.choose_tree_size(tree.probabilities, draft_seconds))
        return self._finish(tree, "drafter", decision, primary, learned_seconds)

    @staticmethod
    def _primary_chain(tree: DraftTree, probabilities: torch.Tensor) -> tuple[list[int], list[float]]:
        """The tree's likeliest drafter chain (each node's first drafter child, from the root) and the drafter's
        confidence of each of its tokens: what the policy's calibrator learns from after the round."""
        nodes, confidences, node = [], [], -1
        while True:
            child = next((c for c in tree.children(node) if tree.sources[c] == "drafter"), None)
            depth = len(nodes)
            if child is None or depth >= probabilities.shape[0]:
                return nodes, confidences
            nodes.append(child)
            confidences.append(float(probabilities[depth, tree.tokens[child]]))
            node = child

    def _finish(self, tree: DraftTree, source: str, decision, primary, draft_seconds) -> DraftTree:
        self._round = (decision, tree, primary, draft_seconds)
        self.stats.record_round_plan(source, len(tree))
        self.clock.end_draft()
        self.passes.verification_starts()
        return tree

    def update_tree_strategy(self, input_ids: torch.LongTensor, tree: DraftTree, path: list[int]) -> None:
        """Records the outcome of one tree verification: `path`, the accepted nodes (after eos and length cropping),
        the last of which is followed by one more committed token."""
        verify_seconds = self.passes.learned_verify_seconds(self.clock.end_verify())
        decision, _, primary, draft_seconds = self._round
        if decision is not None:
            first_round = self.stats.rounds == 0  # its verification includes the prefill
            if decision.source == "drafter" and primary is not None:
                nodes, confidences = primary
                accepted = 0
                while accepted < len(nodes) and accepted < len(path) and path[accepted] == nodes[accepted]:
                    accepted += 1
                num_sent, kwargs = len(nodes), {"confidences": confidences, "draft_seconds": draft_seconds}
            else:
                num_sent, accepted, kwargs = len(tree), len(path), {}
                if decision.source == "target":
                    num_sent = accepted = 0
            self.planner.policy.observe_round(
                decision,
                num_sent=num_sent,
                num_accepted=accepted,
                verify_seconds=None if first_round else verify_seconds,
                verify_rows=len(tree) + 1,
                **kwargs,
            )
        self.stats.record_outcome(len(path))
        self.planner.save_if_ends(lambda: self.proposer.generation_ends(input_ids, self.max_length))


__all__ = ["TreeRounds"]
