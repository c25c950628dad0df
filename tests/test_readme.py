"""The README's commands are the ones CI runs; its summary and options tables and docs/RESULTS.md's tables are generated
(benchmarks/render_readme.py) from the recorded JSON and the options declaration."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("python3 -m venv")]
    assert len(ci_lines) == 1
    assert ci_lines[0] in (ROOT / "README.md").read_text().splitlines()


def test_readme_results_table_is_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "render_readme.py"), "--check"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _render_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_readme", ROOT / "benchmarks" / "render_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_suite_section_renders_recorded_suite_results(tmp_path):
    import json

    render = _render_module()
    render.ROOT = tmp_path
    assert "not recorded yet" in render.render_suite()
    row = {"tokens_per_second": 20.0, "speedup": 1.0, "median_speedup": 1.0, "tau": 1.0, "lossless_match": 1.0,
           "draft_ms": 0.0, "verify_ms": 0.0, "predicted_speedup": 1.0}
    settings = {"target": "smollm2-135m-instruct", "drafter": "d3d-smollm2-135m-instruct", "drafter_layers": 30,
                "block_size": 16, "assistant": "runs/ar", "num_prompts": 10, "max_new_tokens": 128,
                "torch_threads": 2, "cpu_count": 2, "machine": "x86_64", "torch": "2.13", "transformers": "5.24"}
    for prompts in ("mt-bench", "humaneval"):
        for dtype in ("bfloat16", "float32"):
            folder = tmp_path / render.SUITE / f"{prompts}_{dtype}"
            folder.mkdir(parents=True)
            result = {"summary": {"target": row, "d3d": dict(row, speedup=0.8, tau=3.0)},
                      "settings": dict(settings, prompts=prompts, dtype=dtype),
                      "method_settings": {"pld": {"prompt_lookup_num_tokens": 10}}}
            (folder / "results.json").write_text(json.dumps(result))
    (tmp_path / render.SUITE / "report").mkdir()
    (tmp_path / render.SUITE / "report" / "speedup.png").write_bytes(b"")
    text = render.render_suite()
    # float32 before bfloat16, humaneval before mt-bench, one table per dtype with predicted speed-ups
    assert text.index("Benchmark suite, float32") < text.index("Benchmark suite, bfloat16")
    assert text.count("| prompts | method |") == 2 and "| predicted speed-up |" in text
    assert text.index("| humaneval | d3d |") < text.index("| mt-bench | d3d |")
    assert "![speedup](../benchmarks/results/suite/report/speedup.png)" in text and "tau_distribution" not in text
