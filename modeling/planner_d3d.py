"""What every synchronous round (chain or tree) shares: the policy client (`RoundPlanner`) and the draft pass with
the cache it extends (`DraftPasses`).

Part of the self-contained remote-code bundle: imports only torch and its siblings.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .calibration_d3d import CalibrationStore, policy_for
from .drafting_d3d import D3DCache
from .fast_paths_d3d import layout_mark
from .lookup_d3d import lookup_match
from .options_d3d import D3DGenerationOptions, experiment
from .policy_d3d import DraftPolicy
from .runtime_d3d import timed


class DraftPasses:
    """The synchronous draft pass of one call and the cache it extends: the drafter's own `D3DCache`, or a view of
    the target's cache (`share_target_cache`).

    A pass during which `MatmulLayouts` was still timing candidate layouts (a row count seen for the first time) ran
    some matmuls on slower layouts than it will from then on: its time is used for that round's choice but not
    learned into the cost curves (`timed_pass`, `learned_verify_seconds`: `fast_paths_d3d.layout_mark`), where the
    policy's EMA would keep it."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.device = drafter.model.embed_tokens.weight.device
        self.cache = D3DCache()  # a new, empty drafter state for every `generate` call
        self.target_cache = None
        self._verify_mark = layout_mark()
        # EAGLE's feature (`D3DConfig.reads_target_hidden_state`): the target's last hidden state before the anchor
        self.reads_hidden_state = bool(getattr(drafter.config, "reads_target_hidden_state", False))
        self.anchor_hidden_state: torch.Tensor | None = None

    def share_target_cache(self, cache) -> None:
        """Makes every later pass attend to the target's `cache` (a `DynamicCache` that D3D's loop keeps at the
        committed tokens before the last one) instead of the drafter's own; the pass ingests only the tokens the
        target has not cached and never changes `cache`."""
        self.target_cache = cache

    def pass_cache(self) -> D3DCache:
        """The cache the next pass extends: the drafter's own, or a view of the target's (its layers' tensors, not
        copied; the pass appends to the view, never to the target's cache): the target's first layers, or for a
        `shares_target_cache` drafter the layers `source_layer_ids` names."""
        if self.target_cache is None:
            if getattr(self.drafter.config, "shares_target_cache", False):
                raise ValueError(
                    "This drafter attends to the target's cache (`shares_target_cache=True`) and has no cache of its "
                    "own, so it drafts only in D3D's own synchronous loop over a `DynamicCache` of full-attention "
                    "layers (`target.generate(input_ids, assistant_model=drafter)` with the default options). This "
                    "call is not one: d3d_decoding_loop='transformers', a call only transformers' loop can run (e.g. "
                    "output_attentions, extra model arguments), or a target cache of another kind."
                )
            return self.cache
        view = D3DCache()
        config = self.drafter.config
        layer_ids = range(config.num_hidden_layers)
        if getattr(config, "shares_target_cache", False):  # layer i attends to the target's layer source_layer_ids[i]
            layer_ids = config.source_layer_ids or layer_ids
        for layer in (self.target_cache.layers[i] for i in layer_ids):
            if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
                return view  # nothing cached yet (before the prefill)
            view.key_cache.append(layer.keys)
            view.value_cache.append(layer.values)
        return view

    def awaits_prefill(self, cache: D3DCache) -> bool:
        """Whether this round must leave drafting to the target: the drafter attends to the target's cache
        (`shares_target_cache`) and that cache is still empty (the first round's verification is the prefill), so
        there is no context to draft over."""
        return bool(getattr(self.drafter.config, "shares_target_cache", False)) and cache.get_seq_length() == 0

    def keep_hidden_state(self, hidden_states: torch.Tensor, row: int) -> None:
        """Keeps, for a drafter that reads it (`reads_hidden_state`), the target's last hidden state at `row` of a
        verification (`hidden_states` of shape `(1, rows, hidden_size)`: its forward's `hidden_states[-1]`), the row
        whose scores chose the last committed token, the next pass's anchor."""
        if self.reads_hidden_state:
            self.anchor_hidden_state = hidden_states[0, row][None].to(self.device)

    def pass_hidden_state(self) -> torch.Tensor | None:
        """The `anchor_hidden_state` of the next pass (`None` for a drafter that does not read it).

        Raises:
            RuntimeError: for a drafter that reads it when no verification has kept one (a loop that did not ask the
                target for its hidden states: `keep_hidden_state`).
        """
        if not self.reads_hidden_state:
            return None
        if self.anchor_hidden_state is None:
            raise RuntimeError(
                "This drafter reads the target's last hidden state before the anchor (`reads_target_hidden_state`), "
                "but no verification kept one: D3D's loop must run the target with `output_hidden_states=True` and "
                "call `DraftPasses.keep_hidden_state`."
            )
        return self.anchor_hidden_state

    def timed_pass(self, committed, cache, num_masks: int) -> tuple[torch.Tensor, float, float | None]:
        """A draft pass: `(block logits, its seconds, the seconds to learn or None)`."""
        mark = layout_mark()
        state = self.pass_hidden_state()
        extra = {} if state is None else {"anchor_hidden_state": state}  # a drafter without it keeps its signature
        block_logits, seconds = timed(
            lambda: self.drafter.draft_logits(committed, cache, num_masks=num_masks, **extra)[0]
        )
        return block_logits, seconds, mark.learned(seconds)

    def verification_starts(self) -> None:
        """Marks the start of a verification (for `learned_verify_seconds`)."""
        self._verify_mark = layout_mark()

    def learned_verify_seconds(self, seconds: float | None) -> float | None:
        """The verification's time, or `None` when `MatmulLayouts` timed candidates during it."""
        return self._verify_mark.learned(seconds)


