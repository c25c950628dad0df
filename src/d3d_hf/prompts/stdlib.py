"""Training prompts derived from the Python standard library installed with the interpreter (`stdlib_prompts`).

The sources are the stdlib's own ``.py`` files (Python Software Foundation License Version 2), parsed with
:mod:`ast`, never imported; :func:`stdlib_source_info` records the Python version and the folder read.
"""

from __future__ import annotations

import ast
import inspect
import os
import platform
import random
import sysconfig
import textwrap
import warnings
from functools import lru_cache
from pathlib import Path

from .prompt import Prompt

STDLIB_KINDS: tuple[str, ...] = ("implement", "explain", "docstring", "type_hints", "class")
"""The instruction kinds :func:`stdlib_prompts` derives, in the order they are interleaved:

* ``implement``: "Write a Python function `name(signature)` that matches this description: <docstring summary>"
  (for methods: "Write the method `name(self, ...)` of a Python class `Class` ...");
* ``explain``: "Explain what this Python code does" + the function's source without its docstring;
* ``docstring``: "Write a docstring for this Python function" + the source without its docstring;
* ``type_hints``: "Add type hints to this Python function" + the source without its docstring (only for
  functions that have no annotations);
* ``class``: "Write a Python class `Name` that matches this description: <docstring summary>", listing up to
  eight of its public methods.
"""

STDLIB_LICENSE = "Python Software Foundation License Version 2 (PSF-2.0)"
"""Licence of the Python standard library sources that :func:`stdlib_prompts` quotes."""

MAX_SOURCE_CHARS = 1500
"""Longest function source (docstring removed, dedented) quoted by the ``explain``/``docstring``/``type_hints``
kinds."""

_SUMMARY_CHARS = (20, 600)
_MAX_CLASS_METHODS = 8

# Folders (any path component) and top-level modules of the stdlib that are not walked: tests, GUI/demo code,
# installed third-party packages, build configuration, deprecated or generated modules.
_SKIP_DIRS = frozenset(
    {
        "__pycache__",
        "__phello__",
        "dist-packages",
        "distutils",
        "encodings",
        "ensurepip",
        "idlelib",
        "lib-dynload",
        "lib2to3",
        "msilib",
        "pydoc_data",
        "site-packages",
        "test",
        "tests",
        "tkinter",
        "turtledemo",
        "venv",
    }
)
_SKIP_MODULES = frozenset({"antigravity", "this", "__hello__", "__future__", "setup"})

_IMPLEMENT = "Write a Python function `{signature}` that matches this description:\n\n{summary}"
_IMPLEMENT_METHOD = (
    "Write the method `{signature}` of a Python class `{cls}` that matches this description:\n\n{summary}"
)
_EXPLAIN = "Explain what this Python code does:\n\n```python\n{source}\n```"
_DOCSTRING = "Write a docstring for this Python function:\n\n```python\n{source}\n```"
_TYPE_HINTS = "Add type hints to this Python function and show the annotated code:\n\n```python\n{source}\n```"
_CLASS = "Write a Python class `{name}` that matches this description:\n\n{summary}"


def stdlib_source_info() -> dict:
    """Where :func:`stdlib_prompts` reads from: Python version, stdlib folder and licence.

    Returns:
        ``{"python_version": "3.11.7", "stdlib_path": "...", "license": "..."}``.
    """
    return {
        "python_version": platform.python_version(),
        "stdlib_path": sysconfig.get_paths()["stdlib"],
        "license": STDLIB_LICENSE,
    }


def _summary(doc: str) -> str | None:
    """First paragraph of a docstring, on one line; ``None`` when it is too short, too long or a doctest."""
    paragraph = inspect.cleandoc(doc).split("\n\n", 1)[0]
    text = " ".join(paragraph.split())
    if not (_SUMMARY_CHARS[0] <= len(text) <= _SUMMARY_CHARS[1]) or ">>>" in text:
        return None
    return text


