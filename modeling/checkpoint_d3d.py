"""Checkpoint I/O of D3D drafters: atomic folder saves, whole-file checks of safetensors weights, and the hooks through
which an installed library adds to a save or a push (d3d_hf renders the model card).

Part of the self-contained remote-code bundle: imports only the Python standard library (no other bundle file,
nothing from d3d_hf).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from importlib.metadata import entry_points

#: entry-point groups through which an installed package extends saving and pushing (d3d_hf declares both in its
#: pyproject.toml): each `d3d.save_hooks` entry is `hook(model, save_directory)`, called after every complete save;
#: the `d3d.push_handlers` entry, when one is installed, replaces transformers' `push_to_hub` with
#: `handler(model, repo_id, tokenizer=None, **kwargs)`.
SAVE_HOOKS_GROUP = "d3d.save_hooks"
PUSH_HANDLERS_GROUP = "d3d.push_handlers"


def _load_entry_points(group: str) -> list[Callable]:
    """The loaded entries of `group`, sorted by name; an entry whose package cannot be imported is skipped (its
    distribution is registered but not importable here, e.g. removed from the environment without uninstalling)."""
    loaded = []
    for entry in sorted(entry_points(group=group), key=lambda e: e.name):
        try:
            loaded.append(entry.load())
        except ImportError:
            continue
    return loaded


def save_hooks() -> list[Callable]:
    """The installed `d3d.save_hooks` (sorted by name; empty with only torch + transformers installed)."""
    return _load_entry_points(SAVE_HOOKS_GROUP)


def push_handler() -> Callable | None:
    """The installed `d3d.push_handlers` entry (the first by name), or `None`."""
    handlers = _load_entry_points(PUSH_HANDLERS_GROUP)
    return handlers[0] if handlers else None


def _with_variant(name: str, variant: str | None) -> str:
    """`model.safetensors` -> `model.<variant>.safetensors` (transformers' naming of weight-file variants)."""
    if not variant:
        return name
    parts = name.split(".")
    return ".".join([*parts[:-1], variant, parts[-1]])


def _safetensors_problem(path: str) -> str | None:
    """What is wrong with the safetensors file at `path` (truncated, corrupt header), or `None` if its header is
    sound and describes exactly the file's size. Reads only the header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"truncated ({size} bytes, shorter than a safetensors header)"
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            return f"truncated (its header announces {header_len} bytes, the file holds {size - 8} after it)"
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return "corrupt (its header is not valid JSON)"
    if not isinstance(header, dict):
        return "corrupt (its header is not a JSON object)"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            return f"corrupt (the header entry of {name!r} has no data offsets)"
    if 8 + header_len + end != size:
        return f"truncated or corrupt ({size} bytes, its header describes {8 + header_len + end})"
    return None


def check_weight_files(folder: str, variant: str | None = None) -> None:
    """Raises `OSError` naming the file when the safetensors weights of a local checkpoint folder are truncated or
    corrupt (a missing weights file is left to transformers, which names it)."""
    single = os.path.join(folder, _with_variant("model.safetensors", variant))
    index = os.path.join(folder, _with_variant("model.safetensors.index.json", variant))
    fix = (
        "The save that wrote it was interrupted or the file was damaged in transfer: save the drafter again with "
        "`save_pretrained`, or copy / download the folder again."
    )
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted({os.path.join(folder, name) for name in json.load(f)["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise OSError(f"{index} is corrupt ({type(err).__name__}: {err}). {fix}") from err
    else:
        return
    for path in files:
        if not os.path.isfile(path):
            raise OSError(f"{path} is missing (listed in {os.path.basename(index)}). {fix}")
        problem = _safetensors_problem(path)
        if problem is not None:
            raise OSError(f"{path} is {problem}. {fix}")


def publish_folder(staging: str, final: str, variant: str | None = None) -> None:
    """Moves every file written into `staging` to the same place under `final` with `os.replace` (each file
    appears whole or not at all), weights after the other files and `config.json` last. Files of `final` that the
    save did not write are kept, except weight files of an earlier save that the new ones supersede (a stale
    `model.safetensors` would otherwise shadow new shards, stale shards would sit next to a new single file)."""
    written = []
    for root, _, files in os.walk(staging):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                try:
                    os.fsync(f.fileno())  # on disk before it replaces anything (survives a power cut, not just a kill)
                except OSError:  # platforms that cannot sync a read-only handle
                    pass
            written.append(os.path.relpath(path, staging))
    single = _with_variant("model.safetensors", variant)
    index = _with_variant("model.safetensors.index.json", variant)
    shard = re.compile(re.escape(single[: -len(".safetensors")]) + r"-\d{5}-of-\d{5}\.safetensors")

    def is_weights(name: str) -> bool:
        return name in (single, index) or shard.fullmatch(name) is not None

    order = {False: 0, True: 1}
    written.sort(key=lambda rel: (rel == "config.json", order[is_weights(rel)], rel))
    os.makedirs(final, exist_ok=True)
    for rel in written:
        destination = os.path.join(final, rel)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.replace(os.path.join(staging, rel), destination)
    if any(is_weights(rel) for rel in written):
        for name in os.listdir(final):
            if is_weights(name) and name not in written and os.path.isfile(os.path.join(final, name)):
                os.remove(os.path.join(final, name))


def save_folder_atomically(write: Callable[[str], object], save_directory: str | os.PathLike, variant=None):
    """Runs `write(staging_folder)` into a temporary sibling folder of `save_directory` (a hidden folder inside it when
    its parent is read-only), then moves each written file into `save_directory` with `publish_folder`, so that an
    interrupted save leaves the previous checkpoint complete. Returns what `write` returned.

    Raises:
        NotADirectoryError: if `save_directory` is an existing file.
    """
    final = os.path.realpath(os.fspath(save_directory))  # symlinks resolved: staging on the same file system
    if os.path.isfile(final):
        raise NotADirectoryError(f"{save_directory} is a file; `save_pretrained` writes a folder: pass a folder.")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    try:
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", suffix=".saving", dir=parent)
    except PermissionError:  # the parent is read-only (e.g. the root of a mounted volume): stage inside
        os.makedirs(final, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".d3d-", suffix=".saving", dir=final)
    try:
        result = write(staging)
        publish_folder(staging, final, variant)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


__all__ = [
    "PUSH_HANDLERS_GROUP",
    "SAVE_HOOKS_GROUP",
    "check_weight_files",
    "publish_folder",
    "push_handler",
    "save_folder_atomically",
    "save_hooks",
]
