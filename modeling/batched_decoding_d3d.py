"""Batched D3D decoding: several sequences in D3D's own loop, one draft pass and one target forward per round.

Part of the self-contained remote-code bundle: imports only torch, the public transformers API (plus
`transformers.generation.utils._speculative_sampling` for `d3d_sampling="speculative"`) and its siblings.

transformers' assisted generation decodes one sequence at a time. `target.generate(input_ids,
attention_mask=..., assistant_model=drafter)` with a left-padded batch (or one padded prompt) is sent here by the
wrapper of `_assisted_decoding` (`decoding_d3d.install_decoding_hook`); a batch of one unpadded prompt never is.

**Ragged acceptance** (our design). Every sequence keeps its own accepted length, but the target's `DynamicCache`
keeps one batch axis whose rounds append the same number of slots `R` to every sequence (the longest row count
of the round): sequence `a` places its rows right-aligned (`R - r_a` pad rows first, then its pending committed
tokens, then its drafts). Which slots hold a sequence's committed tokens is `RaggedSlots.valid`; rejected drafts
and pad rows stay in the tensors but no query ever attends to them again, and when they pile up the cache is
compacted (`RaggedSlots.compaction_index`). Each query row attends to the valid slots of its own sequence and,
causally, to that sequence's rows of the round; a pad row attends only to itself (so no row of the softmax is
empty). Position ids are per sequence: a token's index in its own, unpadded sequence, as if it ran alone. A drafter
on the target's own layers reads the same cache with the same validity (`DraftPasses.pass_cache`); a drafter with
its own `D3DCache` gets its own `RaggedSlots`. A finished sequence is removed from both caches' batch axis, so it
stops costing rows.

**The rounds** (`BatchedRounds.plan`) are decided by the drafter's policy, the same `DraftPolicy.decide` that
decides one sequence's rounds, given every sequence's state (`SequenceState`: its room, pending tokens and lookup
match): a plain target step, a prompt-lookup round (each sequence its own match) or a draft pass of `m` masks for
every sequence (each may send its lookup match instead where that is expected to give more), rated by expected
committed tokens of the batch per second; after the pass, `DraftPolicy.choose(batch=...)` gives one number `k` of
drafts for every drafting sequence. A fixed `d3d_num_drafts=k` drafts `k` masks for every sequence each round. A
drafter that reads the target's cache drafts nothing in the prefill round (`draft_pass=False`: its pass would compute
the prompts' keys and values a second time). The policy reads the curves scaled by its `batched_costs` (a batched
forward costs more than one sequence's curve says at the same total rows: `benchmarks/batched_rows_cost.py`), which
this loop teaches after every forward (`BatchedRounds._learn`); acceptance is learned per sequence.

**What each sequence sees** is what transformers' batched target-only decoding gives its row: logits processors
and stopping criteria run on the sequence's own row (the left-padded prompt, then its own tokens), and
`max_length` counts the padded prompt, so `max_new_tokens` is per sequence. Greedy outputs equal target-only
decoding of the batch and of each prompt alone (float32).

**Holes** (`check_prompt_mask`): a mask may also hide tokens after a prompt's first real one, e.g. the mask
transformers infers when `generate` gets no `attention_mask` (`input_ids != pad_token_id`, whenever `eos_token_id`
is another id) has a zero wherever the prompt holds the pad id, and SmolLM2's chat template emits its pad id
(`<|im_end|>`) inside every prompt. Target-only decoding never attends to such a token and counts positions over
the real tokens only (`cumsum - 1`); the loop does the same by caching and drafting from the real tokens alone
(`BatchedRounds.own_tokens`) while processors and stopping criteria still see the row as given, so it decodes
exactly what target-only decoding does with that mask. A mask that hides a prompt's last token is refused.

**Seeds** (`do_sample=True`, `d3d_sampling="invariant"`): the call seed is one draw from torch's default generator
as for one sequence; sequence `i` of the batch uses Gumbel noise keyed by `(seed_i, t)` with `t` the token's index in
its own unpadded sequence, `seed_0` the call seed and `seed_i` (i >= 1) a SplitMix64 mix of the call seed and `i`.
So a sequence's text depends only on the torch seed, its index in the batch, its prompt and the target (never on
the plan, the other prompts or the padding), and the first prompt of a batch samples exactly what it samples alone.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .drafting_d3d import D3DCache
from .fast_paths_d3d import GQA_SDPA, layout_mark
from .generation_d3d import d3d_candidate_generator
from .options_d3d import call_options, check_batch_options
from .policy_d3d import SequenceState
from .prompt_masks_d3d import check_prompt_mask, needs_batched_loop
from .sampling_d3d import ShiftedNoise, sequence_noise
from .verifier_d3d import _speculative_sampling, accept_chain, cut_committed, process_rows

#: model keyword arguments the batched loop honours (anything else: the call is refused with its name)
_KNOWN_MODEL_KWARGS = frozenset(
    {"cache", "past_key_values", "attention_mask", "position_ids", "use_cache", "logits_to_keep", "inputs_tensor"}
)


def _refuse_call(target, generation_config, synced_gpus: bool, streamer, model_kwargs: dict[str, Any]) -> None:
    """Raises a `ValueError` for what the batched loop does not run (before any forward pass)."""
    reason = None
    if target.config.is_encoder_decoder:
        reason = "the target is an encoder-decoder model"
    elif synced_gpus:
        reason = "`synced_gpus=True` was passed"
    elif streamer is not None:
        reason = "a streamer was passed (transformers' streamers take one sequence)"
    elif generation_config.return_dict_in_generate and (
        generation_config.output_attentions or generation_config.output_hidden_states
    ):
        reason = "`output_attentions` / `output_hidden_states` were asked for"
    elif getattr(generation_config, "assistant_ensemble_weight", None) is not None:
        reason = "`assistant_ensemble_weight` was set"
    else:
        extra = sorted(k for k, v in model_kwargs.items() if k not in _KNOWN_MODEL_KWARGS and v is not None)
        if extra:
            reason = f"model keyword arguments {extra} were passed"
    if reason is not None:
        raise ValueError(
            f"Batched D3D decoding (several prompts, or a padded prompt) cannot take this call: {reason}. Drop it, "
            "or call `generate` once per unpadded prompt."
        )


class RaggedSlots:
    """Which slots of a cache with a batch axis hold each sequence's committed tokens.

    Attributes:
        valid (`torch.BoolTensor` of shape `(batch_size, num_slots)`): `True` where the slot holds a committed token of
            that row's sequence.
        lengths (`list[int]`): committed tokens cached per row, which is also the position of the row's next token.
    """

    def __init__(self, batch_size: int, device: torch.device) -> None:
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        self.lengths = [0] * batch_size

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def inputs(
        self, counts: list[int], rows: int, tail: int = 0
    ) -> tuple[torch.BoolTensor, torch.LongTensor, torch.BoolTensor]:
        """The attention of one forward of `rows` new rows per sequence, sequence `a`'s `counts[a]` real rows
        right-aligned (its first `rows - counts[a]` rows are padding).

        A real row attends to the sequence's valid slots and causally to its real rows; the last `tail` rows of
        every sequence (a draft pass's masks) attend to all its real rows; a pad row attends to itself only.

        Returns:
            `(allowed, position_ids, real)`: `torch.BoolTensor` of shape `(batch_size, 1, rows, num_slots + rows)`
            (`True` = may attend), `torch.LongTensor` of shape `(batch_size, rows)` (real row `j` of sequence `a` is at
            `lengths[a] + j`; pad rows at 0) and the real rows, `torch.BoolTensor` of shape `(batch_size, rows)`.
        """
        device = self.valid.device
        index = torch.arange(rows, device=device)
        start = rows - torch.tensor(counts, device=device)
        real = index[None, :] >= start[:, None]
        causal = index[None, :] <= index[:, None]
        causal = causal | (index[:, None] >= rows - tail)
        block = real[:, :, None] & real[:, None, :] & causal[None]
        block |= torch.eye(rows, dtype=torch.bool, device=device)[None]
        cached = self.valid[:, None, :] & real[:, :, None]
        allowed = torch.cat([cached, block], dim=-1)[:, None]
        lengths = torch.tensor(self.lengths, device=device)
        positions = torch.where(real, lengths[:, None] + index[None, :] - start[:, None], 0)
        return allowed, positions, real

    def append(self, counts: list[int], rows: int, kept: list[int]) -> None:
        """Records a forward that appended `rows` slots per sequence (real rows right-aligned as in `inputs`), of which
        sequence `a` keeps the first `kept[a]` real ones."""
        device = self.valid.device
        index = torch.arange(rows, device=device)
        start = rows - torch.tensor(counts, device=device)
        stop = start + torch.tensor(kept, device=device)
        new = (index[None, :] >= start[:, None]) & (index[None, :] < stop[:, None])
        self.valid = torch.cat([self.valid, new], dim=1)
        self.lengths = [n + k for n, k in zip(self.lengths, kept, strict=True)]

    def select(self, rows: torch.LongTensor) -> None:
        """Keeps the batch rows `rows` (finished sequences leave)."""
        self.valid = self.valid.index_select(0, rows)
        self.lengths = [self.lengths[int(r)] for r in rows.tolist()]

    def compaction_index(self, min_waste: int = 16) -> torch.LongTensor | None:
        """When at least `max(min_waste, num_slots / 4)` slots of every row are holes, the slots to keep:
        `torch.LongTensor` of shape `(batch_size, max(lengths))`, each row's valid slots first (in order), then
        its first slot repeated as filler; the validity becomes left-aligned. `None` when not worth it."""
        longest = max(self.lengths, default=0)
        if self.num_slots - longest < max(min_waste, self.num_slots // 4):
            return None
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]
        keep = (
            torch.arange(longest, device=self.valid.device)[None, :]
            < torch.tensor(self.lengths, device=self.valid.device)[:, None]
        )
        self.valid = keep
        return torch.where(keep, order, 0)


def _map_cache(cache, fn) -> None:
    """Replaces every key and value tensor `[B, H_kv, S, D]` of `cache` (a `DynamicCache` or a `D3DCache`) by
    `fn(tensor)`."""
    if isinstance(cache, D3DCache):
        cache.key_cache = [fn(t) for t in cache.key_cache]
        cache.value_cache = [fn(t) for t in cache.value_cache]
        return
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)


def _gather_slots(index: torch.LongTensor):
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        b, h, _, d = tensor.shape
        return tensor.gather(2, index[:, None, :, None].expand(b, h, index.shape[1], d))

    return gather


def _check_cache(cache) -> None:
    layers = getattr(cache, "layers", None)
    if layers is None or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []}) or [type(cache).__name__]
        raise ValueError(
            f"Batched D3D decoding keeps each sequence's slots in a DynamicCache of full-attention layers; this "
            f"target's cache has {kinds}. Call `generate` once per unpadded prompt with this target."
        )
    if cache.get_seq_length() > 0:
        raise ValueError(
            "Batched D3D decoding starts from an empty cache, but `past_key_values` already holds "
            f"{cache.get_seq_length()} positions. Pass no cache, or call `generate` once per unpadded prompt."
        )


def sequence_processors(logits_processor, index: int) -> LogitsProcessorList:
    """The call's logits processors as sequence `index` of the batch sees them, called on its row alone (batch 1):
    transformers' processors with per-sequence state get sequence `index`'s (`RepetitionPenaltyLogitsProcessor`'s
    `prompt_ignore_length`, the row's padding; `PrefixConstrainedLogitsProcessor`'s function, called with
    `batch_id=index`); the others are shared as they are."""
    rows = LogitsProcessorList()
    for processor in logits_processor or []:
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
            processor.prompt_ignore_length, torch.Tensor
        ):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[index : index + 1]
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            function = processor._prefix_allowed_tokens_fn
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = lambda batch_id, sent, f=function, i=index: f(i, sent)
        rows.append(processor)
    return rows


class _Plan:
    """One sequence's candidates for a round: `source` (`"target"`, `"drafter"`, `"lookup"`), the draft tokens
    (`(1, 1)` each) with the scores they were chosen from, the drafter's confidences, the lookup n-gram size."""

    def __init__(self, source="target", drafts=None, scores=None, confidences=None, ngram=None) -> None:
        self.source, self.drafts, self.scores = source, drafts or [], scores or []
        self.confidences, self.ngram = confidences, ngram


class BatchedRounds:
    """The state and rounds of one batched call (`batched_assisted_decoding`).

    Args:
        generator (`D3DCandidateGenerator`): the call's generator (options, stats, proposer, planner, draft passes),
            built for the batch.
        target (`PreTrainedModel`): the target; `cache` its `DynamicCache` (empty), passed to its forward as
            `cache_key` (`"cache"` or `"past_key_values"`, as transformers named it for this call).
        prompts (`torch.LongTensor` of shape `(batch_size, seq_len)`): the prompts as given (padding and holes
            included: logits processors and stopping criteria see these rows).
        prompt_mask (`torch.BoolTensor` of shape `(batch_size, seq_len)`): `True` at the prompts' real tokens, at least
            one per row and always the last column; zeros before a row's first real token are left padding, zeros
            after it are holes (a token the target never attends to, as transformers' mask hides it).
    """

    def __init__(
        self, generator, target, cache, cache_key: str, prompts: torch.LongTensor, prompt_mask: torch.BoolTensor
    ):
        self.generator, self.target, self.cache, self.cache_key = generator, target, cache, cache_key
        self.keeps_logits = target._supports_logits_to_keep() if hasattr(target, "_supports_logits_to_keep") else False
        self.prefill = True  # the round being verified is the prefill (`verify`)
        self.draft_seconds = None
        self.hidden = {}  # sequence -> the target's last hidden state before its anchor (`reads_target_hidden_state`)
        self.drafter = generator.drafter
        self.block_size = generator.block_size
        self.max_length = generator.max_length
        batch, width = prompts.shape
        self.rows = [prompts[a : a + 1] for a in range(batch)]  # each sequence's padded row, grown as it decodes
        prompt_mask = prompt_mask.to(prompts.device)
        lengths = prompt_mask.sum(dim=1).tolist()
        self.offsets = [width - n for n in lengths]  # row index - offset = index in the sequence's own tokens
        self.prompt_width = width
        # a prompt with holes: its real tokens, which the target sees as one unbroken sequence (`own_tokens`)
        self.gapped_prompts = [
            None if bool(prompt_mask[a, width - lengths[a] :].all()) else prompts[a : a + 1, prompt_mask[a]]
            for a in range(batch)
        ]
        self.active = list(range(batch))  # the sequences still decoding, in cache batch order
        self.slots = RaggedSlots(batch, target.device)
        self.shared = generator.passes.target_cache is not None
        self.draft_slots = None if self.shared else RaggedSlots(batch, generator.passes.device)
        call_noise = generator.proposer.noise
        self.noise = [
            None if call_noise is None else ShiftedNoise(sequence_noise(call_noise, a), self.offsets[a])
            for a in range(batch)
        ]
        self.processors = [sequence_processors(generator.proposer.logits_processor, a) for a in range(batch)]
        impl = getattr(target.config, "_attn_implementation", None)
        self.bool_mask = impl in ("sdpa", GQA_SDPA)
        self.dtype = next(target.parameters()).dtype

    # -- planning ---------------------------------------------------------------------------------------------------

    def own_tokens(self, a: int) -> torch.LongTensor:
        """Sequence `a` without its padding and the holes of its prompt, `(1, n)`: what the target's cache holds of it
        (positions `0 .. n - 1`), what the drafter and prompt lookup read."""
        gapped = self.gapped_prompts[a]
        if gapped is None:
            return self.rows[a][:, self.offsets[a] :]
        return torch.cat([gapped, self.rows[a][:, self.prompt_width :]], dim=1)

    def last_tokens(self, a: int, count: int) -> torch.LongTensor:
        """The last `count` of sequence `a`'s own tokens (`own_tokens`), `(count,)`."""
        tokens = self.own_tokens(a)
        return tokens[0, tokens.shape[1] - count :]

    def limit(self, a: int) -> int:
        return max(0, min(self.block_size - 1, self.max_length - self.rows[a].shape[1] - 1))

    def pending(self, row: int) -> int:
        """Committed tokens of cache row `row` not in the target's cache."""
        a = self.active[row]
        return self.rows[a].shape[1] - self.offsets[a] - self.slots.lengths[row]

    def draft_pending(self, row: int) -> int:
        if self.shared:
            return self.pending(row)
        a = self.active[row]
        return self.rows[a].shape[1] - self.offsets[a] - self.draft_slots.lengths[row]

    def plan(self) -> tuple[list[_Plan], str]:
        """The round's candidates for every active sequence and the round's source, as the policy decides the
        round for the whole batch (`DraftPolicy.decide(batch=...)`, module docstring "The rounds")."""
        planner, proposer = self.generator.planner, self.generator.proposer
        limits = [self.limit(a) for a in self.active]
        lookups = []
        for a, limit in zip(self.active, limits, strict=True):
            tokens, ngram = (
                (None, None) if limit == 0 else planner.lookup(self.own_tokens(a), limit, proposer.eos_token_ids)
            )
            lookups.append((tokens[0].tolist() if tokens is not None and tokens.shape[1] else [], ngram))
        states = [
            SequenceState(limit, self.draft_pending(r), self.pending(r), len(tokens), ngram or None)
            for r, (limit, (tokens, ngram)) in enumerate(zip(limits, lookups, strict=True))
        ]
        # the prefill round of a drafter that reads the target's cache drafts nothing: its pass would compute the
        # prompts' keys and values a second time (the target's prefill computes them in this round's forward)
        prefill = self.shared and self.slots.num_slots == 0
        decision = planner.policy.decide(batch=states, draft_pass=not prefill)
        source = decision.source
        masks = decision.num_lookup if source == "lookup" else decision.pass_masks
        lookup_for = decision.lookup_rows or (False,) * len(states)
        plans = [_Plan() for _ in self.active]
        if source == "lookup" or source == "drafter":
            for row, a in enumerate(self.active):
                tokens, ngram = lookups[row]
                count = min(len(tokens), limits[row], masks)  # `masks`: the lookup cap of a lookup round
                if lookup_for[row] and count > 0:
                    drafts, scores = proposer.lookup_drafts(self.rows[a], tokens[:count])
                    plans[row] = _Plan("lookup", drafts, scores, ngram=ngram)
        if source == "drafter":
            self._draft(plans, limits, decision)
        return plans, source

    def _draft(self, plans: list[_Plan], limits: list[int], decision) -> None:
        """One draft pass of `decision.pass_masks` masks for every active sequence; the sequences without a lookup
        plan take its drafts, then send a common number `k` of them (`DraftPolicy.choose(batch=...)`)."""
        passes, proposer = self.generator.passes, self.generator.proposer
        masks = decision.pass_masks
        batch = len(self.active)
        pending = [self.draft_pending(r) for r in range(batch)]
        width = max(pending)
        cache = passes.pass_cache()
        slots = self.slots if self.shared else self.draft_slots
        device = passes.device
        ids = torch.zeros(batch, width + masks, dtype=torch.long, device=device)
        for r, a in enumerate(self.active):
            ids[r, width - pending[r] : width] = self.last_tokens(a, pending[r]).to(device)
        masked = torch.zeros_like(ids, dtype=torch.bool)
        masked[:, width:] = True
        allowed, positions, _ = slots.inputs([p + masks for p in pending], width + masks, tail=masks)
        extra = {}
        if passes.reads_hidden_state:  # each anchor (column `width - 1`) reads the state that chose it
            states = torch.zeros(batch, width + masks, self.hidden[self.active[0]].shape[-1], device=device)
            for r, a in enumerate(self.active):
                states[r, width - 1] = self.hidden[a].to(device)
            extra["target_hidden_states"] = states
        mark = layout_mark()  # a pass that timed matmul layouts is not learned
        start = time.perf_counter()
        with torch.no_grad():
            logits = self.drafter(
                input_ids=ids,
                masked_positions=masked,
                attention_mask=allowed.to(device),
                position_ids=positions.to(device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=masks + 1,
                **extra,
            ).logits.float()
        seconds = time.perf_counter() - start
        self.draft_seconds = seconds
        self._learn("draft", width + masks, mark.learned(seconds))
        if not self.shared:
            cache.crop(slots.num_slots + width)
            slots.append(pending, width, pending)
        for r, a in enumerate(self.active):
            if plans[r].source == "lookup" or limits[r] == 0:
                continue
            proposer.noise, proposer.logits_processor = self.noise[a], self.processors[a]
            drafts, scores = proposer.choose(self.rows[a], logits[r, : min(masks, limits[r])])
            confidences = proposer.confidences(drafts, scores) if drafts else []
            plans[r] = _Plan("drafter", drafts, scores, confidences)
        states = [
            SequenceState(
                verify_pending=self.pending(r),
                lookup_tokens=len(p.drafts) if p.source == "lookup" else 0,
                lookup_ngram_size=(p.ngram or None) if p.source == "lookup" else None,
            )
            for r, p in enumerate(plans)
        ]
        confidences = [p.confidences or [] if p.source == "drafter" else None for p in plans]
        k = self.generator.planner.policy.choose(confidences, seconds, decision, batch=states)
        for p in plans:
            if p.source == "drafter":
                p.drafts, p.scores = p.drafts[:k], p.scores[:k]

    def _learn(self, kind: str, rows: int, seconds: float | None) -> None:
        """Learns a batched forward's time into the policy's `batched_costs` (adaptive; `None`: not learned)."""
        policy = self.generator.planner.policy
        curve = policy.verify_curve if kind == "verify" else policy.draft_curve
        if seconds is not None and curve is not None and self.generator.planner.mode == "adaptive":
            policy.batched_costs.observe(kind, curve, len(self.active), rows, seconds)

    def learn_verify(self, seconds: float) -> None:
        """Learns the round's verification (the target's forward and the acceptance of every sequence, `seconds`)
        unless it was the prefill or `MatmulLayouts` timed candidates during it."""
        if not self.prefill:
            self._learn("verify", self.width, self.generator.passes.learned_verify_seconds(seconds))

    # -- verification -----------------------------------------------------------------------------------------------

    def verify(self, plans: list[_Plan], do_sample: bool):
        """One target forward over every active sequence's pending tokens and drafts; returns per cache row the
        committed tokens `(1, n + 1)`, the number of accepted drafts `n`, and the processed / raw score rows of the
        committed tokens."""
        batch = len(self.active)
        device = self.target.device
        self.prefill = self.slots.num_slots == 0
        self.generator.passes.verification_starts()
        pending = [self.pending(r) for r in range(batch)]
        counts = [p + len(plan.drafts) for p, plan in zip(pending, plans, strict=True)]
        width = max(counts)
        ids = torch.zeros(batch, width, dtype=torch.long, device=device)
        for r, a in enumerate(self.active):
            tokens = self.last_tokens(a, pending[r]).to(device)
            if plans[r].drafts:
                tokens = torch.cat([tokens, torch.cat(plans[r].drafts, dim=1)[0].to(device)])
            ids[r, width - counts[r] :] = tokens
        allowed, positions, _ = self.slots.inputs(counts, width)
        if self.bool_mask:
            mask = allowed
        else:
            mask = torch.zeros(allowed.shape, dtype=self.dtype, device=device)
            mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        most = max(len(p.drafts) for p in plans)
        keep = {"logits_to_keep": most + 1} if self.keeps_logits else {}
        reads_hidden_state = self.generator.passes.reads_hidden_state
        if reads_hidden_state:  # the drafter reads the state that chose each sequence's next anchor
            keep["output_hidden_states"] = True
        with torch.no_grad():
            outputs = self.target(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_key: self.cache},
                **keep,
            )
        logits = outputs.logits[:, -most - 1 :].float()
        results = []
        for r, a in enumerate(self.active):
            plan, row = plans[r], self.rows[a]
            k = len(plan.drafts)
            new_logits = logits[r, most - k :].to(row.device)
            raw = new_logits.clone()
            drafts = torch.cat(plan.drafts, dim=1).to(row.device) if k else row.new_zeros((1, 0))
            candidates = torch.cat([row, drafts], dim=1)
            cur_len = row.shape[1]
            process_rows(self.processors[a], lambda i, c=candidates, n=cur_len: c[:, : n + i], new_logits)
            draft_scores = torch.stack(plan.scores, dim=1).to(row.device) if k else None
            valid, n = accept_chain(
                candidates, cur_len, new_logits, do_sample=do_sample, noise=self.noise[a], draft_scores=draft_scores
            )
            results.append((valid.to(row.device), n, new_logits, raw))
            if reads_hidden_state:  # the row whose scores chose the last committed token
                self.hidden[a] = outputs.hidden_states[-1][r, width - counts[r] + pending[r] - 1 + n]
        self.counts, self.width = counts, width
        return results

    def commit(self, kept: list[int]) -> None:
        """Records in the target's slots that cache row `r` keeps `kept[r]` of the rows it sent."""
        self.slots.append(self.counts, self.width, kept)

    def leave(self, finished_rows: list[int]) -> None:
        """Removes the cache rows of finished sequences, then compacts the caches when holes pile up."""
        if finished_rows:
            keep = [r for r in range(len(self.active)) if r not in set(finished_rows)]
            self.active = [self.active[r] for r in keep]
            if not self.active:
                return
            index = torch.tensor(keep, dtype=torch.long, device=self.slots.valid.device)
            _map_cache(self.cache, lambda t: t.index_select(0, index.to(t.device)))
            self.slots.select(index)
            if not self.shared:
                _map_cache(self.generator.passes.cache, lambda t: t.index_select(0, index.to(t.device)))
                self.draft_slots.select(index.to(self.draft_slots.valid.device))
        index = self.slots.compaction_index()
        if index is not None:
            _map_cache(self.cache, _gather_slots(index))
        if not self.shared:
            index = self.draft_slots.compaction_index()
            if index is not None:
                _map_cache(self.generator.passes.cache, _gather_slots(index))


def batched_assisted_decoding(
    target,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs: Any,
):
    r"""
    Speculative decoding of a batch with a D3D drafter in D3D's own loop (module docstring); what `generate` runs
    for a D3D assistant when the prompts are a batch or padded. The arguments are those transformers prepares for
    `GenerationMixin._assisted_decoding`.

    Args:
        target (`PreTrainedModel`): the target (decoder-only, a `DynamicCache` of full-attention layers).
        input_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`): the prompts, left-padded; the mask may hide
            tokens inside a prompt too (holes: `check_prompt_mask`), but never a prompt's last token.
        logits_processor (`LogitsProcessorList`), stopping_criteria (`StoppingCriteriaList`),
        generation_config (`GenerationConfig`): as transformers prepared them (`pad_token_id` fills finished rows).
        assistant_model (`D3DForDiffusionDrafting`): the drafter.
        tokenizer (*optional*): the target's tokenizer (stop strings).
        model_kwargs: `generate`'s model keyword arguments: `attention_mask` of shape `(batch_size, seq_len)` (1 =
            real token; `None` for no padding; the one transformers inferred from `pad_token_id` when `generate` got
            none), the target's (empty) cache as `cache`.

    Returns:
        `torch.LongTensor` of shape `(batch_size, seq_len + longest generated)`: each row its prompt as given, its
        generated tokens, then `pad_token_id` up to the longest row (transformers' batch convention); or, with
        `return_dict_in_generate=True`, `GenerateDecoderOnlyOutput` with `sequences` and, when asked for, `scores` /
        `logits`: one `(batch_size, vocab_size)` tensor per generated position, zeros in the rows of sequences that
        had finished (`cache` is `None`: the batched cache holds padding and finished sequences were removed).

    Raises:
        ValueError: before any forward pass, for a prompt row whose last token is masked or that is all padding
            (`check_prompt_mask`: right padding, or a prompt ending with the pad id under the mask transformers
            inferred), a tree, `d3d_async=True`,
            `d3d_fused_drafting=True`, `d3d_decoding_loop="transformers"` (`check_batch_options`), a streamer,
            `synced_gpus`, an encoder-decoder target, a target cache that is not a `DynamicCache` of full-attention
            layers or is not empty, no `pad_token_id` for a batch, `d3d_sampling="speculative"` without transformers'
            `_speculative_sampling`, and for what `D3DCandidateGenerator` refuses.
    """
    attention_mask = model_kwargs.get("attention_mask")
    batch, width = input_ids.shape
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    options = call_options(generation_config, assistant_model)  # those the call resolved
    check_batch_options(options, batch, padded)
    _refuse_call(target, generation_config, synced_gpus, streamer, model_kwargs)
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None and generation_config.pad_token_id is not None:
        pad = torch.as_tensor(generation_config.pad_token_id)
    prompt_mask = check_prompt_mask(input_ids, attention_mask, pad)
    if pad is None:
        raise ValueError("A batch needs `pad_token_id` to fill finished rows: pass `pad_token_id=` to `generate`.")
    pad_id = int(pad.flatten()[0])
    do_sample = bool(generation_config.do_sample)
    if do_sample and options.sampling == "speculative" and _speculative_sampling is None:
        raise ValueError(
            "`d3d_sampling='speculative'` in a batch needs transformers' `_speculative_sampling`, which this "
            "transformers lacks: use `d3d_sampling='invariant'` (the default)."
        )
    cache_key = "cache" if model_kwargs.get("cache") is not None else "past_key_values"
    cache = model_kwargs.get(cache_key)
    if cache is None:
        raise RuntimeError("Assisted decoding requires a cache")
    _check_cache(cache)
    generator = d3d_candidate_generator(  # the call's state, built here (no detour through transformers' factory)
        target, assistant_model, input_ids, generation_config, logits_processor, model_kwargs, tokenizer
    )
    stats = generator.stats
    stats.batch_size = batch
    return_dict = bool(generation_config.return_dict_in_generate)
    want_scores = return_dict and generation_config.output_scores
    want_logits = return_dict and generation_config.output_logits
    eos = getattr(generation_config, "_eos_token_tensor", None)
    eos_ids = set() if eos is None else {int(t) for t in eos.flatten().tolist()}
    scores = [[] for _ in range(batch)]
    raw_logits = [[] for _ in range(batch)]
    with generator.own_loop(target, cache, batched=True):
        rounds = BatchedRounds(generator, target, cache, cache_key, input_ids, prompt_mask)
        policy = generator.planner.policy
        while rounds.active:
            start = time.perf_counter()
            plans, source = rounds.plan()
            drafted = time.perf_counter()
            results = rounds.verify(plans, do_sample)
            kept, finished, committed, accepted = [], [], 0, 0
            for r, a in enumerate(list(rounds.active)):
                valid, n, new_logits, raw = results[r]
                row = rounds.rows[a]
                valid = cut_committed(valid, generation_config.max_length - row.shape[1], eos_ids)
                n = valid.shape[1] - 1
                rounds.rows[a] = row = torch.cat([row, valid], dim=1)
                committed += n + 1
                accepted += n
                plan = plans[r]
                if plan.source == "drafter" and plan.confidences:
                    policy.calibrator.observe(plan.confidences, min(n, len(plan.drafts)), len(plan.drafts))
                elif plan.source == "lookup" and plan.drafts:
                    policy.observe_lookup(len(plan.drafts), min(n, len(plan.drafts)), plan.ngram)
                if want_scores:
                    scores[a].extend(new_logits[i : i + 1] for i in range(n + 1))
                if want_logits:
                    raw_logits[a].extend(raw[i : i + 1] for i in range(n + 1))
                kept.append(n)
                if bool(stopping_criteria(row, new_logits[n : n + 1])[0]):
                    finished.append(r)
                if rounds.noise[a] is not None:
                    rounds.noise[a].forget_before(row.shape[1])
            # the target's cache keeps, per sequence, its pending tokens and the accepted drafts
            rounds.commit([rounds.counts[r] - len(plans[r].drafts) + kept[r] for r in range(len(kept))])
            candidates = sum(len(p.drafts) for p in plans)
            stats.record_round_plan(source if candidates else "target", candidates)
            stats.rounds += 1
            stats.accepted_drafts += accepted
            stats.new_tokens += committed
            stats.acceptance_lengths.append(committed)
            stats.draft_seconds.append(drafted - start)
            stats.verify_seconds.append(time.perf_counter() - drafted)
            rounds.learn_verify(stats.verify_seconds[-1])
            rounds.leave(finished)
        generator.planner.save_if_ends(lambda: True)
    longest = max(row.shape[1] for row in rounds.rows)
    sequences = torch.full((batch, longest), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    for a, row in enumerate(rounds.rows):
        sequences[a, : row.shape[1]] = row[0]
    if not return_dict:
        return sequences

    def steps(per_sequence):
        if not any(per_sequence):
            return None
        vocab = next(s for s in per_sequence if s)[0].shape[-1]
        out = []
        for t in range(longest - width):
            step = torch.zeros(batch, vocab, device=input_ids.device)
            for a, rows in enumerate(per_sequence):
                if t < len(rows):
                    step[a] = rows[t][0].to(step.device)
            out.append(step)
        return tuple(out)

    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=steps(scores) if want_scores else None,
        logits=steps(raw_logits) if want_logits else None,
        cache=None,
    )


__all__ = [
    "BatchedRounds",
    "RaggedSlots",
    "batched_assisted_decoding",
    "check_prompt_mask",
    "needs_batched_loop",
]
