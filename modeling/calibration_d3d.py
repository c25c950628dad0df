"""Calibration of the cost-aware drafting policy (`policy_d3d.py`): the machine it runs on (`cpu_model`), a key per
machine, model pair, dtype and threads (`calibration_key`), the store that keeps the learned state in memory and as
JSON files under the user's cache folder (`CalibrationStore`), and the short measurement of both cost curves for a
target and a D3D drafter (`measure_cost_curves`; d3d-hf docs/DESIGN.md section 9).

Part of the self-contained remote-code bundle: imports only the Python standard library, torch, the public
transformers API and the sibling `policy_d3d` (and, inside `measure_cost_curves` only, `drafting_d3d`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .estimates_d3d import CostCurve, _is_int
from .policy_d3d import DraftPolicy

logger = logging.getLogger(__name__)

#: Version of the JSON files `CalibrationStore` writes; a file of another version is ignored (and replaced).
CALIBRATION_FORMAT_VERSION = 2  # 2: per-position lookup acceptance (LookupAcceptance)

#: Environment variable that overrides the cache folder of `CalibrationStore`.
CACHE_ENV = "D3D_HF_CACHE"

#: CPU flags that change forward speed (recorded by `cpu_model` and in calibration keys).
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@functools.lru_cache(maxsize=1)
def _cpu_model_cached() -> tuple[str, frozenset[str]]:
    name, flags = "", frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                field, _, value = line.partition(":")
                field = field.strip()
                if field == "model name" and not name:
                    name = value.strip()
                elif field in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "unknown", flags


def cpu_model() -> dict[str, Any]:
    """The CPU's model name and the instruction-set flags that change forward speed.

    Reads `/proc/cpuinfo` on Linux (first `model name` and `flags` lines), else `platform.processor()`; flags it
    cannot read are reported absent. Cached for the process.

    Returns:
        `dict`: `{"model": str, "avx2": bool, "avx512f": bool, "avx512_bf16": bool, "amx_bf16": bool,
        "amx_tile": bool}`.
    """
    name, flags = _cpu_model_cached()
    return {"model": name, **{flag: flag in flags for flag in SPEED_FLAGS}}


def _cpu_string() -> str:
    info = cpu_model()
    present = [flag for flag in SPEED_FLAGS if info[flag]]
    return f"{info['model']} [{' '.join(present)}]"


def config_fingerprint(config: Any) -> str:
    """A short stable hash of a model config (a transformers `PretrainedConfig` or a dict).

    Fields that do not change the computation are left out: names and paths (`_name_or_path`, `name_or_path`),
    `transformers_version`, `_commit_hash`, `architectures`, and `dtype`/`torch_dtype` (the dtype is its own part of
    `calibration_key`).

    Returns:
        `str`: 16 hex digits.
    """
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    ignored = {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        "architectures",
        "dtype",
        "torch_dtype",
    }
    data = {k: v for k, v in data.items() if k not in ignored}
    blob = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def calibration_key(
    *,
    target: str,
    target_config: str = "",
    drafter: str = "",
    drafter_config: str = "",
    dtype: Any = "float32",
    threads: int | None = None,
    device: Any = "cpu",
    cpu: str | None = None,
    torch_version: str | None = None,
    **extra: Any,
) -> str:
    """A stable key for one calibration: the same models, numerics and machine give the same key.

    Args:
        target (`str`): the target's name (e.g. its hub id or `name_or_path`).
        target_config (`str`): a fingerprint of its config (`config_fingerprint`).
        drafter (`str`): the drafter's name ("" without a drafter).
        drafter_config (`str`): a fingerprint of its config (block size, layers, adapters, ...).
        dtype (`str` or `torch.dtype`, defaults to `"float32"`): the compute dtype.
        threads (`int`, *optional*): torch's intra-op threads; defaults to `torch.get_num_threads()`.
        device (`str` or `torch.device`, defaults to `"cpu"`): the device the models run on (e.g. `"cuda:0"`).
        cpu (`str`, *optional*): the CPU model and speed flags; defaults to `cpu_model()`'s.
        torch_version (`str`, *optional*): defaults to `torch.__version__`.
        **extra: further parts (JSON-serialisable or `str()`-able), e.g. a kernel setting.

    Returns:
        `str`: 24 hex digits (a SHA-256 prefix of the parts as sorted JSON), safe as a file name.
    """
    parts = {
        "target": target,
        "target_config": target_config,
        "drafter": drafter,
        "drafter_config": drafter_config,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": torch.get_num_threads() if threads is None else int(threads),
        "device": str(device),
        "cpu": _cpu_string() if cpu is None else cpu,
        "torch": torch.__version__ if torch_version is None else torch_version,
        **extra,
    }
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def default_cache_dir() -> str:
    """`$D3D_HF_CACHE/cost_curves` if set, else `$XDG_CACHE_HOME/d3d_hf/cost_curves` or
    `~/.cache/d3d_hf/cost_curves` (resolved on each call)."""
    base = os.environ.get(CACHE_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "d3d_hf")
    return os.path.join(base, "cost_curves")


#: In-memory states, `(folder, key) -> JSON text` (shared by every `CalibrationStore` of the process).
_MEMORY: dict[tuple[str, str], str] = {}


#: Folders whose failed write was already warned about in this process.
_WARNED_FOLDERS: set[str] = set()


class CalibrationStore:
    """Learned policy states (cost curves, calibrator, lookup estimate) by `calibration_key`, in memory and on disk.

    Each key is one JSON file `<folder>/<key>.json`:
    `{"format_version": CALIBRATION_FORMAT_VERSION, "key": ..., "parts": {...}, "saved_at": <unix seconds>, "state":
    {...}}`, written
    atomically (a temporary file in the same folder, then `os.replace`). Loading prefers the in-memory copy (a
    module-level dict keyed by folder and key), then the file. A file that cannot be read or parsed, or that has
    another `format_version` or key, is ignored (and replaced by the next `save`): never an error. A failed write
    warns through `logging` (once per folder and process; later failures are logged at INFO) and returns `None`:
    calibration is an optimisation, never a reason to stop decoding.

    Args:
        folder (`str`, *optional*): defaults to `default_cache_dir()` (resolved when the store is created).
    """

    def __init__(self, folder: str | None = None) -> None:
        self.folder = os.path.abspath(folder or default_cache_dir())

    def path(self, key: str) -> str:
        """The file of `key`.

        Raises:
            ValueError: if `key` is not a plain file-name-safe string.
        """
        if not key or not all(ch.isalnum() or ch in "-_" for ch in key):
            raise ValueError(
                f"A calibration key must be letters, digits, '-' or '_' (see calibration_key), got {key!r}."
            )
        return os.path.join(self.folder, f"{key}.json")

    def load(self, key: str) -> dict[str, Any] | None:
        """The state saved under `key` (a fresh copy), or `None` if there is none usable."""
        path = self.path(key)
        text = _MEMORY.get((self.folder, key))
        if text is not None:
            return json.loads(text)
        try:
            with open(path, encoding="utf-8") as f:
                record = json.load(f)
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if (
            not isinstance(record, dict)
            or record.get("format_version") != CALIBRATION_FORMAT_VERSION
            or record.get("key") != key
            or not isinstance(record.get("state"), dict)
        ):
            logger.info("Ignoring %s: not a calibration file of format version %d.", path, CALIBRATION_FORMAT_VERSION)
            return None
        _MEMORY[(self.folder, key)] = json.dumps(record["state"])
        return record["state"]

    def save(self, key: str, state: Mapping[str, Any], parts: Mapping[str, Any] | None = None) -> str | None:
        """Keeps `state` in memory and writes it to disk atomically.

        Args:
            key (`str`): from `calibration_key`.
            state (`Mapping`): JSON-serialisable (e.g. `DraftPolicy.state_dict()`).
            parts (`Mapping`, *optional*): the key's parts, stored for people reading the file.

        Returns:
            `str`: the file written, or `None` if writing failed (the state is still kept in memory).

        Raises:
            ValueError: for a bad key, or a state that is not JSON-serialisable.
        """
        path = self.path(key)
        try:
            text = json.dumps(dict(state))
        except TypeError as err:
            raise ValueError(f"The calibration state is not JSON-serialisable: {err}") from None
        _MEMORY[(self.folder, key)] = text
        record = {
            "format_version": CALIBRATION_FORMAT_VERSION,
            "key": key,
            "parts": {k: str(v) for k, v in (parts or {}).items()},
            "saved_at": time.time(),
            "state": json.loads(text),
        }
        tmp = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.folder)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, path)
        except OSError as err:
            log = logger.info if self.folder in _WARNED_FOLDERS else logger.warning
            _WARNED_FOLDERS.add(self.folder)
            log("Could not save the calibration to %s: %s (decoding goes on; it is kept in memory)", path, err)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return None
        return path

    def forget(self, key: str | None = None) -> None:
        """Drops the in-memory copy of `key` (every key of this folder when `None`); files are kept."""
        for mem_key in list(_MEMORY):
            if mem_key[0] == self.folder and (key is None or mem_key[1] == key):
                del _MEMORY[mem_key]


# --------------------------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------------------------


def _median_seconds(fn, reset, repeats: int, sync, layout_mark=None) -> float:
    """The median time of `repeats` calls of `fn` after a warm-up call, and after more warm-up calls (at most 16)
    while a call times alternative matmul layouts (optional `layout_mark`: `fast_paths_d3d.layout_mark`)."""
    for _ in range(17):
        mark = layout_mark() if layout_mark is not None else None
        fn()  # warm-up
        reset()
        if mark is None or not mark.timed():
            break
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
        reset()
    return statistics.median(times)


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def measure_cost_curves(
    target,
    drafter,
    rows: Iterable[int] = (1, 2, 4, 8, 16),
    context_length: int = 128,
    repeats: int = 3,
    device: torch.device | str | None = None,
    *,
    seed: int = 0,
    monotone: bool = True,
) -> tuple[CostCurve, CostCurve]:
    r"""
    A short calibration of `t_verify` and `t_draft` on the machine at hand (seconds by new rows).

    Builds a random context of `context_length` token ids (timing does not depend on their values), then:

    - target: prefills a `transformers.DynamicCache` with the context once, and times forwards of `q` new rows
      (`target(input_ids, cache=cache, use_cache=True)`, as a verification of `q - 1` drafts; transformers 5.24
      deprecates the older name `past_key_values`), cropping the cache back to the context after each (transformers
      5.24 crops by a negative count of tokens to remove: `cache.crop(context_length)` raises);
    - drafter: prefills a `D3DCache` with the context, and times draft passes of `q` rows, 1 committed token plus
      `q - 1` masks (`drafter.draft_logits(committed_ids, cache, num_masks=q - 1)`), cropping back after each.

    Each time is the median of `repeats` after one warm-up call (more until one runs on chosen matmul layouts only:
    `fast_paths_d3d.layout_mark`, which counts the target's too under `d3d_target_matmul_layouts`), under
    `torch.no_grad()` with both models in eval mode (their previous modes are restored), the drafter on its fast
    paths (`patches_d3d.apply_fast_paths`; the target's are the caller's, e.g. the `generate` call's). On CUDA the
    device is synchronised around each call. A drafter that shares its target's weights gets them attached first.
    Rows above the drafter's block size time a longer block.

    Args:
        target (`PreTrainedModel`): the causal LM to verify with.
        drafter (`D3DForDiffusionDrafting`): the D3D drafter.
        rows (`Iterable[int]`, defaults to `(1, 2, 4, 8, 16)`): the `q` to time, each >= 1.
        context_length (`int`, defaults to 128): cached tokens before each timed forward, >= 1.
        repeats (`int`, defaults to 3): timed calls per point, >= 1.
        device (`torch.device` or `str`, *optional*): where the token ids are created; defaults to each model's
            own device.
        seed (`int`, defaults to 0): seed of the random context.
        monotone (`bool`, defaults to `True`): return `CostCurve.monotone()` of the measurements (more rows never
            cheaper), which removes timing noise of a few repeats at the price of hiding a real dip (a faster
            kernel path for some row counts, docs/DESIGN.md section 9); `False` returns the raw medians.

    Returns:
        `tuple[CostCurve, CostCurve]`: `(verify_curve, draft_curve)`.

    Raises:
        ValueError: for empty or bad `rows`, `context_length < 1` or `repeats < 1`.
    """
    from transformers import DynamicCache

    from .drafting_d3d import D3DCache, timing_state  # deferred: no sibling import at module import time
    from .fast_paths_d3d import layout_mark
    from .patches_d3d import apply_fast_paths

    rows = sorted({CostCurve._check_rows(q) for q in rows})
    if not rows:
        raise ValueError("`rows` must name at least one row count.")
    if not _is_int(context_length) or context_length < 1:
        raise ValueError(f"`context_length` must be an int >= 1, got {context_length!r}.")
    if not _is_int(repeats) or repeats < 1:
        raise ValueError(f"`repeats` must be an int >= 1, got {repeats!r}.")
    if getattr(drafter.config, "shares_target_weights", False) and getattr(drafter, "_attached_target", None) is None:
        drafter.attach_target_weights(target)
    target_device = torch.device(device) if device is not None else _device_of(target)
    drafter_device = torch.device(device) if device is not None else _device_of(drafter)
    cuda = [d for d in (target_device, drafter_device) if d.type == "cuda"]

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    generator = torch.Generator().manual_seed(seed)
    vocab = min(target.config.get_text_config().vocab_size, drafter.config.vocab_size)

    def random_ids(length: int) -> torch.LongTensor:
        return torch.randint(0, vocab, (1, length), generator=generator)

    context = random_ids(context_length)
    modes = (target.training, drafter.training)
    target.eval()
    drafter.eval()
    verify, draft = {}, {}
    d3d_drafter = hasattr(getattr(drafter, "model", None), "fast_path_settings")
    fast_paths = apply_fast_paths(drafter) if d3d_drafter else contextlib.nullcontext()
    try:
        with torch.no_grad(), fast_paths:
            cache = DynamicCache(config=target.config)
            target(input_ids=context.to(target_device), cache=cache, use_cache=True)

            def crop_target() -> None:
                extra = cache.get_seq_length() - context_length
                if extra > 0:
                    cache.crop(-extra)

            # time draft passes once their matmul layouts are chosen (`D3DModel.autotune_matmuls`)
            layouts = layout_mark if d3d_drafter else None
            drafter_cache = D3DCache()
            state = timing_state(drafter)  # a zero target state for a drafter that reads one: it costs the same
            drafter.draft_logits(context.to(drafter_device), drafter_cache, num_masks=0, **state)
            for q in rows:
                ids = random_ids(q).to(target_device)
                verify[q] = _median_seconds(
                    lambda ids=ids: target(input_ids=ids, cache=cache, use_cache=True),
                    crop_target,
                    repeats,
                    sync,
                    layouts,  # the target's forwards too, under `d3d_target_matmul_layouts`
                )
                committed = random_ids(1).to(drafter_device)
                draft[q] = _median_seconds(
                    lambda committed=committed, q=q: drafter.draft_logits(
                        committed, drafter_cache, num_masks=q - 1, **state
                    ),
                    lambda: drafter_cache.crop(context_length),
                    repeats,
                    sync,
                    layouts,
                )
    finally:
        target.train(modes[0])
        drafter.train(modes[1])
    verify_curve, draft_curve = CostCurve(verify), CostCurve(draft)
    if monotone:
        verify_curve, draft_curve = verify_curve.monotone(), draft_curve.monotone()
    return verify_curve, draft_curve


_POLICIES: dict[str, DraftPolicy] = {}


def _weights_fingerprint(model) -> str:
    """A cheap fingerprint of a model's weights (the first values of a few tensors), so that two models with one
    config but different weights (a fine-tuned copy, random test models) keep separate acceptance calibrations."""
    digest = hashlib.sha256()
    for index, (name, tensor) in enumerate(model.state_dict().items()):
        if index % 8 == 0 or "lora" in name or "mask_embedding" in name:
            digest.update(name.encode())
            digest.update(tensor.detach().flatten()[:16].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


#: a curve point over 16 rows that costs more than this many one-row target steps is taken for a measurement disturbed
#: by other jobs (the dearest real case seen, bf16 without native support, is 7.3 steps at 16 rows; DESIGN.md s.9)
_MAX_PLAUSIBLE_STEPS = 12.0


def _plausible(verify_curve: CostCurve | None, draft_curve: CostCurve | None) -> bool:
    """Whether both curves look like an undisturbed measurement (every point up to 16 rows within
    `_MAX_PLAUSIBLE_STEPS` one-row target steps)."""
    if verify_curve is None or draft_curve is None:
        return False
    step = verify_curve(1)
    return all(
        seconds <= _MAX_PLAUSIBLE_STEPS * step
        for curve in (verify_curve, draft_curve)
        for q, seconds in curve.points.items()
        if q <= 16
    )


#: a stored calibration whose one-row target forward is off by more than this fraction (either way) when it is first
#: used in a process is measured again (`policy_for`)
DRIFT_MARGIN = 0.3


def _drifted(verify_curve: CostCurve, target, drafter, margin: float) -> bool:
    """Whether a few one-row target forwards now (median of 3 after a warm-up, on the calibration's 128-token
    context) differ from the stored curve's one-row time by more than `margin` (a fraction) either way."""
    now, _ = measure_cost_curves(target, drafter, rows=(1,), repeats=3, monotone=False)
    stored, measured = verify_curve(1), now(1)
    ratio = measured / stored if stored > 0 else float("inf")
    drifted = not (1 / (1 + margin) <= ratio <= 1 + margin)
    if drifted:
        logger.info(
            "Stored cost curves are stale (one-row target forward %.1f ms now, %.1f ms stored): measuring again.",
            1e3 * measured,
            1e3 * stored,
        )
    return drifted


def policy_for(
    target,
    drafter,
    store: CalibrationStore | None = None,
    target_matmul_layouts: bool = False,
    drift_margin: float | None = DRIFT_MARGIN,
) -> tuple[DraftPolicy, str]:
    """The adaptive `DraftPolicy` of a (target, drafter) pair on this machine, dtype, threads and device.

    `target_matmul_layouts`: whether the target's forwards run on `MatmulLayouts` (`d3d_target_matmul_layouts`; the
    caller routes the target through `d3d_hf.experiments` around this call and the decoding): another verification cost
    curve, so another key.

    One policy per `calibration_key` lives in memory for the process, so what it learns in one `generate` call
    carries over to the next; it starts from the state stored on disk under that key (`CalibrationStore`) and,
    the first time the pair is used here, from a short `measure_cost_curves` calibration (about 20 forwards of each
    model), which is stored at once. The caller saves the learned state with `policy.save_to(store, key)`.

    Drift: a stored calibration is checked at its first use in a process by a few one-row target forwards
    (`_drifted`); where they differ from the stored one-row time by more than `drift_margin` (default `DRIFT_MARGIN`
    = 0.3, either way; `None`: no check), the curves are measured again and replace the stored ones (a calibration
    taken on a loaded machine, or a machine that changed speed since, would otherwise be kept until rounds slowly
    correct it).

    Returns:
        `(policy, key)`.
    """
    dtype = next(target.parameters()).dtype
    device = next(target.parameters()).device
    parts = {
        "target": str(getattr(target, "name_or_path", "") or type(target).__name__),
        "target_config": config_fingerprint(target.config),
        "drafter": str(getattr(drafter, "name_or_path", "") or type(drafter).__name__),
        "drafter_config": config_fingerprint(drafter.config),
        "dtype": dtype,
        "device": device,
        "weights": _weights_fingerprint(drafter),
        # the draft pass's weight layout (`D3DModel.fused_projections`) and matmul layouts change what it costs
        "fused_projections": str(getattr(getattr(drafter, "model", None), "fused_projections", None)),
        "autotune_matmuls": str(getattr(getattr(drafter, "model", None), "autotune_matmuls", None)),
        "target_matmul_layouts": str(bool(target_matmul_layouts)),
        # the target's attention function while calibrating (`patches_d3d.switch_attention` switches it)
        "target_attention": str(getattr(target.config, "_attn_implementation", None)),
    }
    key = calibration_key(**parts)
    policy = _POLICIES.get(key)
    if policy is None:
        store = store or CalibrationStore()
        max_drafts = int(drafter.config.block_size) - 1
        policy = DraftPolicy(CostCurve({1: 1.0}), CostCurve({1: 1.0}), max_drafts=max_drafts)  # curves restored below
        restored = policy.restore_from(store, key) and _plausible(policy.verify_curve, policy.draft_curve)
        if restored and drift_margin is not None and _drifted(policy.verify_curve, target, drafter, drift_margin):
            restored = False  # the machine is not what it was when the curves were stored: measure them again
        if not restored:
            for _ in range(3):  # a measurement taken while other jobs load the CPU is redone (and never stored)
                verify_curve, draft_curve = measure_cost_curves(target, drafter, monotone=False)
                if _plausible(verify_curve, draft_curve):
                    break
            policy = DraftPolicy(verify_curve, draft_curve, max_drafts=max_drafts)
            if _plausible(verify_curve, draft_curve):
                policy.save_to(store, key, {k: str(v) for k, v in parts.items()})
        _POLICIES[key] = policy
    return policy, key


__all__ = [
    "CACHE_ENV",
    "CALIBRATION_FORMAT_VERSION",
    "DRIFT_MARGIN",
    "SPEED_FLAGS",
    "CalibrationStore",
    "calibration_key",
    "config_fingerprint",
    "cpu_model",
    "default_cache_dir",
    "measure_cost_curves",
    "policy_for",
]
