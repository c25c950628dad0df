"""Requests the target writes itself (Magpie, Xu et al., arXiv 2406.08464): training prompts without a corpus.

An aligned chat model, given its chat template up to the point where the user's text begins, continues with text in
the user's voice: a request. :func:`magpie_requests` samples such requests from the target, one domain at a time (a
system prompt from :data:`MAGPIE_DOMAINS` before the user turn steers the mix toward the domain, loosely), keeps
those that pass :func:`clean_request`, drops repeats and anything close to an evaluation prompt
(:func:`~d3d_hf.prompts.near_evaluation_match`), and appends them to a JSONL prompt file that
:func:`~d3d_hf.prompts.load_prompts` and ``d3d-hf data --prompts FILE`` read. The stored prompt is the request alone
as one user turn: the system prompt only chose the domain, and the target later answers the request under its own
default template, the way it answers the evaluation prompts.

Why the target and not a corpus: nothing installable offline ships a large instruction set that is not an evaluation
set, and requests written by the target are in the target's own register, which is what its answers (the drafter's
training data) should cover. DESIGN.md section 11 records the probe that chose the settings (T=1.0, top-p 0.95).
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch

from .prompt import Prompt
from .sources import evaluation_texts, near_evaluation_match

MAGPIE_DOMAINS: dict[str, tuple[str | None, ...]] = {
    "code": (
        "You are a helpful coding assistant.",
        "You are an expert Python programmer who helps users write, fix and understand code.",
        "You are a software engineer who answers questions about programming, algorithms and tools.",
        "You are a patient programming tutor for beginners.",
    ),
    "math": (
        "You are a math tutor who helps students solve word problems step by step.",
        "You are a helpful assistant that solves arithmetic and algebra problems.",
        "You are a teacher who explains math homework clearly.",
    ),
    "writing": (
        "You are a creative writing assistant who writes stories, poems, emails and essays on request.",
        "You are a helpful assistant that drafts and edits letters, messages and short articles.",
    ),
    "explanation": (
        "You are a knowledgeable assistant who explains science, history and everyday topics clearly.",
        "You are a friendly teacher who explains how things work.",
    ),
    "advice": (
        "You are a thoughtful assistant who gives practical advice about work, study, health and daily life.",
        "You are a helpful assistant that helps people plan, decide and organise.",
    ),
    "roleplay": (
        "You are an actor who plays any character the user asks for and stays in role.",
        "You are a role-play partner for games, interviews and conversations.",
    ),
    "extraction": (
        "You are an assistant that summarises, classifies and extracts information from text the user provides.",
        "You are a helpful assistant that rewrites, shortens and reformats text.",
    ),
    "general": (None,),
}
"""Domain -> system prompts that steer the sampled requests (``None``: the template's default system prompt)."""

DEFAULT_MAGPIE_COUNTS: dict[str, int] = {
    "code": 1500,
    "math": 1000,
    "writing": 700,
    "explanation": 700,
    "advice": 500,
    "roleplay": 400,
    "extraction": 400,
    "general": 800,
}
"""Requests per domain of ``d3d-hf magpie`` without ``--counts`` (6,000 in all)."""

MIN_REQUEST_CHARS = 20
MAX_REQUEST_CHARS = 800
_SENTINEL = "\u0000magpie-user-text\u0000"
_NORMALIZE = re.compile(r"[^a-z0-9]+")


def query_prefix(tokenizer, system_prompt: str | None) -> list[int]:
    """Token ids of the chat template up to where the user's text begins (Magpie's pre-query template).

    The template is rendered for ``[system?, user(SENTINEL)]`` as text and cut at the sentinel, so any chat template
    works (for SmolLM2's ChatML: ``<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n``).

    Args:
        tokenizer: A ``PreTrainedTokenizerBase`` with a chat template.
        system_prompt (`str | None`): The system turn; ``None`` leaves the template's default.

    Returns:
        `list[int]`: the prefix ids (special tokens included, as the template writes them).

    Raises:
        ValueError: The tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("Magpie needs a chat model: the tokenizer has no chat template.")
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    text = tokenizer.apply_chat_template([*messages, {"role": "user", "content": _SENTINEL}], tokenize=False)
    return list(tokenizer(text.split(_SENTINEL, 1)[0], add_special_tokens=False)["input_ids"])


def clean_request(text: str, finished: bool) -> tuple[str | None, str]:
    """Whether a sampled request is kept, and why not.

    Kept: a request the model ended itself (it emitted the end-of-turn token within the budget), of
    :data:`MIN_REQUEST_CHARS`-:data:`MAX_REQUEST_CHARS` characters and at least 4 words, holding no chat-template
    marker (``<|``, ``im_start``, ``[INST]``) and no role label at its start (``assistant:``, ``user:``).

    Returns:
        `(text or None, reason)`: the stripped request and ``"kept"``, or ``None`` and the reason (``"unfinished"``,
        ``"too_short"``, ``"too_long"``, ``"template"``).
    """
    text = text.strip()
    if not finished:
        return None, "unfinished"
    if len(text) < MIN_REQUEST_CHARS or len(text.split()) < 4:
        return None, "too_short"
    if len(text) > MAX_REQUEST_CHARS:
        return None, "too_long"
    lowered = text.lower()
    markers = "<|" in text or "im_start" in lowered or "[inst]" in lowered
    if markers or re.match(r"^(assistant|user|system)\s*:", lowered):
        return None, "template"
    return text, "kept"


def _refused(text: str) -> bool:
    """An evaluation prompt, word for word or nearly (:func:`~d3d_hf.prompts.near_evaluation_match`)."""
    return text.strip() in evaluation_texts() or near_evaluation_match(text) is not None


def _normalized(text: str) -> str:
    return _NORMALIZE.sub(" ", text.lower()).strip()


def _read_existing(path: Path) -> list[dict]:
    """The records of a file this module wrote; a last line cut short by a killed run is removed from the file."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i != len(lines) - 1:
                raise ValueError(f"{path}, line {i + 1}: not valid JSON; this file was not written by Magpie.") from err
            path.write_text("".join(lines[:i]), encoding="utf-8")
    if records and not all(isinstance(r, dict) and "domain" in r and "messages" in r for r in records):
        raise ValueError(f"{path} holds prompts not written by magpie_requests: choose a new output file.")
    return records


@torch.no_grad()
def _sample(target, prefix: list[int], batch_size: int, max_new_tokens: int, temperature: float, top_p: float,
            eos_ids: list[int], pad_id: int) -> list[tuple[list[int], bool]]:  # fmt: skip
    """`batch_size` continuations of one prefix: (ids before the first eos, whether an eos ended it)."""
    ids = torch.tensor([prefix] * batch_size, dtype=torch.long, device=target.device)
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
    )
    rows = []
    for row in out[:, len(prefix) :].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos_ids), None)
        rows.append((row if cut is None else row[:cut], cut is not None))
    return rows


