"""Making D3D drafters from real checkpoint folders.

Entry points:

- `convert_autoregressive_checkpoint`: any local Llama-, Mistral- or Qwen3-architecture causal-LM folder
  (`config.json` + safetensors) -> a D3D drafter initialised from its layers (`from_autoregressive`).
- `load_published_d3d_checkpoint`: a folder in the layout of the published D3D checkpoints (D3D-1.7B-8B, D3D-8B-8B,
  D3D-8B-32B, ...), inferred as described in its docstring.
- `export_causal_lm`: the other direction, a drafter's committed-context path as a plain `LlamaForCausalLM` /
  `Qwen3ForCausalLM` folder (e.g. an autoregressive assistant trained with `block_loss_weight=0`, for
  `d3d-hf bench --methods ar-assist --assistant DIR`).

Mask token choice for padded vocabularies: Qwen3 checkpoints have 151936 embedding rows but their tokenizer produces
only ids below `len(tokenizer)` (151669 for Qwen3), so the rows in between are spare. When the folder has a tokenizer
and such spare ids exist, the first one is reused as the mask token by default: the drafter's `vocab_size` stays equal
to the target's (transformers' assisted generation requires it) and the mask needs no extra parameter. The spare row
is taken as it is in the checkpoint (it is never produced by the tokenizer, so the drafter's causal predictions are
exactly the source's) and learns its meaning in training. Without a tokenizer, spare ids cannot be told apart from
real ones, and the drafter gets a separate learned mask embedding (initialised to the mean input embedding).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .modeling import D3DForDiffusionDrafting

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen3")
"""`model_type`s of autoregressive checkpoints whose decoder layers `from_autoregressive` copies."""

QWEN3_REFERENCE_SHAPES: dict[str, dict[str, int]] = {
    "Qwen3-1.7B": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
    },
    "Qwen3-8B": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
    },
}
"""Shapes of the Qwen3 models the published D3D drafters derive from (D3D-1.7B-* drafters are 28-layer 1.7B-shaped,
D3D-8B-* drafters 36-layer 8B-shaped, or fewer layers after pruning). Used to name a checkpoint's shape in messages."""

_BLOCK_SIZE_KEYS = ("block_size", "block_length", "diffusion_block_size", "draft_block_size")
_MASK_ID_KEYS = ("mask_token_id", "mask_id")
_MASK_TENSOR = re.compile(r"(^|\.)(mask_embedding|mask_embed|mask_emb|mask_token|mask_token_embedding)(\.weight)?$")


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not folder.is_dir():
        raise FileNotFoundError(f"No checkpoint folder at {folder}.")
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json: give a folder written by `save_pretrained`.")
    return json.loads(path.read_text(encoding="utf-8"))


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    found = sorted(folder.glob("*.safetensors"))
    if not found:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        raise FileNotFoundError(
            f"{folder} has no safetensors weights{f' (found {others[:3]})' if others else ''}. Convert them first, "
            "e.g. `AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder)`."
        )
    return found


def _load_tokenizer(folder: Path) -> PreTrainedTokenizerBase | None:
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def spare_mask_token_id(vocab_size: int, tokenizer: PreTrainedTokenizerBase | None) -> int | None:
    """The first vocabulary id the tokenizer never produces, or `None` if there is none.

    Args:
        vocab_size (`int`): rows of the model's embedding matrix (`config.vocab_size`).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): the model's tokenizer.

    Returns:
        `int` id `>= len(tokenizer)` (and above every id in the tokenizer's vocabulary), or `None` when the tokenizer
        fills the vocabulary (e.g. SmolLM2's 49152) or no tokenizer is given.
    """
    if tokenizer is None:
        return None
    used = len(tokenizer)
    vocab = tokenizer.get_vocab()
    if vocab:
        used = max(used, max(vocab.values()) + 1)
    return used if used < vocab_size else None


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str:
    if dtype is None or dtype == "auto":
        return "auto"
    from .targets import parse_dtype

    return parse_dtype(dtype)


