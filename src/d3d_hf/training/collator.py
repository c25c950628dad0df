"""`D3DDataCollator`: batches `{prompt_ids, response_ids}` rows and samples the noisy blocks of the objective."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch


class D3DDataCollator:
    """Batches `{prompt_ids, response_ids}` rows for the D3D objective and samples the noisy blocks.

    Returns a dict of tensors:
        `input_ids` `(batch, L)` long, right-padded with `pad_token_id`; `attention_mask` `(batch, L)` long;
        `response_start` `(batch,)` long, index of the first response token; `anchors` `(batch, K)` long, anchor
        positions (-1 = no block: the response is too short); `block_masked` `(batch, K, B-1)` bool, which block
        positions `a+1 .. a+B-1` are masked.

    Anchors are drawn without replacement from `[response_start - 1, length - 2]` (the last prompt token is a valid
    anchor: it drafts the start of the response, as at inference). The blocks of a row are drawn from a generator
    seeded by `(seed, epoch, the row's tokens)`, not from a global random state (which data-loader prefetching
    advances at unpredictable times), so a resumed run draws exactly the blocks of an uninterrupted one and every
    epoch draws new blocks. `D3DTrainer` sets `epoch` at the start of each epoch.
    """

    def __init__(
        self,
        block_size: int,
        anchors_per_sequence: int = 8,
        mask_ratio: tuple[float, float] = (1.0, 1.0),
        max_length: int = 512,
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

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, starts = [], []
        for row in rows:
            prompt, response = list(row["prompt_ids"]), list(row["response_ids"])
            response = response[: self.max_length - 1]
            prompt = prompt[-(self.max_length - len(response)) :] if prompt else []
            sequences.append(prompt + response)
            starts.append(len(prompt))
        length = max(1, max(len(s) for s in sequences))
        batch = len(rows)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, length), dtype=torch.long)
        anchors = torch.full((batch, self.num_anchors), -1, dtype=torch.long)
        block_masked = torch.ones((batch, self.num_anchors, self.block_size - 1), dtype=torch.bool)
        for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
            input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[i, : len(seq)] = 1
            gen = self._generator(rows[i]["prompt_ids"], rows[i]["response_ids"])
            first = max(start - 1, 0)
            num_candidates = max(len(seq) - 1 - first, 0)
            chosen = first + torch.randperm(num_candidates, generator=gen)[: self.num_anchors].sort().values
            anchors[i, : len(chosen)] = chosen
            low, high = self.mask_ratio
            if low < 1.0:
                ratios = low + (high - low) * torch.rand(len(chosen), 1, generator=gen)
                block_masked[i, : len(chosen)] = torch.rand(len(chosen), self.block_size - 1, generator=gen) < ratios
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_start": torch.tensor(starts, dtype=torch.long),
            "anchors": anchors,
            "block_masked": block_masked,
        }


__all__ = ["D3DDataCollator"]
