"""Target-distilled training data for D3D drafters: real prompts answered by the target itself.

A D3D drafter learns the distribution of the target it drafts for (self-distillation, docs/DESIGN.md section 3), so
every training example is a prompt plus the *target's own* response to it: greedy when ``temperature == 0``,
otherwise sampled at that temperature. Evaluation prompts (HumanEval) are never used for training.

The prompts come from :func:`~d3d_hf.prompts.load_prompt_sources` (``stdlib[:N]``, the prompts
:func:`~d3d_hf.prompts.stdlib_prompts` derives from the Python standard library, and JSONL files; evaluation sets
are refused). Those functions and their constants live in :mod:`d3d_hf.prompts` and are importable from here too.

:func:`generate_dataset` writes, under its ``output_dir``::

    generation_settings.json    target, dtype, decoding settings, prompt sources and counts, library versions,
                                and one entry per run (batch size, how many prompts were generated)
    shards/shard-00000.safetensors  the rows of one batch per file (token ids, 2 bytes a token: d3d_hf.shards; or
    shards/shard-00001.safetensors  one JSON line per row with shard_format="jsonl"), each written atomically, so a
    ...                             killed run resumes where it stopped (prompts whose id is in a shard are skipped)
    dataset/                    ``datasets.Dataset.save_to_disk`` of all requested prompts, written at the end;
                                load it with ``datasets.load_from_disk(output_dir / "dataset")``

Each row holds ``id`` (str), ``messages`` (the prompt's chat messages), ``prompt_ids`` (list of int: the
chat-templated prompt as :func:`d3d_hf.prompts.encode_prompt` gives it), ``response_ids`` (list of int: the
generated ids up to and including the end-of-sequence token when one was emitted, no padding) and ``response``
(the decoded response, special tokens skipped).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# the prompt sources moved to d3d_hf.prompts; d3d_hf.data still exports them (its `__all__`)
from .prompts import (
    EVALUATION_SETS,
    MAX_SOURCE_CHARS,
    STDLIB_KINDS,
    STDLIB_LICENSE,
    Prompt,
    encode_prompt,
    load_prompt_sources,
    stdlib_prompts,
    stdlib_source_info,
)
from .shards import SHARD_SUFFIX, read_token_shard, write_token_shard
from .utils import library_versions, write_json_atomic

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# ----------------------------------------------------------------------------------------------------------------
# Generation

SETTINGS_FILE = "generation_settings.json"
SHARDS_DIR = "shards"
DATASET_DIR = "dataset"
_FORMAT = "d3d-hf target-distilled data v1"
_RESUME_KEYS = (
    "format",
    "target",
    "dtype",
    "max_new_tokens",
    "temperature",
    "decoding",
    "seed",
    "chat_template_sha256",
    "eos_token_ids",
)
"""Settings that must be equal to resume into a folder. Batch size and prompt sources may change between runs
(more prompts can be added; the batch size only changes padding numerics) and are recorded per run."""


def _eos_ids(target, tokenizer) -> list[int]:
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _pad_id(target, tokenizer, eos_ids: list[int]) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    pad = getattr(getattr(target, "generation_config", None), "pad_token_id", None)
    if pad is not None:
        return int(pad)
    if eos_ids:
        return eos_ids[0]
    raise ValueError("The tokenizer has no pad_token_id and the target no pad or eos id: set tokenizer.pad_token.")


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read_shards(shards: Path) -> tuple[dict[str, dict], int]:
    """Rows already generated (id -> row) and the index for the next shard file.

    Reads both shard formats: token shards (``shard-NNNNN.safetensors``, :mod:`d3d_hf.shards`; their rows have no
    ``response`` text) and JSONL shards (``shard-NNNNN.jsonl``).
    """
    done: dict[str, dict] = {}
    next_index = 0
    if not shards.is_dir():
        return done, next_index
    paths = sorted([*shards.glob("shard-*.jsonl"), *shards.glob(f"shard-*{SHARD_SUFFIX}")])
    for path in sorted(paths, key=lambda p: int(p.name.split("-")[1].split(".")[0])):
        next_index = max(next_index, int(path.name.split("-")[1].split(".")[0]) + 1)
        if path.suffix == SHARD_SUFFIX:
            for row in read_token_shard(path):
                done[row["id"]] = row
            continue
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    done[row["id"]] = row
    return done, next_index


def load_generated_rows(output_dir: str | os.PathLike, tokenizer=None) -> list[dict]:
    """Every row in the shards of a :func:`generate_dataset` folder, finished or not, in shard order.

    Rows are ``{"id", "messages", "prompt_ids", "response_ids"}`` plus ``response`` (the decoded text) when the shard
    stored it (JSONL) or ``tokenizer`` is given. This is how training reads a ``d3d-hf data`` folder, finished or
    not: the ``dataset/`` folder, written at the end of a run and not committed, lists the requested prompts in
    prompt order instead.

    Raises:
        FileNotFoundError: ``output_dir`` has no ``shards/`` folder with shards in it.
    """
    done, _ = _read_shards(Path(output_dir) / SHARDS_DIR)
    if not done:
        raise FileNotFoundError(f"{output_dir} holds no shards ({SHARDS_DIR}/shard-*): run `d3d-hf data` first.")
    rows = list(done.values())
    if tokenizer is not None:
        for row in rows:
            row.setdefault("response", tokenizer.decode(row["response_ids"], skip_special_tokens=True))
    return rows


def _left_pad(sequences: Sequence[list[int]], pad_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """``input_ids`` and ``attention_mask``, both ``torch.LongTensor`` of shape ``(batch_size, max_len)``."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, width - len(seq) :] = 1
    return input_ids, attention_mask


