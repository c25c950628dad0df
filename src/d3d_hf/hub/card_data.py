"""The data a drafter's model card is rendered from: `DrafterCardData` (attached as `drafter.card_data`, saved as
`d3d_card_data.json`), `MeasuredResult` (one row of its results table) and `result_from_benchmark` (a row from
a `d3d-hf bench` results file)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

CARD_DATA_FILE = "d3d_card_data.json"
"""File name of the card data written next to the card."""


@dataclass
class MeasuredResult:
    """One measurement of the drafter with its target, as shown in the card's results table.

    Only what was measured: every field except `prompts` may be `None` and is then shown as "not measured".

    Attributes:
        prompts (`str`): the prompt set, e.g. `"HumanEval (first 20 problems)"`.
        tau (`float`, *optional*): mean acceptance length, tokens committed per target forward (bonus included).
        speedup (`float`, *optional*): decode tokens/s with the drafter over target-only `generate` (aggregate).
        tokens_per_second (`float`, *optional*): decode tokens/s with the drafter.
        target_tokens_per_second (`float`, *optional*): decode tokens/s of target-only `generate`, same run.
        lossless_match (`float`, *optional*): fraction of prompts (0..1) whose output equals target-only output.
        num_prompts (`int`, *optional*): number of prompts measured.
        dtype (`str`, *optional*): weight dtype of target and drafter, e.g. `"bfloat16"`.
        hardware (`str`, *optional*): device and thread count, e.g. `"1x H200"` or `"2-core x86_64 CPU, 2 threads"`.
        block_size (`int`, *optional*): draft block size `B` used.
        max_new_tokens (`int`, *optional*): new tokens per prompt.
        decoding (`str`, *optional*): e.g. `"greedy"` or `"sampling, temperature 0.7"`.
        target_model (`str`, *optional*): the target measured with, when it differs from the card's target.
        command (`str`, *optional*): the command that produced the numbers.
        notes (`str`, *optional*): anything else needed to reproduce them.
    """

    prompts: str
    tau: float | None = None
    speedup: float | None = None
    tokens_per_second: float | None = None
    target_tokens_per_second: float | None = None
    lossless_match: float | None = None
    num_prompts: int | None = None
    dtype: str | None = None
    hardware: str | None = None
    block_size: int | None = None
    max_new_tokens: int | None = None
    decoding: str | None = None
    target_model: str | None = None
    command: str | None = None
    notes: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeasuredResult:
        """Builds a result from a plain dict.

        Raises:
            TypeError: if `data` has keys that are not fields (a misspelt number must not vanish silently).
        """
        return cls(**_checked_fields(cls, data))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form without `None` fields, for JSON."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class DrafterCardData:
    """Everything the model card shows that is not in the drafter's config (attach as `drafter.card_data`).

    Attributes:
        target_model (`str`, *optional*): Hub id of the target; defaults to `config.target_model`.
        base_model (`str` or `list[str]`, *optional*): Hub id(s) the weights derive from; defaults to
            `config.source_model` when that is a Hub id. Written to the `base_model` front-matter field.
        datasets (`list[str]`): Hub dataset ids (or descriptions) of the training data.
        training (`dict`, *optional*): training settings as shown (e.g. a trainer config's `to_dict()`, steps,
            learning rate, hardware, wall time, command); rendered as a table in the given order.
        results (`list[MeasuredResult]`): measurements with the target.
        tags (`list[str]`): extra Hub tags.
        license (`str`, *optional*): license id for the front matter (the source model's license applies to derived
            weights; set it explicitly, it is never guessed).
    """

    target_model: str | None = None
    base_model: str | list[str] | None = None
    datasets: list[str] = field(default_factory=list)
    training: dict[str, Any] | None = None
    results: list[MeasuredResult] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    license: str | None = None

    def __post_init__(self) -> None:
        self.results = [r if isinstance(r, MeasuredResult) else MeasuredResult.from_dict(r) for r in self.results]
        self.datasets = list(self.datasets)
        self.tags = list(self.tags)
        if self.training is not None:
            self.training = dict(self.training)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DrafterCardData:
        """Builds card data from a plain dict (as stored in `d3d_card_data.json`).

        Raises:
            TypeError: if `data` has keys that are not fields.
        """
        return cls(**_checked_fields(cls, data))

    @classmethod
    def coerce(cls, value: DrafterCardData | Mapping[str, Any] | None) -> DrafterCardData:
        """`value` as `DrafterCardData` (`None` gives empty data)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise TypeError(f"Card data must be a DrafterCardData or a dict, got {type(value).__name__}.")

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form for JSON (results without `None` fields)."""
        data = asdict(self)
        data["results"] = [r.to_dict() for r in self.results]
        return data

    def save(self, folder: str | os.PathLike) -> Path:
        """Writes `d3d_card_data.json` into `folder` and returns its path."""
        path = Path(folder) / CARD_DATA_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n", encoding="utf-8")
        return path


def _checked_fields(cls, data: Mapping[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise TypeError(f"Unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(names)}.")
    return dict(data)


def load_card_data(folder: str | os.PathLike) -> DrafterCardData | None:
    """Reads the card data a drafter folder was saved with.

    Args:
        folder (`str` or `os.PathLike`): a folder written by `save_pretrained`.

    Returns:
        `DrafterCardData`, or `None` when the folder has no `d3d_card_data.json`.
    """
    path = Path(folder) / CARD_DATA_FILE
    if not path.is_file():
        return None
    return DrafterCardData.from_dict(json.loads(path.read_text(encoding="utf-8")))


def result_from_benchmark(
    benchmark: Mapping[str, Any], method: str = "d3d", hardware: str | None = None, prompts: str | None = None
) -> MeasuredResult:
    """Turns the JSON written by `d3d-hf bench --output FILE` (`d3d_hf.bench.run_benchmark` plus `settings`) into a
    `MeasuredResult`.

    Args:
        benchmark (`Mapping`): the loaded JSON (`summary`, `settings`).
        method (`str`, defaults to `"d3d"`): the method whose numbers to take.
        hardware (`str`, *optional*): overrides the hardware description derived from `settings`.
        prompts (`str`, *optional*): overrides the prompt-set description derived from `settings`.

    Returns:
        `MeasuredResult` with tau, speed-up, tokens/s (drafter and target) and lossless match of `method`.

    Raises:
        ValueError: if the file has no summary for `method` or for the `target` reference.
    """
    summary = benchmark.get("summary", {})
    if method not in summary or "target" not in summary:
        raise ValueError(
            f"The benchmark has no summary for {method!r} and 'target' (found {sorted(summary)}); run "
            f"`d3d-hf bench --methods target,{method} --output FILE`."
        )
    s, ref, settings = summary[method], summary["target"], benchmark.get("settings", {})
    if hardware is None:
        if settings.get("cuda"):
            hardware = str(settings["cuda"])
        elif settings.get("cpu_count"):
            hardware = f"{settings['cpu_count']}-core {settings.get('machine', '')} CPU".replace("  ", " ")
            if settings.get("torch_threads"):
                hardware += f", {settings['torch_threads']} threads"
    if prompts is None and settings.get("prompts") is not None:
        prompts = str(settings["prompts"])
        offset, limit = int(settings.get("offset") or 0), settings.get("limit")
        if limit and offset:  # `--offset K --limit N`: prompts K..K+N-1 (0-based, as the bench counts them)
            prompts += f" (prompts {offset}-{offset + int(limit) - 1})"
        elif limit:
            prompts += f" (first {limit})"
    return MeasuredResult(
        prompts=prompts or "not recorded",
        tau=s.get("tau"),
        speedup=s.get("speedup"),
        tokens_per_second=s.get("tokens_per_second"),
        target_tokens_per_second=ref.get("tokens_per_second"),
        lossless_match=s.get("lossless_match"),
        num_prompts=s.get("prompts", settings.get("num_prompts")),
        dtype=settings.get("dtype"),
        hardware=hardware,
        block_size=settings.get("block_size"),
        max_new_tokens=settings.get("max_new_tokens"),
        decoding=settings.get("decoding"),
        target_model=settings.get("target"),
        command=settings.get("command"),
    )


__all__ = ["CARD_DATA_FILE", "DrafterCardData", "MeasuredResult", "load_card_data", "result_from_benchmark"]
