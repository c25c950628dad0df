"""`d3d-hf` (d3d_hf.cli) argument errors are reported clearly (exit code 2, a one-line message), most before any
model is loaded."""

from pathlib import Path

import pytest
from _tiny import tiny_target, tiny_tokenizer

from d3d_hf.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--methods", "target,eagle", "--drafter", "x"], "unknown --methods"),
        (["bench", "--methods", "target,d3d"], "needs --drafter"),
        (["bench", "--drafter", "x", "--limit", "0"], "--limit must be >= 1"),
        (["bench", "--drafter", "x", "--prompts", "/nonexistent/prompts.jsonl"], "does not exist"),
        (["bench", "--drafter", "x", "--worker-threads", "1"], "--worker-threads only apply to method d3d-async"),
        (["bench", "--drafter", "x", "--num-hypotheses", "2", "--reuse-on-miss"], "--num-hypotheses, --reuse-on-miss"),
    ],
)
def test_bench_argument_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_output_under_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["bench", "--drafter", "x", "--output", str(tmp_path / "file" / "r.json")]) == 2
    assert "parent of it is a file" in capsys.readouterr().err


def test_existing_results_are_not_overwritten(tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text("{}")
    assert main(["bench", "--drafter", "x", "--output", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert out.read_text() == "{}"


@pytest.mark.parametrize(
    "argv",
    [
        ["init-drafter", "--from", "t", "--output", "o", "--layer-ids", "0,a"],
        ["init-drafter", "--from", "t", "--output", "o", "--layer-ids", "1,1"],
        ["init-drafter", "--from", "t", "--output", "o", "--block-size", "0"],
        ["bench", "--drafter", "x", "--block-size", "-3"],
        ["bench", "--drafter", "x", "--threads", "-1"],
    ],
)
def test_bad_values_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "expected" in capsys.readouterr().err


def test_missing_drafter_folder(tmp_path, capsys):
    assert main(["generate", "--drafter", str(tmp_path / "none"), "--prompt", "hi"]) == 2
    assert "init-drafter" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["generate", "--drafter", str(tmp_path / "empty"), "--prompt", "hi"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_corrupt_drafter_weights_give_a_one_line_error(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _tiny import tiny_target

    from d3d_hf import D3DForDiffusionDrafting

    folder = tmp_path / "bad"
    D3DForDiffusionDrafting.from_autoregressive(tiny_target(), block_size=4).save_pretrained(folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    assert main(["generate", "--drafter", str(folder), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "\nerror:" in "\n" + err.splitlines()[-1] and "Traceback" not in err and "model.safetensors" in err


def test_bench_argument_errors_for_new_methods(tiny_folders, capsys):
    assert main(["bench", "--target", str(tiny_folders / "target"), "--methods", "target,ar-assist"]) == 2
    assert "needs --assistant" in capsys.readouterr().err
    bad = tiny_folders / "bad_assistant"
    tiny_target("llama", vocab_size=101).save_pretrained(bad)
    tiny_tokenizer(101).save_pretrained(bad)
    args = [
        "bench",
        "--target",
        str(tiny_folders / "target"),
        "--assistant",
        str(bad),
        "--methods",
        "target,ar-assist",
        "--prompts",
        str(tiny_folders / "prompts.jsonl"),
        "--max-new-tokens",
        "2",
    ]
    assert main(args) == 2
    assert "does not use the target's tokenizer" in capsys.readouterr().err