def _trim(ids: list[int], eos_ids: list[int]) -> list[int]:
    """Cut a generated row after its first eos token (kept); what follows is padding."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[: i + 1]
    return ids


@torch.no_grad()
def generate_batch(
    target: PreTrainedModel,
    prompt_ids: Sequence[list[int]],
    pad_token_id: int,
    eos_token_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
) -> list[list[int]]:
    """Generate the target's responses to a batch of prompts, left-padded, in one ``generate`` call.

    Args:
        target: The causal LM.
        prompt_ids: One list of token ids per prompt (lengths may differ).
        pad_token_id: Id written into the left padding (masked out by the attention mask) and after finished rows.
        eos_token_ids: Ids that end a response.
        max_new_tokens: Most tokens generated per prompt.
        temperature: 0 for greedy decoding; otherwise pure temperature sampling (``top_k=0``, ``top_p=1``) from
            the global torch RNG.

    Returns:
        One list of generated ids per prompt, up to and including the first eos token (when one was emitted),
        without padding.
    """
    input_ids, attention_mask = _left_pad(prompt_ids, pad_token_id)
    if temperature > 0:
        decoding = {"do_sample": True, "temperature": float(temperature), "top_k": 0, "top_p": 1.0}
    else:
        decoding = {"do_sample": False}
    out = target.generate(
        input_ids=input_ids.to(target.device),
        attention_mask=attention_mask.to(target.device),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        **decoding,
    )
    new = out[:, input_ids.shape[1] :].tolist()
    return [_trim(row, eos_token_ids) for row in new]


def check_output_folder(output_dir: str | os.PathLike, overwrite: bool = False) -> None:
    """The checks of a ``generate_dataset`` output folder that need no target, so that ``d3d-hf data`` runs them
    before it loads one: the folder must not be a file, and must be new, empty, or an earlier run (which
    ``generate_dataset`` then resumes or refuses by its settings) unless ``overwrite``.

    Raises:
        FileExistsError: ``output_dir`` is a file, or is non-empty without being an earlier run and ``overwrite`` is
            not set.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise FileExistsError(f"{output_dir} is a file; choose a folder for the generated data.")
    if overwrite or (output_dir / SETTINGS_FILE).is_file():
        return
    if output_dir.is_dir() and any(output_dir.iterdir()):
        raise FileExistsError(
            f"{output_dir} is not empty and holds no {SETTINGS_FILE}: choose an empty or new folder, or pass "
            "overwrite=True (--overwrite) to write into it (other files are kept)."
        )


def _prepare_output(output_dir: Path, settings: dict, resume: bool, overwrite: bool) -> dict | None:
    """Check ``output_dir`` may be written; returns the settings of an earlier run to resume, or ``None``."""
    settings_path = output_dir / SETTINGS_FILE
    check_output_folder(output_dir, overwrite)
    if overwrite:
        for name in (SHARDS_DIR, DATASET_DIR):
            if (output_dir / name).is_dir():
                shutil.rmtree(output_dir / name)
        settings_path.unlink(missing_ok=True)
        return None
    if settings_path.is_file():
        if not resume:
            raise FileExistsError(
                f"{output_dir} holds an earlier generation run; resume it (resume=True, the CLI default) or start "
                "over with overwrite=True (--overwrite), which deletes its shards and dataset."
            )
        old = json.loads(settings_path.read_text(encoding="utf-8"))
        diffs = [
            f"{key}: folder has {old.get(key)!r}, this run {settings.get(key)!r}"
            for key in _RESUME_KEYS
            if old.get(key) != settings.get(key)
        ]
        if diffs:
            raise ValueError(
                f"Cannot resume into {output_dir}: its data was generated with different settings ("
                + "; ".join(diffs)
                + "). Use another output folder, or pass overwrite=True (--overwrite) to start over."
            )
        return old
    return None