def _source_without_docstring(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The dedented source of a function (from its ``def`` line) with its docstring lines removed.

    ``None`` when the docstring shares a line with other code, or nothing but ``pass``/``...``/a ``raise`` is left.
    """
    doc = node.body[0]
    if doc.lineno <= node.lineno or len(node.body) < 2:
        return None
    rest = node.body[1:]
    if len(rest) == 1 and isinstance(rest[0], (ast.Pass, ast.Raise)):
        return None
    if len(rest) == 1 and isinstance(rest[0], ast.Expr) and isinstance(rest[0].value, ast.Constant):
        return None
    head = lines[node.lineno - 1 : doc.lineno - 1]
    tail = lines[doc.end_lineno : node.end_lineno]
    return textwrap.dedent("\n".join(head + tail)).strip("\n")


def _has_annotations(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = node.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return node.returns is not None or any(a is not None and a.annotation is not None for a in every)


def _function_candidates(
    module: str, lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, cls: str | None
) -> list[tuple[str, str, str]]:
    doc = ast.get_docstring(node, clean=False)
    if not doc:
        return []
    qualname = node.name if cls is None else f"{cls}.{node.name}"
    base = f"stdlib/{module}.{qualname}"
    out = []
    signature = f"{node.name}({ast.unparse(node.args)})"
    if node.returns is not None:
        signature += f" -> {ast.unparse(node.returns)}"
    summary = _summary(doc)
    if summary is not None:
        if cls is None:
            text = _IMPLEMENT.format(signature=signature, summary=summary)
        else:
            text = _IMPLEMENT_METHOD.format(signature=signature, cls=cls, summary=summary)
        out.append(("implement", f"{base}/implement", text))
    source = _source_without_docstring(lines, node)
    if source is not None and len(source) <= MAX_SOURCE_CHARS:
        out.append(("explain", f"{base}/explain", _EXPLAIN.format(source=source)))
        out.append(("docstring", f"{base}/docstring", _DOCSTRING.format(source=source)))
        if not _has_annotations(node):
            out.append(("type_hints", f"{base}/type_hints", _TYPE_HINTS.format(source=source)))
    return out


def _class_candidates(module: str, lines: list[str], node: ast.ClassDef) -> list[tuple[str, str, str]]:
    out = []
    methods = []
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not child.name.startswith("_"):
            methods.append(child.name)
            out.extend(_function_candidates(module, lines, child, node.name))
    doc = ast.get_docstring(node, clean=False)
    summary = _summary(doc) if doc else None
    if summary is not None:
        text = _CLASS.format(name=node.name, summary=summary)
        if methods:
            shown = ", ".join(f"`{m}`" for m in methods[:_MAX_CLASS_METHODS])
            text += f"\n\nGive it the public methods {shown}."
        out.append(("class", f"stdlib/{module}.{node.name}/class", text))
    return out


def _module_candidates(module: str, text: str) -> list[tuple[str, str, str]]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SyntaxWarning for old escape sequences in a few modules
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in tree.body:
        if getattr(node, "name", "_").startswith("_"):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.extend(_function_candidates(module, lines, node, None))
        elif isinstance(node, ast.ClassDef):
            out.extend(_class_candidates(module, lines, node))
    return out


@lru_cache(maxsize=4)
def _stdlib_candidates(stdlib_dir: str) -> tuple[tuple[str, str, str], ...]:
    """Every ``(kind, id, user message)`` derivable from the stdlib at ``stdlib_dir``, in sorted walk order."""
    root = Path(stdlib_dir)
    candidates: dict[str, tuple[str, str, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("config-", ".")))
        rel = Path(dirpath).relative_to(root)
        if rel.parts and not all(p.isidentifier() for p in rel.parts):
            continue
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            stem = filename[:-3]
            parts = [*rel.parts] + ([] if stem == "__init__" else [stem])
            if not parts or parts[0] in _SKIP_MODULES or any(p.startswith(("_", "test")) for p in parts):
                continue
            try:
                text = (Path(dirpath) / filename).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            for kind, pid, content in _module_candidates(".".join(parts), text):
                candidates.setdefault(pid, (kind, pid, content))
    return tuple(candidates.values())


def stdlib_prompts(limit: int | None = None, seed: int = 0) -> list[Prompt]:
    """Training prompts derived from the Python standard library installed with the running interpreter.

    Source and licence: the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (recorded with the Python
    version by :func:`stdlib_source_info`), which are distributed under the Python Software Foundation License
    Version 2. The files are parsed with :mod:`ast` (never imported). Walked in sorted order, skipping tests
    (``test``/``tests`` folders, ``test*`` modules), private modules (``_*``), GUI and demo code (``idlelib``,
    ``tkinter``, ``turtledemo``), installed packages (``site-packages``), build configuration and deprecated or
    generated packages (``lib2to3``, ``distutils``, ``encodings``, ``ensurepip``, ``pydoc_data``, ...). Public
    top-level functions, public methods of public top-level classes and public classes with a docstring give the
    kinds in :data:`STDLIB_KINDS`. The set is disjoint from every evaluation set (it never reads HumanEval).

    Selection is deterministic given ``seed`` and the Python installation: the candidates of each kind are
    shuffled with ``random.Random(seed)`` and the kinds are interleaved round-robin in :data:`STDLIB_KINDS` order
    (a kind that runs out is dropped from the rotation), so any ``limit`` gives a balanced mix. On CPython 3.11
    there are about 12,000 candidates; the first call parses ~600 files (a few seconds), later calls are cached.

    Args:
        limit: Number of prompts to return (positive), or ``None`` for all candidates.
        seed: Seed of the shuffle.

    Returns:
        Prompts with one user turn each (no system message, so the chat template adds its default) and
        ``raw=None``; ids are ``"stdlib/<module>.<qualname>/<kind>"``, e.g. ``"stdlib/json.dumps/explain"``.

    Raises:
        ValueError: ``limit`` is not a positive integer or ``None``.
        FileNotFoundError: The interpreter has no standard library sources (e.g. a zipped stdlib).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}.")
    stdlib_dir = sysconfig.get_paths()["stdlib"]
    if not Path(stdlib_dir, "os.py").is_file():
        raise FileNotFoundError(
            f"No Python standard library sources at {stdlib_dir} (os.py is missing): the 'stdlib' prompt source "
            "needs an interpreter installed with its .py files."
        )
    by_kind: dict[str, list[tuple[str, str, str]]] = {kind: [] for kind in STDLIB_KINDS}
    for candidate in _stdlib_candidates(stdlib_dir):
        by_kind[candidate[0]].append(candidate)
    rng = random.Random(seed)
    queues = []
    for kind in STDLIB_KINDS:
        items = sorted(by_kind[kind], key=lambda c: c[1])
        rng.shuffle(items)
        queues.append(items)
    chosen: list[tuple[str, str, str]] = []
    total = sum(len(q) for q in queues)
    wanted = total if limit is None else min(limit, total)
    depth = 0
    while len(chosen) < wanted:
        for queue in queues:
            if depth < len(queue) and len(chosen) < wanted:
                chosen.append(queue[depth])
        depth += 1
    return [Prompt(id=pid, messages=[{"role": "user", "content": content}]) for _, pid, content in chosen]


__all__ = ["MAX_SOURCE_CHARS", "STDLIB_KINDS", "STDLIB_LICENSE", "stdlib_prompts", "stdlib_source_info"]
