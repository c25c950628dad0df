"""Reports of benchmark results: Markdown tables and matplotlib plots (`d3d-hf bench --output-dir`, `d3d-hf report`).

Input: one or more results of `d3d-hf bench` (`d3d_hf.bench.run_benchmark` output plus `settings`), typically one
per prompt set and dtype. Output (`write_report`):

- `report.md`: one table over every result (prompt set, dtype, method: tokens/s, speed-ups, tau, lossless match,
  draft/verify ms per round, hit rate and predicted speed-up when present), the settings of each run, the plots;
- `speedup.png`: aggregate speed-up over the target by prompt set and method (median over prompts as a dot, the
  cost model's prediction as a cross when measured);
- `tau_distribution.png`: distribution of per-round acceptance lengths (tokens committed per target forward) for
  every speculative method, one panel per prompt set;
- `round_time.png`: mean time per round split into draft and verify (per token for the target alone), with tau.

Plots use matplotlib's object API (`matplotlib.figure.Figure`), which neither needs nor changes a GUI backend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bench import format_round_plans, format_table

PLOTS = ("speedup.png", "tau_distribution.png", "round_time.png")


def _figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - matplotlib is in the demo extra
        raise ModuleNotFoundError(
            "Plots need matplotlib: pip install 'd3d-hf[demo]' (or pip install matplotlib)."
        ) from err
    return Figure(**kwargs)


def result_label(result: dict[str, Any], results: Sequence[dict[str, Any]]) -> str:
    """The prompt set of `result`, with its dtype when `results` span several dtypes."""
    settings = result.get("settings", {})
    label = str(settings.get("prompts", "results"))
    if "/" in label or "\\" in label:  # a JSONL file: its name is enough
        label = Path(label).name
    dtypes = {r.get("settings", {}).get("dtype") for r in results}
    if len(dtypes) > 1:
        label += f" ({settings.get('dtype')})"
    return label


def settings_line(settings: dict[str, Any]) -> str:
    """One sentence describing how a result was measured (docs/DESIGN.md section 6: always record these)."""
    parts = [f"target `{settings.get('target')}`"]
    if settings.get("drafter"):
        parts.append(
            f"drafter `{settings['drafter']}` ({settings.get('drafter_layers')} layers, block size "
            f"{settings.get('block_size')})"
        )
    if settings.get("assistant"):
        parts.append(f"assistant `{settings['assistant']}`")
    parts.append(f"{settings.get('dtype')}")
    parts.append(
        f"{settings.get('num_prompts')} `{settings.get('prompts')}` prompts x {settings.get('max_new_tokens')} "
        "new tokens, greedy"
    )
    cpu = settings.get("cpu") or {}
    flags = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if cpu.get(flag)]
    machine = f"{cpu['model']}, {' '.join(flags) or 'no AVX2'}" if cpu.get("model") else settings.get("machine")
    parts.append(
        f"{settings.get('torch_threads')} threads on {settings.get('cpu_count')} CPU cores ({machine})"
        if not settings.get("cuda")
        else str(settings["cuda"])
    )
    parts.append(f"torch {settings.get('torch')}, transformers {settings.get('transformers')}")
    return ", ".join(parts)


def format_suite_table(results: Sequence[dict[str, Any]]) -> str:
    """One Markdown table over several results: a `prompts` column followed by `format_table`'s columns."""
    rows: list[str] = []
    header = None
    for result in results:
        table = format_table(result["summary"]).splitlines()
        label = result_label(result, results)
        if header is None or len(table[0]) > len(header[0]):
            header = ["| prompts " + table[0], "|---" + table[1]]
        rows += [f"| {label} " + line for line in table[2:]]
    if header is None:
        return ""
    # align rows that lack the optional columns of the widest table
    width = header[0].count("|")
    rows = [row + " - |" * (width - row.count("|")) for row in rows]
    return "\n".join(header + rows)


def _speculative(result: dict[str, Any]) -> list[str]:
    return [m for m in result["summary"] if m != "target"]


