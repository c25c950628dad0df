"""Regenerates the generated parts of README.md and docs/RESULTS.md from the recorded benchmark JSON files and the
options declaration.

    python benchmarks/render_readme.py          # rewrite every block between its markers
    python benchmarks/render_readme.py --check  # exit 1 if a block is out of date

Each block lies between `<!-- NAME:start -->` and `<!-- NAME:end -->` (see BLOCKS):

- README.md: `summary` (one table of the cost-aware engine's speed-ups and what its drafter adds, from
  `benchmarks/results/contribution/`) and
  `options` (`options_markdown_table()`, the user options of `modeling/options_d3d.py`);
- docs/RESULTS.md: the detailed tables, one block per experiment (`results-engine`, `results-tree`,
  `results-full-block`, `results-async`, `results-pruning`, `results-suite`), and `internal-options`
  (`options_markdown_table(internal=True)`).

Every file listed in RESULTS must exist; each becomes one table with the settings and the command that made it.
The benchmark suite (`benchmarks/run_suite.sh`): every `benchmarks/results/suite/<set>_<dtype>/results.json`
found, one table per dtype over all prompt sets and methods (with the cost model's predicted speed-up), and the
plots of `benchmarks/results/suite/report/` when they exist; without suite results, a line saying how to record them.
Links in docs/RESULTS.md are relative to docs/ (`../benchmarks/...`).
"""

import argparse
import json
import sys
from pathlib import Path

from d3d_hf.modeling.options_d3d import options_markdown_table

from d3d_hf.bench import PromptRun, _round_plan_summary, format_round_plans, format_table
from d3d_hf.report import PLOTS, format_suite_table

ROOT = Path(__file__).resolve().parents[1]
README = "README.md"
RESULTS_DOC = "docs/RESULTS.md"
LINK = "../"  # docs/RESULTS.md links to repository files from docs/
RESULTS = [
    ("benchmarks/results/shipped_humaneval_float32.json", "shipped drafter `d3d-smollm2-135m-instruct`"),
    ("benchmarks/results/shipped_humaneval_bfloat16.json", "shipped drafter `d3d-smollm2-135m-instruct`"),
    ("benchmarks/results/foundation_humaneval_float32.json", "untrained drafter from `d3d-hf init-drafter`"),
    ("benchmarks/results/foundation_humaneval_bfloat16.json", "untrained drafter from `d3d-hf init-drafter`"),
]

# rendered when recorded (each names the script that records it)
OPTIONAL = [
    (
        "benchmarks/results/full_humaneval_float32_t1.json",
        "shipped drafter, **all 164 HumanEval prompts** (a tau and losslessness run at low priority beside other jobs: "
        "its tokens/s are not a speed measurement; speed is in the tables below)",
        "bash benchmarks/run_humaneval_full.sh float32 1",
    ),
    (
        "benchmarks/results/full_humaneval_bfloat16_t2.json",
        "shipped drafter, **all 164 HumanEval prompts**",
        "bash benchmarks/run_humaneval_full.sh bfloat16 2",
    ),
    ("benchmarks/results/async/humaneval_bfloat16_h1.json", "shipped drafter, async with 1 hypothesis", None),
    ("benchmarks/results/async/humaneval_bfloat16_h4.json", "shipped drafter, async with 4 hypotheses", None),
    ("benchmarks/results/async/humaneval_bfloat16_h16.json", "shipped drafter, async with 16 hypotheses", None),
    ("benchmarks/results/async/humaneval_float32_h4.json", "shipped drafter, async with 4 hypotheses", None),
    ("benchmarks/results/async/humaneval_bfloat16_h4_w2.json", "shipped drafter, async with 4 hypotheses", None),
]
PRUNING = "benchmarks/pruning/pruning_path.json"
PRUNED = "benchmarks/results/pruning/humaneval_bfloat16_{}layers.json"


SUITE = "benchmarks/results/suite"
DTYPE_ORDER = ("float32", "bfloat16", "float16")
SET_ORDER = ("humaneval", "gsm8k", "mt-bench", "vicuna-bench")


def _order(result: dict) -> tuple:
    st = result["settings"]
    dtype, prompts = st.get("dtype"), st.get("prompts")
    return (
        DTYPE_ORDER.index(dtype) if dtype in DTYPE_ORDER else len(DTYPE_ORDER),
        SET_ORDER.index(prompts) if prompts in SET_ORDER else len(SET_ORDER),
        str(prompts),
    )


