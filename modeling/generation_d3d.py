"""D3D candidate generator and the transformers hook that makes `target.generate(..., assistant_model=drafter)` use it.

Part of the self-contained remote-code bundle: imports only torch and the public transformers API, so a checkpoint
loaded with `trust_remote_code=True` (without d3d_hf installed) decodes with D3D too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from .calibration_d3d import CalibrationStore, policy_for
from .configuration_d3d import validate_config
from .decoding_d3d import install_decoding_hook, remove_decoding_hook
from .drafting_d3d import D3DCache
from .estimates_d3d import expected_tokens
from .lookup_d3d import lookup_match
from .policy_d3d import DraftPolicy
from .runtime_d3d import PackedPassWorker, RoundClock, default_worker_threads, timed
from .tree_d3d import DraftTree, build_draft_tree

#: transformers releases the hook was tested with (inclusive lower, exclusive upper bound).
SUPPORTED_TRANSFORMERS = ("5.24.0", "5.30.0")
_HOOK_ATTRIBUTE = "_d3d_generation_hook"
#: `GenerationMixin._validate_generation_mode`, the first step of `generate` that sees the assistant and the final
#: generation config, is wrapped too, when it has these parameters (see `install_generation_hook`)
_EXPECTED_VALIDATION_PARAMETERS = ("generation_mode", "generation_config", "generation_mode_kwargs")
_EXPECTED_FACTORY_PARAMETERS = (
    "generation_config",
    "input_ids",
    "inputs_tensor",
    "logits_processor",
    "model_kwargs",
    "assistant_model",
    "target_tokenizer",
    "assistant_tokenizer",
)


#: per-call options read from the `GenerationConfig` passed to `generate`, else from `drafter.generation_config`
ASYNC_OPTIONS = {"d3d_async": False, "d3d_num_hypotheses": 4, "d3d_reuse_on_miss": False, "d3d_worker_threads": None}
#: per-call options of the cost-aware engine, read like `ASYNC_OPTIONS`: `d3d_num_drafts` is `"adaptive"` (drafts per
#: round chosen by expected tokens per second, 0 = a plain target step), a whole number in [0, block_size - 1]
#: (that many drafts every round, as far as the remaining length allows) or `"full"` (`block_size - 1`: the engine
#: before the policy); `d3d_prompt_lookup` makes n-gram matches in the prompt and the generated text a free
#: candidate source (adaptive mode only)
POLICY_OPTIONS = {"d3d_num_drafts": "adaptive", "d3d_prompt_lookup": True}
#: per-call options of D3D's own decoding loop (`decoding_d3d`), read like `ASYNC_OPTIONS`: `d3d_decoding_loop` is
#: `"d3d"` (D3D's loop) or `"transformers"` (transformers' assisted-generation loop, chain verification only);
#: `d3d_tree_budget` is `None` (chain verification: exactly transformers' rounds), `"adaptive"` (a draft tree whose
#: node count, 0 to `block_size`, maximises expected tokens per second on the verify cost curve) or a whole number
#: `n >= 1` (a tree of at most `n` nodes every drafter round); `d3d_tree_branching` is the drafter candidates per
#: depth (>= 1)
#: `d3d_share_target_cache` (D3D's own loop, synchronous drafting): a drafter whose committed-token keys and values
#: are the target's own (it shares the target's weights and runs the target's first layers, in order) attends to the
#: target's cache instead of re-running the committed tokens in a cache of its own; `False` keeps its own cache
#: `d3d_target_matmul_layouts` (D3D's own loop, synchronous drafting, CPU): the target's verification forwards of 2-32
#: rows run their linears on the faster matmul layout of this machine (`modeling_d3d.target_matmul_layouts`); off by
#: default (the target's forward is the user's)
TREE_OPTIONS = {
    "d3d_decoding_loop": "d3d",
    "d3d_tree_budget": None,
    "d3d_tree_branching": 4,
    "d3d_share_target_cache": True,
    "d3d_target_matmul_layouts": False,
}
"""Defaults; `d3d_num_hypotheses` is at most the block size when not set; `d3d_worker_threads=None` gives the CPU
worker half of the calling thread's torch intra-op threads (at least one)."""


