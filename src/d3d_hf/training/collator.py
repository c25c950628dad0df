"""`D3DDataCollator`: batches `{prompt_ids, response_ids}` rows (`d3d-hf data`) or TRL-prepared `{input_ids, labels}`
rows and samples the noisy blocks of the objective."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch


class D3DDataCollator:
    """Batches rows for the D3D objective and samples the noisy blocks.

    Two row formats (one per dataset):

    - `{prompt_ids, response_ids}` (`d3d-hf data`): the response is learned; the prompt is cut from the left (and
      the response to `max_length - 1`) so that both fit in `max_length`.
    - `{input_ids, labels}` as `trl.SFTTrainer` prepares any TRL dataset (conversational, prompt-completion, text
      or pre-tokenized; `labels` is -100 on the tokens its `completion_mask` / `assistant_masks` exclude): the
      tokens whose label is not -100 are learned (the batch then has a `loss_mask`); rows are cut to `max_length`
      from the right, as TRL's `truncation_mode="keep_start"` does. A row whose learned tokens are a suffix
      `input_ids[s:]` gets exactly the blocks of the `{prompt_ids: input_ids[:s], response_ids: input_ids[s:]}` row.

    Returns a dict of tensors:
        `input_ids` `(batch, L)` long, right-padded with `pad_token_id`; `attention_mask` `(batch, L)` long;
        `response_start` `(batch,)` long, index of the first response token; `anchors` `(batch, K)` long, anchor
        positions (-1 = no block: the response is too short); `block_masked` `(batch, K, B-1)` bool, which block
        positions `a+1 .. a+B-1` are masked; for `{input_ids, labels}` rows also `loss_mask` `(batch, L)` bool, the
        tokens to learn (`response_start` is then the first of them).

    Anchors are drawn without replacement from the positions `a` whose next token `a + 1` is learned, i.e.
    `[response_start - 1, length - 2]` for a response (the last prompt token is a valid anchor: it drafts the start
    of the response, as at inference). The blocks of a row are drawn from a generator
    seeded by `(seed, epoch, the row's tokens)`, not from a global random state (which data-loader prefetching
    advances at unpredictable times), so a resumed run draws exactly the blocks of an uninterrupted one and every
    epoch draws new blocks. `D3DTrainer` sets `epoch` at the start of each epoch.
    """

    def __init__(
        self,
        block_size: int,
        anchors_per_sequence: int = 8,
        mask_ratio: tuple[float, float] = (1.0, 1.0),
        max_length: int | None = 512,
        pad_token_id: int = 0,
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_anchors = anchors_per_sequence
        self.mask_ratio = mask_ratio
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.epoch = 0

    def _generator(self, prompt: list[int], response: list[int]) -> torch.Generator:
        data = np.asarray([self.seed, self.epoch, len(prompt), *prompt, *response], dtype=np.int64).tobytes()
        return torch.Generator().manual_seed(zlib.crc32(data))

    def _rows(self, rows: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[bool]] | None, list[tuple]]:
        """Token sequences, their learned-token masks (`None` for prompt/response rows) and the generator keys."""
        limit = self.max_length
        if "input_ids" in rows[0] and "prompt_ids" not in rows[0]:
            sequences, masks, keys = [], [], []
            for row in rows:
                ids = list(row["input_ids"])[:limit]
                labels = row.get("labels")
                mask = [True] * len(ids) if labels is None else [int(x) != -100 for x in list(labels)[: len(ids)]]
                start = mask.index(True) if True in mask else len(ids)
                sequences.append(ids)
                masks.append(mask)
                keys.append((ids[:start], ids[start:]))
            return sequences, masks, keys
        if "prompt_ids" not in rows[0] or "response_ids" not in rows[0]:
            raise ValueError(
                f"D3DDataCollator needs rows with `prompt_ids` and `response_ids` (d3d-hf data) or `input_ids` (and "
                f"`labels`, as trl.SFTTrainer prepares them), got the columns {sorted(rows[0])}."
            )
        sequences, keys = [], []
        for row in rows:
            prompt, response = list(row["prompt_ids"]), list(row["response_ids"])
            if limit is not None:
                response = response[: limit - 1]
                prompt = prompt[-(limit - len(response)) :] if prompt else []
            sequences.append(prompt + response)
            keys.append((row["prompt_ids"], row["response_ids"], len(prompt)))
        return sequences, None, keys

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, masks, keys = self._rows(rows)
        if masks is None:
            starts = [key[2] for key in keys]
        else:
            starts = [len(key[0]) for key in keys]
        length = max(1, max(len(s) for s in sequences))
        batch = len(rows)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, length), dtype=torch.long)
        loss_mask = torch.zeros((batch, length), dtype=torch.bool)
        anchors = torch.full((batch, self.num_anchors), -1, dtype=torch.long)
        block_masked = torch.ones((batch, self.num_anchors, self.block_size - 1), dtype=torch.bool)
        for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
            input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[i, : len(seq)] = 1
            gen = self._generator(keys[i][0], keys[i][1])
            if masks is None:
                first = max(start - 1, 0)
                candidates = torch.arange(first, max(len(seq) - 1, first))
            else:
                loss_mask[i, : len(seq)] = torch.tensor(masks[i], dtype=torch.bool)
                # anchors whose next token is learned (a contiguous range for a response suffix)
                candidates = torch.nonzero(loss_mask[i, 1 : len(seq)]).flatten()
            chosen = candidates[torch.randperm(len(candidates), generator=gen)[: self.num_anchors]].sort().values
            anchors[i, : len(chosen)] = chosen
            low, high = self.mask_ratio
            if low < 1.0:
                ratios = low + (high - low) * torch.rand(len(chosen), 1, generator=gen)
                block_masked[i, : len(chosen)] = torch.rand(len(chosen), self.block_size - 1, generator=gen) < ratios
        out = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_start": torch.tensor(starts, dtype=torch.long),
            "anchors": anchors,
            "block_masked": block_masked,
        }
        if masks is not None:
            out["loss_mask"] = loss_mask
        return out


__all__ = ["D3DDataCollator"]