class RoundPlanner:
    """The policy client of one call: which `DraftPolicy` decides the rounds, the prompt-lookup match it decides
    with, what it learns after each round and when its state is saved.

    Adaptive (`d3d_num_drafts="adaptive"`): the drafter's own `draft_policy` if it has one, else the machine's
    calibrated policy for this (target, drafter) pair (`calibration_d3d.policy_for`, measured under the fast paths
    the call's `generate` applied: `patches_d3d.apply_fast_paths`). Fixed (a number or `"full"`): a `DraftPolicy` of
    that many drafts; prompt lookup off. Without a target to calibrate against, the fixed full block (recorded in
    `stats.overrides`).

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        options (`D3DGenerationOptions`): the call's options.
        target (`PreTrainedModel`, *optional*): the target.
        overrides (`dict[str, str]`): where a replaced default is recorded.
    """

    def __init__(self, drafter, options: D3DGenerationOptions, target, overrides: dict[str, str]) -> None:
        block_size = int(drafter.config.block_size)
        mode = options.num_drafts
        self.store = self.key = None
        self.fixed_num_drafts: int | None = None
        self.prompt_lookup = options.prompt_lookup
        own = getattr(drafter, "draft_policy", None)  # a user's own policy (e.g. curves measured elsewhere)
        if mode == "adaptive" and own is None and target is None:
            mode = "full"  # nothing to calibrate against: the engine before the policy
            overrides["d3d_num_drafts"] = "adaptive -> full: no target to calibrate the cost curves against"
        if mode != "adaptive":
            fixed = block_size - 1 if mode == "full" else int(mode)
            self.policy = DraftPolicy(max_drafts=block_size - 1, mode=fixed)
            self.mode, self.fixed_num_drafts = str(fixed), fixed
            if self.prompt_lookup:
                self.prompt_lookup = False  # explicit True with a fixed plan is refused by the options
                overrides["d3d_prompt_lookup"] = "True -> False: a fixed d3d_num_drafts sends drafter drafts only"
            return
        self.mode = "adaptive"
        if own is not None:
            self.policy = own
            return
        self.store = CalibrationStore()
        self.policy, self.key = policy_for(
            target, drafter, self.store, target_matmul_layouts=options.target_matmul_layouts
        )
        if not options.draft_passes:  # the ablation without the drafter (d3d_hf): its own policy, never saved
            self.policy, self.key = experiment("draft_passes")(self.policy, self.key), None

    def cost_curves_ms(self) -> dict[str, dict[int, float]] | None:
        """The adaptive policy's cost curves as they stand, milliseconds by new rows (`None` for a fixed plan)."""
        if self.mode != "adaptive" or self.policy.verify_curve is None:
            return None
        return {
            name: {q: 1e3 * sec for q, sec in curve.points.items()}
            for name, curve in (("verify", self.policy.verify_curve), ("draft", self.policy.draft_curve))
            if curve is not None
        }

    def lookup(self, input_ids: torch.LongTensor, limit: int, eos_token_ids: list[int]):
        """The prompt-lookup match after `input_ids` (`(tokens (1, n), matched n-gram size)`, or `(None, None)`)."""
        if not self.prompt_lookup:
            return None, None
        return lookup_match(input_ids, num_tokens=limit, eos_token_id=eos_token_ids or None)

    def save_if_ends(self, ends: Callable[[], bool]) -> None:
        """Saves what the policy learned, for the next process, when the call ends (`ends()` is asked only for a
        calibrated policy)."""
        if self.key is not None and ends():
            self.policy.save_to(self.store, self.key)


__all__ = ["DraftPasses", "RoundPlanner"]
