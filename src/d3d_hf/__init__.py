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
    install_generation_hook,
    remove_generation_hook,
)

__version__ = "0.1.0"

AutoConfig.register("d3d", D3DConfig, exist_ok=True)
AutoModel.register(D3DConfig, D3DForDiffusionDrafting, exist_ok=True)
install_generation_hook()

__all__ = [
    "D3DCache",
    "D3DCandidateGenerator",
    "D3DConfig",
    "D3DForDiffusionDrafting",
    "D3DGenerationStats",
    "D3DModel",
    "D3DPreTrainedModel",
    "install_generation_hook",
    "remove_generation_hook",
]