def _prompt_counts(prompts: Sequence[Prompt]) -> dict:
    """Prompts by source (`stdlib`, a templated source such as `math` or `chat-extra`, `magpie` for the requests of
    `d3d-hf magpie`, or `file` for other JSONL prompts), and the stdlib ones by kind."""
    from .prompts import SYNTHETIC_SOURCES

    named = tuple(f"{name}/" for name in ("stdlib", "magpie", *SYNTHETIC_SOURCES))
    counts = Counter(p.id.split("/", 1)[0] if p.id.startswith(named) else "file" for p in prompts)
    kinds = Counter(p.id.rsplit("/", 1)[1] for p in prompts if p.id.startswith("stdlib/"))
    out = dict(sorted(counts.items()))
    if kinds:
        out["stdlib_kinds"] = dict(sorted(kinds.items()))
    return out


def _check_generation_arguments(
    prompts: list[Prompt], max_new_tokens: int, batch_size: int, shard_format: str, temperature: float
) -> None:
    """The argument checks of :func:`generate_dataset` (the ``ValueError`` cases of its docstring about them)."""
    if not prompts:
        raise ValueError("No prompts given: pass at least one Prompt (e.g. load_prompt_sources('stdlib:100')).")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i, n in Counter(ids).items() if n > 1)
        raise ValueError(f"Duplicate prompt id {dup!r}: prompt ids must be unique.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}.")
    if shard_format not in ("tokens", "jsonl"):
        raise ValueError(f"shard_format must be 'tokens' or 'jsonl', got {shard_format!r}.")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}.")


def _generation_settings(
    target,
    tokenizer,
    target_name: str | None,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_ids: list[int],
    pad_id: int,
) -> dict:
    """The settings of a :func:`generate_dataset` run, as ``generation_settings.json`` records them (those of
    ``_RESUME_KEYS`` must match for a later run to resume into the folder)."""
    dtype = next(target.parameters()).dtype
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "format": _FORMAT,
        "target": target_name or getattr(target, "name_or_path", None) or type(target).__name__,
        "dtype": str(dtype).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "temperature": float(temperature),
        "decoding": "greedy" if temperature == 0 else "sampling (temperature only, top_k=0, top_p=1)",
        "seed": seed,
        "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest(),
        "eos_token_ids": eos_ids,
        "pad_token_id": pad_id,
        "padding": "left, with attention mask",
        "tokenizer": getattr(tokenizer, "name_or_path", None),
    }


def _pending_prompts(prompts: Sequence[Prompt], done: dict[str, dict], shards: Path) -> list[Prompt]:
    """The prompts not answered in a shard yet, in their order.

    Raises:
        ValueError: if a prompt's id is in a shard with other messages.
    """
    by_id = {p.id: p for p in prompts}
    for pid, row in done.items():
        if pid in by_id and row["messages"] != list(by_id[pid].messages):
            raise ValueError(
                f"Prompt {pid!r} is already in {shards} with different messages: the prompt set changed under the "
                "same ids. Use another output folder, or overwrite=True to start over."
            )
    return [p for p in prompts if p.id not in done]


def _length_sorted(pending: list[Prompt], encoded: dict[str, list[int]], batch_size: int) -> list[Prompt]:
    """``pending`` length-sorted within windows of 8 batches."""
    # little padding, and a run stopped early has answered a prefix of the prompts in their given order (the mix of
    # sources the caller chose), not only the shortest prompts of all
    window = 8 * batch_size
    return [
        p
        for w in range(0, len(pending), window)
        for p in sorted(pending[w : w + window], key=lambda q: len(encoded[q.id]))
    ]


def _write_shard(shards: Path, index: int, rows: list[dict], shard_format: str, tokenizer) -> None:
    """Writes one batch's rows as shard ``index`` (token ids, or JSON lines with the decoded ``response`` added to
    the rows), atomically."""
    if shard_format == "tokens":
        write_token_shard(shards / f"shard-{index:05d}{SHARD_SUFFIX}", rows)
        return
    for row in rows:
        row["response"] = tokenizer.decode(row["response_ids"], skip_special_tokens=True)
    path = shards / f"shard-{index:05d}.jsonl"
    tmp = shards / f".{path.name}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_dataset(datasets, rows: list[dict], output_dir: Path, tokenizer) -> Dataset:
    """The requested ``rows`` (``response`` decoded where a token shard left it out) as a ``datasets.Dataset``, saved
    to ``output_dir/dataset`` in place of an earlier one."""
    for row in rows:
        row.setdefault("response", tokenizer.decode(row["response_ids"], skip_special_tokens=True))
    dataset = datasets.Dataset.from_list(rows)
    if (output_dir / DATASET_DIR).exists():
        shutil.rmtree(output_dir / DATASET_DIR)
    dataset.save_to_disk(str(output_dir / DATASET_DIR))
    return dataset


