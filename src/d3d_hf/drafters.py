"""Creating, saving and loading D3D drafters from the Python API and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel

from .modeling import D3DConfig, D3DForDiffusionDrafting
from .targets import parse_dtype
from .utils import ensure_writable_dir  # re-exported: `d3d_hf.drafters.ensure_writable_dir` predates `utils`

PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"
#: Drafters shipped inside the package, by name.
KNOWN_DRAFTERS = {"d3d-smollm2-135m-instruct": PRETRAINED_DIR / "d3d-smollm2-135m-instruct"}


def resolve_drafter(name_or_path: str) -> str:
    """Maps a shipped drafter's name (`KNOWN_DRAFTERS`) to its folder; returns anything else unchanged.

    Raises:
        FileNotFoundError: if a known name's folder is missing from this installation.
    """
    if name_or_path in KNOWN_DRAFTERS:
        folder = KNOWN_DRAFTERS[name_or_path]
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"The shipped drafter {name_or_path!r} is missing from {folder}; reinstall d3d-hf.")
        return str(folder)
    return name_or_path


def _check_local_drafter_folder(folder: str) -> None:
    """The checks `load_drafter` makes on a local folder before transformers reads it (transformers would ask
    interactively about remote code for a config without `model_type`, and name no fix for a missing weights file).
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"No drafter folder at {folder}; create one with `d3d-hf init-drafter --from TARGET --output DIR`."
        )
    config_file = os.path.join(folder, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{folder} has no config.json: it is not a saved drafter folder.")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except ValueError as err:
        raise ValueError(
            f"{config_file} is not valid JSON ({err}): the save that wrote it was interrupted or the file was edited "
            "by hand. Save the drafter again with `save_pretrained`, or repair the file."
        ) from err
    if not isinstance(config, dict) or "model_type" not in config:
        raise ValueError(
            f'{config_file} has no `model_type`: add `"model_type": "d3d"` if the folder holds a D3D drafter, '
            "or save the drafter again with `save_pretrained`."
        )
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    if config.get("model_type") == "d3d" and not any(os.path.exists(os.path.join(folder, n)) for n in names):
        raise FileNotFoundError(
            f"{folder} has a config.json but no weights (model.safetensors): the save that wrote it stopped before "
            "the weights. Save the drafter again with `save_pretrained`."
        )


ADAPTER_CONFIG = "adapter_config.json"
#: `base_model_name_or_path` of an adapter folder that holds its base drafter itself (config.json and weights beside
#: `adapter_config.json`, transformers' layout for a local model with an embedded adapter): the folder, relative to
#: itself. `D3DTrainer` writes it for a drafter made in memory, so that the folder loads wherever it is moved.
EMBEDDED_BASE = "."
#: where adapter folders saved by d3d-hf 0.1 before the embedded layout hold their base drafter
BASE_DRAFTER_DIR = "base_drafter"


def _adapter_base(folder: str) -> str | None:
    """For a local PEFT adapter folder (`adapter_config.json`), its base drafter: the folder itself when it also holds
    a `config.json` (the embedded layout); else `base_model_name_or_path`, resolved relative to the folder when that
    exists there, else as given, else the folder's own `base_drafter/` (a folder saved before the embedded layout,
    then moved). `None` for anything that is not an adapter folder.

    Raises:
        ValueError: if the adapter config is not valid JSON or names no base drafter.
    """
    config_file = os.path.join(folder, ADAPTER_CONFIG)
    if not os.path.isfile(config_file):
        return None
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    try:
        with open(config_file, encoding="utf-8") as f:
            base = json.load(f).get("base_model_name_or_path")
    except ValueError as err:
        raise ValueError(f"{config_file} is not valid JSON ({err}): save the adapter again.") from err
    if not base:
        raise ValueError(
            f"{config_file} names no base drafter (`base_model_name_or_path`): set it to the folder or hub id of the "
            "drafter the adapter was trained on."
        )
    relative = os.path.join(folder, base)
    if os.path.isdir(relative):
        return relative
    inside = os.path.join(folder, BASE_DRAFTER_DIR)
    if not os.path.exists(base) and os.path.isfile(os.path.join(inside, "config.json")):
        return inside  # the recorded absolute path went with the folder's old place
    return base


def _load_base_without_adapter(folder: str, dtype, device: str) -> D3DForDiffusionDrafting:
    """The base drafter of an embedded-layout adapter folder, without its adapter: transformers applies an adapter it
    finds beside a config.json, so the base is loaded from a temporary folder that links every file but the
    adapter's."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as view:
        for name in os.listdir(folder):
            if name.startswith("adapter_"):
                continue
            source, link = os.path.abspath(os.path.join(folder, name)), os.path.join(view, name)
            try:
                os.symlink(source, link)
            except OSError:  # no symlinks on this file system: copy
                (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, link)
        return load_drafter(view, dtype=dtype, device=device)


def _load_adapter_drafter(folder: str, base: str, dtype, device: str) -> D3DForDiffusionDrafting:
    """A PEFT adapter folder: its base drafter loaded by `load_drafter`, the adapter applied through PEFT and merged
    in."""
    try:
        from peft import PeftModel
    except ImportError as err:  # pragma: no cover - peft is in the train extra
        raise ValueError(f"{folder} holds a PEFT adapter: loading it needs peft (pip install 'd3d-hf[train]').") from (
            err
        )
    if base == folder:
        drafter = _load_base_without_adapter(folder, dtype, device)
    else:
        drafter = load_drafter(base, dtype=dtype, device=device)
    return PeftModel.from_pretrained(drafter, folder).merge_and_unload().to(device).eval()


def load_drafter(
    name_or_path: str, dtype: torch.dtype | str = torch.float32, device: str = "cpu"
) -> D3DForDiffusionDrafting:
    """Loads a saved D3D drafter.

    Args:
        name_or_path (`str`): a shipped drafter's name (`KNOWN_DRAFTERS`, e.g. `d3d-smollm2-135m-instruct`), a
            folder written by `save_pretrained` (or `d3d-hf init-drafter`, `d3d-hf train`) or a hub id. A drafter
            that shares its target's weights is returned unattached: `target.generate(...,
            assistant_model=drafter)` attaches them. A local PEFT adapter folder (`adapter_config.json`, as `D3DTrainer`
            writes with `peft_save_merged=False`) loads its base drafter (the folder's own config.json and weights
            when it holds them, else `base_model_name_or_path`, relative to the folder where it lies inside it),
            applies the adapter through PEFT and returns the merged drafter. Such a folder loads after it is moved.
        dtype (`torch.dtype` or `str`, defaults to `torch.float32`): weight dtype.
        device (`str`, defaults to `"cpu"`): device to load to.

    Returns:
        `D3DForDiffusionDrafting` in eval mode.

    Raises:
        FileNotFoundError: if a local-looking path does not exist, a local folder has no config.json or no weights
            file, or a name without `/` is neither shipped nor local (a Hub id is `owner/name`).
        ValueError: if the checkpoint is not a D3D drafter, its config.json is not valid JSON, lacks `model_type`
            or a required field (`D3DConfig.from_dict`), or its weights do not match its config (no mask token,
            missing or unused tensors; `D3DForDiffusionDrafting.from_pretrained`), or an adapter folder names no
            base drafter.
        OSError: if a weights file is truncated or corrupt.
    """
    name_or_path = resolve_drafter(name_or_path)
    base = _adapter_base(name_or_path)
    if base is not None:
        return _load_adapter_drafter(name_or_path, base, dtype, device)
    load_drafter_config(name_or_path)
    drafter = AutoModel.from_pretrained(name_or_path, dtype=parse_dtype(dtype))
    return drafter.to(device).eval()


def load_drafter_config(name_or_path: str) -> D3DConfig:
    """Reads only a saved drafter's config (no weights): what `load_drafter` checks first, and what the CLI checks
    its options against before any model loads.

    Args:
        name_or_path (`str`): as for `load_drafter` (for a PEFT adapter folder, its base drafter's config).

    Returns:
        The drafter's `D3DConfig` (validated: `D3DConfig.from_dict`).

    Raises:
        FileNotFoundError, ValueError: as `load_drafter` raises them for the folder and the config.
    """
    name_or_path = resolve_drafter(name_or_path)
    base = _adapter_base(name_or_path)
    if base is not None and base != name_or_path:  # a PEFT adapter folder: its base drafter's config (the adapter
        return load_drafter_config(base)  # changes no config field); an embedded base is read below
    looks_local = os.path.sep in name_or_path or name_or_path.startswith(".") or os.path.exists(name_or_path)
    if looks_local:
        _check_local_drafter_folder(name_or_path)
    elif "/" not in name_or_path:  # neither shipped, nor local, nor a Hub id (`owner/name`): a typo, refused at once
        import difflib

        close = difflib.get_close_matches(name_or_path, KNOWN_DRAFTERS, n=1, cutoff=0.5)
        raise FileNotFoundError(
            f"No drafter {name_or_path!r}: it is not a shipped drafter ({', '.join(sorted(KNOWN_DRAFTERS))}), a "
            "local folder, or a Hub id (`owner/name`)."
            + (f" Did you mean {close[0]!r}?" if close else " Pass one of those.")
        )
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except OSError as err:
        raise FileNotFoundError(
            f"Cannot load drafter {name_or_path!r}: no such local folder, and the Hugging Face Hub could not "
            f"provide it ({type(err).__name__}). Pass an existing folder or a reachable hub id."
        ) from err
    if not isinstance(config, D3DConfig):
        raise ValueError(
            f"{name_or_path} holds a `{config.model_type}` model, not a D3D drafter (model_type 'd3d'); create one "
            "with `d3d-hf init-drafter`."
        )
    return config


def draft_vocabulary(token_rows, size: int, vocab_size: int, always: list[int] | tuple[int, ...] = ()) -> list[int]:
    """The `size` ids a draft vocabulary covers (FR-Spec, arXiv 2502.14856): `always` first, then the most frequent ids
    of `token_rows` (ties broken by the smaller id), then the smallest unused ids if the rows hold fewer.

    Args:
        token_rows (iterable of `list[int]`): token-id sequences, e.g. the `response_ids` of the target's answers
            (what the drafter will draft).
        size (`int`): ids to return, in [1, vocab_size].
        vocab_size (`int`): the target's vocabulary size.
        always (`list[int]`): ids kept whatever their count (the end-of-turn / eos ids).

    Returns:
        `list[int]` of `size` distinct ids in `[0, vocab_size)`, in the order above (the LM head's row order).

    Raises:
        ValueError: `size` outside [1, vocab_size], an id outside the vocabulary, or more `always` ids than `size`.
    """
    from collections import Counter

    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= vocab_size:
        raise ValueError(f"A draft vocabulary size must be an int in [1, {vocab_size}], got {size!r}.")
    always = list(dict.fromkeys(int(i) for i in always))
    if len(always) > size:
        raise ValueError(f"{len(always)} ids must always be kept, more than the draft vocabulary's {size}.")
    counts: Counter = Counter()
    for row in token_rows:
        counts.update(int(t) for t in row)
    if any(not 0 <= t < vocab_size for t in [*counts, *always]):
        raise ValueError(f"Token ids must be in [0, {vocab_size}): the rows or `always` hold one outside.")
    chosen = dict.fromkeys(always)
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) >= size:
            break
        chosen.setdefault(token)
    filler = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.setdefault(next(filler))
    return list(chosen)


__all__ = [
    "BASE_DRAFTER_DIR",
    "EMBEDDED_BASE",
    "draft_vocabulary",
    "KNOWN_DRAFTERS",
    "D3DForDiffusionDrafting",
    "ensure_writable_dir",
    "load_drafter",
    "load_drafter_config",
    "resolve_drafter",
]
