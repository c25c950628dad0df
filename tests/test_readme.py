"""The README's commands are the ones CI runs, and its results table is generated from recorded JSON."""

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