def convert_autoregressive_checkpoint(
    folder: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
    block_size: int = 16,
    mask_token_id: int | None = None,
    reuse_spare_id: bool = True,
    dtype: torch.dtype | str | None = "auto",
    source_model: str | None = None,
    target_model: str | None = None,
    overwrite: bool = False,
) -> D3DForDiffusionDrafting:
    """Makes a D3D drafter from a local autoregressive checkpoint folder (Llama, Mistral or Qwen3 architecture).

    The folder is loaded with `AutoModelForCausalLM` and passed to `D3DForDiffusionDrafting.from_autoregressive`,
    which copies the chosen decoder layers, the final norm, the embeddings and the LM head. Untrained, the drafter's
    causal (next-token) logits equal the source's when all layers are kept; train it to draft blocks.

    Args:
        folder (`str` or `os.PathLike`): a checkpoint folder with `config.json` and safetensors weights (one file or
            shards with `model.safetensors.index.json`), optionally with tokenizer files.
        output (`str` or `os.PathLike`, *optional*): where to save the drafter (with the tokenizer and model card);
            nothing is saved when `None`.
        num_layers (`int`, *optional*): copy the first `num_layers` layers (default: all). Exclusive with `layer_ids`.
        layer_ids (`Sequence[int]`, *optional*): source layer indices to copy, in order.
        block_size (`int`, defaults to 16): draft block size `B`.
        mask_token_id (`int`, *optional*): a spare vocabulary id to use as the mask token. When `None` and
            `reuse_spare_id` is set, the first id the folder's tokenizer never produces is used if there is one
            (Qwen3: 151669 of 151936 rows); otherwise the drafter gets a separate learned mask embedding.
        reuse_spare_id (`bool`, defaults to `True`): whether to pick a spare id automatically (see above).
        dtype (`torch.dtype` or `str`, defaults to `"auto"`): weight dtype; `"auto"` keeps the checkpoint's.
        source_model (`str`, *optional*): name recorded as the drafter's source (default: `folder`); give the Hub
            id (e.g. `"Qwen/Qwen3-8B"`) so that the model card links it as `base_model`.
        target_model (`str`, *optional*): the target recorded in the config (default: `source_model`).
        overwrite (`bool`, defaults to `False`): allow writing into a non-empty `output` folder.

    Returns:
        `D3DForDiffusionDrafting` in eval mode, on CPU, in `dtype`.

    Raises:
        FileNotFoundError: if `folder` has no `config.json` or no safetensors weights.
        FileExistsError: if `output` is a non-empty folder and `overwrite` is `False`.
        ValueError: for an unsupported architecture (names the supported ones), a D3D folder, bad layer choices, or
            a `mask_token_id` outside the vocabulary.
    """
    from transformers import AutoModelForCausalLM

    from .modeling import D3DForDiffusionDrafting
    from .utils import ensure_writable_dir

    folder = Path(folder)
    raw = _read_config(folder)
    model_type = raw.get("model_type")
    if model_type == "d3d":
        raise ValueError(f"{folder} already holds a D3D drafter: load it with `d3d_hf.drafters.load_drafter`.")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{folder} holds a `{model_type}` model ({', '.join(raw.get('architectures') or [])}); D3D drafters are "
            "made from decoder layers of the Llama / Qwen3 family: supported model types "
            f"{list(SUPPORTED_MODEL_TYPES)}. For a published D3D checkpoint use `load_published_d3d_checkpoint` "
            "(`d3d-hf convert --published-d3d`)."
        )
    _safetensors_files(folder)
    if output is not None:
        output = ensure_writable_dir(output, overwrite)
    tokenizer = _load_tokenizer(folder)
    vocab_size = int(raw.get("vocab_size", 0))
    if mask_token_id is None and reuse_spare_id:
        mask_token_id = spare_mask_token_id(vocab_size, tokenizer)
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=_resolve_dtype(dtype))
    drafter = D3DForDiffusionDrafting.from_autoregressive(
        source,
        num_layers=num_layers,
        layer_ids=list(layer_ids) if layer_ids is not None else None,
        block_size=block_size,
        mask_token_id=mask_token_id,
        source_model=source_model or str(folder),
        target_model=target_model or source_model or str(folder),
    )
    del source
    if output is not None:
        drafter.save_pretrained(output, tokenizer=tokenizer)
    return drafter


