"""Prompts: the `Prompt` type and its encoding, the prompt sets drafters are measured on, and training prompts.

- `prompt`: `Prompt` (one chat prompt) and `encode_prompt` (its target input ids, through the chat template);
- `benchmarks`: `load_prompts`, the named evaluation sets (HumanEval, GSM8K, MT-Bench, Vicuna bench: sources and
  licences in its docstring) and JSONL prompt files;
- `stdlib`: `stdlib_prompts`, training instructions derived from the Python standard library;
- `synthetic`: `math_word_problems` and `chat_instructions`, templated training prompts for math and chat;
- `sources`: `load_prompt_sources`, the training prompt sources (`stdlib[:N]`, `math[:N]`, `chat[:N]` and JSONL
  files, never an evaluation set nor a near-duplicate of an evaluation prompt: `near_evaluation_match`);
- `magpie`: `magpie_requests`, requests the target writes itself (Magpie) into a JSONL prompt file (it needs the
  target, so it is imported from `d3d_hf.prompts.magpie`, not here).

Every name is importable from `d3d_hf.prompts` itself (the stdlib and source names also from `d3d_hf.data`).
"""

# `importlib` and the `X as X` names: what the single-module `d3d_hf.prompts` had besides `__all__`, for the tests
import importlib.util  # noqa: F401  (tests patch `d3d_hf.prompts.importlib.util.find_spec`)

from .benchmarks import GSM8K_INSTRUCTION, HUMANEVAL_INSTRUCTION, PROMPT_SETS, load_prompts
from .benchmarks import _package_file as _package_file
from .benchmarks import _read_jsonl_records as _read_jsonl_records
from .benchmarks import _round_robin as _round_robin
from .prompt import Prompt, encode_prompt
from .prompt import _to_id_list as _to_id_list
from .sources import (
    EVALUATION_SETS,
    evaluation_texts,
    load_prompt_sources,
    near_evaluation_match,
    refuse_evaluation_rows,
)
from .stdlib import MAX_SOURCE_CHARS, STDLIB_KINDS, STDLIB_LICENSE, stdlib_prompts, stdlib_source_info
from .synthetic import chat_instructions, math_word_problems
from .synthetic_extra import SYNTHETIC_SOURCES, more_chat_instructions, more_math_word_problems

__all__ = [
    "EVALUATION_SETS",
    "GSM8K_INSTRUCTION",
    "HUMANEVAL_INSTRUCTION",
    "MAX_SOURCE_CHARS",
    "PROMPT_SETS",
    "STDLIB_KINDS",
    "STDLIB_LICENSE",
    "SYNTHETIC_SOURCES",
    "Prompt",
    "chat_instructions",
    "encode_prompt",
    "evaluation_texts",
    "load_prompt_sources",
    "load_prompts",
    "math_word_problems",
    "more_chat_instructions",
    "more_math_word_problems",
    "near_evaluation_match",
    "refuse_evaluation_rows",
    "stdlib_prompts",
    "stdlib_source_info",
]
