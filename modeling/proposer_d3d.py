"""`DraftProposer`: turns a draft pass's block logits, or a prompt-lookup match, into draft tokens and the scores of
the distributions they were drawn from.

Part of the self-contained remote-code bundle: imports only torch and the public transformers API.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import StopStringCriteria


def as_id_list(value) -> list[int]:
    """Token ids of an `eos_token_id`-like value (an int, a list, a tensor or `None`) as a list of ints."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class DraftProposer:
    """Chooses draft tokens after the target's logits processors, and knows where drafting must stop.

    Drafts are the argmax (greedy), the Gumbel-max under the call's noise (`do_sample=True` with drafter-invariant
    sampling, `noise` set: `sampling_d3d`) or a sample (speculative sampling) of the drafter's scores after the same
    logits processors the target applies, applied to the real committed sequence, so the returned scores are exactly the
    distribution `q` each draft was drawn from, as lossless speculative sampling requires. A draft never contains a
    token that completes one of `generation_config.stop_strings` (such a token and what follows it are left to the
    target, so generation stops exactly where target-only decoding stops) and ends after an eos token.

    Args:
        generation_config (`GenerationConfig`): the call's config (`do_sample`, `eos_token_id`, `stop_strings`).
        logits_processor (`LogitsProcessorList`, *optional*): the target's processors (and warpers when sampling).
        vocab_size (`int`): the vocabulary size (lookup drafts' point masses).
        device (`torch.device`): where the drafter's scores live.
        target_tokenizer (`PreTrainedTokenizerBase`, *optional*): needed for `stop_strings`.

    Raises:
        ValueError: for `stop_strings` without a tokenizer.
    """

    def __init__(self, generation_config, logits_processor, vocab_size: int, device, target_tokenizer=None) -> None:
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.vocab_size = int(vocab_size)
        self.device = device
        self.eos_token_ids = as_id_list(generation_config.eos_token_id)
        self.noise = None  # `sampling_d3d.GumbelNoise` under drafter-invariant sampling (set by D3D's loop)
        self.stop_string_criteria = None
        if generation_config.stop_strings:
            if target_tokenizer is None:
                raise ValueError("`stop_strings` need the tokenizer: pass `tokenizer=...` to `generate`.")
            self.stop_string_criteria = StopStringCriteria(target_tokenizer, generation_config.stop_strings)

    def completes_stop_string(self, sequence: torch.LongTensor) -> bool:
        """Whether `sequence` (`(1, seq_len)`) ends a stop string."""
        return self.stop_string_criteria is not None and bool(self.stop_string_criteria(sequence, None).any())

    def generation_ends(self, input_ids: torch.LongTensor, max_length: int) -> bool:
        """Whether decoding stops after `input_ids` by length, eos or stop string (the criteria the drafter knows; a
        user's own stopping criterion is not among them)."""
        if input_ids.shape[1] >= max_length or int(input_ids[0, -1]) in self.eos_token_ids:
            return True
        return self.completes_stop_string(input_ids)

    @staticmethod
    def confidences(drafts: list[torch.LongTensor], scores: list[torch.FloatTensor]) -> list[float]:
        """The drafter's probability of each chosen draft under the distribution it was chosen from."""
        ids = torch.cat(drafts, dim=1).view(-1, 1).to(scores[0].device)
        return torch.cat(scores, dim=0).softmax(dim=-1).gather(1, ids).view(-1).tolist()

    def lookup_drafts(self, input_ids: torch.LongTensor, tokens: list[int]):
        """Prompt-lookup tokens as drafts, with the scores of the distribution they were "drawn" from: a point mass
        (0 at the token, -inf elsewhere), so lossless speculative sampling accepts token `d` with probability `p(d)`
        and otherwise resamples from the target's residual, exactly as for a drafter's draft. Stops after an eos and
        before a token that completes a stop string, as `choose` does.

        Returns:
            `(drafts, scores)`: lists of `(1, 1)` token tensors and `(1, vocab_size)` score tensors.
        """
        drafts, scores, sequence = [], [], input_ids
        for token_id in tokens:
            token = input_ids.new_tensor([[token_id]])
            if self.stop_string_criteria is not None:
                extended = torch.cat([sequence, token], dim=1)
                if self.completes_stop_string(extended):
                    break
                sequence = extended
            point_mass = torch.full((1, self.vocab_size), float("-inf"), device=self.device)
            point_mass[0, token_id] = 0.0
            drafts.append(token)
            scores.append(point_mass)
            if token_id in self.eos_token_ids:
                break
        return drafts, scores

    def choose(
        self, input_ids: torch.LongTensor, logits: torch.FloatTensor
    ) -> tuple[list[torch.LongTensor], list[torch.FloatTensor]]:
        """Draft tokens (each `(1, 1)`) and their processed scores (each `(1, vocab_size)`) from block rows `logits`
        of shape `(num_drafts, vocab_size)` after `input_ids` (`(1, seq_len)`); stops after an eos and before a
        stop-string-completing token."""
        sequence = input_ids.to(logits.device)
        has_processors = self.logits_processor is not None and len(self.logits_processor) > 0
        start = input_ids.shape[1]  # the absolute position of the first draft
        noise = self.noise if self.do_sample else None
        if not has_processors:
            # no history-dependent processors: choose every draft token in one vectorised call
            if noise is not None:
                chosen = noise.choose(logits, range(start, start + logits.shape[0]))[None]
            elif self.do_sample:
                chosen = torch.multinomial(logits.softmax(dim=-1), num_samples=1).view(1, -1)
            else:
                chosen = logits.argmax(dim=-1)[None]
        drafts, scores = [], []
        for k in range(logits.shape[0]):
            step_scores = logits[k : k + 1]
            if has_processors:
                step_scores = self.logits_processor(sequence, step_scores)
                if noise is not None:
                    token = noise.choose(step_scores, [start + k]).view(1, 1)
                elif self.do_sample:
                    token = torch.multinomial(step_scores.softmax(dim=-1), num_samples=1)
                else:
                    token = step_scores.argmax(dim=-1, keepdim=True)
            else:
                token = chosen[:, k : k + 1]
            if has_processors or self.stop_string_criteria is not None:
                # only history-dependent processors and stop strings need the sequence with the drafts so far
                extended = torch.cat([sequence, token], dim=1)
                if self.completes_stop_string(extended):
                    break
                sequence = extended
            drafts.append(token)
            scores.append(step_scores)
            if int(token) in self.eos_token_ids:
                break
        return drafts, scores


__all__ = ["DraftProposer", "as_id_list"]