def _find_prefix(keys: Sequence[str]) -> str:
    embeds = [k for k in keys if k.endswith("embed_tokens.weight")]
    if len(embeds) != 1:
        raise ValueError(
            f"Expected exactly one `*embed_tokens.weight` tensor to locate the decoder, found {embeds or 'none'}; "
            "this does not look like a Qwen3-style checkpoint."
        )
    return embeds[0][: -len("embed_tokens.weight")]


def load_published_d3d_checkpoint(
    folder: str | os.PathLike,
    *,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    dtype: torch.dtype | str | None = None,
    source_model: str | None = None,
    target_model: str | None = None,
    strict: bool = True,
) -> D3DForDiffusionDrafting:
    """Loads a folder in the layout of the published D3D drafters (D3D-1.7B-8B, D3D-8B-8B, D3D-8B-32B, ...).

    No published D3D file was available to check this against: the layout is **inferred** from what is known (the
    drafters are Qwen3-derived block-diffusion LMs of Qwen3-1.7B / Qwen3-8B shape, possibly with pruned layers). What
    this function assumes, and how each assumption degrades:

    - `config.json` is a Qwen3 config (`model_type` containing `"qwen3"`, or `"d3d"`; MoE is rejected), read with
      transformers' `Qwen3Config` (so legacy `rope_theta`/`rope_scaling` and `rope_parameters` both work). Layers
      are Qwen3 layers: grouped-query attention with per-head q/k RMSNorm (`use_qk_norm=True` when `q_norm` weights
      are present, which they are in every Qwen3 layer), SwiGLU MLP, RMSNorm, no biases unless `attention_bias`.
    - Weights are safetensors with Qwen3 parameter names under *some* prefix: the one tensor ending in
      `embed_tokens.weight` fixes the prefix (`model.`, `model.model.`, `drafter.model.`, ...); `lm_head.weight` may
      have any prefix, and is tied to the embeddings when absent.
    - Layer indices present in the file define the drafter's layers in order; if they are not `0..n-1` (a pruned
      drafter that kept the source indices), they are recorded as `source_layer_ids`. A config `num_hidden_layers`
      that disagrees with the file is overridden by the file (with a warning).
    - Block size: the argument, else the first of the config keys `block_size`, `block_length`,
      `diffusion_block_size`, `draft_block_size`, else 16 (with a warning).
    - Mask token: the argument, else config `mask_token_id` / `mask_id`, else a hidden-size tensor named like
      `mask_embedding` / `mask_token` (kept as the separate mask embedding), else the tokenizer's `mask_token`, else
      the first spare id above the tokenizer (warning: its row may not be the trained mask), else a fresh separate
      mask embedding (warning: untrained).
    - Any other tensor raises (with `strict=True`) rather than being dropped silently: a published checkpoint with an
      extra module (e.g. a projection of target features) is a different model that this loader does not cover.

    Args:
        folder (`str` or `os.PathLike`): the checkpoint folder (`config.json`, safetensors, optional tokenizer).
        block_size (`int`, *optional*): overrides the inferred block size.
        mask_token_id (`int`, *optional*): overrides the inferred mask token id.
        dtype (`torch.dtype` or `str`, *optional*): weight dtype (default: the dtype stored in the file).
        source_model (`str`, *optional*): recorded as `config.source_model` (default: config `source_model`, else
            `folder`).
        target_model (`str`, *optional*): recorded as `config.target_model` (default: config `target_model`).
        strict (`bool`, defaults to `True`): raise on tensors that have no place in the drafter (else warn and drop).

    Returns:
        `D3DForDiffusionDrafting` in eval mode on CPU.

    Raises:
        FileNotFoundError: if the folder, its `config.json` or its safetensors are missing.
        ValueError: if the config is not Qwen3-like, the weight names do not follow the Qwen3 layout, shapes
            disagree with the config, or (with `strict`) tensors are left over. The message lists examples.
    """
    from .modeling import D3DForDiffusionDrafting

    folder = Path(folder)
    raw, qcfg = _published_config(folder)
    state = _read_safetensors(folder)
    prefix = _find_prefix(list(state))
    mapped, layers, tie, mask_vector, mask_key = _take_published_tensors(state, prefix, qcfg.hidden_size, folder)
    if mask_token_id is None:
        mask_token_id = next((int(raw[k]) for k in _MASK_ID_KEYS if raw.get(k) is not None), None)
    if mask_token_id is not None and mask_vector is not None:  # an explicit / recorded mask id wins
        state[mask_key] = mask_vector
        mask_vector = None
    _check_leftover_tensors(state, folder, strict)
    if not layers:
        raise ValueError(f"No decoder layers `{prefix}layers.N.*` in {folder}.")

    found_ids, source_layer_ids, use_qk_norm = _renumber_layers(layers, mapped, raw, qcfg.num_hidden_layers)
    if block_size is None:
        block_size = next((int(raw[k]) for k in _BLOCK_SIZE_KEYS if raw.get(k) is not None), None)
        if block_size is None:
            block_size = 16
            warnings.warn("No block size in config.json; using 16 (pass `block_size=` to override).", stacklevel=2)
    tokenizer = _load_tokenizer(folder)
    if mask_token_id is None and mask_vector is None:
        mask_token_id = _fallback_mask_token_id(tokenizer, qcfg.vocab_size)

    config = _published_d3d_config(
        qcfg,
        raw,
        num_hidden_layers=len(found_ids),
        use_qk_norm=use_qk_norm,
        tie_word_embeddings=tie or bool(raw.get("tie_word_embeddings", False)),
        block_size=block_size,
        mask_token_id=mask_token_id,
        source_model=source_model or raw.get("source_model") or str(folder),
        source_layer_ids=source_layer_ids,
        target_model=target_model or raw.get("target_model"),
    )
    ref = mapped["model.embed_tokens.weight"]
    drafter = D3DForDiffusionDrafting(config).to(dtype=ref.dtype)
    _load_mapped_weights(drafter, mapped, mask_vector, folder)
    if dtype is not None and dtype != "auto":
        from .targets import parse_dtype

        drafter = drafter.to(parse_dtype(dtype))
    return drafter.eval()


