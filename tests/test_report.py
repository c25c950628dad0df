"""Reports (d3d_hf.report): tables, and the `d3d-hf bench --output-dir` and `report` commands on tiny models saved
as folders with a word-level tokenizer."""

from __future__ import annotations

import json

import pytest

from d3d_hf.cli import main
from d3d_hf.report import PLOTS, format_suite_table, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def _bench_args(root, *extra):
    return [
        "bench",
        "--drafter",
        str(root / "drafter"),
        "--assistant",
        str(root / "assistant"),
        "--methods",
        "target,pld,ar-assist,d3d",
        "--prompts",
        str(root / "prompts.jsonl"),
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
        *extra,
    ]


def test_bench_output_dir_writes_results_report_and_plots(tiny_folders, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_bench_args(tiny_folders, "--cost-model", "--cost-prefix-length", "16", "--output-dir", str(out))) == 0
    printed = capsys.readouterr().out
    assert "predicted speed-up" in printed and "Target forward over n new tokens" in printed
    result = json.loads((out / "results.json").read_text())
    assert list(result["summary"]) == ["target", "pld", "ar-assist", "d3d"]
    assert all(s["lossless_match"] == 1.0 for s in result["summary"].values())
    assert result["summary"]["target"]["predicted_speedup"] == 1.0
    assert all(result["summary"][m]["predicted_speedup"] > 0 for m in ("pld", "ar-assist", "d3d"))
    assert result["cost_model"]["block_size"] == 4 and result["cost_model"]["draft_ms"]
    settings = result["settings"]
    assert settings["assistant"] == str(tiny_folders / "assistant") and settings["block_size"] == 4
    assert settings["dtype"] == "float32" and settings["torch_threads"] == 1
    assert result["method_settings"]["ar-assist"]["assistant_layers"] == 2
    report = (out / "report.md").read_text()
    assert "| prompts | method |" in report and "ar-assist" in report and "![speedup](speedup.png)" in report
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG
    # an existing folder is kept unless --overwrite
    assert main(_bench_args(tiny_folders, "--output-dir", str(out))) == 2
    assert "--overwrite" in capsys.readouterr().err

    # `d3d-hf report` over several results (here the same one twice, as two prompt sets)
    other = dict(result, settings=dict(result["settings"], prompts="other"))
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert (
        main(
            [
                "report",
                str(out / "results.json"),
                str(tmp_path / "other.json"),
                "--output-dir",
                str(tmp_path / "report"),
            ]
        )
        == 0
    )
    combined = (tmp_path / "report" / "report.md").read_text()
    assert combined.count("| d3d |") == 2 and "| other | d3d |" in combined
    assert all((tmp_path / "report" / name).read_bytes()[:8] == PNG for name in PLOTS)


def test_suite_table_aligns_optional_columns():
    base = {
        "tokens_per_second": 10.0,
        "speedup": 1.0,
        "median_speedup": 1.0,
        "tau": 1.0,
        "lossless_match": 1.0,
        "draft_ms": 0.0,
        "verify_ms": 0.0,
    }
    plain = {"summary": {"target": base}, "settings": {"prompts": "a", "dtype": "float32"}}
    rich = {
        "summary": {"target": base, "d3d": dict(base, predicted_speedup=2.0)},
        "settings": {"prompts": "b", "dtype": "bfloat16"},
    }
    lines = format_suite_table([plain, rich]).splitlines()
    assert lines[0].startswith("| prompts | method |") and lines[0].endswith("| predicted speed-up |")
    assert lines[2].startswith("| a (float32) | target |") and lines[2].endswith("| - |")
    assert lines[4].startswith("| b (bfloat16) | d3d |") and lines[4].endswith("| 2.00x |")
    assert len({line.count("|") for line in lines}) == 1


def test_write_report_rejects_nothing(tmp_path):
    with pytest.raises(ValueError, match="No results"):
        write_report([], tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{}", "no `summary` of methods"),
        (
            '{"summary": {"target": {"tau": 1.0}}, "runs": {"target": []}}',
            "summary of `target` lacks tokens_per_second",
        ),
        ('{"summary": {"d3d": {}}}', "`runs` do not cover"),
        ('{"a": 1}\n{"b": 2}\n', "is not a JSON file"),
        ("[1, 2]", "no `summary` of methods"),
    ],
)
def test_report_refuses_a_file_that_is_not_a_bench_result(tmp_path, capsys, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    out = tmp_path / "report"
    assert main(["report", str(bad), "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was written