def render_suite() -> str:
    files = sorted((ROOT / SUITE).glob("*/results.json"))
    if not files:
        return (
            "**Benchmark suite** (target, prompt lookup, autoregressive assistant and D3D on HumanEval, GSM8K and "
            "MT-Bench, float32 and bfloat16, with the cost model): not recorded yet; `bash benchmarks/run_suite.sh` "
            "records it here.\n"
        )
    results = sorted((json.loads(f.read_text()) for f in files), key=_order)
    parts = []
    for dtype in dict.fromkeys(r["settings"]["dtype"] for r in results):
        group = [r for r in results if r["settings"]["dtype"] == dtype]
        st = group[0]["settings"]
        sets = ", ".join(f"{r['settings']['num_prompts']} {r['settings']['prompts']}" for r in group)
        parts.append(
            f"**Benchmark suite, {dtype}**: **{st['target']}**, the shipped drafter `{st['drafter']}` "
            f"({st['drafter_layers']} layers, block size {st['block_size']}), the autoregressive assistant "
            f"`{st.get('assistant')}` (`examples/train_ar_assistant.sh`), prompt lookup with "
            f"{group[0].get('method_settings', {}).get('pld', {}).get('prompt_lookup_num_tokens')} tokens; "
            f"{sets} prompts, {st['max_new_tokens']} new tokens, {st['torch_threads']} threads on {st['cpu_count']} "
            f"CPU cores ({st['machine']}), torch {st['torch']}, transformers {st['transformers']}. Recorded in "
            f"[`{SUITE}/`]({LINK}{SUITE}/) by `bash benchmarks/run_suite.sh`; predicted speed-ups from the cost model "
            "(`d3d_hf.costmodel`) measured in the same runs."
        )
        parts.append("")
        parts.append(format_suite_table(group))
        parts.append("")
    plots = [f"{SUITE}/report/{name}" for name in PLOTS if (ROOT / SUITE / "report" / name).exists()]
    parts += [f"![{Path(p).stem}]({LINK}{p})" for p in plots]
    return "\n".join(parts).rstrip() + "\n"


ENGINE = "benchmarks/results/engine"
CONTRIBUTION = "benchmarks/results/contribution"


def render_engine() -> list[str]:
    """The cost-aware engine's run (`bash benchmarks/run_engine.sh`): one table per dtype over the prompt sets, with
    the machine's CPU and extensions, and each set's rounds by candidate source and chosen `k`."""
    files = sorted((ROOT / ENGINE).glob("*/results.json"))
    if not files:
        return []
    results = sorted((json.loads(f.read_text()) for f in files), key=_order)
    parts = []
    for dtype in dict.fromkeys(r["settings"]["dtype"] for r in results):
        group = [r for r in results if r["settings"]["dtype"] == dtype]
        st = group[0]["settings"]
        cpu = st.get("cpu") or {}
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if cpu.get(f)]
        sets = ", ".join(f"{r['settings']['num_prompts']} {r['settings']['prompts']}" for r in group)
        parts.append(
            f"**Cost-aware engine, {dtype}**: **{st['target']}** with the shipped drafter `{st['drafter']}` "
            f"({st['drafter_layers']} layers, block size {st['block_size']}; `d3d` and `d3d-async` in the default "
            f"adaptive mode), prompt lookup with "
            f"{group[0].get('method_settings', {}).get('pld', {}).get('prompt_lookup_num_tokens')} tokens; {sets} "
            f"prompts, {st['max_new_tokens']} new tokens, {st['torch_threads']} threads on {st['cpu_count']} CPU "
            f"cores ({cpu.get('model', st['machine'])}; {' '.join(flags) or 'no AVX2'}), torch {st['torch']}, "
            f"transformers {st['transformers']}. Recorded in [`{ENGINE}/`]({LINK}{ENGINE}/) by "
            "`bash benchmarks/run_engine.sh`."
        )
        parts += ["", format_suite_table(group), ""]
        for result in group:
            plans = format_round_plans(_plan_summary(result))
            if plans:
                parts += [
                    f"Rounds on {result['settings']['prompts']} ({dtype}) by candidate source and `k`:",
                    "",
                    plans,
                    "",
                ]
    return parts


