"""Model cards, hub-ready folders and `push_to_hub` up to the upload call (no network)."""

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from _tiny import tiny_target, word_tokenizer
from d3d_hf.modeling.hooks_d3d import SUPPORTED_TRANSFORMERS
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.errors import EntryNotFoundError
from transformers import AutoModel

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.cli import main
from d3d_hf.hub import (
    CARD_DATA_FILE,
    CARD_MARKER,
    DrafterCardData,
    MeasuredResult,
    load_card_data,
    render_model_card,
    result_from_benchmark,
)

MODELING_FILES = tuple(sorted(p.name for p in (Path(__file__).resolve().parents[1] / "modeling").glob("*_d3d.py")))
RESULTS = [
    MeasuredResult(
        prompts="HumanEval (first 20)",
        num_prompts=20,
        tau=2.13,
        speedup=1.87,
        tokens_per_second=41.25,
        target_tokens_per_second=22.05,
        lossless_match=1.0,
        dtype="float32",
        hardware="2-core x86_64 CPU, 2 threads",
        block_size=16,
        max_new_tokens=128,
        decoding="greedy",
        command="d3d-hf bench --limit 20",
    ),
    {"prompts": "MT-Bench", "tau": 3.456, "hardware": "1x H200", "dtype": "bfloat16"},  # no speed-up measured
]


