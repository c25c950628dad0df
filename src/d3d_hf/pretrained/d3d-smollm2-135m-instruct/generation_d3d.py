"""D3D candidate generator and the transformers hook that makes `target.generate(..., assistant_model=drafter)` use it.

Part of the self-contained remote-code bundle: imports only torch and the public transformers API, so a checkpoint
loaded with `trust_remote_code=True` (without d3d_hf installed) decodes with D3D too.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

if TYPE_CHECKING:
    from .modeling_d3d import D3DForDiffusionDrafting

#: transformers releases the hook was tested with (inclusive lower, exclusive upper bound).
SUPPORTED_TRANSFORMERS = ("5.24.0", "5.30.0")
_HOOK_ATTRIBUTE = "_d3d_generation_hook"
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


@dataclass
class D3DGenerationStats:
    """Statistics of one `generate` call with a D3D drafter (stored as `drafter.last_generation_stats`).

    Attributes:
        rounds (`int`): target verification forwards (the first one includes the prompt prefill).
        new_tokens (`int`): tokens committed by those forwards (accepted drafts plus one bonus token each).
        accepted_drafts (`int`): draft tokens the target accepted.
        drafted_tokens (`int`): draft tokens proposed.
        draft_seconds (`list[float]`): wall time of each round's draft pass, seconds.
        verify_seconds (`list[float]`): wall time from the end of each draft pass to the end of its verification
            (target forward plus transformers' acceptance bookkeeping), seconds.
        acceptance_lengths (`list[int]`): tokens committed per round (`tau` of each round).
    """

    rounds: int = 0
    new_tokens: int = 0
    accepted_drafts: int = 0
    drafted_tokens: int = 0
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean acceptance length: committed tokens per target verification forward, bonus included."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (with `tau`), for JSON."""
        return {**asdict(self), "tau": self.tau}


class D3DCandidateGenerator(CandidateGenerator):
    """Synchronous D3D drafting for transformers' assisted-generation loop (d3d-hf docs/DESIGN.md section 2).

    Each round the drafter extends its own KV cache with the tokens committed since its last call and, in the same
    forward pass, denoises the block `[anchor, MASK x (B-1)]`; the target then verifies the `B-1` drafts in one
    forward (transformers' loop), commits the accepted prefix plus a bonus token, and crops its cache. Drafts are
    the argmax (greedy) or a sample (`do_sample=True`) of the drafter's scores after the same logits processors the
    target applies, so the returned scores are exactly the distribution `q` each draft was drawn from, as lossless
    speculative sampling requires.

    A draft never contains a token that completes one of `generation_config.stop_strings`: such a token and what
    follows it are left to the target, so generation stops exactly where target-only decoding stops (transformers
    checks stop strings only at the end of each round).

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
            the target's or the drafter's `max_position_embeddings`, a drafter without a mask token, or
            `stop_strings` without a tokenizer.
    """

    def __init__(
        self,
        drafter: D3DForDiffusionDrafting,
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
        from .modeling_d3d import D3DCache  # deferred: modeling_d3d imports this module

        self.cache = D3DCache()  # a new, empty drafter state for every `generate` call
        self.stats = D3DGenerationStats()
        drafter.last_generation_stats = self.stats
        self._draft_end = None

    def _draft_device(self) -> torch.device:
        return self.drafter.model.embed_tokens.weight.device

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
        start = time.perf_counter()
        cur_len = input_ids.shape[1]
        num_drafts = min(self.block_size - 1, self.max_length - cur_len - 1)
        if num_drafts <= 0:
            self._draft_end = time.perf_counter()
            self.stats.draft_seconds.append(self._draft_end - start)
            return input_ids, None
        device = self._draft_device()
        committed = input_ids[:, self.cache.get_seq_length() :].to(device)
        logits = self.drafter.draft_logits(committed, self.cache)[:, :num_drafts].float()

        sequence = input_ids.to(device)
        has_processors = self.logits_processor is not None and len(self.logits_processor) > 0
        if not has_processors:
            # no history-dependent processors: choose every draft token in one vectorised call
            if self.do_sample:
                chosen = torch.multinomial(logits[0].softmax(dim=-1), num_samples=1).view(1, -1)
            else:
                chosen = logits.argmax(dim=-1)
        drafts, scores = [], []
        for k in range(num_drafts):
            step_scores = logits[:, k]
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
        self._draft_end = time.perf_counter()
        self.stats.draft_seconds.append(self._draft_end - start)
        if not drafts:
            return input_ids, None
        self.stats.drafted_tokens += len(drafts)
        candidate_ids = torch.cat([input_ids, torch.cat(drafts, dim=1).to(input_ids.device)], dim=1)
        return candidate_ids, torch.stack(scores, dim=1)

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches) -> None:
        """Records the outcome of one verification (`num_matches` accepted drafts, after transformers' eos and
        length cropping)."""
        now = time.perf_counter()
        num_matches = int(num_matches)
        self.stats.rounds += 1
        self.stats.accepted_drafts += num_matches
        self.stats.new_tokens += num_matches + 1
        self.stats.acceptance_lengths.append(num_matches + 1)
        if self._draft_end is not None:
            self.stats.verify_seconds.append(now - self._draft_end)


def _check_prompt_and_drafter(drafter: D3DForDiffusionDrafting, prompt_length: int, target=None) -> None:
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
    transformers' own behaviour.
    Undo it with `remove_generation_hook()`.

    Raises:
        RuntimeError: if the installed transformers has no candidate-generator factory with the expected signature
            (supported range: `SUPPORTED_TRANSFORMERS`).
    """
    current = GenerationMixin._get_candidate_generator
    if getattr(current, _HOOK_ATTRIBUTE, False):
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


def remove_generation_hook() -> None:
    """Restores transformers' own candidate-generator factory (a no-op when the hook is not installed)."""
    current = GenerationMixin._get_candidate_generator
    if getattr(current, _HOOK_ATTRIBUTE, False):
        GenerationMixin._get_candidate_generator = current._d3d_original


__all__ = [
    "D3DCandidateGenerator",
    "D3DGenerationStats",
    "SUPPORTED_TRANSFORMERS",
    "install_generation_hook",
    "remove_generation_hook",
]
