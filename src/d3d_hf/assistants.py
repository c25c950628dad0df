"""Autoregressive assistants for the `ar-assist` baseline, including one shipped inside the package.

An `ar-assist` assistant is a plain causal LM of the target's tokenizer that transformers' assisted generation runs
token by token (`target.generate(..., assistant_model=assistant)`). The one shipped with d3d-hf,
`ar-smollm2-135m-instruct`, is the equal-budget autoregressive counterpart of the shipped D3D drafter: the first 6 of
SmolLM2-135M-Instruct's 30 layers, trained on the same data for the same steps (examples/train_ar_assistant.sh). Its
embeddings (and tied LM head) stayed frozen at the target's during training, so the package stores only what
training changed (the layers and the final norm, in bfloat16, ~42 MB) and `load_assistant` takes the embeddings
from the target when it builds the model (a second or two).

A folder of this layers-only kind is marked by `ASSISTANT_FILE` (`d3d_assistant.json`: the target whose embeddings
it takes, and the stored dtype); any other causal-LM folder loads as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .targets import load_target, parse_dtype
from .utils import ensure_writable_dir

PRETRAINED_DIR = Path(__file__).resolve().parent / "pretrained"
#: Autoregressive assistants shipped inside the package, by name.
KNOWN_ASSISTANTS = {"ar-smollm2-135m-instruct": PRETRAINED_DIR / "ar-smollm2-135m-instruct"}
#: The file that marks a layers-only assistant folder (`save_layers_only`).
ASSISTANT_FILE = "d3d_assistant.json"
_EMBEDDING_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
_FORMAT_VERSION = 1


def resolve_assistant(name_or_path: str) -> str:
    """Maps a shipped assistant's name (`KNOWN_ASSISTANTS`) to its folder; returns anything else unchanged.

    Raises:
        FileNotFoundError: if a known name's folder is missing from this installation.
    """
    if name_or_path in KNOWN_ASSISTANTS:
        folder = KNOWN_ASSISTANTS[name_or_path]
        if not (folder / ASSISTANT_FILE).exists():
            raise FileNotFoundError(
                f"The shipped assistant {name_or_path!r} is missing from {folder}; reinstall d3d-hf."
            )
        return str(folder)
    return name_or_path


def is_layers_only(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a layers-only assistant (`save_layers_only`), which needs its target's embeddings."""
    return os.path.isfile(os.path.join(folder, ASSISTANT_FILE))


def save_layers_only(
    model: PreTrainedModel,
    output_dir: str | os.PathLike,
    embeddings_from: str,
    target: PreTrainedModel,
    dtype: torch.dtype | str = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Saves a causal LM whose embeddings are its target's without them: config, the other weights in `dtype`, and
    the `ASSISTANT_FILE` marker naming the target (what `load_assistant` takes the embeddings from).

    Args:
        model (`PreTrainedModel`): the assistant (a causal LM with tied embeddings, e.g. from `export_causal_lm`).
        output_dir (`str` or `os.PathLike`): the folder to write (created; must be empty unless `overwrite`).
        embeddings_from (`str`): the target's name or path, as `load_target` takes it.
        target (`PreTrainedModel`): that target, to check that the embeddings really are its own.
        dtype (`torch.dtype` or `str`, defaults to `torch.bfloat16`): dtype of the stored weights.
        overwrite (`bool`, defaults to `False`): replace the files of an existing non-empty folder.

    Returns:
        `Path`: the folder.

    Raises:
        ValueError: if the model's embeddings are not exactly the target's, or its LM head is not tied to them.
        FileExistsError: if `output_dir` is not empty and `overwrite` is False.
    """
    config = model.config.get_text_config()
    if not getattr(config, "tie_word_embeddings", False):
        raise ValueError("Only an assistant whose LM head is tied to its embeddings can be saved without them.")
    own = model.get_input_embeddings().weight.detach().float().cpu()
    theirs = target.get_input_embeddings().weight.detach().float().cpu()
    if own.shape != theirs.shape or not torch.equal(own, theirs):
        raise ValueError(
            f"The assistant's embeddings are not {embeddings_from}'s (they changed in training, or another target): "
            "save it whole with `save_pretrained` instead."
        )
    folder = Path(output_dir)
    ensure_writable_dir(folder, overwrite)
    storage = parse_dtype(dtype)
    state = {
        k: v.detach().to(storage).contiguous().cpu() for k, v in model.state_dict().items() if k not in _EMBEDDING_KEYS
    }
    model.config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    marker = {"format_version": _FORMAT_VERSION, "embeddings_from": embeddings_from, "stored_dtype": str(storage)}
    (folder / ASSISTANT_FILE).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
    return folder


def load_assistant(
    name_or_path: str,
    target: PreTrainedModel | None = None,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Loads an autoregressive assistant for `ar-assist`.

    Args:
        name_or_path (`str`): a shipped assistant's name (`KNOWN_ASSISTANTS`, e.g. `ar-smollm2-135m-instruct`), a
            layers-only folder (`save_layers_only`), or anything `load_target` loads (a causal-LM folder, a GGUF
            file, a hub id).
        target (`PreTrainedModel`, *optional*): for a layers-only assistant, the target whose embeddings it takes
            (shared, not copied, when the dtype and device match); loaded from the marker's name when `None`.
        dtype (`torch.dtype` or `str`, defaults to `torch.float32`): parameter dtype (a layers-only assistant stored
            in bfloat16 is cast up for float32).
        device (`str` or `torch.device`, defaults to `"cpu"`): where to put it.

    Returns:
        `PreTrainedModel` in eval mode.

    Raises:
        FileNotFoundError: if a shipped assistant is missing or a layers-only folder lacks its weights.
        ValueError: if the marker is unreadable, or `target`'s embeddings do not fit the assistant's config.
    """
    folder = resolve_assistant(name_or_path)
    torch_dtype = parse_dtype(dtype)
    if not is_layers_only(folder):
        return load_target(folder, dtype=torch_dtype, device=device)[0]
    try:
        marker = json.loads(Path(folder, ASSISTANT_FILE).read_text(encoding="utf-8"))
        embeddings_from = marker["embeddings_from"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{folder}/{ASSISTANT_FILE} is not a readable assistant marker ({err}).") from err
    weights = Path(folder, "model.safetensors")
    if not weights.is_file():
        raise FileNotFoundError(f"{folder} has no model.safetensors: save the assistant again.")
    if target is None:
        target = load_target(embeddings_from, dtype=torch_dtype, device=device)[0]
    config = AutoConfig.from_pretrained(folder)
    embed = target.get_input_embeddings().weight
    expected = (config.get_text_config().vocab_size, config.get_text_config().hidden_size)
    if tuple(embed.shape) != expected:
        raise ValueError(
            f"The target's embeddings are {tuple(embed.shape)}, the assistant {name_or_path!r} expects {expected}: "
            f"pass the target it was trained for ({embeddings_from})."
        )
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    state = {k: v.to(torch_dtype) for k, v in load_file(str(weights)).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in _EMBEDDING_KEYS]
    if missing or unexpected:
        raise ValueError(f"{weights} does not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}.")
    shared = embed.detach()
    if shared.dtype != torch_dtype:
        shared = shared.to(torch_dtype)
    model.get_input_embeddings().weight = torch.nn.Parameter(shared, requires_grad=False)
    model.tie_weights()
    return model.to(device).eval()


__all__ = [
    "ASSISTANT_FILE",
    "KNOWN_ASSISTANTS",
    "is_layers_only",
    "load_assistant",
    "resolve_assistant",
    "save_layers_only",
]
