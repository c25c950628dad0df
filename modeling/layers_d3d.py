"""The layers of the D3D decoder stack, identical in layout to Llama/Qwen3 decoder layers: RoPE, the reference
(eager) attention and the packed-kernel attention function, RMSNorm, the mask embedding, attention, SwiGLU MLP and
the decoder layer. Their projections are `D3DLinear`s called one by one with the forward's block gate (the plain
path, which training runs); `patches_d3d.apply_fast_paths` routes them through `fast_paths_d3d` from outside.

Part of the self-contained remote-code bundle: imports only torch, the public transformers API and its siblings.

Attention convention: every attention mask handled here is boolean, `True` where a query may attend to a key, of
shape `(batch_size, 1, query_len, key_len)`; `key_len` counts the cached tokens first, then the current ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .adapters_d3d import D3DLinear
from .configuration_d3d import D3DConfig
from .drafting_d3d import D3DCache


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of `x` (RoPE helper)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Applies RoPE to `q`/`k` of shape `[B, H, T, D]` with `cos`/`sin` of shape `[B, T, D]`."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[B, H_kv, S, D]` -> `[B, H_kv * n_rep, S, D]` (grouped-query attention)."""
    if n_rep == 1:
        return hidden_states
    b, h, s, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention. `query` `[B, H, T, D]`, `key`/`value` `[B, H_kv, S, D]`, boolean mask `[B, 1, T, S]`.

    Returns the output `[B, T, H, D]` and the attention probabilities `[B, H, T, S]`.
    """
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights



def kernel_attention_interface(kernel: Callable) -> Callable:
    """A transformers-style attention function (`(module, query, key, value, attention_mask, scaling, ...)` ->
    `(output [B, T, H, D], None)`) that runs a registered packed-attention kernel: `attention_mask` is then the
    packed pass's metadata `(segment_ids, positions, chain_lengths)`, from which the kernel computes the tree mask
    (`drafting_d3d.packed_attention_mask` states the rule)."""

    def packed_kernel_attention(module, query, key, value, attention_mask, scaling, **kwargs):
        return kernel(query, key, value, *attention_mask, scale=scaling).transpose(1, 2), None

    return packed_kernel_attention


def block_adapter_shape(config: D3DConfig, layer_idx: int, in_features: int, out_features: int) -> tuple[int, float]:
    """`(rank, alpha)` of the block adapter of a projection in layer `layer_idx`: `config.block_lora_rank` and
    `block_lora_alpha`, or in the last `config.block_lora_full_layers` layers full rank `min(in, out)` with `alpha`
    scaled alike, so that every adapter has the same scale `alpha / rank`."""
    rank, alpha = config.block_lora_rank, config.block_lora_alpha
    if rank > 0 and layer_idx >= config.num_hidden_layers - getattr(config, "block_lora_full_layers", 0):
        full = min(in_features, out_features)
        return full, alpha * full / rank
    return rank, alpha


def create_block_adapters(
    config: D3DConfig, layers: nn.ModuleList, rank: int, alpha: float, modules: list[str] | None, full_layers: int
) -> None:
    """Gives every projection of `modules` (default `config.block_lora_modules`) in `layers` a fresh block adapter of
    `block_adapter_shape`, and records rank, alpha, modules and `full_layers` in `config`
    (`D3DForDiffusionDrafting.add_block_adapter`).

    Raises:
        ValueError: if `rank < 1` or `full_layers` is not a whole number in `[0, len(layers)]`.
    """
    if rank < 1:
        raise ValueError(f"`rank` must be >= 1, got {rank}.")
    if isinstance(full_layers, bool) or not isinstance(full_layers, int) or not 0 <= full_layers <= len(layers):
        raise ValueError(
            f"`full_layers` must be a whole number in [0, {len(layers)}] (the drafter's layers), got {full_layers!r}."
        )
    modules = list(modules or config.block_lora_modules)
    config.block_lora_rank, config.block_lora_alpha = int(rank), float(alpha)
    config.block_lora_modules, config.block_lora_full_layers = modules, full_layers
    for index, layer in enumerate(layers):
        for name in modules:
            parent = layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp
            projection = getattr(parent, name)
            projection.add_adapter(*block_adapter_shape(config, index, projection.in_features, projection.out_features))


def _projection(
    config: D3DConfig, name: str, in_features: int, out_features: int, bias: bool, layer_idx: int
) -> D3DLinear:
    """A `D3DLinear` with a block adapter (`block_adapter_shape`) when `name` is in `config.block_lora_modules` and
    the rank is > 0."""
    rank, alpha = block_adapter_shape(config, layer_idx, in_features, out_features)
    return D3DLinear(in_features, out_features, bias, rank if name in config.block_lora_modules else 0, alpha)


class D3DMaskEmbedding(nn.Module):
    """The mask token's learned input embedding, `weight` of shape `(hidden_size,)`, kept outside the vocabulary.

    A module (not a bare parameter) so that PEFT can train and save it (`modules_to_save=["mask_embedding"]`).
    """

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))


class D3DRMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension (computed in float32)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class D3DRotaryEmbedding(nn.Module):
    """Rotary position embedding; `forward(x, position_ids)` returns `cos`, `sin` of shape `[B, T, head_dim]`."""

    def __init__(self, config: D3DConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: D3DConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        """Inverse frequencies of the original RoPE (`base ** (-2i / head_dim)`) and a unit scaling."""
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class D3DAttention(nn.Module):
    """Grouped-query self-attention with RoPE and optional Qwen3-style per-head q/k RMSNorm."""

    def __init__(self, config: D3DConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False  # the mask is always explicit
        h, kv, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = _projection(config, "q_proj", config.hidden_size, h * self.head_dim, bias, layer_idx)
        self.k_proj = _projection(config, "k_proj", config.hidden_size, kv * self.head_dim, bias, layer_idx)
        self.v_proj = _projection(config, "v_proj", config.hidden_size, kv * self.head_dim, bias, layer_idx)
        self.o_proj = _projection(config, "o_proj", h * self.head_dim, config.hidden_size, bias, layer_idx)
        if config.use_qk_norm:
            self.q_norm = D3DRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = D3DRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        past_key_values: D3DCache | None = None,
        block_gate: torch.Tensor | None = None,
        attention_interface: Callable = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`block_gate` (`(batch_size, seq_len, 1)`, 1 at draft-block rows, *optional*) is where the projections'
        block adapters apply (`D3DLinear`). `attention_interface` is the attention function `D3DModel.forward` chose
        for this forward (transformers' signature: `(module, query, key, value, attention_mask, scaling=...,
        dropout=...)` -> `(output [B, T, H, D], weights or None)`); `eager_attention_forward` when `None`."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states, block_gate).view(hidden_shape)
        key_states = self.k_proj(hidden_states, block_gate).view(hidden_shape)
        value_states = self.v_proj(hidden_states, block_gate).view(hidden_shape)
        if self.config.use_qk_norm:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface = attention_interface or eager_attention_forward
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.config.attention_dropout,
            scaling=self.scaling,
            is_causal=False,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output, block_gate), attn_weights


class D3DMLP(nn.Module):
    """SwiGLU feed-forward block: `down(act(gate(x)) * up(x))`."""

    def __init__(self, config: D3DConfig, layer_idx: int = 0) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = _projection(config, "gate_proj", hidden, inner, bias, layer_idx)
        self.up_proj = _projection(config, "up_proj", hidden, inner, bias, layer_idx)
        self.down_proj = _projection(config, "down_proj", inner, hidden, bias, layer_idx)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, block_gate: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.act_fn(self.gate_proj(x, block_gate)) * self.up_proj(x, block_gate)
        return self.down_proj(hidden, block_gate)


class D3DDecoderLayer(nn.Module):
    """Pre-norm transformer layer (attention + SwiGLU MLP), identical in layout to Llama/Qwen3 decoder layers."""

    def __init__(self, config: D3DConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = D3DAttention(config, layer_idx)
        self.mlp = D3DMLP(config, layer_idx)
        self.input_layernorm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        past_key_values: D3DCache | None = None,
        block_gate: torch.Tensor | None = None,
        attention_interface: Callable = None,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings,
            attention_mask,
            past_key_values,
            block_gate,
            attention_interface,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states), block_gate)


def create_hidden_state_input(config) -> tuple[nn.Module | None, nn.Linear | None]:
    """`(hidden_state_norm, hidden_state_proj)` of a `config.reads_target_hidden_state` drafter (EAGLE's feature): an
    RMSNorm and a square bias-free linear that starts at zero (`_d3d_zero_init`); `(None, None)` for other drafters."""
    if not getattr(config, "reads_target_hidden_state", False):
        return None, None
    proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
    proj._d3d_zero_init = True  # a new drafter starts as one without the feature
    return D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps), proj


def add_target_hidden_states(
    inputs_embeds: torch.Tensor, target_hidden_states: torch.Tensor | None, model: nn.Module
) -> torch.Tensor:
    """`inputs_embeds` plus `model.hidden_state_proj(model.hidden_state_norm(target_hidden_states))`: EAGLE's feature
    (arXiv 2401.15077) as `D3DModel.forward` takes it (`D3DConfig.reads_target_hidden_state`; both `None` for a
    drafter without it). Both tensors have shape `(batch_size, seq_len, hidden_size)`; a zero row adds nothing.

    Raises:
        ValueError: if the state is missing for a drafter that reads it, given to one that does not, or misshapen.
    """
    norm, proj = model.hidden_state_norm, model.hidden_state_proj
    if proj is None:
        if target_hidden_states is not None:
            raise ValueError(
                "`target_hidden_states` was given, but this drafter does not read the target's hidden state "
                "(`config.reads_target_hidden_state=False`): pass none."
            )
        return inputs_embeds
    if target_hidden_states is None:
        raise ValueError(
            "This drafter reads the target's last hidden state before the anchor "
            "(`config.reads_target_hidden_state=True`): pass `target_hidden_states` (zeros where a row has none)."
        )
    if target_hidden_states.shape != inputs_embeds.shape:
        raise ValueError(
            f"`target_hidden_states` must have shape {tuple(inputs_embeds.shape)} (one row per input row), got "
            f"{tuple(target_hidden_states.shape)}."
        )
    return inputs_embeds + proj(norm(target_hidden_states.to(inputs_embeds.dtype)))


__all__ = [
    "D3DAttention",
    "D3DDecoderLayer",
    "D3DMLP",
    "D3DMaskEmbedding",
    "D3DRMSNorm",
    "D3DRotaryEmbedding",
    "add_target_hidden_states",
    "apply_rotary_pos_emb",
    "create_hidden_state_input",
    "eager_attention_forward",
    "kernel_attention_interface",
    "repeat_kv",
]
