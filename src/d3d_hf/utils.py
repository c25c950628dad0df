"""Small helpers shared by the d3d-hf modules: atomic JSON files, library versions, output folders."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from pathlib import Path


def write_json_atomic(path: str | os.PathLike, obj: object) -> None:
    """Writes `obj` as indented UTF-8 JSON (non-ASCII kept, trailing newline) to `path`, atomically.

    The text goes to a hidden temporary file next to `path` (`.NAME.tmp`) that then replaces `path`
    (`os.replace`), so a process killed mid-write leaves the previous file, never a truncated one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def library_versions(*distributions: str) -> dict[str, str | None]:
    """The Python version and the installed versions of `distributions`, for recording with results.

    Args:
        distributions (`str`): distribution names as pip knows them (`"torch"`, `"transformers"`, `"d3d-hf"`, ...).

    Returns:
        `{"python": platform.python_version(), name: version, ...}` in the order given; the version is read from
        the installed package metadata (`importlib.metadata`, nothing is imported) and is `None` for a
        distribution that is not installed.
    """
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in distributions:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def ensure_writable_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Returns `path` as a `Path` after checking it may be written.

    Raises:
        FileExistsError: if `path` is a non-empty directory (or a file) and `overwrite` is `False`; nothing a user
            saved is replaced without being asked.
    """
    path = Path(path)
    if path.exists() and (path.is_file() or any(path.iterdir())) and not overwrite:
        raise FileExistsError(
            f"{path} already exists and is not empty; choose another output or pass --overwrite (files of the same "
            "name are replaced, other files are kept)."
        )
    return path


__all__ = ["ensure_writable_dir", "library_versions", "write_json_atomic"]