def split_card(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


@pytest.fixture
def drafter():
    d = D3DForDiffusionDrafting.from_autoregressive(
        tiny_target("qwen3"), layer_ids=[0, 2], block_size=4, source_model="Qwen/Qwen3-tiny"
    )
    d.config.target_model = "Qwen/Qwen3-tiny-target"
    return d


@pytest.fixture
def fake_hub(monkeypatch):
    """Replaces the network calls of `push_to_hub`; records what `create_commit` would upload."""
    uploads = {"commits": [], "remote_readme": None}

    def create_repo(self, repo_id, **kwargs):
        uploads["create_repo"] = {"repo_id": repo_id, **kwargs}
        return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"me/{repo_id}"})()

    def hf_hub_download(self, repo_id, filename, **kwargs):
        if uploads["remote_readme"] is None:
            raise EntryNotFoundError(f"{filename} not found in {repo_id}")
        return str(uploads["remote_readme"])

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for op in operations:
            with open(op.path_or_fileobj, "rb") as f:  # the temporary folder is gone after the call
                files[op.path_in_repo] = f.read()
        uploads["commits"].append({"repo_id": repo_id, "files": files, **kwargs})
        return type("CommitInfo", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return uploads


def test_card_front_matter_sections_and_numbers(drafter):
    text = render_model_card(
        drafter,
        results=RESULTS,
        training={"steps": 360, "learning_rate": 5e-05, "lambda_ar": 0.5, "data": "480 target-answered prompts"},
        datasets=["me/target-answers"],
        repo_id="me/d3d-tiny",
    )
    front, body = split_card(text)
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert {"custom_code", "speculative-decoding", "d3d"} <= set(front["tags"])
    assert front["base_model"] == "Qwen/Qwen3-tiny"
    assert front["target_model"] == "Qwen/Qwen3-tiny-target"
    assert front["datasets"] == ["me/target-answers"]
    assert ModelCard(text).data.target_model == "Qwen/Qwen3-tiny-target"  # huggingface_hub reads it too
    assert CARD_MARKER in body
    sections = (
        "## Quick start",
        "## Compatibility",
        "## Training recipe",
        "## Measured",
        "## Framework",
        "## Citation",
    )
    for section in sections:
        assert section in body, section
    assert 'target_id = "Qwen/Qwen3-tiny-target"' in body and "assistant_model=drafter" in body
    assert 'AutoModel.from_pretrained("me/d3d-tiny", trust_remote_code=True' in body
    assert f">= {SUPPORTED_TRANSFORMERS[0]}, < {SUPPORTED_TRANSFORMERS[1]}" in body
    assert "decodes a left-padded batch" in body
    # measured numbers exactly as passed, missing ones said so
    row = next(line for line in body.splitlines() if line.startswith("| HumanEval"))
    cells = ("20 prompts", "2-core x86_64 CPU, 2 threads", "float32", "| 16 |", "| 128 |", "greedy", "2.13", "1.87x")
    for cell in cells:
        assert cell in row, cell
    assert "41.2" in row and "22.1" in row and "100%" in row  # formatted, not changed
    row = next(line for line in body.splitlines() if line.startswith("| MT-Bench"))
    assert "3.46" in row and "1x H200" in row and row.count("not measured") == 4
    assert "`d3d-hf bench --limit 20`" in body
    assert "| steps | 360 |" in body and "| learning_rate | 5e-05 |" in body
    assert "Initialised from Qwen/Qwen3-tiny, keeping source layers [0, 2]" in body
    assert f"- transformers: {transformers.__version__}" in body
    assert "eprint        = {2611.06425}" in body and "title         = {D3D}" in body and "author" not in body


def test_card_without_data_invents_nothing(drafter):
    drafter.config.source_model = "/some/local/folder"
    drafter.config.target_model = None
    front, body = split_card(render_model_card(drafter.config))
    assert "base_model" not in front and "target_model" not in front and "datasets" not in front
    assert "Not measured: no measurement was attached" in body
    assert "No training record was attached" in body and "Training data: not recorded." in body
    assert 'target_id = "TARGET_MODEL_ID"' in body and "The target model was not recorded" in body
    assert "x |" not in body.split("## Measured")[1].split("## Framework")[0]  # no speed-up cell anywhere
    with pytest.raises(TypeError, match="tua"):
        MeasuredResult.from_dict({"prompts": "x", "tua": 2.0})


def test_result_from_benchmark():
    bench = {
        "summary": {
            "target": {"tokens_per_second": 23.0, "tau": 1.0},
            "d3d": {"prompts": 8, "tokens_per_second": 30.5, "speedup": 1.33, "tau": 2.1, "lossless_match": 1.0},
        },
        "settings": {
            "target": "smollm2-135m-instruct",
            "dtype": "float32",
            "block_size": 16,
            "prompts": "humaneval",
            "limit": 8,
            "max_new_tokens": 64,
            "decoding": "greedy",
            "command": "d3d-hf bench --limit 8",
            "cpu_count": 2,
            "machine": "x86_64",
            "torch_threads": 2,
            "cuda": None,
        },
    }
    r = result_from_benchmark(bench)
    assert (r.tau, r.speedup, r.tokens_per_second, r.target_tokens_per_second) == (2.1, 1.33, 30.5, 23.0)
    assert r.prompts == "humaneval (first 8)" and r.num_prompts == 8 and r.hardware == "2-core x86_64 CPU, 2 threads"
    bench["settings"]["offset"] = 20  # `--offset 20 --limit 8`: not the first 8
    assert result_from_benchmark(bench).prompts == "humaneval (prompts 20-27)"
    with pytest.raises(ValueError, match="no summary"):
        result_from_benchmark({"summary": {"target": {}}})


def test_save_pretrained_writes_card_and_keeps_a_user_readme(drafter, tmp_path):
    path = tmp_path / "my.d3d-drafter_v0.1"
    drafter.card_data = DrafterCardData(results=[RESULTS[0]], datasets=["me/target-answers"])
    drafter.save_pretrained(path, tokenizer=word_tokenizer())
    for name in ("model.safetensors", "config.json", *MODELING_FILES, "README.md", CARD_DATA_FILE, "tokenizer.json"):
        assert (path / name).is_file(), name
    assert "card_data" not in json.loads((path / "config.json").read_text())  # measured numbers stay out of config
    assert "| 2.13 |" in (path / "README.md").read_text()
    assert load_card_data(path) == drafter.card_data
    # a generated card is regenerated from the new data
    drafter.card_data = {"results": [{"prompts": "HumanEval", "tau": 2.5}]}
    drafter.save_pretrained(path)
    assert "| 2.50 |" in (path / "README.md").read_text() and "| 2.13 |" not in (path / "README.md").read_text()
    # a README the user wrote is kept
    (path / "README.md").write_text("# My own card\n")
    with pytest.warns(UserWarning, match="not generated by d3d-hf"):
        drafter.save_pretrained(path)
    assert (path / "README.md").read_text() == "# My own card\n"
    drafter.save_pretrained(tmp_path / "no-card", model_card=False)
    assert not (tmp_path / "no-card" / "README.md").exists()


def test_push_to_hub_uploads_a_complete_folder(drafter, fake_hub, tmp_path):
    drafter.card_data = {"results": [RESULTS[0]]}
    drafter.push_to_hub("me/d3d-tiny", tokenizer=word_tokenizer(), private=True)
    assert fake_hub["create_repo"]["private"] is True
    (commit,) = fake_hub["commits"]
    files = commit["files"]
    assert commit["repo_id"] == "me/d3d-tiny" and commit["commit_message"] == "Upload D3D drafter"
    expected = {"model.safetensors", "config.json", *MODELING_FILES, "README.md", CARD_DATA_FILE, "tokenizer.json"}
    assert expected <= set(files), sorted(files)
    assert "tokenizer_config.json" in files
    config = json.loads(files["config.json"])
    assert config["auto_map"]["AutoModel"] == "modeling_d3d.D3DForDiffusionDrafting"
    readme = files["README.md"].decode()
    assert CARD_MARKER in readme and '"me/d3d-tiny"' in readme and "| 2.13 |" in readme
    # what would be uploaded loads with trust_remote_code as the same drafter
    folder = tmp_path / "uploaded"
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content)
    loaded = AutoModel.from_pretrained(folder, trust_remote_code=True)
    for key, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_push_keeps_a_user_readme_on_the_hub(drafter, fake_hub, tmp_path):
    fake_hub["remote_readme"] = tmp_path / "README.md"
    fake_hub["remote_readme"].write_text("# Hand-written card on the Hub\n")
    with pytest.warns(UserWarning, match="already has a README.md"):
        drafter.push_to_hub("me/d3d-tiny")
    assert "README.md" not in fake_hub["commits"][-1]["files"]
    drafter.push_to_hub("me/d3d-tiny", overwrite_card=True)
    assert CARD_MARKER in fake_hub["commits"][-1]["files"]["README.md"].decode()