def _published_config(folder: Path):
    """`(config.json as a dict, its transformers Qwen3Config)` of a published D3D checkpoint folder.

    Raises:
        ValueError: if the folder is already a d3d-hf drafter, or its config is not a dense Qwen3-style one (or uses
            sliding-window attention).
    """
    from transformers import Qwen3Config

    raw = _read_config(folder)
    model_type = str(raw.get("model_type", ""))
    if model_type == "d3d" and "use_qk_norm" in raw:
        raise ValueError(f"{folder} is already a d3d-hf drafter folder: load it with `d3d_hf.drafters.load_drafter`.")
    if ("qwen3" not in model_type.lower() and "d3d" not in model_type.lower()) or "moe" in model_type.lower():
        raise ValueError(
            f"{folder} has model_type `{model_type}`; the published D3D drafters are Qwen3-derived (dense), so a "
            "`qwen3`-like config is expected. For a Llama / Qwen3 autoregressive checkpoint use "
            "`convert_autoregressive_checkpoint` (`d3d-hf convert` without --published-d3d)."
        )
    # layer_types only serves sliding-window attention, which D3D layers do not use (and pruning changes the count)
    skip = ("model_type", "architectures", "auto_map", "transformers_version", "layer_types")
    try:
        qcfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in skip})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{folder}/config.json is not a valid Qwen3-style config: {err}") from err
    if getattr(qcfg, "use_sliding_window", False):
        raise ValueError(f"{folder} uses sliding-window attention, which D3D drafters do not implement.")
    return raw, qcfg


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, by name."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    return state