def plot_speedup(results: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Grouped bars: aggregate speed-up over the target per prompt set (group) and method (bar)."""
    methods = list(dict.fromkeys(m for r in results for m in _speculative(r)))
    fig = _figure(figsize=(max(6.0, 1.6 * len(results) * max(1, len(methods)) / 2 + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / max(1, len(methods))
    for j, method in enumerate(methods):
        xs, agg, med, pred = [], [], [], []
        for i, result in enumerate(results):
            s = result["summary"].get(method)
            if s is None:
                continue
            xs.append(i + (j - (len(methods) - 1) / 2) * width)
            agg.append(s["speedup"])
            med.append(s["median_speedup"])
            pred.append(s.get("predicted_speedup"))
        bars = ax.bar(xs, agg, width=width * 0.95, label=method)
        color = bars.patches[0].get_facecolor() if bars.patches else None
        ax.plot(xs, med, "o", color="black", markersize=3)
        px = [x for x, p in zip(xs, pred, strict=True) if p is not None]
        if px:
            ax.plot(
                px,
                [p for p in pred if p is not None],
                "x",
                color=color,
                markersize=8,
                markeredgewidth=2,
                markeredgecolor="black",
            )
    ax.axhline(1.0, color="gray", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(results)), [result_label(r, results) for r in results])
    ax.set_ylabel("speed-up over target alone (tokens/s)")
    ax.set_title(
        "Speed-up over the target alone\n(bar: aggregate, dot: median over prompts, x: cost model)", fontsize="medium"
    )
    ax.legend(fontsize="small")
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_tau_distribution(results: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """One panel per result: fraction of rounds with each acceptance length, per speculative method."""
    fig = _figure(figsize=(7.0, 2.6 * max(1, len(results))), layout="constrained")
    axes = fig.subplots(max(1, len(results)), 1, squeeze=False)[:, 0]
    for ax, result in zip(axes, results, strict=False):
        methods = [m for m in _speculative(result) if any(r.get("acceptance_lengths") for r in result["runs"][m])]
        lengths = {m: [k for r in result["runs"][m] for k in r.get("acceptance_lengths", [])] for m in methods}
        top = max((max(v) for v in lengths.values() if v), default=1)
        width = 0.8 / max(1, len(methods))
        for j, method in enumerate(methods):
            values = lengths[method]
            ks = list(range(1, top + 1))
            share = [values.count(k) / len(values) for k in ks]
            tau = sum(values) / len(values)
            ax.bar(
                [k + (j - (len(methods) - 1) / 2) * width for k in ks],
                share,
                width=width * 0.95,
                label=f"{method} (tau {tau:.2f})",
            )
        ax.set_title(result_label(result, results))
        ax.set_xlabel("tokens committed per target forward (acceptance length)")
        ax.set_ylabel("share of rounds")
        if methods:
            ax.legend(fontsize="small")
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def plot_round_time(results: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Stacked horizontal bars: mean draft and verify ms per round for each result and method; for the target
    alone, ms per token (one forward each)."""
    labels, draft, verify, alone, notes = [], [], [], [], []
    for result in results:
        for method, s in result["summary"].items():
            labels.append(f"{result_label(result, results)}: {method}")
            if method == "target":
                alone.append(1e3 / s["tokens_per_second"] if s["tokens_per_second"] else 0.0)
                draft.append(0.0)
                verify.append(0.0)
                notes.append("per token")
            else:
                alone.append(0.0)
                draft.append(s["draft_ms"])
                verify.append(s["verify_ms"])
                notes.append(f"tau {s['tau']:.2f}")
    fig = _figure(figsize=(8.0, 0.35 * len(labels) + 1.5), layout="constrained")
    ax = fig.subplots()
    ys = list(range(len(labels)))[::-1]
    ax.barh(ys, alone, color="tab:gray", label="target alone (per token)")
    ax.barh(ys, draft, color="tab:orange", label="draft")
    ax.barh(ys, verify, left=draft, color="tab:blue", label="verify")
    for y, d, v, a, note in zip(ys, draft, verify, alone, notes, strict=True):
        ax.text(max(d + v, a), y, f" {note}", va="center", fontsize="small")
    ax.set_yticks(ys, labels, fontsize="small")
    ax.set_xlabel("ms per round (target forward + its draft)")
    ax.set_title("Time per round, split into draft and verify")
    fig.legend(fontsize="small", loc="outside lower center", ncols=3)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


# what every method's summary of a `d3d-hf bench` result holds that the tables and plots read
_SUMMARY_KEYS = ("tokens_per_second", "speedup", "median_speedup", "tau", "lossless_match", "draft_ms", "verify_ms")


def load_bench_results(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Reads the results files of `d3d-hf bench` (`--output FILE`, or `results.json` of `--output-dir`) for
    `write_report`, checking each before anything is written.

    Args:
        paths (sequence of `str` or `Path`): one JSON file per bench run.

    Returns:
        The results, in the order given.

    Raises:
        FileNotFoundError: if a path is not a file.
        ValueError: naming the file, if it is not JSON or not a bench result: a JSON object whose `summary` maps each
            method to its numbers (`tokens_per_second`, `speedup`, `tau`, ...) and whose `runs` holds that method's
            per-prompt runs.
    """
    results = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"No results file at {path}; write one with `d3d-hf bench --output FILE`.")
        try:
            result = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path} is not a JSON file ({err}): pass the results file of `d3d-hf bench`.") from err
        summary = result.get("summary") if isinstance(result, dict) else None
        runs = result.get("runs") if isinstance(result, dict) else None
        problem = None
        if not isinstance(summary, dict) or not summary:
            problem = "it has no `summary` of methods"
        elif not isinstance(runs, dict) or set(summary) - set(runs):
            problem = "its `runs` do not cover every method of its `summary`"
        else:
            for method, numbers in summary.items():
                missing = [key for key in _SUMMARY_KEYS if not isinstance(numbers, dict) or key not in numbers]
                if missing:
                    problem = f"the summary of `{method}` lacks {', '.join(missing)}"
                    break
        if problem:
            raise ValueError(
                f"{path} is not a result of `d3d-hf bench`: {problem}. Pass the file that `d3d-hf bench --output "
                "FILE` wrote, or the results.json of its `--output-dir`."
            )
        results.append(result)
    return results


def write_report(results: Sequence[dict[str, Any]], output_dir: str | Path, title: str = "Benchmark") -> list[Path]:
    """Writes `report.md` and the three plots (module docstring) for `results` into `output_dir` (created).

    Returns:
        The written paths.

    Raises:
        ValueError: if `results` is empty.
    """
    if not results:
        raise ValueError("No results to report.")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_speedup(results, out / "speedup.png"),
        plot_tau_distribution(results, out / "tau_distribution.png"),
        plot_round_time(results, out / "round_time.png"),
    ]
    lines = [f"# {title}", "", format_suite_table(results), ""]
    for result in results:
        plans = format_round_plans(result["summary"])
        if plans:
            lines += [f"Rounds of **{result_label(result, results)}** by candidate source and by `k`:", "", plans, ""]
    lines += ["## Settings", ""]
    for result in results:
        settings = result.get("settings", {})
        lines.append(f"- **{result_label(result, results)}**: {settings_line(settings)}.")
        if settings.get("command"):
            lines.append(f"  Command: `{settings['command']}`")
    cost = next((r["cost_model"] for r in results if r.get("cost_model")), None)
    if cost:
        lines += ["", "Predicted speed-ups come from the cost model (`d3d_hf.costmodel`) measured in the same run."]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in written]
    report = out / "report.md"
    report.write_text("\n".join(lines) + "\n")
    return [report, *written]


__all__ = [
    "PLOTS",
    "format_suite_table",
    "load_bench_results",
    "plot_round_time",
    "plot_speedup",
    "plot_tau_distribution",
    "result_label",
    "settings_line",
    "write_report",
]
