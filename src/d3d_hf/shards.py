"""Token-id shards: the target's answers stored compactly, so that tens of thousands of them fit in a repository.

One shard is one ``safetensors`` file (``shard-NNNNN.safetensors``) that holds the rows of one generation batch:

    prompt_ids        uint16 (int32 for vocabularies over 65,536 ids), shape (total prompt tokens,)
    prompt_offsets    int64, shape (rows + 1,): row i's prompt is prompt_ids[prompt_offsets[i]:prompt_offsets[i+1]]
    response_ids      like prompt_ids, the concatenated responses (up to and including eos, no padding)
    response_offsets  int64, shape (rows + 1,)

and, in the file's string metadata, ``format`` (:data:`SHARD_FORMAT`) and ``rows``: a JSON list of
``{"id", "messages"}`` per row, so a shard alone says which prompt each answer belongs to and the evaluation guard
can read the prompts. 2 bytes per token against ~6 for the same ids as JSON text; git compresses both further.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SHARD_FORMAT = "d3d-hf token shard v1"
SHARD_SUFFIX = ".safetensors"


def _pack(sequences: Sequence[Sequence[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in sequences])
    flat = np.fromiter((t for s in sequences for t in s), dtype=np.int64, count=int(offsets[-1]))
    return flat.astype(dtype), offsets


def write_token_shard(path: str | os.PathLike, rows: Sequence[dict]) -> None:
    """Writes rows ``{"id", "messages", "prompt_ids", "response_ids"}`` to one shard file, atomically.

    The file is written next to ``path`` as ``.NAME.tmp`` and renamed over it, so a killed writer never leaves a
    truncated shard.

    Args:
        path (`str | os.PathLike`): the ``.safetensors`` file.
        rows (`Sequence[dict]`): ``id`` (str), ``messages`` (chat messages), ``prompt_ids`` and ``response_ids``
            (lists of non-negative ints).

    Raises:
        ValueError: no rows, a negative id, or an id that does not fit int32.
    """
    from safetensors.numpy import save_file

    if not rows:
        raise ValueError("A token shard needs at least one row.")
    every = [t for r in rows for key in ("prompt_ids", "response_ids") for t in r[key]]
    top = max(every, default=0)
    if every and (min(every) < 0 or top >= 2**31):
        raise ValueError("Token ids must be in [0, 2**31): these rows hold an id outside it.")
    dtype = np.uint16 if top < 2**16 else np.int32
    prompt_ids, prompt_offsets = _pack([r["prompt_ids"] for r in rows], dtype)
    response_ids, response_offsets = _pack([r["response_ids"] for r in rows], dtype)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    meta = {"format": SHARD_FORMAT, "rows": json.dumps([{"id": r["id"], "messages": r["messages"]} for r in rows])}
    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_offsets": prompt_offsets,
        "response_ids": response_ids,
        "response_offsets": response_offsets,
    }
    save_file(tensors, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_token_shard(path: str | os.PathLike) -> list[dict]:
    """The rows of one shard: ``{"id", "messages", "prompt_ids", "response_ids"}`` (ids as lists of int).

    Raises:
        ValueError: the file is not a token shard of this format.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = f.metadata() or {}
        if meta.get("format") != SHARD_FORMAT:
            raise ValueError(f"{path} is not a d3d-hf token shard (format {meta.get('format')!r}).")
        arrays = {k: f.get_tensor(k) for k in ("prompt_ids", "prompt_offsets", "response_ids", "response_offsets")}
    heads = json.loads(meta["rows"])
    rows = []
    for i, head in enumerate(heads):
        p0, p1 = arrays["prompt_offsets"][i : i + 2]
        r0, r1 = arrays["response_offsets"][i : i + 2]
        rows.append(
            {
                "id": head["id"],
                "messages": head["messages"],
                "prompt_ids": arrays["prompt_ids"][p0:p1].astype(np.int64).tolist(),
                "response_ids": arrays["response_ids"][r0:r1].astype(np.int64).tolist(),
            }
        )
    return rows


__all__ = ["SHARD_FORMAT", "SHARD_SUFFIX", "read_token_shard", "write_token_shard"]