def _plan_summary(result: dict) -> dict:
    """The recorded summary with each method's round plan summary recomputed from its recorded runs (results
    recorded before `drafter_token_share` existed get it too)."""
    summary = {m: dict(s) for m, s in result["summary"].items()}
    fields = set(PromptRun.__dataclass_fields__)
    for method, runs in result.get("runs", {}).items():
        if method in summary:
            summary[method].update(_round_plan_summary([PromptRun(**{k: v for k, v in r.items() if k in fields})
                                                        for r in runs]))
    return summary


TREE = "benchmarks/results/tree"


def _table_and_plans(result: dict) -> list[str]:
    """One run's results table, then its rounds by candidate source and `k` (when it has D3D rounds)."""
    plans = format_round_plans(_plan_summary(result))
    return [format_suite_table([result]), ""] + ([plans, ""] if plans else [])


def render_tree() -> list[str]:
    """Tree verification (`bash benchmarks/run_tree.sh`): the speed cells (adaptive engine with and without trees,
    one table per dtype) and the acceptance cells (a 16-node tree every round, float32, one table over the sets)."""
    speed = sorted((ROOT / TREE).glob("speed_*/results.json"))
    tau = sorted((ROOT / TREE).glob("tau_*/results.json"))
    if not speed and not tau:
        return []
    parts = []
    for f in speed:
        result = json.loads(f.read_text())
        st = result["settings"]
        cpu = st.get("cpu") or {}
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if cpu.get(f)]
        budget = result.get("method_settings", {}).get("d3d-tree", {}).get("tree_budget")
        parts += [
            f"**Tree verification, {st['dtype']}**: **{st['target']}** with the shipped drafter `{st['drafter']}`; "
            f"`d3d` the cost-aware engine (chain rounds), `d3d-tree` the same engine whose drafter rounds verify a "
            f"best-first tree of at most {budget} nodes (prompt-lookup match as a branch, the target's cache shared); "
            f"{st['num_prompts']} {st['prompts']} prompts (from #{st.get('offset', 0)}), {st['max_new_tokens']} new "
            f"tokens, {st['torch_threads']} threads on {st['cpu_count']} CPU cores ({cpu.get('model', st['machine'])}; "
            f"{' '.join(flags) or 'no AVX2'}), torch {st['torch']}, transformers {st['transformers']}. Recorded in "
            f"[`{f.parent.relative_to(ROOT)}/`]({LINK}{f.parent.relative_to(ROOT)}/) by `bash benchmarks/run_tree.sh`.",
            "",
        ]
        parts += _table_and_plans(result)
    for f in sorted((ROOT / TREE).glob("cache_*/results.json")):
        result = json.loads(f.read_text())
        st = result["settings"]
        parts += [
            f"**The shared target cache, {st['dtype']}**: `d3d` (the drafter attends to the target's cache; each pass "
            "ingests one token) against `d3d-own-cache` (`d3d_share_target_cache=False`: its own cache, re-running "
            f"the committed tokens), same run; {st['num_prompts']} {st['prompts']} prompts (from "
            f"#{st.get('offset', 0)}), {st['max_new_tokens']} new tokens, {st['torch_threads']} threads. Recorded in "
            f"[`{f.parent.relative_to(ROOT)}/`]({LINK}{f.parent.relative_to(ROOT)}/) by `bash benchmarks/run_tree.sh`.",
            "",
        ]
        parts += _table_and_plans(result)
    if tau:
        results = sorted((json.loads(f.read_text()) for f in tau), key=_order)
        st = results[0]["settings"]
        sets = ", ".join(f"{r['settings']['num_prompts']} {r['settings']['prompts']}" for r in results)
        parts += [
            f"**The trees themselves, {st['dtype']}**: a drafter round with a 16-node tree every round (`--num-drafts "
            f"full --tree-budget 16`), so tau is the trees' acceptance, not the engine's mix; {sets} prompts, "
            f"{st['max_new_tokens']} new tokens, {st['torch_threads']} threads. Recorded in "
            f"[`{TREE}/`]({LINK}{TREE}/) by `bash benchmarks/run_tree.sh`.",
            "",
            format_suite_table(results),
            "",
        ]
    return parts