def _take_published_tensors(state: dict[str, torch.Tensor], prefix: str, hidden: int, folder: Path):
    """Takes out of `state` the tensors a D3D drafter has a place for: returns `(mapped, layers, tie, mask_vector,
    mask_key)`, the embeddings, final norm and LM head under the drafter's names (`mapped`), the decoder layers'
    tensors by file layer index (`layers`), whether the LM head is absent (tied), and the mask-embedding-like tensor
    with its name (`None` when there is none). What is left in `state` has no place in the drafter.

    Raises:
        ValueError: if the final norm is missing, there are several LM heads or mask tensors, or the mask tensor's
            shape is not `(hidden,)`.
    """
    layer_re = re.compile(rf"^{re.escape(prefix)}layers\.(\d+)\.(.+)$")
    layers: dict[int, dict[str, torch.Tensor]] = {}
    mapped: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": state.pop(prefix + "embed_tokens.weight"),
    }
    norm_key = prefix + "norm.weight"
    if norm_key not in state:
        raise ValueError(f"No final norm `{norm_key}` in {folder}; this does not look like a Qwen3-style checkpoint.")
    mapped["model.norm.weight"] = state.pop(norm_key)
    lm_heads = [k for k in state if k.endswith("lm_head.weight")]
    if len(lm_heads) > 1:
        raise ValueError(f"Several LM heads in {folder}: {lm_heads}.")
    tie = not lm_heads
    if lm_heads:
        mapped["lm_head.weight"] = state.pop(lm_heads[0])
    mask_vector, mask_key = None, None
    for key in list(state):
        match = layer_re.match(key)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = state.pop(key)
        elif _MASK_TENSOR.search(key):
            if state[key].numel() != hidden:
                raise ValueError(
                    f"Mask tensor `{key}` of {folder} has shape {tuple(state[key].shape)}, expected ({hidden},) "
                    "(hidden_size of config.json): shape mismatches between weights and config."
                )
            if mask_vector is not None:
                raise ValueError(f"Several mask-embedding-like tensors in {folder}: {key} and an earlier one.")
            mask_vector = state.pop(key).reshape(hidden)
            mask_key = key
    return mapped, layers, tie, mask_vector, mask_key