def _whole_number(value: Any) -> int | None:
    """`value` as an `int` when it is a whole number (an `int`, or a float such as `2.0`; never a `bool`), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


@dataclass
class D3DGenerationStats:
    """Statistics of one `generate` call with a D3D drafter (stored as `drafter.last_generation_stats`).

    Attributes:
        rounds (`int`): target verification forwards (the first one includes the prompt prefill).
        new_tokens (`int`): tokens committed by those forwards (accepted drafts plus one bonus token each).
        accepted_drafts (`int`): draft tokens the target accepted.
        drafted_tokens (`int`): draft tokens proposed.
        draft_seconds (`list[float]`): wall time of each round's drafting on the critical path, seconds: the draft
            pass (synchronous), or waiting for the packed pass plus choosing the tokens (asynchronous hit).
        verify_seconds (`list[float]`): wall time from the end of each round's drafting to the end of its
            verification (target forward plus transformers' acceptance bookkeeping), seconds.
        acceptance_lengths (`list[int]`): tokens committed per round (`tau` of each round).
        asynchronous (`bool`): whether packed successor drafting was on.
        num_hypotheses (`int`): successor blocks per packed pass (asynchronous only).
        hits (`int`): rounds whose block came from the packed pass because the real outcome was a hypothesis and
            its bonus guess was right.
        reused (`int`): missed rounds that still used a packed block, with the real bonus token substituted
            (`d3d_reuse_on_miss=True`).
        misses (`int`): rounds after a packed pass that needed a synchronous draft.
        packed_seconds (`list[float]`): wall time of each joined packed pass on the worker thread, seconds (off the
            critical path; on CUDA the time to enqueue it).
        join_wait_seconds (`list[float]`): how long each join waited for the packed pass to finish (CPU), seconds:
            the part of the packed pass that verification did not hide.
        worker_threads (`int`): torch intra-op threads of the CPU worker that ran the packed passes (0 when none
            ran on the CPU worker).
        policy (`str`): how drafts per round were chosen: `"adaptive"` (the cost-aware `DraftPolicy`) or the fixed
            `d3d_num_drafts`.
        asynchronous_off_reason (`str`, *optional*): why the adaptive engine drafted synchronously although
            `d3d_async=True` was asked for (`None` otherwise).
        round_sources (`list[str]`): per round, where its candidates came from: `"drafter"`, `"lookup"` (prompt
            lookup, no draft pass) or `"target"` (none: a plain target step).
        round_candidates (`list[int]`): per round, the candidates sent for verification (the chosen `k`).
        cost_curves_ms (`dict`, *optional*): the adaptive policy's cost curves when the call started, milliseconds by
            new rows (`{"verify": {rows: ms}, "draft": {rows: ms}}`); `None` for a fixed `d3d_num_drafts`.
        decoding_loop (`str`): the loop that ran the call: `"d3d"` (`decoding_d3d`) or `"transformers"`.
        tree_budget (`int` or `str`, *optional*): `d3d_tree_budget` of the call (`None`: chain verification); with a
            tree, `round_candidates` counts the nodes verified per round and `acceptance_lengths` the path plus one.
        shared_target_cache (`bool`): the draft passes attended to the target's cache (`d3d_share_target_cache`).
        target_matmul_layouts (`bool`): the target's verification forwards ran on `MatmulLayouts`
            (`d3d_target_matmul_layouts`).
        target_gqa_attention (`bool`): the target's forwards ran on `gqa_sdpa_attention_forward`
            (`modeling_d3d.target_gqa_attention`: D3D's own loop, CPU, `"sdpa"` with grouped-query attention).
    """

    rounds: int = 0
    new_tokens: int = 0
    accepted_drafts: int = 0
    drafted_tokens: int = 0
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    asynchronous: bool = False
    num_hypotheses: int = 0
    hits: int = 0
    reused: int = 0
    misses: int = 0
    packed_seconds: list[float] = field(default_factory=list)
    join_wait_seconds: list[float] = field(default_factory=list)
    worker_threads: int = 0
    policy: str = "adaptive"
    asynchronous_off_reason: str | None = None
    round_sources: list[str] = field(default_factory=list)
    round_candidates: list[int] = field(default_factory=list)
    cost_curves_ms: dict[str, dict[int, float]] | None = None
    decoding_loop: str = "transformers"
    tree_budget: int | str | None = None
    shared_target_cache: bool = False
    target_matmul_layouts: bool = False
    target_gqa_attention: bool = False

    def record_round_plan(self, source: str, num_candidates: int) -> None:
        """Records where a round's candidates came from and how many were sent."""
        self.round_sources.append(source if num_candidates or source != "drafter" else "target")
        self.round_candidates.append(int(num_candidates))

    @property
    def tau(self) -> float:
        """Mean acceptance length: committed tokens per target verification forward, bonus included."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def hit_rate(self) -> float:
        """Fraction of rounds after a packed pass whose block was pre-drafted (`hits / (hits + reused + misses)`)."""
        total = self.hits + self.reused + self.misses
        return self.hits / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (with `tau` and `hit_rate`), for JSON."""
        return {**asdict(self), "tau": self.tau, "hit_rate": self.hit_rate}


class D3DCandidateGenerator(CandidateGenerator):
    """D3D drafting for transformers' assisted-generation loop (d3d-hf docs/DESIGN.md section 2).

    **Synchronous rounds.** The drafter extends its own KV cache with the tokens committed since its last call and,
    in the same forward pass, denoises the block `[anchor, MASK x (B-1)]`; the target then verifies the `B-1` drafts
    in one forward (transformers' loop), commits the accepted prefix plus a bonus token, and crops its cache.

    **Asynchronous rounds** (`d3d_async=True`, arXiv 2611.06425). Right after handing a block to the target, the
    drafter runs one packed pass (`D3DForDiffusionDrafting.packed_draft_logits`) that drafts the *successor* block for
    the `d3d_num_hypotheses` most likely verification outcomes, while the target verifies: on a worker thread on
    CPU, on a side CUDA stream (joined with an event) on GPU. A hypothesis is a verification outcome `(m, g)`: `m`
    drafts accepted and bonus token `g`. They are ranked by their likelihood under the drafter, `q_1 ... q_m *
    q_{m+1}(g)` with `q_j` the drafter's confidence in draft `d_j` and `g != d_{m+1}` (the rejected draft; any `g`
    when all `k` drafts pass, from the drafter's guess one past the block), and the `d3d_num_hypotheses` likeliest
    get a successor block `[g, MASK x (B-1)]` (several guesses may share one `m`). When the real outcome `(m*, b*)` is a
    hypothesis (a hit), the pre-drafted block is used and the drafter cache is extended with the
    packed keys/values of what was committed; otherwise the round drafts synchronously (a miss), or, with
    `d3d_reuse_on_miss=True`, uses the block drafted for `m*` although its bonus guess was wrong. Every token is
    still verified by the target, so hits change speed, never output.

    Drafts are the argmax (greedy) or a sample (`do_sample=True`) of the drafter's scores after the same logits
    processors the target applies, applied to the real committed sequence when the block is used, so the returned
    scores are exactly the distribution `q` each draft was drawn from, as lossless speculative sampling requires.
    A draft never contains a token that completes one of `generation_config.stop_strings`: such a token and what
    follows it are left to the target, so generation stops exactly where target-only decoding stops (transformers
    checks stop strings only at the end of each round).

    Options (attributes of the `GenerationConfig` passed to `generate`, e.g. `GenerationConfig(d3d_async=True)`,
    else of `drafter.generation_config`, as transformers reads `num_assistant_tokens` from the assistant):
    `d3d_async` (`bool`, default `False`), `d3d_num_hypotheses` (`int` in `[1, block_size]`, default
    `min(4, block_size)`), `d3d_reuse_on_miss` (`bool`, default `False`), `d3d_worker_threads` (`int` in `[1,
    max(CPU count, torch threads)]`, CPU only, default half of the calling thread's `torch.get_num_threads()`, at
    least 1): intra-op threads of the worker thread that runs the packed pass. The worker and the target's
    verification run at the same time; with both at the full thread count they oversubscribe the cores (SmolLM2 on 2
    cores, bf16, 4 hypotheses: verification 50 -> 67 ms while the packed pass runs, 55 ms with a 1-thread worker, and
    the packed pass itself 159 vs 125 ms; `benchmarks/cpu_threads.py`; with 16 hypotheses the 2-thread worker was
    faster). The calling thread's own count and the count new threads inherit are left as they were. A packed pass
    whose round never comes (generation stopped by length, eos or a stop string) is cancelled, or waited for, before
    `generate` returns; after a stop by a user's own stopping criterion it finishes in the background.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        input_ids (`torch.LongTensor` of shape `(1, seq_len)`): the prompt.
        generation_config (`GenerationConfig`): the target's generation config for this call.
        logits_processor (`LogitsProcessorList`): the target's logits processors (and warpers when sampling).
        target_tokenizer (`PreTrainedTokenizerBase`, *optional*): needed for `stop_strings`.
        target (`PreTrainedModel`, *optional*): the target; its `max_position_embeddings` bounds the prompt.
        Other keyword arguments of transformers' candidate-generator factory are accepted and ignored.

    Raises:
        ValueError: before any forward pass, for a batch size other than 1, an empty prompt, a prompt longer than
            the target's or the drafter's `max_position_embeddings`, a drafter without a mask token,
            `stop_strings` without a tokenizer, or an async option of the wrong type or range (`d3d_async` and
            `d3d_reuse_on_miss` not a bool, `d3d_num_hypotheses` not a whole number in `[1, block_size]`,
            `d3d_worker_threads` not a whole number in `[1, max(CPU count, torch threads)]`); the options are
            checked even when `d3d_async` is off.
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
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"D3D speculative decoding runs one sequence at a time (transformers' assisted generation is batch "
                f"size 1 only); got a batch of {input_ids.shape[0]}. Call `generate` once per prompt."
            )
        _check_prompt_and_drafter(drafter, input_ids.shape[1], target)
        self.drafter = drafter
        self.block_size = int(drafter.config.block_size)
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = generation_config.max_length
        self.logits_processor = logits_processor
        self.eos_token_ids = _as_id_list(generation_config.eos_token_id)
        self.stop_string_criteria = None
        if generation_config.stop_strings:
            if target_tokenizer is None:
                raise ValueError("`stop_strings` need the tokenizer: pass `tokenizer=...` to `generate`.")
            self.stop_string_criteria = StopStringCriteria(target_tokenizer, generation_config.stop_strings)
        options = {}
        for name in (*ASYNC_OPTIONS, *POLICY_OPTIONS, *TREE_OPTIONS):
            value = getattr(generation_config, name, None)
            if value is None:
                value = getattr(getattr(drafter, "generation_config", None), name, None)
            options[name] = value
        for name in ("d3d_async", "d3d_reuse_on_miss"):
            if options[name] is not None and not isinstance(options[name], bool):
                raise ValueError(f"`{name}` must be True or False (or None for the default), got {options[name]!r}.")
        self.asynchronous = bool(options["d3d_async"])
        self.reuse_on_miss = bool(options["d3d_reuse_on_miss"])
        hypotheses = options["d3d_num_hypotheses"]
        if hypotheses is None:
            hypotheses = min(ASYNC_OPTIONS["d3d_num_hypotheses"], self.block_size)
        self.num_hypotheses = _whole_number(hypotheses)
        if self.num_hypotheses is None or not 1 <= self.num_hypotheses <= self.block_size:
            raise ValueError(
                f"`d3d_num_hypotheses` must be a whole number in [1, block_size={self.block_size}] (or None for "
                f"min(4, block_size)), got {hypotheses!r}."
            )
        threads = options["d3d_worker_threads"]
        if threads is None:
            threads = default_worker_threads()
        most = max(os.cpu_count() or 1, torch.get_num_threads())
        self.worker_threads = _whole_number(threads)
        if self.worker_threads is None or not 1 <= self.worker_threads <= most:
            raise ValueError(
                f"`d3d_worker_threads` must be a whole number in [1, {most}] (at most the CPU count or torch's "
                f"threads, whichever is larger; None for half of torch's threads), got {threads!r}."
            )
        layouts = options["d3d_target_matmul_layouts"]
        if layouts is not None and not isinstance(layouts, bool):
            raise ValueError(f"`d3d_target_matmul_layouts` must be True or False (or None for False), got {layouts!r}.")
        self.target_matmul_layouts = bool(layouts)
        self._own_loop = options["d3d_decoding_loop"] in (None, "d3d")  # validated by `_setup_tree`
        self._setup_policy(options, target)
        self._setup_tree(options)
        self.cache = D3DCache()  # a new, empty drafter state for every `generate` call
        self.stats = D3DGenerationStats(
            asynchronous=self.asynchronous,
            num_hypotheses=self.num_hypotheses if self.asynchronous else 0,
            policy=self.policy_mode,
            asynchronous_off_reason=self._async_off_reason,
            tree_budget=self.tree_budget,
            target_matmul_layouts=self.target_matmul_layouts,
        )
        if self.policy_mode == "adaptive" and self.policy.verify_curve is not None:
            self.stats.cost_curves_ms = {
                name: {q: 1e3 * sec for q, sec in curve.points.items()}
                for name, curve in (("verify", self.policy.verify_curve), ("draft", self.policy.draft_curve))
                if curve is not None
            }
        drafter.last_generation_stats = self.stats
        self.round_clock = RoundClock(self.stats.draft_seconds, self.stats.verify_seconds)
        self._worker = PackedPassWorker(self._draft_device(), self.worker_threads)
        self._pending_info = None  # launch info of the packed pass in flight (`self._worker` runs it)
        self._verify_trials = 0  # `_layout_trials()` when the current round's verification began

    def _draft_device(self) -> torch.device:
        return self.drafter.model.embed_tokens.weight.device

    def _layout_trials(self) -> int:
        """The process's `MatmulLayouts.timed_calls` (drafter and, under `d3d_target_matmul_layouts`, target)."""
        trials = getattr(self.drafter.model, "matmul_layout_trials", None)
        return trials() if trials is not None else 0

    def _timed_pass(self, committed, cache, num_masks: int) -> tuple[torch.Tensor, float, float | None]:
        """A draft pass: `(block logits, its seconds, the seconds to learn)`. A pass during which `MatmulLayouts`
        was still timing candidate layouts (a row count seen for the first time) ran some matmuls on slower layouts
        than it will from then on: its time is used for this round's choice but not learned into the cost curve,
        where the policy's EMA would keep it (a row count made too dear stops being chosen, so nothing corrects it)."""
        trials = self._layout_trials()
        block_logits, seconds = timed(lambda: self.drafter.draft_logits(committed, cache, num_masks=num_masks)[0])
        return block_logits, seconds, seconds if self._layout_trials() == trials else None

    def _learned_verify_seconds(self, seconds: float | None) -> float | None:
        """The verification's time, or `None` when `MatmulLayouts` timed candidates during it (see `_timed_pass`)."""
        return seconds if self._layout_trials() == self._verify_trials else None

    def _setup_policy(self, options: dict[str, Any], target) -> None:
        """Validates the policy options and picks the `DraftPolicy` of this call (see `POLICY_OPTIONS`)."""
        mode = options["d3d_num_drafts"]
        mode = POLICY_OPTIONS["d3d_num_drafts"] if mode is None else mode
        fixed = self.block_size - 1 if mode == "full" else _whole_number(mode)
        if mode != "adaptive" and (fixed is None or not 0 <= fixed <= self.block_size - 1):
            raise ValueError(
                f"`d3d_num_drafts` must be 'adaptive', 'full' or a whole number in [0, block_size - 1 = "
                f"{self.block_size - 1}], got {mode!r}."
            )
        lookup = options["d3d_prompt_lookup"]
        if lookup is not None and not isinstance(lookup, bool):
            raise ValueError(f"`d3d_prompt_lookup` must be True or False (or None for the default), got {lookup!r}.")
        self.prompt_lookup = POLICY_OPTIONS["d3d_prompt_lookup"] if lookup is None else lookup
        self._async_off_reason = None
        self._policy_store = self._policy_key = None
        own = getattr(self.drafter, "draft_policy", None)  # a user's own policy (e.g. curves measured elsewhere)
        self._fixed_num_drafts = None
        if mode != "adaptive":
            self.policy, self.policy_mode = DraftPolicy(max_drafts=self.block_size - 1, mode=fixed), str(fixed)
            self._fixed_num_drafts = fixed
            self.prompt_lookup = False
            return
        self.policy_mode = "adaptive"
        if own is not None:
            self.policy = own
        elif target is not None:
            self._policy_store = CalibrationStore()
            with self.target_layouts(target):  # the verify curve of the forwards the loop will run
                self.policy, self._policy_key = policy_for(
                    target, self.drafter, self._policy_store, target_matmul_layouts=self.target_matmul_layouts
                )
        else:  # nothing to calibrate against: the engine before the policy
            fixed = self.block_size - 1
            self.policy, self.policy_mode = DraftPolicy(max_drafts=fixed, mode=fixed), str(fixed)
            self._fixed_num_drafts, self.prompt_lookup = fixed, False
        if self.asynchronous and self._draft_device().type != "cuda":
            # the packed pass and the verification would share the CPU cores: measured slower than synchronous
            # drafting in every setting on the project's CPUs (README, benchmarks/results/async/), so the adaptive
            # engine drafts synchronously there; a fixed `d3d_num_drafts` keeps asynchronous drafting on
            self.asynchronous = False
            self._async_off_reason = "cpu: the packed pass and the verification share the cores"

    def _setup_tree(self, options: dict[str, Any]) -> None:
        """Validates the decoding-loop and tree options (see `TREE_OPTIONS`)."""
        loop = options["d3d_decoding_loop"]
        loop = TREE_OPTIONS["d3d_decoding_loop"] if loop is None else loop
        if loop not in ("d3d", "transformers"):
            raise ValueError(f"`d3d_decoding_loop` must be 'd3d' or 'transformers' (or None for 'd3d'), got {loop!r}.")
        self.decoding_loop = loop
        budget = options["d3d_tree_budget"]
        if budget is not None and budget != "adaptive":
            number = _whole_number(budget)
            if number is None or number < 1:
                raise ValueError(
                    f"`d3d_tree_budget` must be None (chain verification), 'adaptive' or a whole number of nodes >= 1, "
                    f"got {budget!r}."
                )
            budget = number
        branching = options["d3d_tree_branching"]
        branching = TREE_OPTIONS["d3d_tree_branching"] if branching is None else branching
        self.tree_branching = _whole_number(branching)
        if self.tree_branching is None or self.tree_branching < 1:
            raise ValueError(f"`d3d_tree_branching` must be a whole number >= 1, got {branching!r}.")
        self.tree_budget = budget
        share = options["d3d_share_target_cache"]
        if share is not None and not isinstance(share, bool):
            raise ValueError(f"`d3d_share_target_cache` must be True or False (or None for True), got {share!r}.")
        self._share_requested = TREE_OPTIONS["d3d_share_target_cache"] if share is None else share
        self._target_cache = None
        if self.target_matmul_layouts and loop == "transformers":
            raise ValueError(
                "`d3d_target_matmul_layouts` applies to D3D's own decoding loop: drop "
                "`d3d_decoding_loop='transformers'` (or the option)."
            )
        if self.target_matmul_layouts and self.asynchronous:
            raise ValueError(
                "`d3d_target_matmul_layouts` times the target's matmuls, which asynchronous drafting would disturb on "
                "the same cores: it cannot be combined with `d3d_async=True` (on CPU the adaptive engine drafts "
                "synchronously anyway). Set one of them to its default."
            )
        if budget is not None and loop == "transformers":
            raise ValueError(
                "`d3d_tree_budget` needs D3D's own decoding loop: transformers' assisted-generation loop verifies one "
                "chain. Drop `d3d_decoding_loop='transformers'` (or set `d3d_tree_budget=None`)."
            )
        if budget is not None and self.asynchronous:
            raise ValueError(
                "Tree verification drafts synchronously: `d3d_tree_budget` cannot be combined with `d3d_async=True`. "
                "Set one of them to its default."
            )

    @contextlib.contextmanager
    def target_layouts(self, target):
        """The context in which this call's target forwards run (D3D's own loop, and the calibration of its verify
        curve): `modeling_d3d.target_gqa_attention(target)` (the target's multi-row forwards attend without copying
        keys/values per query head; bit-identical) unless `d3d_decoding_loop="transformers"`, and
        `modeling_d3d.target_matmul_layouts(target)` with `d3d_target_matmul_layouts=True`. Yields whether the
        attention was switched."""
        from .modeling_d3d import target_gqa_attention, target_matmul_layouts  # deferred: modeling_d3d imports this

        with contextlib.ExitStack() as stack:
            switched = False
            if target is not None and self._own_loop:
                switched = stack.enter_context(target_gqa_attention(target))
            if target is not None and self.target_matmul_layouts:
                stack.enter_context(target_matmul_layouts(target))
            yield switched

    def can_share_target_cache(self, target) -> bool:
        """Whether this call's drafter computes, for committed tokens, exactly the target's keys and values: it shares
        the target's weights (attached to `target`), its layers are the target's first layers in order
        (`source_layer_ids` 0, 1, ...; block adapters touch only the block rows), and drafting is synchronous."""
        config = self.drafter.config
        layers = list(config.source_layer_ids or range(config.num_hidden_layers))
        return (
            self._share_requested
            and not self.asynchronous
            and bool(getattr(config, "shares_target_weights", False))
            and getattr(self.drafter, "_attached_target", None) is target
            and layers == list(range(len(layers)))
        )

    def share_target_cache(self, cache) -> None:
        """Makes every later draft pass attend to the target's `cache` (a `DynamicCache` that D3D's loop keeps at
        the committed tokens before the last one) instead of the drafter's own (`can_share_target_cache` must hold).
        The pass ingests only the tokens the target has not cached (the last committed token, or the prompt before
        the first verification) and never changes `cache`."""
        self._target_cache = cache
        self.stats.shared_target_cache = True

    def _pass_cache(self) -> D3DCache:
        """The cache the next synchronous draft pass extends: the drafter's own, or a view of the target's (its
        layers' tensors, not copied; the pass appends to the view, never to the target's cache)."""
        if self._target_cache is None:
            return self.cache
        view = D3DCache()
        for layer in self._target_cache.layers[: self.drafter.config.num_hidden_layers]:
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                return view  # nothing cached yet (before the prefill)
            view.key_cache.append(layer.keys)
            view.value_cache.append(layer.values)
        return view

    def get_tree(self, input_ids: torch.LongTensor) -> DraftTree:
        """One round of tree drafting: the nodes to verify after `input_ids` (D3D's own loop, `d3d_tree_budget`).

        The policy decides the round as for a chain (`DraftPolicy.decide`). A drafter round runs one draft pass with
        every mask the remaining length allows and spends the node budget best-first on the block's per-depth
        distributions (after the target's logits processors, on the likeliest chain's history), estimated by the
        policy's calibrated acceptance, with the prompt-lookup match (if any) as an extra branch
        (`tree_d3d.build_draft_tree`); a drafter that shares the target's weights drafts depth 1 exactly, so depth 1
        does not branch. With `d3d_tree_budget="adaptive"` the tree is cut to the node count that maximises
        expected tokens per second, `(1 + sum of path probabilities) / (draft seconds + t_verify(1 + nodes))`. A
        lookup round is the lookup chain; a target round an empty tree.

        Args:
            input_ids (`torch.LongTensor` of shape `(1, seq_len)`): the committed sequence.

        Returns:
            `DraftTree`: nodes parents first (empty for a plain target step). Greedy: every node is a fixed token;
            sampling: only the depth-1 node of an exact drafter is a sample (`tree.proposals`).
        """
        self.round_clock.start_draft()
        self._round = None
        cur_len = input_ids.shape[1]
        limit = min(self.block_size - 1, self.max_length - cur_len - 1)
        tree = DraftTree()
        if limit <= 0:
            return self._finish_tree_round(tree, "target", None, None, None)
        lookup, ngram_size = None, None
        if self.prompt_lookup:
            lookup, ngram_size = lookup_match(input_ids, num_tokens=limit, eos_token_id=self.eos_token_ids or None)
        cache = self._pass_cache()
        num_pending = cur_len - cache.get_seq_length()
        budget = self.block_size if self.tree_budget == "adaptive" else self.tree_budget
        if not hasattr(self.policy, "tree_gains"):  # a user's own policy object of an older kind
            self.policy.tree_gains = {}
        gains = self.policy.tree_gains
        gain_key = (budget, self.tree_branching)
        tree_plan = (budget, gains[gain_key]) if gain_key in gains else None
        decision = self.policy.decide(
            num_pending,
            0 if lookup is None else lookup.shape[1],
            max_candidates=limit,
            lookup_ngram_size=ngram_size or None,
            tree=tree_plan if self.policy_mode == "adaptive" else None,
        )
        if self.policy_mode == "adaptive" and tree_plan is None and self.policy.draft_curve is not None:
            # warm-up: no tree of this size was built yet, so its gain over a chain is unknown; draft one
            decision = dataclasses.replace(decision, source="drafter", num_masks=limit, num_lookup=0, explore=True)
        allow = None
        if self.stop_string_criteria is not None:
            prefix = input_ids

            def allow(path: list[int]) -> bool:
                extended = torch.cat([prefix, prefix.new_tensor([path])], dim=1)
                return not bool(self.stop_string_criteria(extended, None).any())

        if decision.source == "lookup":
            tokens = lookup[0, : decision.num_lookup].tolist()
            chain = [(tokens, [1.0] * len(tokens))]
            tree = build_draft_tree(
                torch.zeros((0, 1)), len(tokens), extra_chains=chain, stop_tokens=self.eos_token_ids, allow=allow
            )
            return self._finish_tree_round(tree, "lookup", decision, None, None)
        if decision.source != "drafter" or decision.num_masks == 0:
            return self._finish_tree_round(tree, "target", decision, None, None)
        committed = input_ids[:, cache.get_seq_length() :].to(self._draft_device())
        num_masks = limit if self._fixed_num_drafts is None else self._fixed_num_drafts
        block_logits, draft_seconds, learned_seconds = self._timed_pass(committed, cache, num_masks)
        chain_drafts, scores = self._choose_drafts(input_ids, block_logits.float()[:num_masks])
        if not scores:
            return self._finish_tree_round(tree, "target", decision, None, learned_seconds)
        probabilities = torch.cat(scores, dim=0).softmax(dim=-1)
        extra = []
        if lookup is not None and self.policy_mode == "adaptive":
            tokens = lookup[0].tolist()
            extra.append((tokens, self.policy.lookup.probabilities(len(tokens), ngram_size or None)))
        exact_first = bool(getattr(self.drafter.config, "shares_target_weights", False))
        tree = build_draft_tree(
            probabilities,
            budget,
            acceptance=self.policy.calibrator.probabilities,
            exact_first=exact_first,
            sample_first=exact_first and self.do_sample,
            extra_chains=extra,
            branching=self.tree_branching,
            stop_tokens=self.eos_token_ids,
            allow=allow,
        )
        primary = self._primary_chain(tree, probabilities)
        chain_estimates = self.policy.calibrator.probabilities(primary[1])
        if exact_first and chain_estimates:
            chain_estimates[0] = 1.0  # as the tree counts it
        chain_expected = expected_tokens(chain_estimates, len(chain_estimates)) - 1.0
        if chain_expected > 0:  # the tree's expected accepted drafts over the chain's, for the next decisions
            ratio = tree.expected_accepted / chain_expected
            gains[gain_key] = ratio if gain_key not in gains else 0.8 * gains[gain_key] + 0.2 * ratio
        if self.tree_budget == "adaptive" and self.policy.verify_curve is not None:
            tree = tree.prefix(self._adaptive_tree_size(tree, num_pending_target=1, draft_seconds=draft_seconds))
        return self._finish_tree_round(tree, "drafter", decision, primary, learned_seconds)

    def _adaptive_tree_size(self, tree: DraftTree, num_pending_target: int, draft_seconds: float) -> int:
        """Node count `n` in `[0, len(tree)]` that maximises `(1 + sum_{i < n} P_i) / (draft_seconds +
        t_verify(num_pending_target + n))`; near-ties (the policy's tolerance) go to the smaller tree."""
        expected, rates = 1.0, []
        for n in range(len(tree) + 1):
            if n:
                expected += tree.probabilities[n - 1]
            rates.append(expected / (draft_seconds + self.policy.verify_curve(num_pending_target + n)))
        top = max(rates)
        return next(n for n, rate in enumerate(rates) if rate >= top * (1 - self.policy.tie_tolerance))

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

    def _finish_tree_round(self, tree: DraftTree, source: str, decision, primary, draft_seconds) -> DraftTree:
        self._round = (decision, tree, primary, draft_seconds)
        self.stats.record_round_plan(source, len(tree))
        self.stats.drafted_tokens += len(tree)
        self.round_clock.end_draft()
        self._verify_trials = self._layout_trials()
        return tree

    def update_tree_strategy(self, input_ids: torch.LongTensor, tree: DraftTree, path: list[int]) -> None:
        """Records the outcome of one tree verification: `path`, the accepted nodes (after eos and length
        cropping), the last of which is followed by one more committed token."""
        verify_seconds = self._learned_verify_seconds(self.round_clock.end_verify())
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
            self.policy.observe_round(
                decision,
                num_sent=num_sent,
                num_accepted=accepted,
                verify_seconds=None if first_round else verify_seconds,
                verify_rows=len(tree) + 1,
                **kwargs,
            )
        self._record_outcome(input_ids, len(path))

    def get_candidates(
        self, input_ids: torch.LongTensor, **kwargs: Any
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Drafts up to `block_size - 1` tokens after `input_ids`.

        Args:
            input_ids (`torch.LongTensor` of shape `(1, seq_len)`): the committed sequence.

        Returns:
            `(candidate_input_ids, candidate_logits)`: `input_ids` followed by the drafts, shape `(1, seq_len +
            num_drafts)`, and the processed draft scores, `torch.FloatTensor` of shape `(1, num_drafts,
            vocab_size)` (`None` when nothing is drafted).
        """
        self.round_clock.start_draft()
        cur_len = input_ids.shape[1]
        limit = min(self.block_size - 1, self.max_length - cur_len - 1)
        self._round = None
        if self.asynchronous:
            return self._asynchronous_candidates(input_ids, limit)
        if limit <= 0:
            return self._finish_round(input_ids, "target", [], [])
        lookup, ngram_size = None, None
        if self.prompt_lookup:
            lookup, ngram_size = lookup_match(input_ids, num_tokens=limit, eos_token_id=self.eos_token_ids or None)
        cache = self._pass_cache()
        num_pending = cur_len - cache.get_seq_length()
        decision = self.policy.decide(
            num_pending,
            0 if lookup is None else lookup.shape[1],
            max_candidates=limit,
            lookup_ngram_size=ngram_size or None,
        )
        drafts, scores, confidences, draft_seconds = [], [], None, None
        if decision.source == "lookup":
            drafts, scores = self._lookup_drafts(input_ids, lookup[0, : decision.num_lookup].tolist())
        elif decision.source == "drafter" and decision.num_masks > 0:
            committed = input_ids[:, cache.get_seq_length() :].to(self._draft_device())
            # a fixed number of drafts keeps its block whole near `max_length` (masks attend to each other, so the
            # number of masks changes the drafts); the adaptive engine computes only the rows it may send
            num_masks = self._fixed_num_drafts if self._fixed_num_drafts is not None else decision.num_masks
            block_logits, seconds, draft_seconds = self._timed_pass(committed, cache, num_masks)
            drafts, scores = self._choose_drafts(input_ids, block_logits.float()[: decision.num_masks])
            if drafts:
                confidences = self._confidences(drafts, scores)
                keep = self.policy.choose(confidences, seconds, decision)
                drafts, scores = drafts[:keep], scores[:keep]
        self._round = (decision, len(drafts), confidences, draft_seconds)  # the seconds to learn
        return self._finish_round(input_ids, decision.source, drafts, scores)

    def _finish_round(self, input_ids: torch.LongTensor, source: str, drafts: list, scores: list):
        """Records the round's plan, ends its draft span and returns what `get_candidates` returns."""
        self.stats.record_round_plan(source, len(drafts))
        self.round_clock.end_draft()
        self._verify_trials = self._layout_trials()
        if not drafts:
            return input_ids, None
        self.stats.drafted_tokens += len(drafts)
        candidate_ids = torch.cat([input_ids, torch.cat(drafts, dim=1).to(input_ids.device)], dim=1)
        return candidate_ids, torch.stack(scores, dim=1)

    def _asynchronous_candidates(self, input_ids: torch.LongTensor, limit: int):
        """`get_candidates` of the asynchronous engine (full blocks; the packed pass drafts the next one)."""
        cur_len = input_ids.shape[1]
        block_logits = self._use_packed_block(input_ids) if self._worker.pending else None
        if limit <= 0:
            return self._finish_round(input_ids, "target", [], [])
        if block_logits is None:
            committed = input_ids[:, self.cache.get_seq_length() :].to(self._draft_device())
            block_logits = self.drafter.draft_logits(committed, self.cache)[0]
        block_logits = block_logits.float()
        drafts, scores = self._choose_drafts(input_ids, block_logits[:limit])
        if drafts and cur_len + 1 < self.max_length:
            self._launch_packed_pass(input_ids, drafts, scores, block_logits)
        return self._finish_round(input_ids, "drafter", drafts, scores)

    @staticmethod
    def _confidences(drafts: list[torch.LongTensor], scores: list[torch.FloatTensor]) -> list[float]:
        """The drafter's probability of each chosen draft under the distribution it was chosen from."""
        ids = torch.cat(drafts, dim=1).view(-1, 1).to(scores[0].device)
        return torch.cat(scores, dim=0).softmax(dim=-1).gather(1, ids).view(-1).tolist()

    def _lookup_drafts(self, input_ids: torch.LongTensor, tokens: list[int]):
        """Prompt-lookup tokens as drafts, with the scores of the distribution they were "drawn" from: a point mass
        (0 at the token, -inf elsewhere), so lossless speculative sampling accepts token `d` with probability
        `p(d)` and otherwise resamples from the target's residual, exactly as for a drafter's draft. Stops after an
        eos and before a token that completes a stop string, as `_choose_drafts` does."""
        drafts, scores, sequence = [], [], input_ids
        vocab_size = int(self.drafter.config.vocab_size)
        for token_id in tokens:
            token = input_ids.new_tensor([[token_id]])
            if self.stop_string_criteria is not None:
                extended = torch.cat([sequence, token], dim=1)
                if bool(self.stop_string_criteria(extended, None).any()):
                    break
                sequence = extended
            point_mass = torch.full((1, vocab_size), float("-inf"), device=self._draft_device())
            point_mass[0, token_id] = 0.0
            drafts.append(token)
            scores.append(point_mass)
            if token_id in self.eos_token_ids:
                break
        return drafts, scores

    def _choose_drafts(
        self, input_ids: torch.LongTensor, logits: torch.FloatTensor
    ) -> tuple[list[torch.LongTensor], list[torch.FloatTensor]]:
        """Draft tokens (each `(1, 1)`) and their processed scores (each `(1, vocab_size)`) from block rows
        `logits` of shape `(num_drafts, vocab_size)`; stops after an eos and before a stop-string-completing token."""
        sequence = input_ids.to(logits.device)
        has_processors = self.logits_processor is not None and len(self.logits_processor) > 0
        if not has_processors:
            # no history-dependent processors: choose every draft token in one vectorised call
            if self.do_sample:
                chosen = torch.multinomial(logits.softmax(dim=-1), num_samples=1).view(1, -1)
            else:
                chosen = logits.argmax(dim=-1)[None]
        drafts, scores = [], []
        for k in range(logits.shape[0]):
            step_scores = logits[k : k + 1]
            if has_processors:
                step_scores = self.logits_processor(sequence, step_scores)
                if self.do_sample:
                    token = torch.multinomial(step_scores.softmax(dim=-1), num_samples=1)
                else:
                    token = step_scores.argmax(dim=-1, keepdim=True)
            else:
                token = chosen[:, k : k + 1]
            if has_processors or self.stop_string_criteria is not None:
                # only history-dependent processors and stop strings need the sequence with the drafts so far
                extended = torch.cat([sequence, token], dim=1)
                if self.stop_string_criteria is not None and bool(self.stop_string_criteria(extended, None).any()):
                    break
                sequence = extended
            drafts.append(token)
            scores.append(step_scores)
            if int(token) in self.eos_token_ids:
                break
        return drafts, scores

    def _launch_packed_pass(self, input_ids, drafts, scores, block_logits) -> None:
        """Chooses the hypotheses and starts the packed successor-drafting pass off the critical path."""
        device = self._draft_device()
        pending = input_ids[:, self.cache.get_seq_length() :].to(device)  # committed but not cached yet
        draft_ids = torch.cat(drafts, dim=1).to(device)
        num_drafts = draft_ids.shape[1]
        # drafter confidence of each draft under the distribution it was chosen from
        confidences = torch.cat(scores, dim=0).softmax(dim=-1).gather(1, draft_ids.view(-1, 1).to(scores[0].device))
        survive = [1.0]  # survive[m]: probability that the first m drafts are accepted
        for confidence in confidences.view(-1).tolist():
            survive.append(survive[-1] * confidence)
        # a hypothesis is an outcome (m accepted drafts, bonus token g); its likelihood under the drafter is
        # survive[m] * q_{m+1}(g) with g != d_{m+1} (the rejected draft), or survive[k] * q_{k+1}(g) when all k pass
        probs = block_logits[: num_drafts + 1].softmax(dim=-1)
        top_probs, top_ids = probs.topk(min(self.num_hypotheses + 1, probs.shape[-1]), dim=-1)
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

        def packed_pass():
            return self.drafter.packed_draft_logits(chain, self.cache, chain_lengths, guesses)

        enqueue_seconds = self._worker.launch(packed_pass)
        if enqueue_seconds is not None:  # CUDA: the time to enqueue the pass
            self.stats.packed_seconds.append(enqueue_seconds)
        else:
            self.stats.worker_threads = self.worker_threads

    def _use_packed_block(self, input_ids: torch.LongTensor) -> torch.FloatTensor | None:
        """Joins the packed pass, extends the drafter cache with what the verification committed, and returns the
        successor block's logits `(block_size, vocab_size)` on a hit (or a reused miss), else `None`."""
        info, self._pending_info = self._pending_info, None
        packed, seconds, wait = self._worker.join(lambda p: [p.logits, *p.key_states, *p.value_states])
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

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches) -> None:
        """Records the outcome of one verification (`num_matches` accepted drafts, after transformers' eos and
        length cropping)."""
        verify_seconds = self._learned_verify_seconds(self.round_clock.end_verify())
        num_matches = int(num_matches)
        if self._round is not None:
            decision, num_sent, confidences, draft_seconds = self._round
            self.policy.observe_round(
                decision,
                num_sent=num_sent,
                num_accepted=min(num_matches, num_sent),
                confidences=confidences,
                draft_seconds=draft_seconds,
                verify_seconds=verify_seconds if self.stats.rounds > 0 else None,  # round 1 includes the prefill
            )
        self._record_outcome(input_ids, num_matches)

    def _record_outcome(self, input_ids: torch.LongTensor, num_matches: int) -> None:
        """The statistics of one verified round, and what happens when it is the call's last."""
        self.stats.rounds += 1
        self.stats.accepted_drafts += num_matches
        self.stats.new_tokens += num_matches + 1
        self.stats.acceptance_lengths.append(num_matches + 1)
        if self._policy_key is not None and self._generation_ends(input_ids):
            self.policy.save_to(self._policy_store, self._policy_key)  # what this call learned, for the next process
        if self._worker.pending and self._generation_ends(input_ids):
            # the pass drafted for a round that will not come: stop it here rather than let it run on after
            # `generate` returns (it would take CPU from whatever the caller does next)
            self._worker.discard()
            self._pending_info = None

    def _generation_ends(self, input_ids: torch.LongTensor) -> bool:
        """Whether transformers' loop stops after this round by length, eos or stop string (the criteria the
        generator knows; after a stop by a user's own stopping criterion the last packed pass finishes on its own)."""
        if input_ids.shape[1] >= self.max_length or int(input_ids[0, -1]) in self.eos_token_ids:
            return True
        return self.stop_string_criteria is not None and bool(self.stop_string_criteria(input_ids, None).any())


def _check_prompt_and_drafter(drafter: PreTrainedModel, prompt_length: int, target=None) -> None:
    """Raises a `ValueError` that says what to change when D3D cannot decode this prompt with this drafter."""
    if prompt_length < 1:
        raise ValueError(
            "The prompt is empty (0 tokens): D3D drafts after the last committed token, so it needs at least one. "
            "Pass a prompt of one token or more (for example `[[tokenizer.bos_token_id]]`)."
        )
    limits = [("drafter", drafter.config)]
    if target is not None:
        limits.insert(0, ("target", target.config.get_text_config()))
    for name, config in limits:
        context = getattr(config, "max_position_embeddings", None)
        if context is not None and prompt_length > context:
            raise ValueError(
                f"The prompt has {prompt_length} tokens but the {name}'s context is {context} tokens "
                f"(`max_position_embeddings`): shorten the prompt to at most {context} tokens, for example by "
                "keeping its last tokens."
            )
    if drafter.config.mask_token_id is None and getattr(drafter.model, "mask_embedding", None) is None:
        raise ValueError(
            "This drafter has no mask token: `config.mask_token_id` is None and it has no `mask_embedding`. Set "
            "`drafter.config.mask_token_id` to the spare vocabulary id it was built with, or re-create it with "
            "`D3DForDiffusionDrafting.from_autoregressive(target)`."
        )


def check_generate_call(drafter: PreTrainedModel, generation_config) -> None:
    """What D3D checks at the start of `target.generate(..., assistant_model=drafter)`, before transformers' own checks
    of the assistant and before any forward pass: the drafter's config (`validate_config`, for fields set by hand such
    as `drafter.config.block_size = 0`) and the options of the call that assisted decoding cannot honour.

    Args:
        drafter (`D3DForDiffusionDrafting`): the assistant.
        generation_config (`GenerationConfig`): the call's generation config (after `generate`'s keyword arguments).

    Raises:
        ValueError: naming the drafter config field (`validate_config`), or `use_cache=False`.
    """
    validate_config(drafter.config)
    if generation_config.use_cache is False:
        raise ValueError(
            "`use_cache=False` cannot be used with an assistant model: speculative decoding keeps the target's KV "
            "cache and crops it to the accepted tokens after every verification. Drop `use_cache=False` (or pass "
            "`use_cache=True`), or call `generate` without `assistant_model`."
        )


def check_generate_inputs(drafter: PreTrainedModel, input_ids: torch.Tensor, model_kwargs: dict | None) -> None:
    """Refuses, before any forward pass, the prompts D3D cannot decode exactly as the target alone would.

    Args:
        drafter (`D3DForDiffusionDrafting`): the assistant.
        input_ids (`torch.Tensor` of shape `(batch_size, seq_len)`): the prompt as `generate` prepared it.
        model_kwargs (`dict`, *optional*): `generate`'s model keyword arguments (`inputs_embeds`, ...).

    Raises:
        ValueError: if `inputs_embeds` was given (with or without `input_ids`: the drafter drafts from token ids, so
            embeddings that are not exactly the ids' own would make the drafts and the target disagree), if
            `input_ids` is not an integer tensor (`torch.long` or `torch.int32`), if an id is outside `[0,
            drafter.config.vocab_size)`, or (`validate_config`) for an invalid drafter config field.
    """
    validate_config(drafter.config)
    if model_kwargs is not None and model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "D3D speculative decoding does not take `inputs_embeds`: the drafter drafts from token ids. Pass the "
            "prompt as `input_ids` (a `torch.long` tensor of shape `(1, seq_len)`) and drop `inputs_embeds`; for "
            "embeddings that are not a tokenised prompt, call `generate` without `assistant_model`."
        )
    if input_ids.dtype not in (torch.long, torch.int32):
        raise ValueError(
            f"`input_ids` must hold token ids as integers (`torch.long`), got a {input_ids.dtype} tensor. Pass the "
            "tokenizer's ids (`tokenizer(..., return_tensors='pt').input_ids`) or convert them with "
            "`input_ids.long()` if they are whole numbers."
        )
    if input_ids.numel() > 0:
        low, high, vocab = int(input_ids.min()), int(input_ids.max()), int(drafter.config.vocab_size)
        if low < 0 or high >= vocab:
            raise ValueError(
                f"`input_ids` holds ids outside the vocabulary [0, {vocab}) (min {low}, max {high}): pass ids of the "
                "target's own tokenizer."
            )


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def install_generation_hook() -> None:
    """Makes `GenerationMixin._get_candidate_generator` defer to assistants that build their own candidate
    generator (any assistant model with a `build_candidate_generator` method, such as a D3D drafter).

    transformers has no registry for candidate generators (d3d-hf docs/DESIGN.md section 2), so this is one
    narrow, idempotent patch of the target's candidate-generator factory; every other assistant keeps
    transformers' own behaviour. For a D3D assistant the factory first refuses the inputs D3D cannot decode exactly
    (`check_generate_inputs`: `inputs_embeds`, non-integer or out-of-vocabulary `input_ids`), and a second wrapper,
    of `GenerationMixin._validate_generation_mode` (the first step of `generate` that sees the assistant), checks the
    drafter's config and `use_cache` (`check_generate_call`) before transformers' own checks.
    Undo both with `remove_generation_hook()`.

    Raises:
        RuntimeError: if the installed transformers has no candidate-generator factory with the expected signature
            (supported range: `SUPPORTED_TRANSFORMERS`).
    """
    current = GenerationMixin._get_candidate_generator
    if getattr(current, _HOOK_ATTRIBUTE, False):
        _install_validation_hook()
        install_decoding_hook()
        return
    parameters = inspect.signature(current).parameters
    if any(name not in parameters for name in _EXPECTED_FACTORY_PARAMETERS):
        raise RuntimeError(
            f"transformers {transformers.__version__} changed `GenerationMixin._get_candidate_generator`; D3D "
            f"supports transformers >= {SUPPORTED_TRANSFORMERS[0]}, < {SUPPORTED_TRANSFORMERS[1]}. Install a "
            "version in that range."
        )
    low, high = (_version_tuple(v) for v in SUPPORTED_TRANSFORMERS)
    if not low <= _version_tuple(transformers.__version__) < high:
        warnings.warn(
            f"D3D was tested with transformers >= {SUPPORTED_TRANSFORMERS[0]}, < {SUPPORTED_TRANSFORMERS[1]}; "
            f"found {transformers.__version__}.",
            stacklevel=2,
        )
    original = current

    @functools.wraps(original)
    def _get_candidate_generator(
        self,
        generation_config,
        input_ids,
        inputs_tensor,
        logits_processor,
        model_kwargs,
        assistant_model=None,
        target_tokenizer=None,
        assistant_tokenizer=None,
    ):
        build = getattr(assistant_model, "build_candidate_generator", None)
        if build is not None:
            check_generate_inputs(assistant_model, input_ids, model_kwargs)
            return build(
                input_ids=input_ids,
                generation_config=generation_config,
                logits_processor=logits_processor,
                target_tokenizer=target_tokenizer,
                target=self,
                model_kwargs=model_kwargs,
            )
        return original(
            self,
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            target_tokenizer=target_tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )

    setattr(_get_candidate_generator, _HOOK_ATTRIBUTE, True)
    _get_candidate_generator._d3d_original = original
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    _install_validation_hook()
    install_decoding_hook()


def _install_validation_hook() -> None:
    """Wraps `GenerationMixin._validate_generation_mode` so that a D3D assistant's `check_generate_call` runs first:
    transformers refuses `use_cache=False` in `_assisted_decoding` before it asks for a candidate generator, and
    compares the assistant's `vocab_size` here. Skipped (those cases keep transformers' own errors) when the method
    is missing or its parameters changed; idempotent."""
    current = getattr(GenerationMixin, "_validate_generation_mode", None)
    if current is None or getattr(current, _HOOK_ATTRIBUTE, False):
        return
    if any(name not in inspect.signature(current).parameters for name in _EXPECTED_VALIDATION_PARAMETERS):
        return

    @functools.wraps(current)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant_model = generation_mode_kwargs.get("assistant_model")
        if getattr(assistant_model, "build_candidate_generator", None) is not None:
            check_generate_call(assistant_model, generation_config)
        return current(self, generation_mode, generation_config, generation_mode_kwargs)

    setattr(_validate_generation_mode, _HOOK_ATTRIBUTE, True)
    _validate_generation_mode._d3d_original = current
    GenerationMixin._validate_generation_mode = _validate_generation_mode


def remove_generation_hook() -> None:
    """Restores transformers' own candidate-generator factory, `_validate_generation_mode` and `_assisted_decoding`
    (a no-op when the hook is not installed)."""
    remove_decoding_hook()
    for name in ("_get_candidate_generator", "_validate_generation_mode"):
        current = getattr(GenerationMixin, name, None)
        if getattr(current, _HOOK_ATTRIBUTE, False):
            setattr(GenerationMixin, name, current._d3d_original)


__all__ = [
    "ASYNC_OPTIONS",
    "D3DCandidateGenerator",
    "D3DGenerationStats",
    "default_worker_threads",
    "SUPPORTED_TRANSFORMERS",
    "check_generate_call",
    "check_generate_inputs",
    "install_generation_hook",
    "remove_generation_hook",
]
