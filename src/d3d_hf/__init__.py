"""d3d-hf: D3D block-diffusion drafters (arXiv 2611.06425) for speculative decoding with Hugging Face transformers.

Importing the package registers `model_type="d3d"` with `AutoConfig`/`AutoModel` and installs the generation hook,
so `target.generate(input_ids, assistant_model=drafter)` decodes with D3D.
"""

from transformers import AutoConfig, AutoModel

from .modeling import (
    D3DCache,
    D3DCandidateGenerator,
    D3DConfig,
    D3DForDiffusionDrafting,
    D3DGenerationStats,
    D3DModel,
    D3DPreTrainedModel,
    apply_fast_paths,
    install_generation_hook,
    remove_generation_hook,
)

__version__ = "0.1.0"

AutoConfig.register("d3d", D3DConfig, exist_ok=True)
AutoModel.register(D3DConfig, D3DForDiffusionDrafting, exist_ok=True)
install_generation_hook()


def __getattr__(name: str):
    """`d3d_hf.load_drafter` (`d3d_hf.drafters.load_drafter`), imported on first use."""
    if name == "load_drafter":
        from .drafters import load_drafter

        return load_drafter
    raise AttributeError(f"module 'd3d_hf' has no attribute {name!r}")


__all__ = [
    "D3DCache",
    "D3DCandidateGenerator",
    "D3DConfig",
    "D3DForDiffusionDrafting",
    "D3DGenerationStats",
    "D3DModel",
    "D3DPreTrainedModel",
    "apply_fast_paths",
    "install_generation_hook",
    "remove_generation_hook",
]
