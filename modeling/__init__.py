"""The remote-code bundle of D3D drafters (copied next to every saved checkpoint); docs/ARCHITECTURE.md maps it."""

from .configuration_d3d import D3DConfig
from .drafting_d3d import D3DCache, D3DPackedDraft, register_packed_attention_kernel
from .generation_d3d import D3DCandidateGenerator
from .hooks_d3d import install_generation_hook, remove_generation_hook
from .modeling_d3d import D3DForDiffusionDrafting, D3DModel, D3DPreTrainedModel
from .options_d3d import D3DGenerationOptions
from .patches_d3d import apply_fast_paths
from .stats_d3d import D3DGenerationStats

__all__ = [
    "D3DCache",
    "D3DCandidateGenerator",
    "D3DConfig",
    "D3DForDiffusionDrafting",
    "D3DGenerationOptions",
    "D3DGenerationStats",
    "D3DModel",
    "D3DPackedDraft",
    "D3DPreTrainedModel",
    "apply_fast_paths",
    "install_generation_hook",
    "register_packed_attention_kernel",
    "remove_generation_hook",
]
