"""Drafters side by side on one machine (issue 37, item 4): draft-pass cost, drafter-alone tau and speed-ups.

For each drafter (shipped names or folders), in one session on an otherwise idle machine:

1. the draft pass at 1, 8 and 16 rows in one-row target steps (`small_drafter_cost.py --drafters`, `--cost-dtype`,
   the plain path: the same for every drafter);
2. its drafter-alone tau on `learning_curve.SETS` (`trl/compare_tau.py`: full blocks, no prompt lookup, greedy, float32,
   `--max-new-tokens`; lossless checked on every prompt);
3. `d3d-hf bench` with `target,pld,d3d,engine-lookup` on `--sets` in each of `--dtypes`: each drafter's ratios are
   taken within its own interleaved run (`engine-lookup` is the same engine with the drafter never drafting, so
   `d3d / engine-lookup` is what the drafter adds; the engine calibrates each drafter's own draft curve).

With `--tree-budget N`, step 2 also measures tau with a tree of `N` draft nodes from the same pass (`compare_tau.py
--tree-budget`; at `N = B - 1` the verification has a full chain's rows) and step 3 adds the `d3d-tree` method with
that budget. `--tree-budget adaptive` lets the engine size each tree by its calibrated costs
(`d3d_tree_budget="adaptive"`): the bench runs it, and tau keeps the chain only (an adaptive tree's size follows the
machine's costs, so it is not a drafter-alone measure).

Every step writes a file under `--out` and is skipped when that file exists, so a stopped run resumes; `--render`
only rebuilds `--out`/README.md from what is there.

    python benchmarks/drafter_side_by_side.py --drafters d3d-smollm2-135m-instruct runs/small4-v8k \
        --out benchmarks/results/small_drafter/side_by_side [--dtypes bfloat16,float32] \
        [--sets humaneval:20:20,gsm8k:0:10,mt-bench:0:10] [--threads 2] [--steps cost,tau,bench] [--tree-budget 15]
        [--render]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from learning_curve import SETS, tau_command

ROOT = Path(__file__).resolve().parents[1]
METHODS = "target,pld,d3d,engine-lookup"


def slug(drafter: str) -> str:
    """A file-name form of a drafter's name or folder."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", drafter.strip("/")).strip("_")


def _run(command: list[str]) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def tree_budget(value: str) -> int | str:
    """`--tree-budget`: a node count >= 1 or "adaptive"."""
    if value == "adaptive":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"--tree-budget takes a node count >= 1 or 'adaptive', got {value!r}")
    return int(value)


def _tau_trees(args) -> tuple[int | None, ...]:
    """The verifications tau is measured with: the chain, and a tree of `--tree-budget` nodes when it is a count."""
    return (None, args.tree_budget) if isinstance(args.tree_budget, int) else (None,)


def measure(args) -> None:
    out = Path(args.out)
    steps = set(args.steps.split(","))
    cost = out / f"cost_{args.cost_dtype}"
    if "cost" in steps and not cost.with_suffix(".json").is_file():
        _run([sys.executable, "benchmarks/small_drafter_cost.py", "--dtype", args.cost_dtype, "--threads",
              str(args.threads), "--layers", "", "--drafters", *args.drafters, "--repeats", str(args.repeats),
              "--output", str(cost.with_suffix(".md")), "--json", str(cost.with_suffix(".json"))])  # fmt: skip
    if "tau" in steps:
        for drafter in args.drafters:
            for name in SETS:
                for tree in _tau_trees(args):
                    path = out / "tau" / f"{slug(drafter)}-{name}{'' if tree is None else f'-tree{tree}'}.json"
                    if not path.is_file():
                        path.parent.mkdir(parents=True, exist_ok=True)
                        command = tau_command(Path(drafter), name, path, limit=args.tau_limit, threads=args.threads,
                                              max_new_tokens=args.max_new_tokens)  # fmt: skip
                        _run(command + ([] if tree is None else ["--tree-budget", str(tree)]))
    if "bench" in steps:
        for dtype in args.dtypes.split(","):
            for spec in args.sets.split(","):
                name, offset, limit = spec.split(":")
                for drafter in args.drafters:
                    folder = out / "bench" / slug(drafter) / f"{name}_{dtype}"
                    if not (folder / "results.json").is_file():
                        methods = METHODS + (",d3d-tree" if args.tree_budget else "")
                        tree = ["--tree-budget", str(args.tree_budget)] if args.tree_budget else []
                        _run(["d3d-hf", "bench", "--drafter", drafter, "--methods", methods, *tree, "--prompts", name,
                              "--offset", offset, "--limit", limit, "--max-new-tokens", str(args.max_new_tokens),
                              "--dtype", dtype, "--threads", str(args.threads), "--output-dir", str(folder),
                              "--overwrite"])  # fmt: skip


