"""`D3DCandidateGenerator`: D3D drafting behind transformers' `CandidateGenerator` contract.

Part of the self-contained remote-code bundle: imports only torch, the public transformers API and its siblings.
The generator composes one object per job: the call's options (`options_d3d`), the statistics (`stats_d3d`), the
draft-token choice (`proposer_d3d`), the policy client and the draft pass (`planner_d3d`), and the round kind that
varies: chain rounds (here), tree rounds (`tree_rounds_d3d`) or asynchronous rounds (`async_rounds_d3d`).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from .async_rounds_d3d import PackedSuccessorDrafting
from .checks_d3d import check_bundle_version, check_generate_inputs, check_prompt_and_drafter
from .fast_paths_d3d import GQA_SDPA
from .options_d3d import D3DGenerationOptions, call_options, check_batch_options
from .planner_d3d import DraftPasses, RoundPlanner
from .proposer_d3d import DraftProposer
from .runtime_d3d import RoundClock
from .sampling_d3d import GumbelNoise
from .stats_d3d import D3DGenerationStats
from .successor_d3d import SuccessorBlocks, fused_drafting_unavailable
from .tree_rounds_d3d import TreeRounds

_WARNED = set()  # warnings given once per process


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def resolve_asynchronous(
    options: D3DGenerationOptions, device: torch.device, overrides: dict[str, str], drafter_config=None
) -> bool:
    """Whether a call runs packed successor drafting (`d3d_async` resolved).

    `True` is honoured on every device, with one warning per process on CPU, where the packed pass and the
    verification share the cores (measured slower than synchronous drafting in every recorded setting,
    benchmarks/results/async/). `"auto"` drafts asynchronously on CUDA when nothing in the call needs synchronous
    rounds (a tree, an explicit adaptive plan or lookup, the target's matmul layouts), synchronously otherwise; the
    reason is recorded in `overrides["d3d_async"]`. A drafter over the target's cache (`drafter_config.
    shares_target_cache`) drafts only synchronously: `"auto"` resolves to `False`, and `True` raises `ValueError`.
    """
    if options.asynchronous is True:
        if getattr(drafter_config, "shares_target_cache", False):
            raise ValueError(
                "d3d_async=True drafts in a packed pass over the drafter's own cache, and this drafter has none: it "
                "attends to the target's cache (`shares_target_cache=True`), which only synchronous rounds share. "
                "Leave d3d_async at 'auto' or set it to False."
            )
        if device.type != "cuda":
            _warn_once(
                "async-cpu",
                "d3d_async=True on CPU: the packed pass and the verification share the cores, which measured slower "
                "than synchronous drafting on the project's CPUs (d3d_async='auto', the default, drafts "
                "synchronously there). Running the packed pass as asked.",
            )
        return True
    if options.asynchronous is False:
        return False
    blockers = [
        (getattr(drafter_config, "shares_target_cache", False), "the drafter attends to the target's cache"),
        (device.type != "cuda", f"{device.type}: the packed pass and the verification share the cores"),
        (options.tree_budget is not None, "tree verification drafts synchronously"),
        (options.is_explicit("num_drafts") and options.num_drafts == "adaptive", "the adaptive plan was asked for"),
        (options.is_explicit("prompt_lookup") and options.prompt_lookup, "prompt lookup was asked for"),
        (options.target_matmul_layouts, "the target's matmul layouts are timed on the same cores"),
    ]
    reason = next((why for blocked, why in blockers if blocked), None)
    if reason is not None:
        overrides["d3d_async"] = f"auto -> False: {reason}"
        return False
    overrides["d3d_async"] = "auto -> True: the drafter runs on CUDA (the packed pass overlaps on a side stream)"
    return True


class D3DCandidateGenerator(CandidateGenerator):
    """D3D drafting for transformers' assisted-generation loop and D3D's own loop (d3d-hf docs/DESIGN.md section 2).

    **Chain rounds** (synchronous, the default). Each round the `RoundPlanner`'s policy chooses a plain target step,
    a prompt-lookup round or a draft pass of `m` masks: the drafter extends its cache (its own, or a view of the
    target's) with the tokens committed since its last call and, in the same forward, denoises `[anchor, MASK x m]`;
    the policy keeps the `k` drafts that maximise expected tokens per second; the target verifies them in one forward,
    commits the accepted prefix plus a bonus token, and the policy learns from the outcome.

    **Fused successor drafting** (`d3d_fused_drafting`, chain rounds in D3D's own loop): after the candidates are
    chosen, `SuccessorBlocks.plan` places drafter blocks inside the coming verification; when the accepted path ends
    at one, the next round's drafts come from it (a `ready` decision of the policy) instead of a draft pass.

    **Tree rounds** (`d3d_tree_budget`, D3D's own loop): `TreeRounds`. **Asynchronous rounds** (`d3d_async`):
    `PackedSuccessorDrafting`.

    Options: the `d3d_*` options of `D3DGenerationOptions` (keyword arguments of `generate`, attributes of its
    `GenerationConfig`, else of `drafter.generation_config`). After the call, `drafter.last_generation_stats` holds
    the `D3DGenerationStats`.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        input_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`): the prompt (a batch: left-padded, for D3D's
            batched loop, `batched_decoding_d3d`).
        generation_config (`GenerationConfig`): the target's generation config for this call.
        logits_processor (`LogitsProcessorList`): the target's logits processors (and warpers when sampling).
        target_tokenizer (`PreTrainedTokenizerBase`, *optional*): needed for `stop_strings`.
        target (`PreTrainedModel`, *optional*): the target; its `max_position_embeddings` bounds the prompt, and the
            adaptive policy is calibrated against it.
        Other keyword arguments of transformers' candidate-generator factory are accepted and ignored.

    Raises:
        ValueError: before any forward pass, for a batch with a tree or `d3d_async=True` (`check_batch_options`;
            a batch is decoded by `batched_decoding_d3d`, which uses this generator's pieces), an empty prompt, a
            prompt longer than
            the target's or the drafter's `max_position_embeddings`, a drafter without a mask token, `stop_strings`
            without a tokenizer, or an option that `D3DGenerationOptions.resolve` refuses.
    """

    def __init__(
        self,
        drafter: PreTrainedModel,
        input_ids: torch.LongTensor,
        generation_config,
        logits_processor=None,
        target_tokenizer=None,
        target=None,
        **unused: Any,
    ) -> None:
        check_prompt_and_drafter(drafter, input_ids.shape[1], target)
        self.drafter = drafter
        self.block_size = int(drafter.config.block_size)
        self.max_length = generation_config.max_length
        self.options = options = call_options(generation_config, drafter)  # those the call resolved
        self.batch_size = int(input_ids.shape[0])
        self.batched = self.batch_size > 1  # the batched loop's rounds (`own_loop(..., batched=True)`)
        check_batch_options(options, self.batch_size)
        self.stats = stats = D3DGenerationStats(options=options)
        drafter.last_generation_stats = stats
        self.proposer = DraftProposer(
            generation_config,
            logits_processor,
            drafter.config.vocab_size,
            drafter.model.embed_tokens.weight.device,
            target_tokenizer,
        )
        if self.proposer.do_sample and options.sampling == "invariant":  # until D3D's own loop enters (`own_loop`)
            stats.overrides["d3d_sampling"] = "invariant -> speculative: transformers' assisted-generation loop"
        self.passes = DraftPasses(drafter)
        self.round_clock = RoundClock(stats.draft_seconds, stats.verify_seconds)
        stats.asynchronous = resolve_asynchronous(options, self.passes.device, stats.overrides, drafter.config)
        if stats.asynchronous and self.batch_size > 1:  # `"auto"` on CUDA (`True` was refused for a batch)
            stats.asynchronous = False
            stats.overrides["d3d_async"] = "auto -> False: a batch drafts synchronously (batched_decoding_d3d)"
        self.tree = self.asynchronous_rounds = self.planner = self.successors = None
        if stats.asynchronous:
            fixed = options.num_drafts
            if fixed == "adaptive":
                stats.overrides["d3d_num_drafts"] = "adaptive -> full: asynchronous rounds draft whole blocks"
            if options.prompt_lookup:
                stats.overrides["d3d_prompt_lookup"] = "True -> False: asynchronous rounds draft from the packed pass"
            num_drafts = None if fixed in ("adaptive", "full") else int(fixed)
            stats.policy = str(self.block_size - 1 if num_drafts is None else num_drafts)
            self.asynchronous_rounds = PackedSuccessorDrafting(
                drafter,
                self.passes.cache,
                self.proposer,
                stats,
                options.num_hypotheses,
                options.reuse_on_miss,
                options.worker_threads,
                self.max_length,
                num_drafts,
            )
            return
        self.planner = RoundPlanner(drafter, options, target, stats.overrides)
        stats.policy = self.planner.mode
        stats.cost_curves_ms = self.planner.cost_curves_ms()
        if options.tree_budget is not None:
            self.tree = TreeRounds(
                drafter,
                options.tree_budget,
                options.tree_branching,
                self.planner,
                self.passes,
                self.proposer,
                stats,
                self.round_clock,
                self.max_length,
            )
        self._round = None

    @property
    def num_drafting_tokens(self) -> int:
        """The most candidate tokens one round sends (`block_size - 1`; a tree's node budget with `d3d_tree_budget`).
        transformers (>= 5.25) reads it before its assisted loop to size the recurrent-state history of caches that
        need one (linear-attention layers); attention caches ignore it."""
        budget = getattr(self.options, "tree_budget", None)
        return int(budget) if budget is not None else self.block_size - 1

    @property
    def cache(self):
        """The drafter's own `D3DCache` (what synchronous passes extend unless they read the target's cache)."""
        return self.passes.cache

    # -- D3D's own loop (`decoding_d3d`) ---------------------------------------------------------------------------

    def _can_share_target_cache(self, target) -> bool:
        """Whether this call's drafter computes, for committed tokens, exactly the target's keys and values: it shares
        the target's weights (attached to `target`), its layers are the target's first layers in order
        (`source_layer_ids` 0, 1, ...; block adapters touch only the block rows), and drafting is synchronous."""
        config = self.drafter.config
        layers = list(config.source_layer_ids or range(config.num_hidden_layers))
        if getattr(config, "shares_target_cache", False):  # it has no other way to see the committed context
            return not self.stats.asynchronous
        return (
            self.options.share_target_cache
            and not self.stats.asynchronous
            and bool(getattr(config, "shares_target_weights", False))
            and getattr(self.drafter, "_attached_target", None) is target
            and layers == list(range(len(layers)))
        )

    @contextlib.contextmanager
    def own_loop(self, target, cache, batched: bool = False):
        """Entered by D3D's own decoding loop around its rounds: shares the target's `cache` with the draft passes
        when the drafter computes the same keys and values (`d3d_share_target_cache`; a `DynamicCache` of full
        layers), draws the call's Gumbel noise under drafter-invariant sampling (`d3d_sampling="invariant"` with
        `do_sample=True`: one draw from torch's default generator), records whether the target's attention runs on
        the copy-free GQA function (`patches_d3d.apply_fast_paths`) and yields the call's `TreeRounds` (`None` for
        chain rounds).
        `batched=True`: the batched loop (`batched_decoding_d3d`) drives the rounds, without fused drafting."""
        self.stats.decoding_loop = "d3d"
        self.batched = batched
        if self.proposer.do_sample and self.options.sampling == "invariant":
            self.proposer.noise = GumbelNoise.from_default_generator(self.drafter.config.vocab_size)
            self.stats.overrides.pop("d3d_sampling", None)
        if self._can_share_target_cache(target) and all(
            type(layer).__name__ == "DynamicLayer" for layer in getattr(cache, "layers", [None])
        ):
            self.passes.share_target_cache(cache)
            self.stats.shared_target_cache = True
        self._resolve_fused_drafting(target)
        # the fast paths were applied where the call started (`decoding_d3d`'s wrapper: `apply_fast_paths`)
        self.stats.target_gqa_attention = (
            getattr(getattr(target, "config", None), "_attn_implementation", None) == GQA_SDPA
        )
        yield self.tree

    def _resolve_fused_drafting(self, target) -> None:
        """Sets `self.successors` when this call drafts inside its verifications (`d3d_fused_drafting`, resolved
        here, in D3D's own loop, where the target is known); records why `"auto"` is off in `stats.overrides`.

        Raises:
            ValueError: for `d3d_fused_drafting=True` where it cannot run, saying why.
        """
        option = self.options.fused_drafting
        if option is False:
            return
        if self.batched:  # `True` was refused for a batch (`check_batch_options`)
            reason = "a batch drafts with one pass per round (batched_decoding_d3d)"
        elif self.stats.asynchronous:
            reason = "asynchronous rounds draft in the packed pass"
        elif self.tree is not None:
            reason = "tree verification drafts with a pass per round"
        elif option == "auto" and self.passes.device.type == "cpu":
            reason = (
                "cpu: the block rows' adapter hooks measured dearer than the draft pass a hit saves "
                "(benchmarks/results/fused/rows_cost.md); True runs it"
            )
        elif self.planner.fixed_num_drafts is not None and option == "auto":
            reason = "a fixed d3d_num_drafts drafts with a pass each round (True drafts in the verifications)"
        elif self.planner.fixed_num_drafts is None and self.planner.policy.draft_curve is None:
            reason = "the adaptive engine runs without draft passes (no draft cost curve)"
        elif "ready_masks" not in inspect.signature(self.planner.policy.decide).parameters:
            reason = "the drafter's own draft_policy decides without `ready_masks` (a block drafted in a verification)"
        else:
            reason = fused_drafting_unavailable(self.drafter, target)
        if reason is not None:
            if option is True:
                raise ValueError(
                    f"`d3d_fused_drafting=True` cannot run in this call: {reason}. Drop the option (the default "
                    "'auto' uses it where it can run)."
                )
            self.stats.overrides["d3d_fused_drafting"] = f"auto -> False: {reason}"
            return
        self.successors = SuccessorBlocks(target, self.drafter, self.planner.policy, self.stats)
        self.stats.fused_drafting = True

    # -- transformers' CandidateGenerator contract -----------------------------------------------------------------

    def get_candidates(
        self, input_ids: torch.LongTensor, **kwargs: Any
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Drafts up to `block_size - 1` tokens after `input_ids`.

        Args:
            input_ids (`torch.LongTensor` of shape `(1, seq_len)`): the committed sequence.

        Raises:
            ValueError: for a batch (D3D's batched loop, `batched_decoding_d3d`, drafts a batch's rounds itself).

        Returns:
            `(candidate_input_ids, candidate_logits)`: `input_ids` followed by the drafts, shape `(1, seq_len +
            num_drafts)`, and the processed draft scores, `torch.FloatTensor` of shape `(1, num_drafts,
            vocab_size)` (`None` when nothing is drafted).
        """
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"`get_candidates` drafts for one sequence, got a batch of {input_ids.shape[0]}: a batch is decoded "
                "by D3D's own loop (`target.generate(..., assistant_model=drafter)` with d3d_decoding_loop='d3d')."
            )
        self.round_clock.start_draft()
        cur_len = input_ids.shape[1]
        limit = min(self.block_size - 1, self.max_length - cur_len - 1)
        self._round = None
        if self.asynchronous_rounds is not None:
            drafts, scores = self.asynchronous_rounds.candidates(input_ids, limit)
            return self._finish_round(input_ids, "drafter" if limit > 0 else "target", drafts, scores)
        if limit <= 0:
            return self._finish_round(input_ids, "target", [], [])
        planner, proposer = self.planner, self.proposer
        ready = self.successors.take_ready() if self.successors is not None else None
        lookup, ngram_size = planner.lookup(input_ids, limit, proposer.eos_token_ids)
        cache = self.passes.pass_cache()
        if self.passes.awaits_prefill(cache):
            return self._finish_round(input_ids, "target", [], [])
        num_pending = cur_len - cache.get_seq_length()
        ready_kwargs = {} if ready is None else {"ready_masks": ready.shape[0]}  # a user's policy may not take it
        decision = planner.policy.decide(
            num_pending,
            0 if lookup is None else lookup.shape[1],
            max_candidates=limit,
            lookup_ngram_size=ngram_size or None,
            **ready_kwargs,
        )
        drafts, scores, confidences, draft_seconds, ready_round = [], [], None, None, False
        if decision.source == "lookup":
            drafts, scores = proposer.lookup_drafts(input_ids, lookup[0, : decision.num_lookup].tolist())
        elif getattr(decision, "ready", False):  # drafted inside the last verification: no pass
            drafts, scores = proposer.choose(input_ids, ready.float()[: min(limit, ready.shape[0])])
            if drafts:
                confidences = proposer.confidences(drafts, scores)
                keep = planner.policy.choose(confidences, 0.0, decision)
                drafts, scores = drafts[:keep], scores[:keep]
            self.stats.ready_rounds += 1
            ready_round = True
        elif decision.source == "drafter" and decision.num_masks > 0:
            committed = input_ids[:, cache.get_seq_length() :].to(self.passes.device)
            masks = getattr(decision, "pass_masks", decision.num_masks)  # a fixed plan's block stays whole
            block_logits, seconds, draft_seconds = self.passes.timed_pass(committed, cache, masks)
            drafts, scores = proposer.choose(input_ids, block_logits.float()[: decision.num_masks])
            if drafts:
                confidences = proposer.confidences(drafts, scores)
                keep = planner.policy.choose(confidences, seconds, decision)
                drafts, scores = drafts[:keep], scores[:keep]
        self._round = (decision, len(drafts), confidences, draft_seconds)  # the seconds to learn
        if self.successors is not None:
            self._plan_successors(decision, drafts, confidences, cur_len)
        return self._finish_round(input_ids, decision.source, drafts, scores, ready_round)

    def _plan_successors(self, decision, drafts: list, confidences: list[float] | None, cur_len: int) -> None:
        """Plans the drafter blocks of this round's verification from the candidates' estimated acceptance."""
        policy, num_sent = self.planner.policy, len(drafts)
        if decision.source == "lookup":
            acceptance = policy.lookup.probabilities(num_sent, decision.lookup_ngram_size)
        elif num_sent:
            acceptance = policy.calibrator.probabilities(confidences[:num_sent])
        else:
            acceptance = []
        tokens = [int(d) for d in drafts]
        room = self.max_length - cur_len
        self.successors.plan(acceptance, tokens, 1 + num_sent, room, set(self.proposer.eos_token_ids))

    def _finish_round(self, input_ids: torch.LongTensor, source: str, drafts: list, scores: list, ready: bool = False):
        """Records the round's plan, ends its draft span and returns what `get_candidates` returns."""
        self.stats.record_round_plan(source, len(drafts), ready)
        self.round_clock.end_draft()
        self.passes.verification_starts()
        if not drafts:
            return input_ids, None
        candidate_ids = torch.cat([input_ids, torch.cat(drafts, dim=1).to(input_ids.device)], dim=1)
        return candidate_ids, torch.stack(scores, dim=1)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches) -> None:
        """Records the outcome of one verification (`num_matches` accepted drafts, after transformers' eos and
        length cropping) and lets the policy learn from it."""
        verify_seconds = self.passes.learned_verify_seconds(self.round_clock.end_verify())
        num_matches = int(num_matches)
        if self._round is not None:
            decision, num_sent, confidences, draft_seconds = self._round
            block_rows = self.successors.block_rows if self.successors is not None else 0
            self.planner.policy.observe_round(
                decision,
                num_sent=num_sent,
                num_accepted=min(num_matches, num_sent),
                confidences=confidences,
                draft_seconds=draft_seconds,
                verify_seconds=verify_seconds if self.stats.rounds > 0 else None,  # round 1 includes the prefill
                verify_rows=num_sent + 1 + block_rows,
            )
        self.stats.record_outcome(num_matches)
        if self.planner is not None:
            self.planner.save_if_ends(lambda: self.proposer.generation_ends(input_ids, self.max_length))
        if self.asynchronous_rounds is not None:
            self.asynchronous_rounds.round_ends(input_ids)


def d3d_candidate_generator(
    target,
    drafter,
    input_ids: torch.LongTensor,
    generation_config,
    logits_processor,
    model_kwargs: dict | None,
    target_tokenizer=None,
) -> D3DCandidateGenerator:
    """The call's `D3DCandidateGenerator`, as D3D's own loops build it (`decoding_d3d`, `batched_decoding_d3d`) and as
    the patched candidate-generator factory builds it for transformers' loop (`hooks_d3d`): the drafter's bundle
    version (`check_bundle_version`; also here, since the validation hook is skipped on some transformers) and
    `generate`'s inputs (`check_generate_inputs`) first, then `drafter.build_candidate_generator`.

    Raises:
        ValueError: for what those checks and `D3DCandidateGenerator` refuse, before any forward pass.
    """
    check_bundle_version(drafter)
    check_generate_inputs(drafter, input_ids, model_kwargs)
    return drafter.build_candidate_generator(
        input_ids=input_ids,
        generation_config=generation_config,
        logits_processor=logits_processor,
        target_tokenizer=target_tokenizer,
        target=target,
        model_kwargs=model_kwargs,
    )


__all__ = ["D3DCandidateGenerator", "d3d_candidate_generator", "resolve_asynchronous"]