def magpie_requests(
    target,
    tokenizer,
    output_file: str | os.PathLike,
    counts: Mapping[str, int] | None = None,
    *,
    batch_size: int = 64,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    top_p: float = 0.95,
    seed: int = 0,
    max_batches_per_domain: int | None = None,
    progress: bool = True,
) -> list[Prompt]:
    """Sample training requests from the target (Magpie) into a JSONL prompt file; resumes a file it wrote before.

    Batches of ``batch_size`` requests are sampled, each for the domain of ``counts`` (keys of
    :data:`MAGPIE_DOMAINS`) furthest behind its count (then the one sampled least for its count), so that a run stopped
    early holds every domain in proportion, and after one of that domain's system prompts in turn, until the file
    holds ``counts[domain]`` requests of each domain. A request is kept when it passes :func:`clean_request`, its
    normalised text (lowercased alphanumeric words) is new, and it is neither an evaluation prompt nor a
    near-duplicate of one (:func:`~d3d_hf.prompts.near_evaluation_match`). Each kept request is appended to
    ``output_file`` as one line
    ``{"id": "magpie/<domain>/<n>", "messages": [{"role": "user", "content": request}], "domain", "system"}``,
    flushed after each batch, so a killed run called again goes on from the requests already in the file (the
    file's requests count toward ``counts``; those the evaluation guard refuses by then are removed from it; ids are
    not reused). Batch ``b`` of a domain samples under the torch seed
    ``seed + crc32(domain) + b``; a resumed run continues with the next ``b``. What was sampled and why requests were
    dropped is written next to the file as ``<output_file>.stats.json`` (per domain: batches, samples, the reason
    counts, where ``"kept"`` counts requests that passed, including any beyond the count in a domain's last batch,
    which are not written; ``removed_by_guard``: requests of the file the guard refused on a later run).

    Args:
        target: The target causal LM (its device and dtype as they are; bf16 is fine: the requests are prompts, not
            the drafter's labels).
        tokenizer: Its tokenizer, with a chat template.
        output_file (`str | os.PathLike`): The JSONL file (``.gz`` not supported for appending; use plain JSONL).
        counts (`Mapping[str, int] | None`): Requests wanted per domain; default :data:`DEFAULT_MAGPIE_COUNTS`.
        batch_size (`int`, default 64): Requests sampled per ``generate`` call.
        max_new_tokens (`int`, default 48): Most tokens of a request; longer ones are dropped (``"unfinished"``).
        temperature (`float`, default 1.0) and top_p (`float`, default 0.95): The sampling settings.
        seed (`int`, default 0): Base seed.
        max_batches_per_domain (`int | None`): Stop a domain after this many batches in this call even if short of
            its count (``None``: no limit beyond ``20 * count / batch_size + 20``, against a model that never ends).
        progress (`bool`, default True): Show a tqdm bar.

    Returns:
        `list[Prompt]`: every request in the file, in file order.

    Raises:
        ValueError: An unknown domain, a count that is not a positive integer, bad sampling settings, or a ``.gz``
            output file.
    """
    counts = dict(DEFAULT_MAGPIE_COUNTS if counts is None else counts)
    unknown = sorted(set(counts) - set(MAGPIE_DOMAINS))
    if unknown:
        raise ValueError(f"Unknown Magpie domain(s) {unknown}: use {sorted(MAGPIE_DOMAINS)}.")
    for domain, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"The count of domain {domain!r} must be a positive integer, got {n!r}.")
    if not (temperature > 0 and 0 < top_p <= 1 and batch_size >= 1 and max_new_tokens >= 1):
        raise ValueError("Magpie needs temperature > 0, 0 < top_p <= 1, batch_size >= 1 and max_new_tokens >= 1.")
    path = Path(output_file)
    if path.suffix == ".gz":
        raise ValueError(f"{path}: write Magpie requests to a plain .jsonl file (it is appended to as it grows).")
    path.parent.mkdir(parents=True, exist_ok=True)

    records = _read_existing(path)
    # the guard may have grown since the file was written: requests it now refuses leave the file
    guarded = [r for r in records if not _refused(r["messages"][0]["content"])]
    removed = len(records) - len(guarded)
    if removed:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in guarded), encoding="utf-8")
        records = guarded
    stats_path = path.with_name(path.name + ".stats.json")
    stats = json.loads(stats_path.read_text(encoding="utf-8")) if stats_path.is_file() else {}
    stats.setdefault("settings", {})
    stats["removed_by_guard"] = stats.get("removed_by_guard", 0) + removed
    stats["settings"].update(
        batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
        target=getattr(target, "name_or_path", None), dtype=str(next(target.parameters()).dtype),
    )  # fmt: skip
    by_domain = stats.setdefault("domains", {})
    seen = {_normalized(r["messages"][0]["content"]) for r in records}
    have = Counter(r["domain"] for r in records)
    next_index = Counter()
    for r in records:
        next_index[r["domain"]] = max(next_index[r["domain"]], int(r["id"].rsplit("/", 1)[1]) + 1)
    eos = target.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(int(tokenizer.eos_token_id))
    pad_id = target.generation_config.pad_token_id if target.generation_config.pad_token_id is not None else eos_ids[0]
    evaluation_texts()  # load the evaluation sets once, before the loop

    from tqdm.auto import tqdm

    bar = tqdm(total=sum(counts.values()), initial=sum(min(have[d], n) for d, n in counts.items()), unit="request",
               disable=not progress)  # fmt: skip
    with path.open("a", encoding="utf-8") as out:
        done_here: Counter = Counter()
        limits = {d: max_batches_per_domain or (20 * n // batch_size + 20) for d, n in counts.items()}
        order = list(counts)
        while True:
            pending = [d for d in order if have[d] < counts[d] and done_here[d] < limits[d]]
            if not pending:
                break
            # the domain furthest behind its count: a run stopped early holds every domain in proportion
            batches = {d: by_domain.get(d, {}).get("batches", 0) for d in pending}
            domain = min(pending, key=lambda d: (have[d] / counts[d], batches[d] / counts[d], order.index(d)))
            wanted = counts[domain]
            entry = by_domain.setdefault(domain, {"batches": 0, "sampled": 0, "reasons": {}, "seconds": 0.0})
            systems = MAGPIE_DOMAINS[domain]
            b = entry["batches"]
            system = systems[b % len(systems)]
            torch.manual_seed(seed + zlib.crc32(domain.encode("utf-8")) + b)
            start = time.perf_counter()
            rows = _sample(target, query_prefix(tokenizer, system), batch_size, max_new_tokens, temperature,
                           top_p, eos_ids, pad_id)  # fmt: skip
            entry["seconds"] = round(entry["seconds"] + time.perf_counter() - start, 2)
            for ids, finished in rows:
                text, reason = clean_request(tokenizer.decode(ids, skip_special_tokens=True), finished)
                if text is not None:
                    key = _normalized(text)
                    if key in seen:
                        text, reason = None, "duplicate"
                    elif _refused(text):
                        text, reason = None, "near_evaluation"
                entry["reasons"][reason] = entry["reasons"].get(reason, 0) + 1
                if text is None or have[domain] >= wanted:
                    continue
                seen.add(key)
                record = {
                    "id": f"magpie/{domain}/{next_index[domain]}",
                    "messages": [{"role": "user", "content": text}],
                    "domain": domain,
                    "system": system,
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                records.append(record)
                have[domain] += 1
                next_index[domain] += 1
                bar.update(1)
            out.flush()
            entry["batches"] += 1
            entry["sampled"] += len(rows)
            done_here[domain] += 1
            stats_path.write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    bar.close()
    return [Prompt(id=r["id"], messages=r["messages"]) for r in records]


__all__ = ["DEFAULT_MAGPIE_COUNTS", "MAGPIE_DOMAINS", "clean_request", "magpie_requests", "query_prefix"]