def render(args) -> str:
    """`--out`/README.md: one row per drafter (cost, tau per set) and one per drafter, set and dtype (speed-ups)."""
    out = Path(args.out)
    lines = [f"Drafters side by side; command: `python benchmarks/drafter_side_by_side.py --drafters "
             f"{' '.join(args.drafters)} --out {args.out} --dtypes {args.dtypes} --sets {args.sets} "
             f"--threads {args.threads}"
             + (f" --tree-budget {args.tree_budget}`" if args.tree_budget else "`"), ""]  # fmt: skip
    cost = out / f"cost_{args.cost_dtype}.json"
    costs = json.loads(cost.read_text()) if cost.is_file() else None
    if costs:
        lines += [f"CPU: {costs['cpu']}; draft pass in one-row target steps ({costs['dtype']}, {costs['threads']} "
                  f"threads; target: one row {costs['target_ms']['1']:.1f} ms, 16 rows "
                  f"{costs['target_ms']['16'] / costs['target_ms']['1']:.2f} steps).", ""]  # fmt: skip
    trees = _tau_trees(args)
    header = "| drafter | layers, head rows | pass 1 / 8 / 16 rows (steps) | "
    header += " | ".join(
        f"tau {n} {o}-{o + k - 1}" + ("" if tree is None else f", tree of {tree}")
        for n, (o, k) in SETS.items()
        for tree in trees
    )
    lines += [header + " |", "|---|---|---|" + "---|" * len(SETS) * len(trees)]
    for drafter in args.drafters:
        # small_drafter_cost.py labels a trained drafter's row "NAME (LAYERS, trained)"
        rows = (costs or {}).get("drafters", {})
        label, row = next(((k, v) for k, v in rows.items() if k.startswith(f"{drafter} (")), ("", None))
        shape = f"{label[len(drafter) + 2 :].split(',')[0]}, {row['head_rows']}" if row else "-"
        passes = " / ".join(f"{row['steps'][q]:.2f}" for q in ("1", "8", "16")) if row else "-"
        cells = []
        for name, tree in ((name, tree) for name in SETS for tree in trees):
            path = out / "tau" / f"{slug(drafter)}-{name}{'' if tree is None else f'-tree{tree}'}.json"
            if path.is_file():
                found = json.loads(path.read_text())
                tau, lossless = next(iter(found["tau"].values())), next(iter(found["lossless"].values()))
                cells.append(f"{tau:.2f} ({lossless:.0%} lossless)")
            else:
                cells.append("-")
        lines.append(f"| {drafter} | {shape} | {passes} | " + " | ".join(cells) + " |")
    lines += ["", "| drafter | set | dtype | pld | d3d (tau) | d3d-tree (tau; budget) | engine-lookup | "
              "d3d / engine-lookup | d3d / pld | d3d-tree / engine-lookup | drafter rounds | lossless (d3d) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for dtype in args.dtypes.split(","):
        for spec in args.sets.split(","):
            name, offset, limit = spec.split(":")
            for drafter in args.drafters:
                path = out / "bench" / slug(drafter) / f"{name}_{dtype}" / "results.json"
                if not path.is_file():
                    continue
                found = json.loads(path.read_text())
                s = found["summary"]
                budget = found.get("method_settings", {}).get("d3d-tree", {}).get("tree_budget", "?")
                sources = s["d3d"].get("round_sources", {})
                rounds = f"{sources.get('drafter', 0)} of {sum(sources.values())}" if sources else "-"
                tree, lookup = s.get("d3d-tree"), s["engine-lookup"]["speedup"]
                lines.append(
                    f"| {drafter} | {name} {offset}+{limit} | {dtype} | {s['pld']['speedup']:.2f}x | "
                    f"{s['d3d']['speedup']:.2f}x ({s['d3d']['tau']:.2f}) | "
                    + (f"{tree['speedup']:.2f}x ({tree['tau']:.2f}; {budget}) | " if tree else "- | ")
                    + f"{lookup:.2f}x | {s['d3d']['speedup'] / lookup:.2f} | "
                    f"{s['d3d']['speedup'] / s['pld']['speedup']:.2f} | "
                    + (f"{tree['speedup'] / lookup:.2f} | " if tree else "- | ")
                    + f"{rounds} | {s['d3d']['lossless_match']:.0%} |"
                )
    text = "\n".join(lines) + "\n"
    (out / "README.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", nargs="+", required=True, help="shipped names or folders")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--sets", default="humaneval:20:20,gsm8k:0:10,mt-bench:0:10", help="NAME:OFFSET:LIMIT,...")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cost-dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=15, help="of the cost timing")
    parser.add_argument("--tau-limit", type=int, help="fewer tau prompts per set than learning_curve.SETS")
    parser.add_argument("--steps", default="cost,tau,bench", help="which of cost,tau,bench to run")
    parser.add_argument(
        "--tree-budget",
        type=tree_budget,
        help="N: also tau with a tree of N drafts, and d3d-tree in the bench; adaptive: bench only",
    )
    parser.add_argument("--render", action="store_true", help="only rebuild README.md")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.render:
        measure(args)
    print(render(args))


if __name__ == "__main__":
    main()
