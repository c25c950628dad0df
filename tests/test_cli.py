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
        (["bench", "--drafter", "x", "--worker-threads", "1"], "--worker-threads only applies to method d3d-async"),
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


@pytest.mark.parametrize("where", ["folder", "hub"])
def test_a_target_that_cannot_load_names_the_known_targets(where, tmp_path, capsys, monkeypatch):
    """A missing folder or an unreachable Hub id: one message, with the known target names once and no doubled
    full stop."""
    if where == "hub":
        import d3d_hf.targets

        def offline(*args, **kwargs):
            raise OSError("We couldn't connect to 'https://huggingface.co'. See offline mode.")

        monkeypatch.setattr(d3d_hf.targets, "load_target", offline)
    target = str(tmp_path / "absent") if where == "folder" else "nosuch-org/nosuch-target"
    assert main(["bench", "--methods", "target", "--target", target, "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("smollm2-135m-instruct") == 1 and ".." not in err, err


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


def test_a_missing_assistant_path_is_refused_before_any_model_loads(tiny_folders, capsys, monkeypatch):
    import d3d_hf.targets

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the --assistant check")

    monkeypatch.setattr(d3d_hf.targets, "load_target", no_load)
    missing = tiny_folders / "no_such_assistant"
    args = ["bench", "--target", str(tiny_folders / "target"), "--assistant", str(missing)]
    assert main([*args, "--methods", "target,ar-assist", "--prompts", str(tiny_folders / "prompts.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err and "ar-smollm2-135m-instruct" in err and "Traceback" not in err


# ----------------------------------------------------------------------------------------------------------------------
# values from outside are validated where they enter, before any model loads (issue 17)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--drafter", "x", "--max-new-tokens", "0"],
        ["generate", "--drafter", "x", "--prompt", "hi", "--max-new-tokens", "-1"],
        ["generate", "--drafter", "x", "--prompt", "hi", "--do-sample", "--temperature", "nan"],
        ["generate", "--drafter", "x", "--prompt", "hi", "--do-sample", "--top-k", "-2"],
        ["data", "--target", "t", "--output", "o", "--batch-size", "0"],
        ["data", "--target", "t", "--output", "o", "--max-new-tokens", "0"],
        ["data", "--target", "t", "--output", "o", "--temperature", "inf"],
        ["cost-model", "--target", "t", "--tau", "2,nan"],
        ["cost-model", "--target", "t", "--hit-rate", ","],
        ["init-drafter", "--from", "t", "--output", "o", "--num-layers", "0"],
        ["convert", "--from", "f", "--output", "o", "--block-size", "0"],
        ["convert", "--from", "f", "--output", "o", "--mask-token-id", "-1"],
        ["convert", "--from", "f", "--output", "o", "--threads", "0"],
        ["push", "--drafter", "d", "--repo-id", "me/x", "--threads", "0"],
        ["prune", "--drafter", "d", "--prompts", "stdlib", "--output", "o", "--min-tau-retention", "nan"],
    ],
    ids=lambda argv: " ".join(argv[:1] + argv[-2:]),
)
def test_more_bad_values_are_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "expected" in capsys.readouterr().err


@pytest.fixture
def no_model_loads(monkeypatch):
    """Makes loading a target or a drafter's weights fail the test: the error must come before."""
    import d3d_hf.drafters
    import d3d_hf.targets

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the argument error")

    monkeypatch.setattr(d3d_hf.targets, "load_target", refuse)
    monkeypatch.setattr(d3d_hf.drafters, "load_drafter", refuse)


def test_drafter_dependent_options_are_checked_before_loading(tiny_folders, no_model_loads, capsys):
    drafter = str(tiny_folders / "drafter")  # block size 4, 3 layers
    bench = ["bench", "--drafter", drafter, "--prompts", str(tiny_folders / "prompts.jsonl"), "--max-new-tokens", "2"]
    cases = [
        (bench + ["--methods", "target,d3d", "--num-drafts", "4"], "--num-drafts 4 is more than a block of 4 tokens"),
        (bench + ["--methods", "target,d3d", "--num-drafts", "4", "--block-size", "4"], "or a larger --block-size"),
        (
            bench + ["--methods", "target,d3d-async", "--num-hypotheses", "5"],
            "--num-hypotheses 5 is more than the block",
        ),
        (
            bench + ["--methods", "target,d3d-async", "--worker-threads", "100000"],
            "--worker-threads must be a whole number in [1, max(CPU count",
        ),
        (bench + ["--block-size", "513"], "--block-size 513 is longer than the drafter's context (512 tokens"),
        (
            ["generate", "--drafter", drafter, "--prompt", "t5", "--block-size", "600"],
            "--block-size 600 is longer than the drafter's context",
        ),
        (
            ["push", "--drafter", drafter, "--repo-id", "me/x", "--results", str(tiny_folders / "none.json")],
            "No results file at --results",
        ),
        (
            ["prune", "--drafter", drafter, "--prompts", "stdlib:4", "--limit", "2", "--num-layers", "3", "--output"]
            + [str(tiny_folders / "prune-out")],
            "--num-layers 3 must be below the drafter's 3 layers",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    # the largest valid values get past these checks (and then load, which the fixture refuses)
    for argv in (
        bench + ["--methods", "target,d3d", "--num-drafts", "3"],
        bench + ["--num-drafts", "7", "--block-size", "8"],
    ):
        with pytest.raises(AssertionError, match="a model was loaded"):
            main(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "0.7"], "--temperature only applies when sampling: add --do-sample"),
        (["--top-k", "5", "--top-p", "0.9"], "--top-k, --top-p only apply when sampling"),
        (["--do-sample", "--temperature", "0"], "--temperature must be > 0"),
        (["--do-sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ],
)
def test_generate_sampling_flags_are_checked_before_loading(argv, message, tiny_folders, no_model_loads, capsys):
    assert main(["generate", "--drafter", str(tiny_folders / "drafter"), "--prompt", "t5 t6"] + argv) == 2
    assert message in capsys.readouterr().err


def test_other_values_are_checked_before_loading(tiny_folders, no_model_loads, capsys):
    target = str(tiny_folders / "target")
    cases = [
        (["cost-model", "--target", target, "--tau", "0.5,2"], "--tau values must be >= 1"),
        (
            ["data", "--target", target, "--output", str(tiny_folders / "d"), "--temperature", "-1"],
            "--temperature must",
        ),
        (["data", "--target", target, "--output", target], "is not empty and holds no"),  # a folder of other files
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--position_weight_gamma", "0"], "`position_weight_gamma` must be a finite number > 0"),
        (["--block_size", "1"], "`block_size` must be a whole number >= 2"),
        (["--max_length", "1"], "`max_length` must be a whole number >= 2"),
        (["--block_lora_rank", "0"], "`block_lora_rank` must be a whole number >= 1"),
        (["--ar_loss_weight", "nan"], "`ar_loss_weight` must be a finite number"),
        (["--peft_lora_alpha", "-1"], "`peft_lora_alpha` must be a finite number > 0"),
        (["--init_block_size", "1"], "--init_block_size must be a whole number >= 2"),
        (["--tau_holdout", "-1"], "--tau_holdout must be a whole number >= 0"),
        (["--threads", "0"], "--threads must be a whole number >= 1"),
        (["--dtype", "float8"], "--dtype must be float32, bfloat16 or float16"),
        (["--tau_eval_steps", "5", "--tau_holdout", "0"], "pass --tau_holdout 1 or more"),
        (["--drafter", "d", "--num_layers", "4"], "--num_layers shape only a new drafter"),
        (
            ["--drafter", "d", "--shares_target_weights", "false", "--draft_vocab_size", "8"],
            "--shares_target_weights, --draft_vocab_size shape only a new drafter",
        ),
    ],
)
def test_train_values_are_checked_before_loading(flags, message, tmp_path, no_model_loads, capsys):
    argv = ["train", "--target", "t", "--data", str(tmp_path / "none"), "--output_dir", str(tmp_path / "out")]
    assert main(argv + ["--use_cpu"] + flags) == 2
    assert message in capsys.readouterr().err


def test_a_missing_optional_package_is_one_error_line(monkeypatch, capsys):
    """`d3d-hf train` without the training extras, and a prompt set whose package is not installed, end with one
    `error:` line that names the install step, not a traceback."""
    import builtins
    import sys

    real_import = builtins.__import__

    def no_trl(name, *args, **kwargs):
        if name in ("trl", "d3d_hf.training") or (name == "training" and "main" in (args[2] or ())):
            raise ModuleNotFoundError("No module named 'trl'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "d3d_hf.training", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_trl)
    assert main(["train", "--help"]) == 2
    assert "pip install -e '.[train]'" in capsys.readouterr().err
    monkeypatch.setattr(builtins, "__import__", real_import)

    from d3d_hf.cli import bench as bench_cli

    def missing(*args, **kwargs):
        raise ModuleNotFoundError("The 'mt-bench' prompt set needs the PyPI package 'flexeval': pip install flexeval")

    monkeypatch.setattr(bench_cli, "load_prompts", missing, raising=False)
    monkeypatch.setattr("d3d_hf.prompts.load_prompts", missing)
    assert main(["bench", "--drafter", "x", "--prompts", "mt-bench", "--limit", "1"]) == 2
    assert "error: The 'mt-bench' prompt set needs" in capsys.readouterr().err


def test_generate_reports_rounds_by_source_and_why_none_drafted():
    """`d3d-hf generate`'s closing lines count the rounds by where their candidates came from; when the cost-aware
    engine drafted in none, they say so and name the option that drafts every round."""
    from types import SimpleNamespace

    from d3d_hf.cli.generate import round_report

    mixed = SimpleNamespace(new_tokens=9, rounds=4, tau=2.25, round_sources=["drafter", "lookup", "drafter", "target"])
    report = round_report(mixed)
    assert "tau 2.25; rounds: drafter 2, lookup 1, target 1" in report and "no round drafted" not in report
    plain = SimpleNamespace(new_tokens=3, rounds=3, tau=1.0, round_sources=["target", "lookup", "target"])
    report = round_report(plain)
    assert "rounds: drafter 0, lookup 1, target 2" in report
    assert 'no round drafted' in report and 'd3d_num_drafts="full"' in report


def test_bench_notes_a_d3d_method_that_never_drafted():
    from d3d_hf.cli.bench import idle_drafter_notes

    summary = {
        "target": {"round_sources": {"target": 8}},
        "d3d": {"round_sources": {"lookup": 3, "target": 5}},
        "d3d-tree": {"round_sources": {"drafter": 2, "target": 3}},
        "engine-lookup": {"round_sources": {"lookup": 3, "target": 5}},  # never drafts, by design
    }
    notes = idle_drafter_notes(summary)
    assert len(notes) == 1 and notes[0].startswith("note: d3d drafted no round")
    assert "--num-drafts full --no-prompt-lookup" in notes[0]
    assert idle_drafter_notes({"d3d": {"round_sources": {}}}) == []  # no rounds recorded: nothing to say
