"""One GPU lease for issues 35 and 37: the rest of the target's answers, the learning curve, the small drafters.

A lent GPU does in minutes what takes these 2-core CPUs days. Within one `--budget` (seconds, one device call) this
runs, side by side on the GPU:

1. the target's greedy answers to the prompts not yet in `--answers` (the same prompts, order and settings as
   `examples/build_smollm2_data.sh`, so the shards resume the CPU-made ones: `generate_dataset`, bf16, batched);
2. learning-curve runs (`benchmarks/learning_curve.py` presets) on a frozen copy of the rows answered before the
   lease, at each of `--samples`, and the standalone small drafters (`--small`) on all of those rows;
3. once the answers are complete, one run per capacity on all rows, its steps sized to the time left;
4. drafter-alone tau (`benchmarks/trl/compare_tau.py`, fp32 greedy, 128 new tokens, full blocks, no lookup) of every
   finished run on the sets of `learning_curve.SETS`, read from `--tau-prompts` (JSONL exports, see `export`), as
   long as time allows.

At `budget - --reserve` seconds whatever still runs is stopped (a training run's last checkpoint is kept), and the
results are packed into at most 8 files under `--out` (the device tool's limit): `results.tar.gz` (logs, tau JSONs,
trainer states), the new shards in `answers.tar.NN` and the drafters in `drafters.tar.NN`, pieces of 15 MiB.

Prepare here (CPU), then run on the device (see `run_scale.sh`):

    python benchmarks/gpu/scale_run.py export --dir .gpu
    bash benchmarks/gpu/run_scale.sh        # on the device: python3 benchmarks/gpu/scale_run.py run --out $OUT ...
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from learning_curve import CAPACITIES, SETS, tau_command, train_command  # noqa: E402

# the spec and order of examples/build_smollm2_data.sh (its defaults)
PROMPT_SPEC = (
    "stdlib:6500,math:2000,math-extra:2500,chat:2000,chat-extra:4000,data/smollm2-135m-instruct/prompts/magpie.jsonl"
)
ANSWERS = "data/smollm2-135m-instruct/answers"
PIECE = 15 * 2**20


def export(args) -> None:
    """Writes `--dir`/prompts.json.gz (the data prompts, shuffled as `d3d-hf data --shuffle` does, ids and messages:
    the device's Python has another stdlib, so it cannot rebuild the stdlib prompts) and `--dir`/tau/<set>.jsonl."""
    from d3d_hf.data import _pending_prompts, _read_shards, load_prompt_sources
    from d3d_hf.prompts import load_prompts

    out = Path(args.dir)
    (out / "tau").mkdir(parents=True, exist_ok=True)
    prompts = load_prompt_sources(PROMPT_SPEC, seed=0)
    prompts = random.Random(0).sample(prompts, len(prompts))
    done, _ = _read_shards(Path(ANSWERS) / "shards")
    pending = _pending_prompts(prompts, done, Path(ANSWERS) / "shards")  # raises if a shard disagrees
    rows = [{"id": p.id, "messages": list(p.messages)} for p in prompts]
    (out / "prompts.json.gz").write_bytes(gzip.compress(json.dumps(rows).encode("utf-8")))
    for name, (offset, count) in SETS.items():
        with open(out / "tau" / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for p in load_prompts(name)[offset : offset + count]:
                record = {"id": p.id, "messages": list(p.messages)}
                if p.raw is not None:
                    record["prompt"] = p.raw
                f.write(json.dumps(record) + "\n")
    print(f"{len(rows)} prompts ({len(pending)} not answered yet) and the tau sets written to {out}")


def generate(args) -> None:
    """Answers the pending prompts of `--prompts-json` into `--answers` on `--device` (bf16, greedy, 512 tokens)."""
    import d3d_hf.data as data
    from d3d_hf.prompts.prompt import Prompt
    from d3d_hf.targets import load_target

    rows = json.loads(gzip.decompress(Path(args.prompts_json).read_bytes()))
    prompts = [Prompt(id=r["id"], messages=r["messages"]) for r in rows]
    settings = json.loads((Path(args.answers) / data.SETTINGS_FILE).read_text())
    # the stdlib prompts came from the CPU machine's Python (the JSON above): keep its record, not this Python's
    data.stdlib_source_info = lambda: settings["stdlib"]
    target, tokenizer = load_target("smollm2-135m-instruct", dtype="bfloat16", device=args.device)
    data.generate_dataset(
        target, tokenizer, prompts, args.answers, max_new_tokens=512, temperature=0.0, batch_size=args.batch_size,
        seed=0, target_name="smollm2-135m-instruct", prompt_sources=PROMPT_SPEC + " (shuffled)",
        progress=True,
    )  # fmt: skip


class Job:
    def __init__(self, name: str, command: list[str], log: Path, kind: str, folder: Path | None = None):
        self.name, self.kind, self.folder, self.log = name, kind, folder, log
        self.started = time.monotonic()
        log.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(log, "w")
        self.file.write("+ " + " ".join(command) + "\n")
        self.file.flush()
        self.proc = subprocess.Popen(command, stdout=self.file, stderr=subprocess.STDOUT, start_new_session=True)

    def poll(self):
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _seconds_per_step(folder: Path) -> float | None:
    state = folder / "trainer_state.json"
    if not state.is_file():
        return None
    state = json.loads(state.read_text())
    runtime = next((e["train_runtime"] for e in state["log_history"] if "train_runtime" in e), None)
    return runtime / state["global_step"] if runtime and state["global_step"] else None


def _row_count(answers: Path) -> int:
    from d3d_hf.data import _read_shards

    return len(_read_shards(answers / "shards")[0])


def _missing_drafters(capacities: list[str]) -> list[str]:
    """The `--drafter` folders (warm-start presets) of `capacities` that hold no drafter here."""
    folders = [flags[flags.index("--drafter") + 1] for flags in map(CAPACITIES.get, capacities) if "--drafter" in flags]
    return [folder for folder in folders if not (Path(folder) / "config.json").is_file()]


def run(args) -> None:
    capacities = [c for c in args.capacities.split(",") if c]
    small = [c for c in args.small.split(",") if c]
    unknown = sorted(set(capacities + small) - set(CAPACITIES))
    if unknown:
        raise SystemExit(f"unknown capacities {unknown}: use {sorted(CAPACITIES)}")
    missing = _missing_drafters(capacities + small)
    if missing:  # refused before a second of the lease goes to runs that would fail on start
        raise SystemExit(f"warm-start presets need {missing}: carry them in this call (benchmarks/gpu/README.md)")
    start = time.monotonic()
    stop_at = start + args.budget - args.reserve
    out, work = Path(args.out), Path(args.work)
    logs = work / "logs"
    runs = work / "runs"
    taus = work / "tau"
    for folder in (logs, runs, taus):
        folder.mkdir(parents=True, exist_ok=True)
    status = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "budget_s": args.budget, "events": []}

    def event(text: str) -> None:
        line = f"[{time.monotonic() - start:6.1f}s] {text}"
        print(line, flush=True)
        status["events"].append(line)

    answers = Path(args.answers)
    frozen = work / "answers-before"
    shutil.copytree(answers, frozen, ignore=shutil.ignore_patterns("dataset"))
    before = _row_count(frozen)
    before_shards = {p.name for p in (frozen / "shards").iterdir()}
    full_runs: set[str] = set()
    event(f"{before} rows answered before this run")
    python = sys.executable
    jobs: list[Job] = []
    gen = Job("generate", [python, __file__, "generate", "--prompts-json", args.prompts_json, "--answers",
                           str(answers), "--device", args.device, "--batch-size", str(args.gen_batch)],
              logs / "generate.log", "generate")  # fmt: skip
    jobs.append(gen)
    trained = []  # (name, folder) of runs to measure
    common = {"epochs": args.epochs, "batch_size": args.batch_size, "device": args.device, "threads": 1}
    usable = before - 4  # --tau_holdout 4: the last rows are never trained on
    plan = [(c, n) for c in capacities for n in map(int, filter(None, args.samples.split(","))) if n <= usable]
    if args.order == "together":  # the small drafters on the rows answered before; else on all rows, after them
        plan += [(c, usable) for c in small]

    def start_curve_runs() -> None:
        for capacity, samples in plan:
            folder = runs / f"{capacity}-{samples}"
            epochs = args.small_epochs if capacity.startswith("small") else args.epochs
            command = train_command(capacity, samples, folder, data=str(frozen), save_steps=100,
                                    **{**common, "epochs": epochs})  # fmt: skip
            jobs.append(Job(f"{capacity}-{samples}", command, logs / f"train-{capacity}-{samples}.log", "train",
                            folder))  # fmt: skip
            event(f"train {capacity} on {samples} rows")

    if args.order == "together":
        start_curve_runs()
    full_started = False
    tau_queue: list[tuple[str, Path, str]] = []
    while time.monotonic() < stop_at:
        time.sleep(2)
        for job in jobs:
            rc = job.poll()
            if rc is None or getattr(job, "seen", False):
                continue
            job.seen = True
            event(f"{job.name} ended with {rc} after {time.monotonic() - job.started:.0f}s")
            if job.kind == "train" and rc == 0:
                trained.append((job.name, job.folder))
                tau_queue += [(job.name, job.folder, name) for name in SETS]
        if gen.poll() not in (None, 0) and not full_started:
            full_started = True
            event("generation failed: no full-data runs")
            if args.order == "answers-first":  # train on the rows answered before, as `together` would
                plan += [(c, usable) for c in small]
                start_curve_runs()
        if gen.poll() == 0 and not full_started:
            full_started = True
            total = _row_count(answers)
            steps_per_s = [s for _, f in trained if (s := _seconds_per_step(f))]
            per_step = max(steps_per_s) if steps_per_s else args.default_step_seconds
            how = "measured" if steps_per_s else "assumed"
            left = stop_at - time.monotonic() - args.full_tau_seconds - 30  # loading and saving
            if args.order == "answers-first":
                start_curve_runs()
            for capacity in capacities + (small if args.order == "answers-first" else []):
                samples = total - 4
                epochs = args.small_epochs if capacity.startswith("small") else args.epochs
                steps = min(epochs * samples // args.batch_size, int(left / (per_step * 1.25)))
                if steps < 50:
                    event(f"no time left for a full-data run of {capacity} ({left:.0f}s)")
                    continue
                folder = runs / f"{capacity}-{samples}"
                command = train_command(capacity, samples, folder, data=str(answers), max_steps=steps, save_steps=100,
                                        **{**common, "epochs": epochs})  # fmt: skip
                jobs.append(Job(f"{capacity}-{samples}", command, logs / f"train-{capacity}-{samples}.log", "train",
                                folder))  # fmt: skip
                full_runs.add(folder.name)
                event(f"train {capacity} on all {samples} rows: {steps} steps ({per_step:.3f}s/step {how})")
        running_tau = sum(1 for j in jobs if j.kind == "tau" and j.poll() is None)
        while tau_queue and running_tau < args.tau_jobs:
            name, folder, set_name = tau_queue.pop(0)
            path = taus / f"{name}-{set_name}.json"
            command = tau_command(folder, set_name, path, device=args.device, limit=args.tau_limit,
                                  prompts=str(Path(args.tau_prompts) / f"{set_name}.jsonl"))  # fmt: skip
            jobs.append(Job(f"tau {name} {set_name}", command, logs / f"tau-{name}-{set_name}.log", "tau"))
            running_tau += 1
        if all(j.poll() is not None for j in jobs) and not tau_queue and full_started:
            break
    for job in jobs:
        if job.poll() is None:
            event(f"stopping {job.name} (out of time)")
            job.stop()
    status["rows_after"] = _row_count(answers)
    status["not_measured"] = [f"{n} {s}" for n, _, s in tau_queue]
    event(f"{status['rows_after']} rows answered; packing")
    _pack(out, work, answers, runs, status, full_runs, before_shards)


def _drafter_files(folder: Path) -> list[Path]:
    """The files of a run's final drafter, else of its last checkpoint (a run stopped early)."""
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        base = folder
    else:
        checkpoints = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
        if not checkpoints:
            return []
        base = checkpoints[-1]
    # the remote-code bundle (*.py) and the tokenizer are the same in every run: `load_drafter` needs neither
    keep = {"config.json", "model.safetensors", "trainer_state.json", "d3d_card_data.json"}
    return [p for p in base.iterdir() if p.name in keep]


def _measured(work: Path, name: str) -> bool:
    return all((work / "tau" / f"{name}-{s}.json").is_file() for s in SETS)


def _pieces(out: Path, name: str, data: bytes, most: int) -> None:
    """Writes `data` as `name.00`, `name.01`, ... of at most `PIECE` bytes, at most `most` of them (the rest is cut)."""
    data = data[: most * PIECE]
    for i in range(0, len(data), PIECE):
        (out / f"{name}.{i // PIECE:02d}").write_bytes(data[i : i + PIECE])


def _pack(out: Path, work: Path, answers: Path, runs: Path, status: dict, full: set[str], before: set[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (work / "status.json").write_text(json.dumps(status, indent=1))
    with tarfile.open(out / "results.tar.gz", "w:gz") as tar:
        for name in ("status.json", "logs", "tau"):
            tar.add(work / name, arcname=name)
        for folder in sorted(runs.iterdir()):
            for state in [folder / "trainer_state.json", *folder.glob("checkpoint-*/trainer_state.json")]:
                if state.is_file():
                    tar.add(state, arcname=str(state.relative_to(work)))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(answers / "generation_settings.json", arcname="generation_settings.json")
        for shard in sorted((answers / "shards").iterdir()):
            if shard.name not in before:  # the shards made here
                tar.add(shard, arcname=f"shards/{shard.name}")
    _pieces(out, "answers.tar", buffer.getvalue(), 3)
    # the full-data runs first (brought back even when measured here: they are the drafters to ship), then the
    # curve runs not measured here, most samples first; a run that does not fit whole goes to the `fetch` archive
    room = 64 * 2**20 - sum(p.stat().st_size for p in out.iterdir()) - 2**20
    room = min(room, (8 - len(list(out.iterdir()))) * PIECE)
    buffer, later = io.BytesIO(), []
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for folder in sorted(runs.iterdir(), key=lambda f: (f.name not in full, -int(f.name.rsplit("-", 1)[1]))):
            if folder.name.startswith("small"):
                later.append(folder)  # standalone drafters: to the `fetch` archive below
                continue
            if folder.name not in full and _measured(work, folder.name):
                continue  # measured here
            files = _drafter_files(folder)
            if buffer.tell() + sum(f.stat().st_size + 1024 for f in files) + 10240 > room:
                later.append(folder)
                continue
            for path in files:
                tar.add(path, arcname=f"{folder.name}/{path.name}")
    _pieces(out, "drafters.tar", buffer.getvalue(), 8 - len(list(out.iterdir())))
    # what did not fit: the standalone drafters carry their own 28M-parameter embedding (~190 MB in float32 for 4
    # layers) and go with bfloat16 weights; all of it is archived here for `fetch` calls on the still-warm machine
    with tarfile.open(work / FETCH_ARCHIVE, "w") as tar:
        for folder in later:
            for path in _drafter_files(folder):
                if path.name == "model.safetensors" and folder.name.startswith("small"):
                    path = _bfloat16_copy(path, work / "bf16" / folder.name)
                tar.add(path, arcname=f"{folder.name}/{path.name}")
    pieces = -(-(work / FETCH_ARCHIVE).stat().st_size // PIECE)
    print(f"packed: {sorted((p.name, p.stat().st_size) for p in out.iterdir())}; {FETCH_ARCHIVE} holds "
          f"{[f.name for f in later]} in {pieces} pieces for `fetch` (FIRST=0, 4, ... with run_scale.sh fetch)",
          flush=True)  # fmt: skip


FETCH_ARCHIVE = "later.tar"


def _bfloat16_copy(path: Path, folder: Path) -> Path:
    """`path` (a safetensors file) with its float tensors cast to bfloat16, written under `folder`."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(path).items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / path.name, metadata={"format": "pt"})
    return folder / path.name


def fetch(args) -> None:
    """Writes pieces `--first` .. `--first + 3` (15 MiB each, 60 MiB: one call's worth) of the `fetch` archive of
    the last `run` (`--work`/later.tar) under `--out`; join all pieces here with `cat later.tar.* > ...`."""
    data = (Path(args.work) / FETCH_ARCHIVE).read_bytes()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    total = -(-len(data) // PIECE)
    for i in range(args.first, min(args.first + 4, total)):
        (out / f"{FETCH_ARCHIVE}.{i:02d}").write_bytes(data[i * PIECE : (i + 1) * PIECE])
    print(f"pieces {args.first}..{min(args.first + 4, total) - 1} of {total} written", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export")
    p.add_argument("--dir", default=".gpu")
    p = sub.add_parser("generate")
    p.add_argument("--prompts-json", required=True)
    p.add_argument("--answers", default=ANSWERS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=1024)
    p = sub.add_parser("run")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/scale")
    p.add_argument("--answers", default=ANSWERS)
    p.add_argument("--prompts-json", default=".gpu/prompts.json.gz")
    p.add_argument("--tau-prompts", default=".gpu/tau")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=540)
    p.add_argument("--reserve", type=float, default=40, help="seconds kept for stopping and packing")
    p.add_argument("--gen-batch", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--small-epochs", type=int, default=1)
    p.add_argument("--samples", default="1000,3000,9000")
    p.add_argument("--capacities", default="adapter-r8,adapter-r8-mlp")
    p.add_argument("--small", default="small2-v8k,small4-v8k")
    p.add_argument("--tau-limit", type=int, default=None, help="prompts per tau set (default: all 20)")
    p.add_argument("--tau-jobs", type=int, default=6, help="tau measurements at once")
    p.add_argument(
        "--default-step-seconds",
        type=float,
        default=0.5,
        help="seconds a training step is assumed to take when no run has measured it (several runs share "
        "the GPU: 0.4-0.7 s on the H200 lease of 2026-12-04)",
    )
    p.add_argument(
        "--order",
        choices=("answers-first", "together"),
        default="answers-first",
        help="answers-first: the answers alone, then every training run (the standalone drafters on all "
        "rows); together: all at once, as the lease of 2026-12-04 did",
    )
    p.add_argument("--full-tau-seconds", type=float, default=0, help="time kept after the full-data runs")
    p = sub.add_parser("fetch")
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/scale")
    p.add_argument("--first", type=int, default=0, help="the first piece to write (0, 4, 8, ...)")
    args = parser.parse_args()
    {"export": export, "generate": generate, "run": run, "fetch": fetch}[args.command](args)


if __name__ == "__main__":
    main()