def generate_dataset(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    output_dir: str | os.PathLike,
    max_new_tokens: int = 192,
    temperature: float = 0.0,
    batch_size: int = 8,
    resume: bool = True,
    progress: bool = True,
    *,
    overwrite: bool = False,
    seed: int = 0,
    target_name: str | None = None,
    prompt_sources: str | None = None,
    shard_format: str = "tokens",
) -> Dataset:
    """Answer prompts with the target itself and save the result as a ``datasets`` dataset (self-distillation).

    Prompts are encoded with :func:`~d3d_hf.prompts.encode_prompt`, sorted by length within windows of 8 batches (less
    padding; a run stopped early has answered a prefix of ``prompts``) and generated ``batch_size`` at a time with
    left padding and an attention mask (the padding side of ``tokenizer`` is not touched: the batch is padded here
    with ``tokenizer.pad_token_id``). After every batch its rows are written to ``output_dir/shards/shard-NNNNN``
    (``.safetensors`` or ``.jsonl``, atomically), so a killed run, called again with the same settings,
    generates only the prompts whose ids are not in a shard yet. At the end all requested prompts (in the order
    of ``prompts``; rows of other prompts in the shards are left out) are saved with ``save_to_disk`` to
    ``output_dir/dataset``. See the module docstring for the layout and the row format.

    Batched versus one-at-a-time: greedy responses of a left-padded batch can differ from ``target.generate`` on
    the prompt alone in a few tokens, because padding changes the shapes of the matrix products and so their
    rounding, and a near-tie between the top two logits can flip (then the rest of that response follows the
    other branch). Measured on SmolLM2-135M-Instruct (16 stdlib prompts, 64 new tokens, batches of 8, 2 CPU
    threads): in float32 all 16 batched responses equalled the one-at-a-time ones token for token (also checked
    by ``tests/test_data.py``); in bfloat16 only 7 of 16 did, the others diverging after 3 to 54 tokens. Either
    way every response is a genuine target response up to rounding, which is what training data for a drafter
    needs: exactness is required of speculative decoding, not of its training data.

    Args:
        target: The target causal LM (``PreTrainedModel``), in eval mode; its device and dtype are used as is.
        tokenizer: Its tokenizer, with a chat template.
        prompts: The prompts (unique ids), e.g. from :func:`load_prompt_sources`.
        output_dir: Folder to write to (created). It must be new or empty, hold an earlier run of this function
            with the same settings (resumed), or ``overwrite`` must be set.
        max_new_tokens: Most tokens generated per prompt.
        temperature: 0 for greedy decoding (default), otherwise sampling at this temperature (no top-k/top-p),
            seeded per batch from ``seed`` and the batch's prompt ids.
        batch_size: Prompts per ``generate`` call.
        resume: Continue an earlier run found in ``output_dir`` (its settings must match); when ``False`` an
            earlier run is an error unless ``overwrite``.
        progress: Show a tqdm progress bar (prompts, with new tokens per second).
        overwrite: Delete the shards, dataset and settings of an earlier run in ``output_dir`` and start over;
            without it nothing already in the folder is replaced. Other files in the folder are kept.
        seed: Sampling seed (recorded; unused for greedy decoding).
        target_name: Name recorded for the target (e.g. ``"smollm2-135m-instruct"``); default
            ``target.name_or_path``.
        prompt_sources: Description of where the prompts came from (e.g. the :func:`load_prompt_sources` spec),
            recorded in the settings.
        shard_format: ``"tokens"`` (default): compact token-id shards (:mod:`d3d_hf.shards`, 2 bytes a token,
            meant to be committed); ``"jsonl"``: one JSON line per row with the decoded ``response`` too (readable,
            ~3x larger, loads with ``datasets.load_dataset("json")``). A folder may hold both; resuming reads both.

    Returns:
        The ``datasets.Dataset`` saved to ``output_dir/dataset``, one row per prompt with columns ``id``,
        ``messages``, ``prompt_ids``, ``response_ids``, ``response``.

    Raises:
        ValueError: No prompts, duplicate prompt ids, a prompt id already in the shards with other messages, a
            bad ``max_new_tokens``/``temperature``/``batch_size``, or an earlier run in ``output_dir`` whose
            settings (target, dtype, max_new_tokens, temperature, seed, chat template, eos ids) differ.
        FileExistsError: ``output_dir`` is a file, is non-empty without being an earlier run, or holds an earlier
            run while ``resume`` is ``False``, and ``overwrite`` is not set.
        ModuleNotFoundError: ``datasets`` is not installed (``pip install 'd3d-hf[train]'``).
    """
    try:
        import datasets
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "generate_dataset needs the 'datasets' package: pip install 'd3d-hf[train]' (or pip install datasets)"
        ) from err
    prompts = list(prompts)
    _check_generation_arguments(prompts, max_new_tokens, batch_size, shard_format, temperature)

    output_dir = Path(output_dir)
    eos_ids = _eos_ids(target, tokenizer)
    pad_id = _pad_id(target, tokenizer, eos_ids)
    settings = _generation_settings(target, tokenizer, target_name, max_new_tokens, temperature, seed, eos_ids, pad_id)
    old = _prepare_output(output_dir, settings, resume, overwrite)
    output_dir.mkdir(parents=True, exist_ok=True)
    shards = output_dir / SHARDS_DIR
    shards.mkdir(exist_ok=True)
    for stale in shards.glob(".*.tmp"):
        stale.unlink()

    done, next_shard = _read_shards(shards)
    pending = _pending_prompts(prompts, done, shards)

    run = {
        "started_utc": _utc_now(),
        "batch_size": batch_size,
        "prompt_sources": prompt_sources,
        "num_prompts": len(prompts),
        "already_done": len(prompts) - len(pending),
        "torch_threads": torch.get_num_threads(),
        "device": str(target.device),
        "versions": library_versions("torch", "transformers", "datasets", "tokenizers", "d3d-hf"),
    }
    uses_stdlib = any(p.id.startswith("stdlib/") for p in prompts)
    record = {
        **settings,
        "batch_size": batch_size,
        "prompt_sources": prompt_sources,
        "num_prompts": len(prompts),
        "prompt_counts": _prompt_counts(prompts),
        "stdlib": stdlib_source_info() if uses_stdlib else (old or {}).get("stdlib"),
        "versions": run["versions"],
        "runs": [*(old or {}).get("runs", []), run],
    }
    write_json_atomic(output_dir / SETTINGS_FILE, record)

    encoded = {p.id: encode_prompt(tokenizer, p)[0].tolist() for p in pending}
    pending = _length_sorted(pending, encoded, batch_size)

    from tqdm.auto import tqdm

    bar = tqdm(total=len(prompts), initial=len(prompts) - len(pending), unit="prompt", disable=not progress)
    new_tokens, start = 0, time.perf_counter()
    try:
        for b in range(0, len(pending), batch_size):
            batch = pending[b : b + batch_size]
            if temperature > 0:
                torch.manual_seed(seed + zlib.crc32("\n".join(p.id for p in batch).encode("utf-8")))
            responses = generate_batch(
                target, [encoded[p.id] for p in batch], pad_id, eos_ids, max_new_tokens, temperature
            )
            rows = [
                {"id": p.id, "messages": list(p.messages), "prompt_ids": encoded[p.id], "response_ids": resp}
                for p, resp in zip(batch, responses, strict=True)
            ]
            _write_shard(shards, next_shard, rows, shard_format, tokenizer)
            next_shard += 1
            for row in rows:
                done[row["id"]] = row
            new_tokens += sum(len(r["response_ids"]) for r in rows)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / max(time.perf_counter() - start, 1e-9):.1f}", refresh=False)
    finally:
        bar.close()

    elapsed = time.perf_counter() - start
    run.update(
        finished_utc=_utc_now(),
        generated=len(pending),
        new_tokens=new_tokens,
        seconds=round(elapsed, 1),
        new_tokens_per_second=round(new_tokens / elapsed, 2) if elapsed > 0 and pending else None,
    )
    write_json_atomic(output_dir / SETTINGS_FILE, record)

    return _save_dataset(datasets, [done[p.id] for p in prompts], output_dir, tokenizer)


__all__ = [
    "DATASET_DIR",
    "EVALUATION_SETS",
    "MAX_SOURCE_CHARS",
    "SETTINGS_FILE",
    "SHARDS_DIR",
    "STDLIB_KINDS",
    "STDLIB_LICENSE",
    "check_output_folder",
    "generate_batch",
    "generate_dataset",
    "load_generated_rows",
    "load_prompt_sources",
    "stdlib_prompts",
    "stdlib_source_info",
]