def _render_result(rel: str, label: str, command: str | None = None) -> list[str]:
    data = json.loads((ROOT / rel).read_text())
    st = data["settings"]
    workers = data.get("method_settings", {}).get("d3d-async", {}).get("worker_threads")
    if workers:
        label += f" and a {workers}-thread packed-pass worker"
    offset = f" (from #{st['offset']})" if st.get("offset") else ""
    return [
        f"**{st['target']}** with the {label} ({st['drafter_layers']} layers), "
        f"{st['dtype']}, {st['num_prompts']} {st['prompts']} prompts{offset}, {st['max_new_tokens']} new tokens, "
        f"block size {st['block_size']}, {st['torch_threads']} threads on {st['cpu_count']} CPU cores "
        f"({st['machine']}), torch {st['torch']}, transformers {st['transformers']}. "
        f"Recorded in [`{rel}`]({LINK}{rel}) by `{command or st['command']}`.",
        "",
        format_table(data["summary"]),
        "",
    ]


def render_pruning() -> list[str]:
    if not (ROOT / PRUNING).exists():
        return []
    path = json.loads((ROOT / PRUNING).read_text())
    lines = [
        f"**Progressive layer pruning** of the shipped drafter (`{path['command']}`; calibration: "
        f"{len(path['prompt_ids'])} held-out stdlib prompts x {path['max_new_tokens']} tokens, {path['dtype']}, "
        f"{path['threads']} thread), with HumanEval speed of the pruned drafters where recorded "
        "(`bash benchmarks/pruning/bench_pruned.sh`: 5 prompts x 128 tokens, bfloat16, 2 threads):",
        "",
        "| layers | removed layer | calibration tau | retention | draft ms/block (calibration) "
        "| HumanEval tau | d3d speed-up | d3d-async speed-up |",
        "|" + "---|" * 8,
    ]
    for step in path["steps"]:
        cells = ["-", "-", "-"]
        bench = ROOT / PRUNED.format(step["num_layers"])
        if bench.exists():
            summary = json.loads(bench.read_text())["summary"]
            cells = [
                f"{summary['d3d']['tau']:.2f}",
                f"{summary['d3d']['speedup']:.2f}x",
                f"{summary['d3d-async']['speedup']:.2f}x",
            ]
        removed = "-" if step["removed_layer"] is None else step["removed_layer"]
        lines.append(
            f"| {step['num_layers']} | {removed} | {step['tau']:.3f} | {step['tau_retention']:.3f} | "
            f"{step['draft_ms']:.1f} | " + " | ".join(cells) + " |"
        )
    lines += ["", f"![pruning curve]({LINK}benchmarks/pruning/pruning_curve.png)", ""]
    return lines


WORKER_THREADS = "benchmarks/results/async/worker_threads_*.json"


def render_worker_threads() -> list[str]:
    files = sorted(ROOT.glob(WORKER_THREADS), key=lambda f: int(f.stem.rsplit("_h", 1)[1]))
    if not files:
        return []
    lines = [
        "**d3d-async, packed-pass worker with 1 vs 2 torch threads** (`d3d_worker_threads`; default half of the "
        "caller's threads), interleaved prompt by prompt in one run per row (`benchmarks/async_worker_threads.py`; "
        "HumanEval prompts 20-29, 128 new tokens, 2 threads, tokens/s and speed-up over the target):",
        "",
        "| dtype | hypotheses | target | d3d | d3d-async, 1-thread worker | d3d-async, 2-thread worker | hit rate "
        "| async draft / verify ms, 1-thread worker | 2-thread worker |",
        "|" + "---|" * 9,
    ]
    for f in files:
        data = json.loads(f.read_text())
        summary, dtype = data["summary"], data["settings"]["dtype"]

        cell = {m: f"{s['tokens_per_second']:.1f} ({s['speedup']:.2f}x)" for m, s in summary.items()}
        times = {m: f"{s['draft_ms']:.0f} / {s['verify_ms']:.0f}" for m, s in summary.items()}
        hypotheses = data["method_settings"]["d3d-async-w1"]["hypotheses"]
        lines.append(
            f"| {dtype} | {hypotheses} | {cell['target']} | {cell['d3d']} | {cell['d3d-async-w1']} | "
            f"{cell['d3d-async-w2']} | {summary['d3d-async-w1']['hit_rate']:.0%} | {times['d3d-async-w1']} | "
            f"{times['d3d-async-w2']} |"
        )
    lines += ["", f"Recorded in `{WORKER_THREADS}`.", ""]
    return lines