def test_save_pretrained_with_push_to_hub_uploads_the_drafter_card(drafter, fake_hub, tmp_path):
    drafter.save_pretrained(tmp_path / "d3d-tiny", push_to_hub=True, repo_id="me/d3d-tiny", commit_message="v1")
    (commit,) = fake_hub["commits"]
    assert commit["commit_message"] == "v1" and CARD_MARKER in commit["files"]["README.md"].decode()
    assert CARD_MARKER in (tmp_path / "d3d-tiny" / "README.md").read_text()


def test_cli_push(drafter, fake_hub, tmp_path, capsys):
    folder = tmp_path / "drafter"
    drafter.to(torch.bfloat16).save_pretrained(folder, tokenizer=word_tokenizer())
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "summary": {"target": {"tokens_per_second": 20.0}, "d3d": {"tau": 2.25, "speedup": 1.5}},
                "settings": {"prompts": "humaneval", "dtype": "bfloat16"},
            }
        )
    )
    rc = main(
        ["push", "--drafter", str(folder), "--repo-id", "me/d3d-tiny", "--private", "--token", "hf_x",
         "--results", str(bench), "--hardware", "1x H200"]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    assert fake_hub["create_repo"]["token"] == "hf_x" and fake_hub["create_repo"]["private"] is True
    files = fake_hub["commits"][-1]["files"]
    assert "tokenizer.json" in files and json.loads(files["config.json"])["dtype"] == "bfloat16"
    readme = files["README.md"].decode()
    assert "| 2.25 |" in readme and "| 1.50x |" in readme and "1x H200" in readme
    # a README.md the user wrote in the folder is what gets uploaded
    (folder / "README.md").write_text("# Mine\n")
    assert main(["push", "--drafter", str(folder), "--repo-id", "me/d3d-tiny"]) == 0
    assert fake_hub["commits"][-1]["files"]["README.md"] == b"# Mine\n"


def test_card_quick_start_runs(tmp_path, capsys):
    """The quick start of a saved card, pointed at local folders, decodes with the D3D candidate generator."""
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    target = tiny_target("qwen3", sharpen=4.0)
    tokenizer = word_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, target_model=str(target_dir))
    drafter.save_pretrained(drafter_dir)
    readme = (drafter_dir / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("path/or/hub-id/of/this/drafter", str(drafter_dir)).replace("256", "12")
    namespace = {}
    exec(compile(code, "quick_start", "exec"), namespace)
    assert namespace["drafter"].last_generation_stats.rounds > 0
    assert "tokens per target forward (tau):" in capsys.readouterr().out


def test_remote_code_saves_without_d3d_hf(drafter, tmp_path):
    """Loaded with only torch + transformers, the drafter re-saves a loadable folder (no card renderer there)."""
    import subprocess
    import sys
    import textwrap

    src, dst = tmp_path / "src.d3d-v1", tmp_path / "dst.d3d-v1"
    drafter.save_pretrained(src)
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["d3d_hf"] = None  # make `import d3d_hf` fail
        from transformers import AutoModel
        drafter = AutoModel.from_pretrained({str(src)!r}, trust_remote_code=True)
        drafter.save_pretrained({str(dst)!r})
        AutoModel.from_pretrained({str(dst)!r}, trust_remote_code=True)
        print("OK")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    assert (dst / "modeling_d3d.py").is_file() and (dst / "model.safetensors").is_file()
    assert not (dst / "README.md").exists()


def test_card_of_a_weight_sharing_drafter_says_what_it_holds():
    """A drafter that runs on its target's weights: the card counts only its own parameters, names its block adapters
    (full rank in the last layers too), and does not call it standalone."""
    target = tiny_target("llama")
    sharing = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, shares_target_weights=True)
    sharing.add_block_adapter(2, alpha=4.0, modules=["q_proj", "down_proj"], full_layers=1)
    sharing.attach_target_weights(target)
    own = sum(t.numel() for t in sharing.drafter_state_dict().values())
    _, body = split_card(render_model_card(sharing))
    assert f"| Parameters | {own:,} of its own" in body
    adapters = "rank 2 on q_proj, down_proj, only at draft-block rows; full rank in the last 1 layers"
    assert f"| Block adapters | {adapters} |" in body
    assert "needs nothing from the target" not in body and "runs on the target's own weights" in body
    standalone = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    _, body = split_card(render_model_card(standalone))
    assert "a standalone block-diffusion language model" in body and "| Block adapters |" not in body
