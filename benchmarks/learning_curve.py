"""The learning curve of issue 35: drafter-alone tau against training samples seen, for several drafter capacities.

For each capacity (a preset of `d3d-hf train` flags, `CAPACITIES`) and each sample count N, trains a drafter on the
first N rows of the committed data (`--max_samples N`: the rows are in a seeded shuffled order, so every prefix is a
sample of every source; the last `--tau_holdout` rows are never trained on) for `--epochs` passes, then measures its
drafter-alone tau on HumanEval 20-39, GSM8K 0-19 and MT-Bench 0-19 with `benchmarks/trl/compare_tau.py`
(`d3d_num_drafts="full"`, no prompt lookup, greedy, float32, 128 new tokens; lossless checked on every prompt).
Every step resumes: a finished run or measurement is kept and skipped, a training run continues from its last
checkpoint. Then it writes the table and the plot:

    python benchmarks/learning_curve.py --samples 500,1000,2000,5000 --capacities adapter-r8,small6-v8k \
        [--data data/smollm2-135m-instruct/answers] [--threads 1] [--epochs 2]

Outputs: `runs/learning_curve/<capacity>-<N>/` (the drafters; not committed), and in
`benchmarks/results/learning_curve/`: `<capacity>-<N>-<set>.json` (compare_tau results), `curve.md` (the table, with
the CPU and the commands) and `curve.png` (tau against samples, one line per capacity and set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETS = {"humaneval": (20, 20), "gsm8k": (0, 20), "mt-bench": (0, 20)}
BATCH = 4
CAPACITIES: dict[str, list[str]] = {
    # every preset distils the target's logits at the block positions (free for block adapters: the clean stream is
    # the target; a standalone drafter pays one no-grad target forward per batch)
    # block adapters over the target's own 30 layers (the shipped design), rank 8 and 32
    "adapter-r8": ["--train_mode", "block_adapter", "--block_lora_rank", "8", "--block_lora_alpha", "16",
                   "--learning_rate", "5e-4", "--ar_loss_weight", "0", "--distill_weight", "1.0",
                   "--dtype", "bfloat16"],
    # the same adapters on the MLP projections only (a capacity option: which projections the adapters act on)
    "adapter-r8-mlp": ["--train_mode", "block_adapter", "--block_lora_rank", "8", "--block_lora_alpha", "16",
                       "--block_lora_modules", "gate_proj", "up_proj", "down_proj", "--learning_rate", "5e-4",
                       "--ar_loss_weight", "0", "--distill_weight", "1.0", "--dtype", "bfloat16"],
    # rank-8 adapters, and full-rank ones on the last two layers (block-row-only full weights in the last layers)
    "adapter-r8-full2": ["--train_mode", "block_adapter", "--block_lora_rank", "8", "--block_lora_alpha", "16",
                         "--block_lora_full_layers", "2", "--learning_rate", "5e-4", "--ar_loss_weight", "0",
                         "--distill_weight", "1.0", "--dtype", "bfloat16"],
    "adapter-r32": ["--train_mode", "block_adapter", "--block_lora_rank", "32", "--block_lora_alpha", "64",
                    "--learning_rate", "5e-4", "--ar_loss_weight", "0", "--distill_weight", "1.0",
                    "--dtype", "bfloat16"],
    # a standalone 6-layer drafter over the target's depth with an 8,192-id draft vocabulary (issue 37)
    "small6-v8k": ["--shares_target_weights", "false", "--train_mode", "full", "--freeze_embeddings", "false",
                   "--layer_ids", "0,6,12,18,24,29", "--draft_vocab_size", "8192", "--learning_rate", "3e-4",
                   "--ar_loss_weight", "1.0", "--distill_weight", "1.0", "--dtype", "float32"],
    # cheaper standalone drafters (issue 37: a draft pass at a fraction of a target step): 4 and 2 of the 30 layers
    "small4-v8k": ["--shares_target_weights", "false", "--train_mode", "full", "--freeze_embeddings", "false",
                   "--layer_ids", "0,10,20,29", "--draft_vocab_size", "8192", "--learning_rate", "3e-4",
                   "--ar_loss_weight", "1.0", "--distill_weight", "1.0", "--dtype", "float32"],
    "small2-v8k": ["--shares_target_weights", "false", "--train_mode", "full", "--freeze_embeddings", "false",
                   "--layer_ids", "0,29", "--draft_vocab_size", "8192", "--learning_rate", "3e-4",
                   "--ar_loss_weight", "1.0", "--distill_weight", "1.0", "--dtype", "float32"],
    # 4 query-only layers over the target's cache, the anchor reading the target's last hidden state from a zero
    # projection (measured better than the identity start, RESULTS 2026-12-05; issue 37,
    # DESIGN section 12): every step runs the target's no-grad forward, which gives the cache and the state; that
    # forward runs in bf16 (`--target_dtype`: 1.8x faster on an avx512_bf16 CPU, block and distillation losses within
    # 0.01 of an fp32 forward's, RESULTS 2026-12-05) while the drafter trains in float32; at 1.2e-3 (4x the first
    # runs' 3e-4) 2,400 samples gave block loss 4.31 against 4.54 and mean accepted prefix 0.59 against 0.53, and 8x
    # gave no more (RESULTS 2026-12-07)
    "small4-qoh-v8k": ["--shares_target_weights", "false", "--shares_target_cache", "true",
                       "--reads_target_hidden_state", "true", "--hidden_state_init", "zeros", "--train_mode",
                       "full", "--freeze_embeddings", "false", "--layer_ids", "0,10,20,29", "--draft_vocab_size",
                       "8192", "--learning_rate", "1.2e-3", "--ar_loss_weight", "0", "--distill_weight", "1.0",
                       "--dtype", "float32", "--target_dtype", "bfloat16"],
    # the same over 6 of the target's layers, the deepest within issue 37's cost bar (0.22 of a target step at 16
    # rows for an untrained 6-layer drafter with this head, bf16, Xeon/AMX): at 2,400 samples on the CPU its block
    # loss was 3.98 against 4.31 and its held-out mean accepted prefix 0.70 against 0.59 (RESULTS 2026-12-08)
    "small6-qoh-v8k": ["--shares_target_weights", "false", "--shares_target_cache", "true",
                       "--reads_target_hidden_state", "true", "--hidden_state_init", "zeros", "--train_mode",
                       "full", "--freeze_embeddings", "false", "--layer_ids", "0,6,12,18,24,29",
                       "--draft_vocab_size", "8192", "--learning_rate", "1.2e-3", "--ar_loss_weight", "0",
                       "--distill_weight", "1.0", "--dtype", "float32", "--target_dtype", "bfloat16"],
}  # fmt: skip


def _at_learning_rate(flags: list[str], rate: str) -> list[str]:
    """`flags` with `--learning_rate` set to `rate` (the preset's other settings unchanged)."""
    i = flags.index("--learning_rate")
    return [*flags[: i + 1], rate, *flags[i + 2 :]]


# rank 8 and 32 at four times the learning rate: at ~1,000 samples the adapters fit their own training rows no better
# than unseen ones (capacity-500-cpu), so they may be optimisation-limited rather than data-limited
CAPACITIES["adapter-r8-lr2e-3"] = _at_learning_rate(CAPACITIES["adapter-r8"], "2e-3")
CAPACITIES["adapter-r32-lr2e-3"] = _at_learning_rate(CAPACITIES["adapter-r32"], "2e-3")
# a warm start: the shipped drafter (rank-8 adapters, trained on ~1,200 templated prompts) grown to rank 32 without
# changing a draft (`d3d_hf.adapter_rank.expand_block_adapters`), then trained at the from-scratch best rate; on the
# CPU, 1,600 samples of it gained +0.07 / +0.04 / +0.05 tau over the shipped drafter (warmstart-cpu); a lease carries
# SHIPPED_DRAFTER into the copied tree (benchmarks/gpu/README.md)
SHIPPED_DRAFTER = ROOT / "src" / "d3d_hf" / "pretrained" / "d3d-smollm2-135m-instruct"
CAPACITIES["warm-r32-lr2e-3"] = ["--drafter", str(SHIPPED_DRAFTER), "--train_mode", "block_adapter",
                                 "--block_lora_rank", "32", "--learning_rate", "2e-3", "--ar_loss_weight", "0",
                                 "--distill_weight", "1.0", "--dtype", "bfloat16"]  # fmt: skip


def train_command(
    capacity: str,
    samples: int,
    out: Path,
    *,
    data: str,
    epochs: int,
    batch_size: int = BATCH,
    device: str = "cpu",
    threads: int = 1,
    max_steps: int | None = None,
    save_steps: int = 50,
) -> list[str]:
    """The `d3d-hf train` command of one learning-curve run: `capacity`'s preset on the first `samples` rows of
    `data` for `epochs` passes of `batch_size` rows (or `max_steps` steps), on `device` ("cpu" or "cuda")."""
    steps = max_steps or max(20, epochs * samples // batch_size)
    return [
        sys.executable, "-m", "d3d_hf.cli", "train", "--target", "smollm2-135m-instruct", "--data", data,
        "--output_dir", str(out),
        "--max_samples", str(samples), "--max_steps", str(steps), "--per_device_train_batch_size", str(batch_size),
        "--lr_scheduler_type", "cosine", "--warmup_steps", str(min(50, steps // 10)), "--anchors_per_sequence", "8",
        "--position_weight_gamma", "7", "--logging_steps", "10", "--save_strategy", "steps",
        "--save_steps", str(save_steps), "--save_total_limit", "1", "--tau_eval_steps", "0", "--tau_holdout", "4",
        "--resume_from_checkpoint", "auto", *(["--use_cpu"] if device == "cpu" else []), "--threads", str(threads),
        "--report_to", "none", *CAPACITIES[capacity],
    ]  # fmt: skip


def _train(capacity: str, samples: int, args) -> Path:
    out = Path(args.runs) / f"{capacity}-{samples}"
    if (out / "config.json").is_file() and (out / "trainer_state.json").is_file():
        return out
    command = train_command(capacity, samples, out, data=args.data, epochs=args.epochs, threads=args.threads)
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return out


def tau_command(
    folder: Path,
    name: str,
    path: Path,
    *,
    limit: int | None = None,
    max_new_tokens: int = 128,
    threads: int = 1,
    device: str = "cpu",
    prompts: str | None = None,
) -> list[str]:
    """The `compare_tau.py` command measuring `folder`'s drafter-alone tau on set `name` (`SETS`: its offset and
    count; `limit` fewer prompts) into `path`; `prompts` reads the set from that JSONL file instead, offset 0."""
    offset, count = SETS[name]
    return [
        sys.executable, str(ROOT / "benchmarks" / "trl" / "compare_tau.py"), "--drafters", str(folder),
        "--prompts", prompts or name, "--offset", "0" if prompts else str(offset), "--limit", str(limit or count),
        "--max-new-tokens", str(max_new_tokens), "--threads", str(threads), "--device", device, "--output", str(path),
    ]  # fmt: skip


def _measure(capacity: str, samples: int, folder: Path, args) -> dict[str, dict]:
    found = {}
    for name in SETS:
        path = Path(args.results) / f"{capacity}-{samples}-{name}.json"
        if not path.is_file():
            command = tau_command(folder, name, path, limit=args.limit, max_new_tokens=args.max_new_tokens,
                                  threads=args.threads)  # fmt: skip
            print("+", " ".join(command), flush=True)
            subprocess.run(command, check=True)
        result = json.loads(path.read_text())
        found[name] = {"tau": next(iter(result["tau"].values())), "lossless": next(iter(result["lossless"].values()))}
    return found


def _render(table: dict, args) -> None:
    from d3d_hf.modeling.calibration_d3d import cpu_model

    lines = [
        "Drafter-alone tau (full blocks, no prompt lookup, greedy, float32, 128 new tokens; lossless share in "
        f"brackets) against training samples seen; CPU: {cpu_model()}; `python benchmarks/learning_curve.py "
        f"--samples {args.samples} --capacities {args.capacities} --epochs {args.epochs}`",
        "",
        "| capacity | samples | " + " | ".join(f"{n} {o}-{o + k - 1}" for n, (o, k) in SETS.items()) + " |",
        "|---|---|" + "---|" * len(SETS),
    ]
    for (capacity, samples), found in sorted(table.items()):
        cells = [f"{found[n]['tau']:.2f} ({found[n]['lossless']:.0%})" for n in SETS]
        lines.append(f"| {capacity} | {samples} | " + " | ".join(cells) + " |")
    (Path(args.results) / "curve.md").write_text("\n".join(lines) + "\n")
    series = {}
    for capacity in sorted({c for c, _ in table}):
        points = sorted((s, f) for (c, s), f in table.items() if c == capacity)
        for name in SETS:
            series[f"{capacity} {name}"] = [(s, f[name]["tau"]) for s, f in points]
    _plot(series, {}, "training samples (target answers)", Path(args.results) / "curve.png")
    print("\n".join(lines))


def _plot(series: dict[str, list[tuple[int, float]]], references: dict[str, float], xlabel: str, path: Path) -> None:
    """Tau against samples (log x), one line per `series` entry and a grey line per `references` entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xy in series.items():
        ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=label)
    for (label, tau), style in zip(references.items(), ("--", ":", "-."), strict=False):
        ax.axhline(tau, color="grey", linestyle=style, linewidth=1, label=label)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("drafter-alone tau")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


#: the shipped drafter as `render_measured` describes it (`shipped-<set>.json` in a results folder)
SHIPPED = (
    "d3d-smollm2-135m-instruct: adapters trained at rank 32 then cut to 8, ~1,200 templated prompts, 1,400 steps of 4"
)


def render_measured(results: Path) -> str:
    """`curve.md` and `curve.png` of a folder of finished runs: `runs.json` (per run: capacity, rows, steps,
    batch_size, samples_seen, finished, final_loss; written from the runs' trainer states) and the compare_tau
    JSONs `<run>-<set>.json`. Tau is plotted against the samples seen (steps x batch), since a run stopped early
    saw fewer than its rows x epochs. `shipped-<set>.json` (the shipped drafter, same script), where present, adds a
    row and a grey line per set. Returns the table."""
    runs = json.loads((results / "runs.json").read_text())
    lines = [
        "| run | rows | steps (of) | samples seen | "
        + " | ".join(f"{n} {o}-{o + k - 1}" for n, (o, k) in SETS.items())
        + " | block / AR / distil loss |",
        "|---|---|---|---|" + "---|" * len(SETS) + "---|",
    ]
    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for name, run in sorted(runs.items(), key=lambda kv: (kv[1]["capacity"], kv[1]["samples_seen"])):
        cells = []
        for set_name in SETS:
            path = results / f"{name}-{set_name}.json"
            if path.is_file():
                found = json.loads(path.read_text())
                tau, lossless = next(iter(found["tau"].values())), next(iter(found["lossless"].values()))
                cells.append(f"{tau:.2f} ({lossless:.0%})")
                line = run["capacity"] + (f" ({run['subset']} rows)" if run.get("subset") else "")
                points.setdefault((line, set_name), []).append((run["samples_seen"], tau))
            else:
                cells.append("-")
        loss = run["final_loss"]
        losses = " / ".join(f"{loss[k]:.2f}" if k in loss else "-" for k in ("block_loss", "ar_loss", "distill_loss"))
        steps = f"{run['steps']}" + ("" if run["finished"] else f" ({run['max_steps']}, stopped)")
        lines.append(f"| {name} | {run['rows']} | {steps} | {run['samples_seen']} | " + " | ".join(cells)
                     + f" | {losses} |")  # fmt: skip
    # the drafter shipped today, measured by the same script (`shipped-<set>.json`): the bar a new drafter must clear
    shipped = {}
    for set_name in SETS:
        path = results / f"shipped-{set_name}.json"
        if path.is_file():
            found = json.loads(path.read_text())
            shipped[set_name] = (next(iter(found["tau"].values())), next(iter(found["lossless"].values())))
    if shipped:
        cells = [f"{shipped[n][0]:.2f} ({shipped[n][1]:.0%})" if n in shipped else "-" for n in SETS]
        lines.append(f"| shipped ({SHIPPED}) | | | | " + " | ".join(cells) + " | |")
    table = "\n".join(lines) + "\n"
    (results / "curve.md").write_text(table)
    series = {f"{capacity} {set_name}": sorted(xy) for (capacity, set_name), xy in sorted(points.items())}
    references = {f"shipped drafter, {set_name}": tau for set_name, (tau, _) in shipped.items()}
    _plot(series, references, "training samples seen (target answers; steps x batch)", results / "curve.png")
    return table


def record_run(folder: Path, results: Path, device: str) -> dict:
    """Adds the finished (or stopped) learning-curve run in `folder` (named `<capacity>-<rows>`, as `train_command`
    names them) to `results`/runs.json, read from its `trainer_state.json`: steps, batch, samples seen, whether it
    finished its schedule, the last logged losses and the wall time; `device` says where it trained. A folder named
    `<capacity>-<subset>-<rows>` (e.g. `adapter-r8-magpie-500`, trained on rows of one kind from
    `benchmarks/data_subset.py`) records `subset` too, and its points get a line of their own. Returns the entry.

    Raises:
        ValueError: if the folder's name does not end in `-<rows>` after a known capacity, or it holds no trainer state.
    """
    name = folder.name
    head, _, rows = name.rpartition("-")
    # the longest preset the name starts with; what lies between it and the rows names a data subset (`-magpie-`)
    capacity = max((c for c in CAPACITIES if head == c or head.startswith(c + "-")), key=len, default=None)
    if capacity is None or not rows.isdigit():
        raise ValueError(
            f"{folder}: expected a folder named <capacity>-<rows> or <capacity>-<subset>-<rows> with a capacity of "
            f"{sorted(CAPACITIES)}"
        )
    subset = head[len(capacity) + 1 :]
    state_path = folder / "trainer_state.json"
    if not state_path.is_file():
        raise ValueError(f"{folder} holds no trainer_state.json: the run has not saved yet.")
    state = json.loads(state_path.read_text())
    logs = [entry for entry in state["log_history"] if "loss" in entry]
    runtime = next((entry["train_runtime"] for entry in state["log_history"] if "train_runtime" in entry), None)
    last = logs[-1] if logs else {}
    entry = {
        "capacity": capacity,
        "rows": int(rows),
        "steps": state["global_step"],
        "max_steps": state["max_steps"],
        "batch_size": state["train_batch_size"],
        "samples_seen": state["global_step"] * state["train_batch_size"],
        "finished": state["global_step"] >= state["max_steps"],
        "final_loss": {
            key: round(float(last[key]), 3) for key in ("loss", "block_loss", "ar_loss", "distill_loss") if key in last
        },
        "train_runtime_s": runtime,
        "device": device,
        **({"subset": subset} if subset else {}),
    }
    path = results / "runs.json"
    runs = json.loads(path.read_text()) if path.is_file() else {}
    runs[name] = entry
    path.write_text(json.dumps(runs, indent=1) + "\n")
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", default="500,1000,2000,5000", help="sample counts, comma-separated")
    parser.add_argument("--capacities", default="adapter-r8,small6-v8k", help=f"of {sorted(CAPACITIES)}")
    parser.add_argument("--data", default="data/smollm2-135m-instruct/answers")
    parser.add_argument("--runs", default="runs/learning_curve")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--limit", type=int, default=None, help="prompts per set (default 20; fewer: a smoke run)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "learning_curve"))
    parser.add_argument("--render", metavar="DIR", help="only draw the table and plot of a folder of measured runs "
                        "(runs.json + compare_tau JSONs, e.g. from benchmarks/gpu/scale_run.py)")  # fmt: skip
    parser.add_argument("--record", nargs="+", metavar="RUN", help="add these finished run folders to --render's "
                        "runs.json (from their trainer states), then draw it")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="with --record: where the runs trained")
    args = parser.parse_args()
    if args.record:
        if not args.render:
            parser.error("--record needs --render DIR (the folder whose runs.json gets the runs)")
        for folder in args.record:
            print(record_run(Path(folder), Path(args.render), args.device))
    if args.render:
        print(render_measured(Path(args.render)))
        return
    unknown = sorted(set(args.capacities.split(",")) - set(CAPACITIES))
    if unknown:
        parser.error(f"unknown capacities {unknown}: use {sorted(CAPACITIES)}")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    Path(args.results).mkdir(parents=True, exist_ok=True)
    table = {}
    for capacity in args.capacities.split(","):
        for samples in (int(n) for n in args.samples.split(",")):
            folder = _train(capacity, samples, args)
            table[(capacity, samples)] = _measure(capacity, samples, folder, args)
            _render(table, args)


if __name__ == "__main__":
    main()