def _cpu_text(settings: dict) -> str:
    """The machine as the engine bench recorded it: CPU model, its AVX2 / AVX-512 / AMX flags."""
    cpu = settings.get("cpu") or {}
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if cpu.get(f)]
    if cpu and not (cpu.get("amx_bf16") or cpu.get("amx_tile")):
        flags.append("no AMX")
    return f"{cpu.get('model', settings['machine'])} ({', '.join(flags) or 'no AVX2'})"


SET_NAMES = {"humaneval": "HumanEval", "gsm8k": "GSM8K", "mt-bench": "MT-Bench", "vicuna-bench": "Vicuna-Bench"}


def render_summary() -> str:
    """README's one table: the drafter-contribution run (`bash benchmarks/run_drafter_contribution.sh`: the engine,
    its baselines and its ablations in one run per cell), one row per prompt set and dtype, with the target's
    tokens/s, prompt lookup's and D3D's speed-ups, D3D's tau and lossless match; then what the drafter adds."""
    files = sorted((ROOT / CONTRIBUTION).glob("*/results.json"))
    if not files:
        return (
            "Not recorded yet: `bash benchmarks/run_drafter_contribution.sh` records it in "
            "`benchmarks/results/contribution/`.\n"
        )
    results = sorted((json.loads(f.read_text()) for f in files), key=_order)
    st = results[0]["settings"]
    sets = ", ".join(
        f"{SET_NAMES.get(r['settings']['prompts'], r['settings']['prompts'])} "
        f"{r['settings'].get('offset', 0)}-{r['settings'].get('offset', 0) + r['settings']['num_prompts'] - 1}"
        for r in results
        if r["settings"]["dtype"] == st["dtype"]
    )
    lines = [
        f"**{st['target']}** with the shipped drafter `{st['drafter']}`, greedy, {st['max_new_tokens']} new tokens, "
        f"prompts {sets}; machine: {_cpu_text(st)}, {st['torch_threads']} torch threads on {st['cpu_count']} cores; "
        f"torch {st['torch']}, transformers {st['transformers']}. Speed-ups are aggregate tokens/s over the target "
        f"alone in the same run; tau is tokens committed per target forward. Recorded in "
        f"[`{CONTRIBUTION}/`]({CONTRIBUTION}/) by `bash benchmarks/run_drafter_contribution.sh`.",
        "",
        "| prompts | dtype | target tok/s | prompt lookup (pld) speed-up | d3d speed-up | d3d tau | d3d lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        rs, summary = result["settings"], result["summary"]
        target, pld, d3d = summary["target"], summary.get("pld"), summary["d3d"]
        lines.append(
            f"| {SET_NAMES.get(rs['prompts'], rs['prompts'])} | {rs['dtype']} | {target['tokens_per_second']:.1f} | "
            + (f"{pld['speedup']:.2f}x" if pld else "-")
            + f" | **{d3d['speedup']:.2f}x** | {d3d['tau']:.2f} | {100 * d3d['lossless_match']:.0f}% |"
        )
    return "\n".join(lines + _contribution_summary()) + "\n"


def _contribution_summary() -> list[str]:
    """README lines: what the drafter adds, from the cells of `bash benchmarks/run_drafter_contribution.sh` (each a
    run of its own: target, pld, d3d and engine-lookup interleaved per prompt)."""
    files = sorted((ROOT / CONTRIBUTION).glob("*/results.json"))
    if not files:
        return []
    lines = [
        "",
        "What the drafter adds: `engine-lookup` is the same engine with its drafter never drafting (plain steps and "
        "its sized prompt-lookup rounds); each row is one run of its own "
        f"([`{CONTRIBUTION}/`]({CONTRIBUTION}/), `bash benchmarks/run_drafter_contribution.sh`, same machine).",
        "",
        "`d3d-fused` is `d3d` with fused successor drafting forced on (`d3d_fused_drafting=True`: the next round's "
        "block drafted inside the verification; the default 'auto' is off on CPU); block hits: its verifications with "
        "drafter blocks whose accepted path ended at one.",
        "",
        "| prompts | dtype | target tok/s | pld | d3d | d3d-fused | engine-lookup | d3d / engine-lookup "
        "| tokens from drafter rounds | block hits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def speedup(summary: dict, method: str) -> str:
        return f"{summary[method]['speedup']:.2f}x" if method in summary else "-"

    for result in sorted((json.loads(f.read_text()) for f in files), key=_order):
        rs, summary = result["settings"], _plan_summary(result)
        offset = rs.get("offset", 0)
        d3d, lookup = summary["d3d"], summary["engine-lookup"]
        fused = summary.get("d3d-fused", {}).get("successor") or d3d.get("successor")
        hits = f"{100 * fused['hit_rate']:.0f}% of {fused['verifications_with_blocks']}" if fused else "-"
        lines.append(
            f"| {SET_NAMES.get(rs['prompts'], rs['prompts'])} {offset}-{offset + rs['num_prompts'] - 1} | "
            f"{rs['dtype']} | {summary['target']['tokens_per_second']:.1f} | {speedup(summary, 'pld')} | "
            f"{d3d['speedup']:.2f}x | {speedup(summary, 'd3d-fused')} | {lookup['speedup']:.2f}x | "
            f"{d3d['speedup'] / lookup['speedup']:.2f} | {100 * d3d.get('drafter_token_share', 0.0):.0f}% | {hits} |"
        )
    return lines


def render_full_block() -> list[str]:
    """Full-block drafting (the engine before the policy): all 164 HumanEval prompts, the shipped and the untrained
    drafter on the first 20."""
    parts = []
    for rel, label, command in OPTIONAL[:2]:
        if (ROOT / rel).exists():
            parts += _render_result(rel, label, command)
    for rel, label in RESULTS:
        parts += _render_result(rel, label)
    return parts


def render_async() -> list[str]:
    """Asynchronous drafting: the `bash benchmarks/run_async.sh` runs, then the worker-thread comparison."""
    parts = []
    for rel, label, command in OPTIONAL[2:]:
        if (ROOT / rel).exists():
            parts += _render_result(rel, label, command)
    return parts + render_worker_threads()


def render_contribution() -> list[str]:
    """What the drafter adds (`bash benchmarks/run_drafter_contribution.sh`): each recorded cell's table (target,
    pld, d3d, engine-lookup) and its rounds by candidate source, with the share of tokens from drafter rounds."""
    files = sorted((ROOT / CONTRIBUTION).glob("*/results.json"))
    if not files:
        return ["Not recorded yet: `bash benchmarks/run_drafter_contribution.sh`."]
    parts = []
    for result in sorted((json.loads(f.read_text()) for f in files), key=_order):
        st = result["settings"]
        offset = st.get("offset", 0)
        parts += [
            f"**{SET_NAMES.get(st['prompts'], st['prompts'])} {offset}-{offset + st['num_prompts'] - 1}, "
            f"{st['dtype']}**: {st['target']} with `{st['drafter']}`, {st['max_new_tokens']} new tokens, "
            f"{st['torch_threads']} threads ({_cpu_text(st)}), torch {st['torch']}.",
            "",
            *_table_and_plans(result),
        ]
    return parts


def _text(parts: list[str] | str) -> str:
    text = parts if isinstance(parts, str) else "\n".join(parts)
    return text.rstrip() + "\n"


# (file, block name, renderer): each block lies between `<!-- NAME:start -->` and `<!-- NAME:end -->` in its file
BLOCKS = [
    (README, "summary", render_summary),
    (README, "options", lambda: options_markdown_table() + "\n"),
    (RESULTS_DOC, "results-engine", lambda: _text(render_engine())),
    (RESULTS_DOC, "results-contribution", lambda: _text(render_contribution())),
    (RESULTS_DOC, "results-tree", lambda: _text(render_tree())),
    (RESULTS_DOC, "results-full-block", lambda: _text(render_full_block())),
    (RESULTS_DOC, "results-async", lambda: _text(render_async())),
    (RESULTS_DOC, "results-pruning", lambda: _text(render_pruning())),
    (RESULTS_DOC, "results-suite", render_suite),
    (RESULTS_DOC, "internal-options", lambda: options_markdown_table(internal=True) + "\n"),
]


def replace_block(text: str, name: str, content: str) -> str:
    """`text` with what lies between the `name` markers replaced by `content` (a `KeyError` when a marker is
    missing)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise KeyError(f"lacks the {start} / {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{content}{end}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for rel in dict.fromkeys(rel for rel, _, _ in BLOCKS):
        path = ROOT / rel
        text = path.read_text()
        new = text
        for _, name, render in (b for b in BLOCKS if b[0] == rel):
            try:
                new = replace_block(new, name, render())
            except KeyError as error:
                print(f"{rel} {error.args[0]}")
                return 1
        if new != text:
            stale.append(rel)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"{', '.join(stale)} out of date: run `python benchmarks/render_readme.py`")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
