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


def load_drafter(
    name_or_path: str, dtype: torch.dtype | str = torch.float32, device: str = "cpu"
) -> D3DForDiffusionDrafting:
    """Loads a saved D3D drafter.

    Args:
        name_or_path (`str`): a shipped drafter's name (`KNOWN_DRAFTERS`, e.g. `d3d-smollm2-135m-instruct`), a
            folder written by `save_pretrained` (or `d3d-hf init-drafter`, `d3d-hf train`) or a hub id. A drafter
            that shares its target's weights is returned unattached: `target.generate(...,
            assistant_model=drafter)` attaches them.
        dtype (`torch.dtype` or `str`, defaults to `torch.float32`): weight dtype.
        device (`str`, defaults to `"cpu"`): device to load to.

    Returns:
        `D3DForDiffusionDrafting` in eval mode.

    Raises:
        FileNotFoundError: if a local-looking path does not exist, or a local folder has no config.json or no
            weights file.
        ValueError: if the checkpoint is not a D3D drafter, its config.json is not valid JSON, lacks `model_type`
            or a required field (`D3DConfig.from_dict`), or its weights do not match its config (no mask token,
            missing or unused tensors; `D3DForDiffusionDrafting.from_pretrained`).
        OSError: if a weights file is truncated or corrupt.
    """
    name_or_path = resolve_drafter(name_or_path)
    load_drafter_config(name_or_path)
    drafter = AutoModel.from_pretrained(name_or_path, dtype=parse_dtype(dtype))
    return drafter.to(device).eval()


def load_drafter_config(name_or_path: str) -> D3DConfig:
    """Reads only a saved drafter's config (no weights): what `load_drafter` checks first, and what the CLI checks
    its options against before any model loads.

    Args:
        name_or_path (`str`): as for `load_drafter`.

    Returns:
        The drafter's `D3DConfig` (validated: `D3DConfig.from_dict`).

    Raises:
        FileNotFoundError, ValueError: as `load_drafter` raises them for the folder and the config.
    """
    name_or_path = resolve_drafter(name_or_path)
    looks_local = os.path.sep in name_or_path or name_or_path.startswith(".") or os.path.exists(name_or_path)
    if looks_local:
        _check_local_drafter_folder(name_or_path)
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


__all__ = [
    "KNOWN_DRAFTERS",
    "D3DForDiffusionDrafting",
    "ensure_writable_dir",
    "load_drafter",
    "load_drafter_config",
    "resolve_drafter",
]
