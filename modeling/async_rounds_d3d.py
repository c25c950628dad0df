"""Asynchronous rounds: packed successor drafting while the target verifies (arXiv 2611.06425; d3d-hf
docs/DESIGN.md section 2).

Part of the self-contained remote-code bundle: imports only torch and its siblings.
"""

from __future__ import annotations

import torch

from .drafting_d3d import D3DCache
from .options_d3d import experiment
from .proposer_d3d import DraftProposer
from .runtime_d3d import PackedPassWorker
from .stats_d3d import D3DGenerationStats


class PackedSuccessorDrafting:
    """The scheduler of asynchronous rounds (`d3d_async` on).

    Right after handing a block to the target, the drafter runs one packed pass
    (`D3DForDiffusionDrafting.packed_draft_logits`) that drafts the *successor* block for the `num_hypotheses` most
    likely verification outcomes, while the target verifies: on a worker thread on CPU, on a side CUDA stream (joined
    with an event) on GPU. A hypothesis is a verification outcome `(m, g)`: `m` drafts accepted and bonus token `g`.
    They are ranked by their likelihood under the drafter, `q_1 ... q_m * q_{m+1}(g)` with `q_j` the drafter's
    confidence in draft `d_j` and `g != d_{m+1}` (the rejected draft; any `g` when all `k` drafts pass, from the
    drafter's guess one past the block), and the likeliest get a successor block `[g, MASK x (B-1)]` (several guesses
    may share one `m`). When the real outcome `(m*, b*)` is a hypothesis (a hit), the pre-drafted block is used and
    the drafter cache is extended with the packed keys/values of what was committed; otherwise the round drafts
    synchronously (a miss), or, with `reuse_on_miss`, uses the block drafted for `m*` although its bonus guess was
    wrong. Every token is still verified by the target, so hits change speed, never output.

    A packed pass whose round never comes (generation stopped by length, eos or a stop string) is cancelled, or
    waited for, before `generate` returns (`discard`); after a stop by a user's own stopping criterion it finishes in
    the background.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        cache (`D3DCache`): the drafter's own cache (asynchronous rounds never read the target's).
        proposer (`DraftProposer`): chooses the drafts.
        stats (`D3DGenerationStats`): where hits, misses and the packed pass's times are recorded.
        num_hypotheses (`int`): successor blocks per packed pass.
        reuse_on_miss (`bool`): use the block drafted for the real acceptance length on a wrong bonus guess.
        worker_threads (`int`): intra-op threads of the CPU worker.
        max_length (`int`): the call's `max_length` (no pass is made for a round that cannot come).
        num_drafts (`int`, *optional*): drafts sent per round (default: the whole block).
    """

    def __init__(
        self,
        drafter,
        cache: D3DCache,
        proposer: DraftProposer,
        stats: D3DGenerationStats,
        num_hypotheses: int,
        reuse_on_miss: bool,
        worker_threads: int,
        max_length: int,
        num_drafts: int | None = None,
    ) -> None:
        self.drafter = drafter
        self.cache = cache
        self.proposer = proposer
        self.stats = stats
        self.num_hypotheses = num_hypotheses
        self.reuse_on_miss = reuse_on_miss
        self.worker_threads = worker_threads
        self.max_length = max_length
        self.num_drafts = num_drafts
        self.device = drafter.model.embed_tokens.weight.device
        cpu_worker = None  # off CUDA the pass runs on a CPU worker thread: the library's experiment
        if self.device.type != "cuda":
            cpu_worker = experiment("worker_threads", "Asynchronous drafting on CPU (`d3d_async=True`)")
        self.worker = PackedPassWorker(self.device, worker_threads, cpu_worker)
        self._pending_info = None  # launch info of the packed pass in flight

    def candidates(self, input_ids: torch.LongTensor, limit: int):
        """This round's drafts after `input_ids` (`(1, seq_len)`), at most `limit`: the packed pass's block on a hit,
        else a synchronous draft pass; then the next packed pass is launched. Returns `(drafts, scores)`."""
        cur_len = input_ids.shape[1]
        block_logits = self._use_packed_block(input_ids) if self.worker.pending else None
        if limit <= 0:
            return [], []
        if block_logits is None:
            committed = input_ids[:, self.cache.get_seq_length() :].to(self.device)
            block_logits = self.drafter.draft_logits(committed, self.cache)[0]
        block_logits = block_logits.float()
        if self.num_drafts is not None:
            limit = min(limit, self.num_drafts)
        drafts, scores = self.proposer.choose(input_ids, block_logits[:limit])
        if drafts and cur_len + 1 < self.max_length:
            self._launch(input_ids, drafts, scores, block_logits)
        return drafts, scores

    def round_ends(self, input_ids: torch.LongTensor) -> None:
        """After a verification: a pass drafted for a round that will not come is stopped here rather than left to
        run on after `generate` returns (it would take CPU from whatever the caller does next)."""
        if self.worker.pending and self.proposer.generation_ends(input_ids, self.max_length):
            self.worker.discard()
            self._pending_info = None

    def _launch(self, input_ids, drafts, scores, block_logits) -> None:
        """Chooses the hypotheses and starts the packed successor-drafting pass off the critical path."""
        pending = input_ids[:, self.cache.get_seq_length() :].to(self.device)  # committed but not cached yet
        draft_ids = torch.cat(drafts, dim=1).to(self.device)
        num_drafts = draft_ids.shape[1]
        # drafter confidence of each draft under the distribution it was chosen from
        confidences = torch.cat(scores, dim=0).softmax(dim=-1).gather(1, draft_ids.view(-1, 1).to(scores[0].device))
        survive = [1.0]  # survive[m]: probability that the first m drafts are accepted
        for confidence in confidences.view(-1).tolist():
            survive.append(survive[-1] * confidence)
        # a hypothesis is an outcome (m accepted drafts, bonus token g); its likelihood under the drafter is
        # survive[m] * q_{m+1}(g) with g != d_{m+1} (the rejected draft), or survive[k] * q_{k+1}(g) when all k pass
        probs = block_logits[: num_drafts + 1].softmax(dim=-1)
        width = min(self.num_hypotheses + 1, probs.shape[-1])
        noise = self.proposer.noise if self.proposer.do_sample else None
        if noise is not None:  # drafter-invariant sampling: guess the bonus token by the Gumbel-max order
            positions = range(input_ids.shape[1], input_ids.shape[1] + probs.shape[0])
            top_ids = noise.perturb(probs.log(), positions).topk(width, dim=-1).indices.to(probs.device)
            top_probs = probs.gather(1, top_ids)
        else:
            top_probs, top_ids = probs.topk(width, dim=-1)
        draft_list = draft_ids[0].tolist()
        candidates = []
        for m in range(num_drafts + 1):
            if input_ids.shape[1] + m + 1 >= self.max_length:
                break  # no round after this outcome: nothing to pre-draft
            for p, g in zip(top_probs[m].tolist(), top_ids[m].tolist(), strict=True):
                if m == num_drafts or g != draft_list[m]:
                    candidates.append((survive[m] * p, m, g))
        if not candidates:
            return
        chosen = sorted(sorted(candidates, key=lambda c: -c[0])[: self.num_hypotheses], key=lambda c: (c[1], -c[0]))
        lengths = [m for _, m, _ in chosen]
        guesses = [g for _, _, g in chosen]
        chain = torch.cat([pending, draft_ids], dim=1)
        offset = pending.shape[1]
        chain_lengths = [offset + m for m in lengths]
        self._pending_info = {"cur_len": input_ids.shape[1], "num_pending": offset, "chain": chain}
        cache, drafter = self.cache, self.drafter

        def packed_pass():
            return drafter.packed_draft_logits(chain, cache, chain_lengths, guesses)

        enqueue_seconds = self.worker.launch(packed_pass)
        if enqueue_seconds is not None:  # CUDA: the time to enqueue the pass
            self.stats.packed_seconds.append(enqueue_seconds)
        else:
            self.stats.worker_threads = self.worker_threads

    def _use_packed_block(self, input_ids: torch.LongTensor) -> torch.FloatTensor | None:
        """Joins the packed pass, extends the drafter cache with what the verification committed, and returns the
        successor block's logits `(block_size, vocab_size)` on a hit (or a reused miss), else `None`."""
        info, self._pending_info = self._pending_info, None
        packed, seconds, wait = self.worker.join(lambda p: [p.logits, *p.key_states, *p.value_states])
        if seconds is not None:
            self.stats.packed_seconds.append(seconds)
            self.stats.join_wait_seconds.append(wait)
        num_new = input_ids.shape[1] - info["cur_len"]  # accepted drafts + 1 bonus token
        accepted = num_new - 1
        num_chain = info["num_pending"] + accepted
        chain = info["chain"]
        if (
            accepted < 0
            or num_chain > chain.shape[1]
            or not torch.equal(
                chain[0, info["num_pending"] : num_chain].cpu(),
                input_ids[0, info["cur_len"] : info["cur_len"] + accepted].cpu(),
            )
        ):
            # not the round the pass was made for (cannot happen in transformers' loop): draft from scratch
            self.stats.misses += 1
            return None
        bonus = int(input_ids[0, -1])
        outcome = [h for h, length in enumerate(packed.hypothesis_chain_lengths) if length == num_chain]
        right = [h for h in outcome if packed.bonus_guesses[h] == bonus]
        hypothesis = right[0] if right else (outcome[0] if outcome else None)  # the likeliest guess comes first
        if right:
            packed.commit(self.cache, num_chain, hypothesis)
            self.stats.hits += 1
            return packed.logits[hypothesis]
        packed.commit(self.cache, num_chain)  # the chain's keys/values are right; the bonus token is drafted anew
        if hypothesis is not None and self.reuse_on_miss:
            self.stats.reused += 1
            return packed.logits[hypothesis]
        self.stats.misses += 1
        return None


__all__ = ["PackedSuccessorDrafting"]