def _check_leftover_tensors(state: dict[str, torch.Tensor], folder: Path, strict: bool) -> None:
    """Refuses (`strict`) or warns about the tensors left in `state` (rotary inverse frequencies aside).

    Raises:
        ValueError: with `strict`, if any is left.
    """
    leftover = sorted(k for k in state if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        message = (
            f"{len(leftover)} tensor(s) of {folder} have no place in a D3D drafter, e.g. {leftover[:5]}: this "
            "checkpoint has modules beyond Qwen3 layers + mask embedding."
        )
        if strict:
            raise ValueError(message + " Pass strict=False to drop them (only if you know they are unused).")
        warnings.warn(message + " Dropped.", stacklevel=3)  # at the caller of load_published_d3d_checkpoint


def _renumber_layers(
    layers: dict[int, dict[str, torch.Tensor]], mapped: dict[str, torch.Tensor], raw: dict[str, Any], config_layers: int
):
    """Adds the layers' tensors to `mapped` as layers `0..n-1` in file order; returns `(found_ids, source_layer_ids,
    use_qk_norm)`: the file's layer indices, the source layer ids to record (the file's indices when they are not
    `0..n-1`, else config.json's), and whether the layers have q/k norms. Warns when config.json counts otherwise."""
    found_ids = sorted(layers)
    if len(found_ids) != config_layers:
        warnings.warn(
            f"config.json says {config_layers} layers but the weights hold {len(found_ids)} "
            f"(indices {found_ids}); using the weights.",
            stacklevel=3,  # at the caller of load_published_d3d_checkpoint
        )
    source_layer_ids = raw.get("source_layer_ids")
    if found_ids != list(range(len(found_ids))):
        source_layer_ids = found_ids
    for new_idx, old_idx in enumerate(found_ids):
        for name, tensor in layers[old_idx].items():
            mapped[f"model.layers.{new_idx}.{name}"] = tensor
    use_qk_norm = "self_attn.q_norm.weight" in layers[found_ids[0]]
    return found_ids, source_layer_ids, use_qk_norm


def _fallback_mask_token_id(tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> int | None:
    """The mask token of a checkpoint that records none: the tokenizer's `mask_token`, else the first spare id
    (warning: its row may not be the trained mask), else `None`, a fresh separate mask embedding (warning)."""
    mask_token_id = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if mask_token_id is None:
        mask_token_id = spare_mask_token_id(vocab_size, tokenizer)
        warnings.warn(
            "No mask token recorded in the checkpoint: "
            + (
                f"using the first spare id {mask_token_id}; its row may not be the trained mask embedding."
                if mask_token_id is not None
                else "using a fresh, untrained separate mask embedding."
            ),
            stacklevel=3,  # at the caller of load_published_d3d_checkpoint
        )
    return mask_token_id


def _published_d3d_config(
    qcfg,
    raw: dict[str, Any],
    *,
    num_hidden_layers: int,
    use_qk_norm: bool,
    tie_word_embeddings: bool,
    block_size: int,
    mask_token_id: int | None,
    source_model: str,
    source_layer_ids: list[int] | None,
    target_model: str | None,
):
    """The `D3DConfig` of a published checkpoint: the shapes, norms and RoPE of its Qwen3 config, the special token
    ids of its config.json, and the rest as given."""
    from .modeling import D3DConfig

    hidden = qcfg.hidden_size
    rope_parameters = dict(getattr(qcfg, "rope_parameters", None) or {})
    rope_parameters.setdefault("rope_type", "default")
    rope_parameters.setdefault("rope_theta", float(getattr(qcfg, "rope_theta", 10000.0) or 10000.0))
    return D3DConfig(
        vocab_size=qcfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=qcfg.intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=qcfg.num_attention_heads,
        num_key_value_heads=qcfg.num_key_value_heads,
        head_dim=getattr(qcfg, "head_dim", None) or hidden // qcfg.num_attention_heads,
        hidden_act=qcfg.hidden_act,
        max_position_embeddings=qcfg.max_position_embeddings,
        rms_norm_eps=qcfg.rms_norm_eps,
        rope_parameters=rope_parameters,
        attention_bias=bool(getattr(qcfg, "attention_bias", False)),
        use_qk_norm=use_qk_norm,
        tie_word_embeddings=tie_word_embeddings,
        block_size=block_size,
        mask_token_id=mask_token_id,
        source_model=source_model,
        source_layer_ids=source_layer_ids,
        target_model=target_model,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )


def _load_mapped_weights(
    drafter: D3DForDiffusionDrafting, mapped: dict[str, torch.Tensor], mask_vector: torch.Tensor | None, folder: Path
) -> None:
    """Loads `mapped` into the new `drafter`: a separate mask embedding gets the checkpoint's mask vector, else the
    mean input embedding (a neutral start); a tied LM head the embeddings.

    Raises:
        ValueError: if the tensors do not map onto the drafter (missing, unexpected, or of other shapes).
    """
    config = drafter.config
    ref = mapped["model.embed_tokens.weight"]
    expected = dict(drafter.state_dict())
    mask_keys = [k for k in expected if "mask_embedding" in k]
    if mask_keys:  # a separate mask embedding: the checkpoint's, else the mean input embedding (neutral start)
        vector = mask_vector if mask_vector is not None else ref.float().mean(dim=0).to(ref.dtype)
        mapped[mask_keys[0]] = vector.reshape(expected[mask_keys[0]].shape)
    if config.tie_word_embeddings:
        mapped.setdefault("lm_head.weight", ref)
    missing = sorted(k for k in expected if k not in mapped)
    unexpected = sorted(k for k in mapped if k not in expected)
    bad_shapes = [
        f"{k}: file {tuple(v.shape)}, config {tuple(expected[k].shape)}"
        for k, v in mapped.items()
        if k in expected and v.shape != expected[k].shape
    ]
    if missing or unexpected or bad_shapes:
        shape = _shape_name(config)
        raise ValueError(
            f"{folder} does not map onto a Qwen3-style D3D drafter ({shape}): missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, shape mismatches {bad_shapes[:3]}."
        )
    drafter.load_state_dict(mapped, strict=False)
    if config.tie_word_embeddings:
        drafter.tie_weights()


def causal_lm_config(config):
    """The transformers config of the causal LM that computes a D3D drafter's committed-context (causal) path:
    `Qwen3Config` when the drafter has q/k norms, else `LlamaConfig` (Llama and Mistral layers are the same).

    Raises:
        ValueError: for a Qwen3-style drafter with MLP biases (Qwen3 has none).
    """
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters),
        attention_bias=config.attention_bias,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    if config.use_qk_norm:
        if config.mlp_bias:
            raise ValueError("A Qwen3-style drafter (q/k norms) with MLP biases has no transformers causal-LM class.")
        return Qwen3Config(**common)
    return LlamaConfig(mlp_bias=config.mlp_bias, **common)


def export_causal_lm(
    drafter: D3DForDiffusionDrafting,
    output_dir: str | os.PathLike | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    target=None,
):
    """Turns a drafter's committed-context path into a plain causal LM (and saves it when `output_dir` is given).

    The drafter's causal path (embeddings, decoder layers, final norm, LM head) has exactly the key names and
    computation of a Llama/Qwen3 causal LM, so the weights are copied as they are; the mask embedding and the block
    adapters are dropped, since neither acts on committed tokens. The result computes the same next-token logits as
    `drafter(input_ids)` with causal attention: an autoregressive drafter trained by `D3DTrainer` with
    `block_loss_weight=0` becomes an assistant for transformers' assisted generation (`ar-assist`).

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter.
        output_dir (`str` or `os.PathLike`, *optional*): folder to `save_pretrained` into (with `tokenizer`).
        tokenizer (`PreTrainedTokenizerBase`, *optional*): saved next to the model.
        target (`PreTrainedModel`, *optional*): attached first when the drafter shares its target's weights.

    Returns:
        `LlamaForCausalLM` or `Qwen3ForCausalLM` in the drafter's dtype, on CPU, in eval mode.

    Raises:
        ValueError: if the drafter shares its target's weights, they are not attached and no `target` is given; for
            a drafter over the target's cache (`shares_target_cache`), which has no causal path.
    """
    from transformers import AutoModelForCausalLM

    if getattr(drafter.config, "shares_target_cache", False):
        raise ValueError(
            "This drafter attends to the target's cache (`shares_target_cache=True`): its layers never ran over the "
            "committed context on their own, so they make no causal LM. Export a drafter trained with an "
            "autoregressive path (`ar_loss_weight > 0`) instead."
        )
    if drafter.config.shares_target_weights and drafter._attached_target is None:
        if target is None:
            raise ValueError("This drafter shares its target's weights: pass `target=` to attach them first.")
        drafter.attach_target_weights(target)
    config = causal_lm_config(drafter.config)
    dtype = drafter.model.embed_tokens.weight.dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {
        k: v.detach().cpu()
        for k, v in drafter.state_dict().items()
        # an attached target is registered as a submodule of the drafter: its own keys are not the drafter's
        if not drafter.is_drafter_specific(k) and not k.startswith("_attached_target.")
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:  # pragma: no cover - the layouts are the same by construction
        raise ValueError(f"Layout mismatch exporting the drafter: missing {missing[:6]}, unexpected {unexpected[:6]}.")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    if output_dir is not None:
        model.save_pretrained(output_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
    return model


def _shape_name(config) -> str:
    for name, shape in QWEN3_REFERENCE_SHAPES.items():
        if all(getattr(config, k) == v for k, v in shape.items() if k != "num_hidden_layers"):
            return f"{name}-shaped, {config.num_hidden_layers} layers"
    return f"hidden size {config.hidden_size}, {config.num_hidden_layers} layers"


__all__ = [
    "QWEN3_REFERENCE_SHAPES",
    "SUPPORTED_MODEL_TYPES",
    "causal_lm_config",
    "convert_autoregressive_checkpoint",
    "export_causal_lm",
    "load_published_d3d_checkpoint",
    "spare_mask_token_id",
]
