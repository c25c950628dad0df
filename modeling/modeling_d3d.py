"""D3D block-diffusion drafter (arXiv 2611.06425): Llama/Qwen3-family decoder stack with a mask token.

Part of the self-contained remote-code bundle uploaded next to every checkpoint: imports only torch, the public
transformers API and its sibling files.

Attention convention: every attention mask handled here is boolean, `True` where a query may attend to a key, of
shape `(batch_size, 1, query_len, key_len)`; `key_len` counts the cached tokens first, then the current ones.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_d3d import D3DConfig
from .generation_d3d import D3DCandidateGenerator, install_generation_hook


class D3DCache:
    """Key/value cache of the drafter's committed context.

    The drafter keeps only committed tokens here (d3d-hf docs/DESIGN.md section 2): a draft pass appends the
    block's keys and values, then `crop` removes them again. Per layer it holds `key_states`/`value_states`
    tensors of shape `[batch_size, num_key_value_heads, seq_len, head_dim]`.
    """

    def __init__(self) -> None:
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of cached positions (0 for an empty cache)."""
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends `[B, H_kv, T, D]` keys/values for `layer_idx` and returns the full `[B, H_kv, S, D]` tensors."""
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def crop(self, max_length: int) -> None:
        """Keeps the first `max_length` positions of every layer (a no-op when the cache is shorter)."""
        if max_length < 0:
            raise ValueError(f"`max_length` must be >= 0, got {max_length}.")
        for i in range(len(self.key_cache)):
            self.key_cache[i] = self.key_cache[i][..., :max_length, :]
            self.value_cache[i] = self.value_cache[i][..., :max_length, :]


class D3DPackedDraft:
    """Result of one packed successor-drafting pass (`D3DForDiffusionDrafting.packed_draft_logits`).

    Attributes:
        logits (`torch.FloatTensor` of shape `(num_hypotheses, block_size, vocab_size)`): for hypothesis `h`, row `j`
            scores draft token `e_{j+1}` of the successor block (row `block_size - 1` is one past the block), as the
            rows of `draft_logits`.
        hypothesis_chain_lengths (`list[int]`): chain tokens each hypothesis assumes committed.
        bonus_guesses (`list[int]`): the first token `g_h` of each successor block (the guessed bonus token).
        prefix_length (`int`): drafter cache length the pass was computed against.
        key_states, value_states (`list[torch.Tensor]`): per layer, the packed tokens' keys/values, shape
            `[1, num_key_value_heads, T, head_dim]`, kept so that committed tokens need no second forward.
    """

    def __init__(self, logits, hypothesis_chain_lengths, bonus_guesses, prefix_length, key_states, value_states):
        self.logits = logits
        self.hypothesis_chain_lengths = list(hypothesis_chain_lengths)
        self.bonus_guesses = list(bonus_guesses)
        self.prefix_length = prefix_length
        self.key_states = key_states
        self.value_states = value_states

    def commit(self, cache: D3DCache, num_chain_tokens: int, hypothesis: int | None = None) -> None:
        """Extends `cache` (which must still hold `prefix_length` positions) with the keys/values of the first
        `num_chain_tokens` chain tokens and, when `hypothesis` is given, of that successor block's first token (its
        bonus guess, which was committed): exactly what a causal pass over those tokens would have cached.

        Raises:
            ValueError: if the cache moved since the pass, or `num_chain_tokens` exceeds the hypothesis' chain.
        """
        if cache.get_seq_length() != self.prefix_length:
            raise ValueError(
                f"The drafter cache holds {cache.get_seq_length()} positions, the packed pass was made for "
                f"{self.prefix_length}."
            )
        index = list(range(num_chain_tokens))
        if hypothesis is not None:
            if num_chain_tokens != self.hypothesis_chain_lengths[hypothesis]:
                raise ValueError("A successor block can only be committed after its own hypothesis' chain.")
            chain_length = self.key_states[0].shape[-2] - len(self.bonus_guesses) * self.logits.shape[1]
            index.append(chain_length + hypothesis * self.logits.shape[1])
        if not index:
            return
        index_t = torch.tensor(index, device=self.key_states[0].device)
        for layer_idx, (keys, values) in enumerate(zip(self.key_states, self.value_states, strict=True)):
            cache.update(keys.index_select(-2, index_t), values.index_select(-2, index_t), layer_idx)


def causal_attention_mask(query_len: int, past_len: int, device: torch.device | str | None = None) -> torch.BoolTensor:
    """Causal mask for `query_len` new tokens after `past_len` cached ones.

    Returns:
        `torch.BoolTensor` of shape `(1, 1, query_len, past_len + query_len)`, `True` where attention is allowed.
    """
    q_pos = torch.arange(query_len, device=device)[:, None] + past_len
    k_pos = torch.arange(past_len + query_len, device=device)[None, :]
    return (k_pos <= q_pos)[None, None]


def draft_attention_mask(
    num_committed: int, num_masks: int, past_len: int, device: torch.device | str | None = None
) -> torch.BoolTensor:
    """Attention mask of one synchronous draft pass (d3d-hf docs/DESIGN.md section 2, "shifted, causal anchor").

    The query sequence is `num_committed` newly committed tokens (the last of them is the anchor) followed by
    `num_masks` mask tokens. Committed tokens attend causally (they extend the drafter's KV cache exactly as an
    autoregressive model would); mask tokens attend to the whole committed context and bidirectionally to each
    other.

    Returns:
        `torch.BoolTensor` of shape `(1, 1, num_committed + num_masks, past_len + num_committed + num_masks)`.
    """
    mask = causal_attention_mask(num_committed + num_masks, past_len, device).clone()
    mask[..., num_committed:, :] = True
    return mask


def packed_metadata(
    chain_length: int, hypothesis_chain_lengths: list[int], block_size: int, device: torch.device | str | None = None
) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """Per-token metadata of a packed successor-drafting pass (d3d-hf docs/DESIGN.md sections 2 and 5).

    The packed sequence is one causal *chain* of `chain_length` tokens (tokens committed since the drafter's last
    call, then the drafts `d1..d_{B-1}` of the block being verified) followed by one successor block of
    `block_size` tokens `[g_h, MASK x (block_size - 1)]` per hypothesis `h`; hypothesis `h` assumes the first
    `hypothesis_chain_lengths[h]` chain tokens get committed.

    Returns:
        `(segment_ids, positions, chain_lengths)`, each a `torch.LongTensor` of shape `(T,)` with `T = chain_length
        + len(hypothesis_chain_lengths) * block_size`: `segment_ids` is 0 on the chain and `h + 1` on block `h`;
        `positions` the index inside the segment; `chain_lengths` how many chain tokens the token sees (`i + 1` for
        chain token `i`, the hypothesis' chain length inside a block).

    Raises:
        ValueError: if a hypothesis' chain length is outside `[0, chain_length]` or `block_size < 1`.
    """
    if block_size < 1:
        raise ValueError(f"`block_size` must be >= 1, got {block_size}.")
    for length in hypothesis_chain_lengths:
        if not 0 <= length <= chain_length:
            raise ValueError(f"A hypothesis' chain length must be in [0, {chain_length}], got {length}.")
    num_blocks = len(hypothesis_chain_lengths)
    chain = torch.arange(chain_length, device=device)
    in_block = torch.arange(block_size, device=device).repeat(num_blocks)
    segment_ids = torch.cat(
        [
            torch.zeros(chain_length, dtype=torch.long, device=device),
            torch.arange(1, num_blocks + 1, device=device).repeat_interleave(block_size),
        ]
    )
    hypotheses = torch.tensor(hypothesis_chain_lengths, dtype=torch.long, device=device)
    chain_lengths = torch.cat([chain + 1, hypotheses.repeat_interleave(block_size)])
    return segment_ids, torch.cat([chain, in_block]), chain_lengths


def packed_attention_mask(
    segment_ids: torch.Tensor, positions: torch.Tensor, chain_lengths: torch.Tensor, prefix_length: int
) -> torch.BoolTensor:
    """Dense boolean mask of a packed successor-drafting pass, from the metadata of `packed_metadata`.

    Query `t` may attend key `s` (keys are the `prefix_length` cached tokens, then the packed tokens in order) iff
    `s` is in the cached prefix; or `s` is a chain token with `positions[s] < chain_lengths[t]`; or `s` is in the
    same successor block as `t` and (`t` is a mask, `positions[t] > 0`, or `s` is the block's first token): the
    block's first token (the bonus guess, an anchor) attends causally, as in a synchronous draft pass ("shifted,
    causal anchor", d3d-hf docs/DESIGN.md section 8), and the masks attend to the whole block.

    Returns:
        `torch.BoolTensor` of shape `(T, prefix_length + T)`, `True` where attention is allowed.
    """
    same_block = (segment_ids[:, None] == segment_ids[None, :]) & (segment_ids[:, None] > 0)
    block = same_block & ((positions[:, None] > 0) | (positions[None, :] == 0))
    chain = (segment_ids[None, :] == 0) & (positions[None, :] < chain_lengths[:, None])
    prefix = torch.ones(segment_ids.shape[0], prefix_length, dtype=torch.bool, device=segment_ids.device)
    return torch.cat([prefix, block | chain], dim=1)


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


class D3DLinear(nn.Linear):
    """`nn.Linear` with an optional low-rank adapter applied only at draft-block positions ("block LoRA").

    `forward(x, block_gate)` returns `x W^T + b + block_gate * (alpha / r) * x A^T B^T`, where `block_gate` is
    `(batch_size, seq_len, 1)` (1 at draft-block positions, 0 at committed-context positions) or `None` (no adapter).
    Design choice (d3d-hf docs/DESIGN.md section 8, lesson 3): the committed context and the anchor go through
    the unmodified weights, so an adapted drafter keeps the source model's exact first-token prediction and a KV
    cache identical to the source model's, while the mask positions learn to denoise the block. `lora_B` starts
    at zero, so a fresh adapter leaves the drafter unchanged.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, rank: int = 0, alpha: float = 16.0):
        super().__init__(in_features, out_features, bias=bias)
        self.rank = int(rank)
        if self.rank > 0:
            self.lora_A = nn.Parameter(torch.zeros(self.rank, in_features))
            self.lora_B = nn.Parameter(torch.zeros(out_features, self.rank))
            self.lora_scaling = float(alpha) / self.rank

    def add_adapter(self, rank: int, alpha: float) -> None:
        """Creates a fresh block adapter (`lora_A` ~ N(0, 1/in_features), `lora_B` = 0) of the given rank."""
        self.rank = int(rank)
        ref = self.weight
        self.lora_A = nn.Parameter(
            torch.randn(self.rank, self.in_features, device=ref.device, dtype=ref.dtype) / self.in_features**0.5
        )
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, self.rank, device=ref.device, dtype=ref.dtype))
        self.lora_scaling = float(alpha) / self.rank

    def forward(
        self, x: torch.Tensor, block_gate: torch.Tensor | None = None, gated_input: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`gated_input` (optional) is `block_gate * x`, when the caller computed it once for several projections of
        the same input; the gate is 0 or 1, so gating the input is exact and the same as gating the output."""
        out = super().forward(x)
        if self.rank > 0 and block_gate is not None:
            if gated_input is None:
                gated_input = x * block_gate
            lora_a, lora_b = self.lora_A, self.lora_B
            if lora_a.dtype != x.dtype:
                lora_a, lora_b = lora_a.to(x.dtype), lora_b.to(x.dtype)
            delta = nn.functional.linear(nn.functional.linear(gated_input, lora_a), lora_b)
            out = torch.add(out, delta, alpha=self.lora_scaling)
        return out


def _projection(config: D3DConfig, name: str, in_features: int, out_features: int, bias: bool) -> D3DLinear:
    """A `D3DLinear` with a block adapter when `name` is in `config.block_lora_modules` and the rank is > 0."""
    rank = config.block_lora_rank if name in config.block_lora_modules else 0
    return D3DLinear(in_features, out_features, bias, rank, config.block_lora_alpha)


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


def _packed_attention_kernel(device: torch.device):
    """`d3d_hf.kernels.packed_attention` when it can run as a Triton kernel on `device` (CUDA, or CPU under Triton's
    interpreter when `TRITON_INTERPRET=1`, for tests; Triton and d3d_hf installed), else `None` (the packed pass then
    uses a dense boolean mask)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from d3d_hf.kernels import packed_attention, triton_unavailable_reason
    except ImportError:
        return None
    return packed_attention if triton_unavailable_reason(device) is None else None


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
        self.q_proj = _projection(config, "q_proj", config.hidden_size, h * self.head_dim, bias)
        self.k_proj = _projection(config, "k_proj", config.hidden_size, kv * self.head_dim, bias)
        self.v_proj = _projection(config, "v_proj", config.hidden_size, kv * self.head_dim, bias)
        self.o_proj = _projection(config, "o_proj", h * self.head_dim, config.hidden_size, bias)
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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        gated = hidden_states * block_gate if block_gate is not None and self.q_proj.rank > 0 else None
        query_states = self.q_proj(hidden_states, block_gate, gated).view(hidden_shape)
        key_states = self.k_proj(hidden_states, block_gate, gated).view(hidden_shape)
        if self.config.use_qk_norm:
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)
        value_states = self.v_proj(hidden_states, block_gate, gated).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        if isinstance(attention_mask, tuple):
            # packed successor pass with the Triton kernel: the tree mask is computed in the kernel from
            # (segment_ids, positions, chain_lengths); see `packed_attention_mask` for the rule
            kernel = _packed_attention_kernel(query_states.device)
            attn_output = kernel(query_states, key_states, value_states, *attention_mask, scale=self.scaling)
            attn_output = attn_output.transpose(1, 2).reshape(*input_shape, -1).contiguous()
            return self.o_proj(attn_output, block_gate), None

        attention_interface: Callable = eager_attention_forward
        if self.config._attn_implementation not in (None, "eager"):
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
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

    def __init__(self, config: D3DConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = _projection(config, "gate_proj", hidden, inner, bias)
        self.up_proj = _projection(config, "up_proj", hidden, inner, bias)
        self.down_proj = _projection(config, "down_proj", inner, hidden, bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor, block_gate: torch.Tensor | None = None) -> torch.Tensor:
        gated = x * block_gate if block_gate is not None and self.gate_proj.rank > 0 else None
        hidden = self.act_fn(self.gate_proj(x, block_gate, gated)) * self.up_proj(x, block_gate, gated)
        return self.down_proj(hidden, block_gate)


class D3DDecoderLayer(nn.Module):
    """Pre-norm transformer layer (attention + SwiGLU MLP), identical in layout to Llama/Qwen3 decoder layers."""

    def __init__(self, config: D3DConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = D3DAttention(config, layer_idx)
        self.mlp = D3DMLP(config)
        self.input_layernorm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        past_key_values: D3DCache | None = None,
        block_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, past_key_values, block_gate
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states), block_gate)


def _with_variant(name: str, variant: str | None) -> str:
    """`model.safetensors` -> `model.<variant>.safetensors` (transformers' naming of weight-file variants)."""
    if not variant:
        return name
    parts = name.split(".")
    return ".".join([*parts[:-1], variant, parts[-1]])


def _safetensors_problem(path: str) -> str | None:
    """What is wrong with the safetensors file at `path` (truncated, corrupt header), or `None` if its header is
    sound and describes exactly the file's size. Reads only the header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"truncated ({size} bytes, shorter than a safetensors header)"
        header_len = int.from_bytes(prefix, "little")
        if header_len > size - 8:
            return f"truncated (its header announces {header_len} bytes, the file holds {size - 8} after it)"
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return "corrupt (its header is not valid JSON)"
    if not isinstance(header, dict):
        return "corrupt (its header is not a JSON object)"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            return f"corrupt (the header entry of {name!r} has no data offsets)"
    if 8 + header_len + end != size:
        return f"truncated or corrupt ({size} bytes, its header describes {8 + header_len + end})"
    return None


def _check_weight_files(folder: str, variant: str | None = None) -> None:
    """Raises `OSError` naming the file when the safetensors weights of a local checkpoint folder are truncated or
    corrupt (a missing weights file is left to transformers, which names it)."""
    single = os.path.join(folder, _with_variant("model.safetensors", variant))
    index = os.path.join(folder, _with_variant("model.safetensors.index.json", variant))
    fix = (
        "The save that wrote it was interrupted or the file was damaged in transfer: save the drafter again with "
        "`save_pretrained`, or copy / download the folder again."
    )
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted({os.path.join(folder, name) for name in json.load(f)["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise OSError(f"{index} is corrupt ({type(err).__name__}: {err}). {fix}") from err
    else:
        return
    for path in files:
        if not os.path.isfile(path):
            raise OSError(f"{path} is missing (listed in {os.path.basename(index)}). {fix}")
        problem = _safetensors_problem(path)
        if problem is not None:
            raise OSError(f"{path} is {problem}. {fix}")


def _publish_folder(staging: str, final: str, variant: str | None = None) -> None:
    """Moves every file written into `staging` to the same place under `final` with `os.replace` (each file
    appears whole or not at all), weights after the other files and `config.json` last. Files of `final` that the
    save did not write are kept, except weight files of an earlier save that the new ones supersede (a stale
    `model.safetensors` would otherwise shadow new shards, stale shards would sit next to a new single file)."""
    written = []
    for root, _, files in os.walk(staging):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                try:
                    os.fsync(f.fileno())  # on disk before it replaces anything (survives a power cut, not just a kill)
                except OSError:  # platforms that cannot sync a read-only handle
                    pass
            written.append(os.path.relpath(path, staging))
    single = _with_variant("model.safetensors", variant)
    index = _with_variant("model.safetensors.index.json", variant)
    shard = re.compile(re.escape(single[: -len(".safetensors")]) + r"-\d{5}-of-\d{5}\.safetensors")

    def is_weights(name: str) -> bool:
        return name in (single, index) or shard.fullmatch(name) is not None

    order = {False: 0, True: 1}
    written.sort(key=lambda rel: (rel == "config.json", order[is_weights(rel)], rel))
    os.makedirs(final, exist_ok=True)
    for rel in written:
        destination = os.path.join(final, rel)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        os.replace(os.path.join(staging, rel), destination)
    if any(is_weights(rel) for rel in written):
        for name in os.listdir(final):
            if is_weights(name) and name not in written and os.path.isfile(os.path.join(final, name)):
                os.remove(os.path.join(final, name))


@dataclass
class D3DModelOutput(ModelOutput):
    """Output of `D3DModel` / `D3DForDiffusionDrafting`.

    Args:
        logits (`torch.FloatTensor` of shape `(batch_size, num_kept, vocab_size)`, *optional*):
            LM-head scores of the kept positions (all positions unless `logits_to_keep` was given). Following the
            autoregressive model the drafter starts from, the output at position `i` predicts the token at `i + 1`.
        last_hidden_state (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`, *optional*):
            Final-norm hidden states.
        cache (`D3DCache`, *optional*):
            The cache, extended with the current tokens when `use_cache=True` (named `cache` as transformers 5
            names it in its outputs).
        hidden_states (`tuple(torch.FloatTensor)`, *optional*):
            Input embeddings and the output of every layer, each `(batch_size, seq_len, hidden_size)`, when
            `output_hidden_states=True`.
    """

    logits: torch.FloatTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    cache: D3DCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


class D3DPreTrainedModel(PreTrainedModel):
    """Weight initialisation and loading glue shared by the D3D model classes."""

    config_class = D3DConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["D3DDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    card_data = None
    """Model-card data (`d3d_hf.hub.DrafterCardData` or a `dict` of its fields) rendered into `README.md` by
    `save_pretrained`; kept out of the config on purpose (measured numbers describe a run, not the model)."""

    def save_pretrained(self, save_directory, *args, tokenizer=None, model_card: bool = True, **kwargs):
        r"""
        `PreTrainedModel.save_pretrained` (weights, `config.json` with `auto_map`, the remote-code bundle), plus the
        tokenizer files and the model card.

        The save is atomic file by file: everything is written into a temporary sibling folder first (a hidden
        folder inside `save_directory` when its parent is read-only), then each file is moved into `save_directory`
        with `os.replace` (weights after the other files, `config.json` last), so an
        interrupted save leaves the previous checkpoint there complete and loadable, never a half-written
        `model.safetensors`. Files already in `save_directory` that this save does not write are kept (weight files
        of an earlier save that the new weights supersede are removed, as transformers does for stale shards).

        Args:
            save_directory (`str` or `os.PathLike`):
                Folder to write (created if needed).
            tokenizer (`PreTrainedTokenizerBase`, *optional*):
                Saved into the same folder, so that the folder (and a Hub repository pushed from it) is complete.
            model_card (`bool`, defaults to `True`):
                Write `README.md` rendered from `self.card_data` and the config, and that data as
                `d3d_card_data.json` (needs the `d3d_hf` package; skipped without it). A `README.md` that d3d-hf did
                not generate is kept (see `d3d_hf.hub.write_model_card`).
            push_to_hub (`bool`, defaults to `False`):
                After saving, upload with `self.push_to_hub` (`repo_id`, `commit_message`, `commit_description`,
                `private`, `create_pr`, `revision`, `tags` and `token` are passed on), so that the uploaded card is
                this drafter's card rather than transformers' generic one.
            Other arguments are those of `PreTrainedModel.save_pretrained`.

        Raises:
            NotADirectoryError: if `save_directory` is an existing file.
        """
        push_kwargs = None
        if kwargs.pop("push_to_hub", False):
            hub_keys = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision", "tags")
            push_kwargs = {key: kwargs.pop(key) for key in hub_keys if key in kwargs}
            push_kwargs["token"] = kwargs.get("token")
        if not kwargs.get("is_main_process", args[0] if args else True):
            return super().save_pretrained(save_directory, *args, **kwargs)
        final = os.path.realpath(os.fspath(save_directory))  # symlinks resolved: staging on the same file system
        if os.path.isfile(final):
            raise NotADirectoryError(f"{save_directory} is a file; `save_pretrained` writes a folder: pass a folder.")
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        try:
            staging = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", suffix=".saving", dir=parent)
        except PermissionError:  # the parent is read-only (e.g. the root of a mounted volume): stage inside
            os.makedirs(final, exist_ok=True)
            staging = tempfile.mkdtemp(prefix=".d3d-", suffix=".saving", dir=final)
        try:
            result = super().save_pretrained(staging, *args, **kwargs)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            _publish_folder(staging, final, kwargs.get("variant"))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if model_card:
            try:
                from d3d_hf.hub import write_model_card
            except ImportError:  # only torch + transformers installed: no card renderer
                write_model_card = None
            if write_model_card is not None:
                write_model_card(self, save_directory)
        if push_kwargs is not None:
            repo_id = push_kwargs.pop("repo_id", os.path.basename(os.path.normpath(save_directory)))
            self.push_to_hub(repo_id, tokenizer=tokenizer, **push_kwargs)
        return result

    def push_to_hub(self, repo_id: str, *, tokenizer=None, **kwargs):
        r"""
        Uploads the folder `save_pretrained` writes (model card included) to the Hub.

        With `d3d_hf` installed this is `d3d_hf.hub.push_drafter` (keyword arguments of transformers' `push_to_hub`,
        plus `tokenizer` and `overwrite_card`); with only torch + transformers it is transformers' `push_to_hub`
        (generic card), followed by `tokenizer.push_to_hub` when a tokenizer is given.

        Returns:
            `huggingface_hub.CommitInfo` of the model upload.
        """
        try:
            from d3d_hf.hub import push_drafter
        except ImportError:  # only torch + transformers installed
            push_drafter = None
        if push_drafter is not None:
            return push_drafter(self, repo_id, tokenizer=tokenizer, **kwargs)
        result = super().push_to_hub(repo_id, **kwargs)
        if tokenizer is not None:
            tokenizer.push_to_hub(repo_id, token=kwargs.get("token"), revision=kwargs.get("revision"))
        return result

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, D3DMaskEmbedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        if isinstance(module, D3DLinear) and module.rank > 0:
            nn.init.normal_(module.lora_A, mean=0.0, std=module.in_features**-0.5)
            nn.init.zeros_(module.lora_B)


class D3DModel(D3DPreTrainedModel):
    """The bare D3D decoder stack (embeddings, layers, final norm), returning final hidden states."""

    def __init__(self, config: D3DConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(D3DDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = D3DRotaryEmbedding(config)
        # A vocabulary that fills every id (SmolLM2) has no spare row for the mask token: keep it separately so the
        # drafter's `vocab_size` stays equal to the target's (transformers' assisted generation requires it).
        self.mask_embedding = D3DMaskEmbedding(config.hidden_size) if config.mask_token_id is None else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def mask_token_embedding(self) -> torch.Tensor:
        """The mask token's input embedding, shape `(hidden_size,)`."""
        if self.mask_embedding is not None:
            return self.mask_embedding.weight
        return self.embed_tokens.weight[self.config.mask_token_id]

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        masked_positions: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: D3DCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
        block_positions: torch.BoolTensor | None = None,
        packed_metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> D3DModelOutput:
        r"""
        Args:
            input_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`):
                Token ids. Values at masked positions are ignored (any filler id may stand there).
            masked_positions (`torch.BoolTensor` of shape `(batch_size, seq_len)`, *optional*):
                `True` where the input is the mask token: its embedding replaces the token embedding.
            attention_mask (`torch.Tensor`, *optional*):
                Either a boolean `(batch_size, 1, seq_len, past_len + seq_len)` mask (`True` = may attend), used as
                is (see `draft_attention_mask` and the block-diffusion training mask), or a `(batch_size,
                past_len + seq_len)` padding mask (1 = real token) combined with causal attention. `None` means
                causal attention.
            position_ids (`torch.LongTensor` of shape `(batch_size, seq_len)`, *optional*):
                Positions; defaults to `past_len + arange(seq_len)`.
            past_key_values (`D3DCache`, *optional*):
                Cache of earlier tokens; updated in place when `use_cache=True`.
            inputs_embeds (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`, *optional*):
                Embeddings to use instead of `input_ids`.
            use_cache (`bool`, defaults to `False`):
                Whether to append the current keys/values to `past_key_values` (created when `None`).
            output_hidden_states (`bool`, defaults to `False`):
                Whether to return the hidden states of every layer.
            block_positions (`torch.BoolTensor` of shape `(batch_size, seq_len)`, *optional*):
                Positions that belong to a draft block, where the block adapters (`block_lora_rank > 0`) apply;
                defaults to `masked_positions`.
            packed_metadata (`tuple` of three `torch.LongTensor` of shape `(seq_len,)`, *optional*):
                `(segment_ids, positions, chain_lengths)` of a packed successor-drafting pass (`packed_metadata`):
                the attention mask is then `packed_attention_mask` of them (pass no `attention_mask`), computed
                inside the Triton kernel of `d3d_hf.kernels` on CUDA when available, else materialised.

        Returns:
            `D3DModelOutput` with `last_hidden_state` of shape `(batch_size, seq_len, hidden_size)`.

        Raises:
            ValueError: if neither or both of `input_ids` and `inputs_embeds` are given, or a mask has the wrong
                shape.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_len = inputs_embeds.shape[:2]
        if masked_positions is not None:
            if masked_positions.shape != (batch_size, seq_len):
                raise ValueError(
                    f"`masked_positions` must have shape {(batch_size, seq_len)}, got {tuple(masked_positions.shape)}."
                )
            mask_vec = self.mask_token_embedding().to(inputs_embeds.dtype)
            inputs_embeds = torch.where(masked_positions[..., None], mask_vec, inputs_embeds)

        if use_cache and past_key_values is None:
            past_key_values = D3DCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        device = inputs_embeds.device
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + seq_len, device=device)[None].expand(batch_size, -1)

        key_len = past_len + seq_len
        if packed_metadata is not None:
            if attention_mask is not None:
                raise ValueError("Pass either `packed_metadata` or `attention_mask`, not both.")
            if _packed_attention_kernel(device) is not None and batch_size == 1:
                attention_mask = tuple(packed_metadata)  # the kernel computes the mask from the metadata
            else:
                attention_mask = packed_attention_mask(*packed_metadata, past_len)[None, None]
        if isinstance(attention_mask, tuple):
            pass
        elif attention_mask is None:
            attention_mask = causal_attention_mask(seq_len, past_len, device)
        elif attention_mask.dim() == 2:
            if attention_mask.shape[-1] != key_len:
                raise ValueError(
                    f"A 2-D `attention_mask` must cover past + current tokens ({key_len}), got "
                    f"{attention_mask.shape[-1]}."
                )
            attention_mask = causal_attention_mask(seq_len, past_len, device) & attention_mask.bool()[:, None, None]
        elif attention_mask.dim() != 4 or attention_mask.shape[-2:] != (seq_len, key_len):
            raise ValueError(
                f"A 4-D `attention_mask` must have shape (batch_size, 1, {seq_len}, {key_len}), got "
                f"{tuple(attention_mask.shape)}."
            )
        if not isinstance(attention_mask, tuple):
            attention_mask = attention_mask.to(device=device, dtype=torch.bool).expand(batch_size, -1, -1, -1)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        cache = past_key_values if use_cache else None
        if past_key_values is not None and not use_cache and past_len > 0:
            raise ValueError("Reading a cache without extending it is not supported: pass `use_cache=True`.")
        if block_positions is None:
            block_positions = masked_positions
        block_gate = None
        if self.config.block_lora_rank > 0 and block_positions is not None:
            block_gate = block_positions[..., None].to(hidden_states.dtype)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask, cache, block_gate)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        return D3DModelOutput(last_hidden_state=hidden_states, cache=cache, hidden_states=all_hidden_states)


class D3DForDiffusionDrafting(D3DPreTrainedModel):
    """D3D drafter: `D3DModel` plus an LM head. Pass it as `assistant_model` to a target's `generate`.

    The drafter is a standalone block-diffusion LM (arXiv 2611.06425): it keeps its own KV cache of the committed
    text and, in one forward pass over `[anchor, MASK x (B-1)]`, predicts `B-1` draft tokens. Alignment
    ("shifted, causal anchor", d3d-hf docs/DESIGN.md section 8): the anchor (last committed token) attends only to the
    committed prefix, and as in the autoregressive model the drafter starts from, the output at block position `j`
    predicts the token at `j + 1`: the anchor's output predicts `d1`, the first mask's output predicts `d2`, and the
    last mask's output predicts one token past the block. An untrained drafter initialised from its target
    therefore already drafts `d1` exactly as the target would.

    `target.generate(input_ids, assistant_model=drafter, ...)` uses `D3DCandidateGenerator` for it (greedy and
    lossless speculative sampling); the hook is installed when a drafter is created.
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _is_d3d_drafter = True

    def __init__(self, config: D3DConfig) -> None:
        super().__init__(config)
        if config.shares_target_weights:
            # embeddings and LM head are the target's tensors (`attach_target_weights`), not tied copies stored here
            self._tied_weights_keys = {}
        self.model = D3DModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        install_generation_hook()
        # decoding options read by `D3DCandidateGenerator` unless the `GenerationConfig` of the call sets them
        # (as transformers reads `num_assistant_tokens` from an assistant's generation config)
        self.generation_config = GenerationConfig(d3d_async=False, d3d_reuse_on_miss=False)
        self.last_generation_stats = None
        self._attached_target = None
        if config.shares_target_weights:
            # only drafter-specific weights are stored; the rest comes from the target (`attach_target_weights`)
            self._keys_to_ignore_on_load_missing = [r"^(?!.*(lora_A|lora_B|mask_embedding)).*$"]

    @staticmethod
    def is_drafter_specific(name: str) -> bool:
        """Whether a state-dict key belongs to the drafter itself (mask embedding, block adapters), not to the
        layers it shares with its target."""
        return "mask_embedding" in name or ".lora_A" in name or ".lora_B" in name

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """The drafter-specific part of `state_dict()` (what a `shares_target_weights` checkpoint stores)."""
        return {k: v for k, v in self.state_dict().items() if self.is_drafter_specific(k)}

    def add_block_adapter(self, rank: int, alpha: float = 16.0, modules: list[str] | None = None) -> None:
        """Adds fresh block adapters (see `D3DLinear`) to every decoder layer and records them in the config.

        Raises:
            ValueError: if `rank < 1` or the drafter already has adapters.
        """
        if rank < 1:
            raise ValueError(f"`rank` must be >= 1, got {rank}.")
        if self.config.block_lora_rank > 0:
            raise ValueError(f"The drafter already has block adapters of rank {self.config.block_lora_rank}.")
        modules = list(modules or self.config.block_lora_modules)
        self.config.block_lora_rank, self.config.block_lora_alpha = int(rank), float(alpha)
        self.config.block_lora_modules = modules
        for layer in self.model.layers:
            for name in modules:
                parent = layer.self_attn if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp
                getattr(parent, name).add_adapter(rank, alpha)

    def attach_target_weights(self, target: PreTrainedModel) -> None:
        """Makes the drafter use the target's own tensors for everything but its drafter-specific weights.

        For `shares_target_weights` drafters: embeddings, the decoder layers `config.source_layer_ids`, the final
        norm and the LM head become references to the target's parameters (no copy, no extra memory), on the
        target's device and dtype. Called automatically by `target.generate(..., assistant_model=drafter)`.

        Raises:
            ValueError: if the target's shapes do not match the drafter's (a different model).
        """
        source = target.state_dict(keep_vars=True)
        layer_ids = self.config.source_layer_ids or list(range(self.config.num_hidden_layers))
        lm_head = target.get_output_embeddings().weight
        own = dict(self.named_parameters(remove_duplicate=False))
        for name in own:
            if self.is_drafter_specific(name):
                continue
            if name.startswith("model.layers."):
                idx, rest = name[len("model.layers.") :].split(".", 1)
                src_name = f"model.layers.{layer_ids[int(idx)]}.{rest}"
            elif name == "lm_head.weight":
                src_name = None
            else:
                src_name = name
            tensor = lm_head if src_name is None else source.get(src_name)
            if tensor is None or tensor.shape != own[name].shape:
                raise ValueError(
                    f"Cannot attach {type(target).__name__} weights to this drafter: `{src_name or 'lm_head.weight'}` "
                    f"is {'missing' if tensor is None else tuple(tensor.shape)}, the drafter expects "
                    f"{tuple(own[name].shape)}. Pass the target the drafter was made for "
                    f"({self.config.target_model})."
                )
            module_name, _, param_name = name.rpartition(".")
            module = self.get_submodule(module_name)
            module._parameters[param_name] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
        ref = lm_head
        for name, param in self.named_parameters():
            if self.is_drafter_specific(name):
                param.data = param.data.to(device=ref.device)
        self.model.rotary_emb.to(ref.device)
        # a plain reference, not a registered submodule: the target's parameters must not become the drafter's
        self._modules.pop("_attached_target", None)
        self.__dict__["_attached_target"] = target

    def _check_weights_attached(self) -> None:
        if self.config.shares_target_weights and self._attached_target is None:
            raise RuntimeError(
                "This drafter shares its layers with its target (`shares_target_weights=True`) and they are not "
                f"attached yet: call `drafter.attach_target_weights(target)` with {self.config.target_model}, or "
                "pass the drafter as `assistant_model` to `target.generate`, which attaches them."
            )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        r"""
        `PreTrainedModel.from_pretrained`, refusing checkpoints that would load as a different drafter than the one
        saved: before loading, the safetensors files of a local folder are checked whole (header and size); after
        loading, every weight the config requires must have come from the checkpoint (transformers would otherwise
        initialise missing ones at random, with only a warning) and no stored weight may be left unused. For a
        `shares_target_weights` drafter only the drafter-specific weights are required.

        Raises:
            OSError: if a weights file of a local folder is truncated or corrupt (naming the file).
            ValueError: if the weights hold no mask embedding while `config.json` sets no `mask_token_id` (a drafter
                without a mask token), lack other weights the config requires, or hold weights it has no place for
                (config and weights of different drafters); if `config.json` lacks a required field (see
                `D3DConfig.from_dict`).
        """
        if pretrained_model_name_or_path is not None:
            folder = os.path.join(os.fspath(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
            if os.path.isdir(folder):
                _check_weight_files(folder, kwargs.get("variant"))
        output_loading_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
        missing = sorted(info.get("missing_keys") or [])
        unexpected = sorted(info.get("unexpected_keys") or [])
        source = pretrained_model_name_or_path
        if model.config.mask_token_id is None and any("mask_embedding" in key for key in missing):
            raise ValueError(
                f"The drafter at {source} has no mask token: its config.json sets no `mask_token_id` and its weights "
                "hold no `model.mask_embedding.weight`. Set `mask_token_id` in config.json to the spare vocabulary id "
                "the drafter was trained with, or create the drafter again (`d3d-hf init-drafter`, or "
                "`D3DForDiffusionDrafting.from_autoregressive(target)` then `save_pretrained`)."
            )
        if missing:
            raise ValueError(
                f"The weights at {source} lack {len(missing)} tensor(s) its config.json requires, e.g. {missing[:4]}: "
                "config.json and the weights belong to different drafters, or the save was incomplete. Save the "
                "drafter again with `save_pretrained`, or correct config.json (`num_hidden_layers`, "
                "`block_lora_rank`, `shares_target_weights`, ...)."
            )
        if unexpected:
            raise ValueError(
                f"The weights at {source} hold {len(unexpected)} tensor(s) its config.json has no place for, e.g. "
                f"{unexpected[:4]}: config.json and the weights belong to different drafters. Save the drafter again "
                "with `save_pretrained`, or correct config.json (`num_hidden_layers`, `block_lora_rank`, "
                "`use_qk_norm`, ...)."
            )
        return (model, info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`; a `shares_target_weights` drafter stores only its own weights."""
        if self.config.shares_target_weights:
            state_dict = kwargs.get("state_dict") or self.state_dict()
            kwargs["state_dict"] = {k: v for k, v in state_dict.items() if self.is_drafter_specific(k)}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        masked_positions: torch.BoolTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: D3DCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool = False,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        block_positions: torch.BoolTensor | None = None,
        packed_metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> D3DModelOutput:
        r"""
        Runs the drafter. Arguments as in `D3DModel.forward`, plus:

        Args:
            logits_to_keep (`int`, defaults to 0):
                Compute logits only for the last `logits_to_keep` positions (0 = all positions).

        Returns:
            `D3DModelOutput` with `logits` of shape `(batch_size, num_kept, vocab_size)` in the model dtype.

        Raises:
            RuntimeError: for a `shares_target_weights` drafter whose target weights are not attached.
        """
        self._check_weights_attached()
        outputs = self.model(
            input_ids=input_ids,
            masked_positions=masked_positions,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            block_positions=block_positions,
            packed_metadata=packed_metadata,
        )
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        outputs.logits = self.lm_head(hidden_states)
        return outputs

    @torch.no_grad()
    def draft_logits(
        self, committed_ids: torch.LongTensor, cache: D3DCache, num_masks: int | None = None
    ) -> torch.FloatTensor:
        r"""
        One synchronous draft pass (d3d-hf docs/DESIGN.md section 2): extends `cache` with `committed_ids` (causal) and
        predicts the block that follows, without keeping the masks in the cache.

        Args:
            committed_ids (`torch.LongTensor` of shape `(1, num_committed)`):
                Tokens committed since the last call (at least one: the last is the anchor).
            cache (`D3DCache`):
                The drafter's cache of the committed context before `committed_ids`; extended in place.
            num_masks (`int`, *optional*):
                Mask tokens after the anchor; defaults to `block_size - 1`.

        Returns:
            `torch.FloatTensor` of shape `(1, num_masks + 1, vocab_size)`: row `j` scores draft token `d_{j+1}`
            (row `num_masks` is the guess one past the block).

        Raises:
            ValueError: if `committed_ids` is empty.
        """
        num_committed = committed_ids.shape[1]
        if num_committed < 1:
            raise ValueError("A draft pass needs at least one committed token (the anchor).")
        num_masks = self.config.block_size - 1 if num_masks is None else num_masks
        past_len = cache.get_seq_length()
        device = self.model.embed_tokens.weight.device
        filler = committed_ids.new_zeros((1, num_masks))
        input_ids = torch.cat([committed_ids.to(device), filler.to(device)], dim=1)
        masked_positions = torch.zeros_like(input_ids, dtype=torch.bool)
        masked_positions[:, num_committed:] = True
        attention_mask = draft_attention_mask(num_committed, num_masks, past_len, device)
        outputs = self(
            input_ids=input_ids,
            masked_positions=masked_positions,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=num_masks + 1,
        )
        cache.crop(past_len + num_committed)
        return outputs.logits

    @torch.no_grad()
    def packed_draft_logits(
        self,
        chain_ids: torch.LongTensor,
        cache: D3DCache,
        hypothesis_chain_lengths: list[int],
        bonus_guesses: list[int],
    ) -> D3DPackedDraft:
        r"""
        Packed successor drafting (arXiv 2611.06425; d3d-hf docs/DESIGN.md section 2): in one forward pass, drafts the
        block that follows each of several possible verification outcomes of the block now being verified.

        The packed sequence is the causal chain `chain_ids` (tokens committed since the drafter's cache was last
        extended, then the drafts under verification) followed by one block `[g_h, MASK x (B-1)]` per hypothesis
        `h`, where `g_h = bonus_guesses[h]` is placed right after the first `hypothesis_chain_lengths[h]` chain
        tokens. Each block attends to the cached prefix, to its hypothesis' chain tokens and to itself (causal
        first token, bidirectional masks); see `packed_attention_mask`. `cache` is not modified: the packed keys and
        values are returned so that `D3DPackedDraft.commit` can extend the cache with what really got committed.
        On CUDA with Triton and d3d_hf installed, attention runs in the packed-attention kernel of `d3d_hf.kernels`
        (mask computed from per-token metadata, none materialised); elsewhere through a dense boolean mask.

        Args:
            chain_ids (`torch.LongTensor` of shape `(1, chain_length)`): the chain (at least one token).
            cache (`D3DCache`): the drafter's cache of the committed context before `chain_ids`.
            hypothesis_chain_lengths (`list[int]`): per hypothesis, chain tokens it assumes committed (0..chain_length).
            bonus_guesses (`list[int]`): per hypothesis, the guessed bonus token id `g_h`.

        Returns:
            `D3DPackedDraft` with `logits` of shape `(num_hypotheses, block_size, vocab_size)` in the model dtype.

        Raises:
            ValueError: for an empty chain, no hypotheses, mismatched lists, or a chain length out of range.
        """
        chain_length = chain_ids.shape[1]
        if chain_length < 1 or not hypothesis_chain_lengths:
            raise ValueError("A packed pass needs a non-empty chain and at least one hypothesis.")
        if len(bonus_guesses) != len(hypothesis_chain_lengths):
            raise ValueError("Pass one bonus guess per hypothesis.")
        block_size = self.config.block_size
        device = self.model.embed_tokens.weight.device
        prefix_length = cache.get_seq_length()
        segment_ids, positions, chain_lengths = packed_metadata(
            chain_length, hypothesis_chain_lengths, block_size, device
        )
        num_blocks = len(hypothesis_chain_lengths)
        blocks = torch.zeros((num_blocks, block_size), dtype=torch.long, device=device)
        blocks[:, 0] = torch.tensor(bonus_guesses, dtype=torch.long, device=device)
        input_ids = torch.cat([chain_ids.to(device)[0], blocks.flatten()])[None]
        masked_positions = ((segment_ids > 0) & (positions > 0))[None]
        # a block token sits right after its hypothesis' chain: position = prefix + chain length + index in block
        position_ids = prefix_length + torch.where(segment_ids == 0, positions, chain_lengths + positions)[None]
        work = D3DCache()  # a shallow copy: `update` concatenates into new tensors, the caller's cache is untouched
        work.key_cache, work.value_cache = list(cache.key_cache), list(cache.value_cache)
        outputs = self(
            input_ids=input_ids,
            masked_positions=masked_positions,
            packed_metadata=(segment_ids, positions, chain_lengths),
            position_ids=position_ids,
            past_key_values=work,
            use_cache=True,
            logits_to_keep=num_blocks * block_size,
        )
        return D3DPackedDraft(
            logits=outputs.logits[0].view(num_blocks, block_size, -1),
            hypothesis_chain_lengths=hypothesis_chain_lengths,
            bonus_guesses=bonus_guesses,
            prefix_length=prefix_length,
            key_states=[k[..., prefix_length:, :] for k in work.key_cache],
            value_states=[v[..., prefix_length:, :] for v in work.value_cache],
        )

    def build_candidate_generator(self, target=None, **kwargs) -> D3DCandidateGenerator:
        """Called by the patched `GenerationMixin._get_candidate_generator` of the target (see
        `generation_d3d.install_generation_hook`): returns the `D3DCandidateGenerator` for one `generate` call
        (attaching the target's weights first for a `shares_target_weights` drafter).

        Raises:
            ValueError: if the target's vocabulary size differs from the drafter's, and for the prompts and drafters
                `D3DCandidateGenerator` refuses (all before any forward pass).
        """
        if target is not None:
            target_vocab = target.config.get_text_config().vocab_size
            if target_vocab != self.config.vocab_size:
                raise ValueError(
                    f"This D3D drafter has a vocabulary of {self.config.vocab_size} tokens but the target has "
                    f"{target_vocab}: a D3D drafter drafts in its target's own token ids (universal assisted "
                    "decoding across tokenizers is not supported). Make a drafter for this target with "
                    "`D3DForDiffusionDrafting.from_autoregressive(target)`."
                )
        if self.config.shares_target_weights and target is not None and self._attached_target is not target:
            self.attach_target_weights(target)
        return D3DCandidateGenerator(drafter=self, target=target, **kwargs)

    @classmethod
    def from_autoregressive(
        cls,
        model: PreTrainedModel,
        num_layers: int | None = None,
        layer_ids: list[int] | None = None,
        block_size: int = 16,
        mask_token_id: int | None = None,
        source_model: str | None = None,
        target_model: str | None = None,
        block_lora_rank: int = 0,
        block_lora_alpha: float = 16.0,
        shares_target_weights: bool = False,
    ) -> D3DForDiffusionDrafting:
        r"""
        Initialises a drafter from an autoregressive causal LM of the same tokenizer (Llama-, Mistral- or
        Qwen3-style layers) by copying the chosen decoder layers, the final norm, the embeddings and the LM head
        (d3d-hf docs/DESIGN.md section 3, "Initialisation").

        Args:
            model (`PreTrainedModel`):
                A causal LM whose decoder layers have the Llama/Qwen3 layout (`model.model.layers[i].self_attn.
                {q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, two RMSNorms, optional `q_norm`/`k_norm`).
            num_layers (`int`, *optional*):
                Copy the first `num_layers` layers. Mutually exclusive with `layer_ids`; if both are `None` all
                layers are copied (the best untrained drafter, d3d-hf docs/DESIGN.md section 8).
            layer_ids (`list[int]`, *optional*):
                Indices of the source layers to copy, in order.
            block_size (`int`, defaults to 16):
                Draft block size `B`.
            mask_token_id (`int`, *optional*):
                A spare vocabulary id to reuse as the mask token. When `None` a separate mask embedding is created,
                initialised to the mean input embedding (a neutral "unknown token" vector).
            source_model, target_model (`str`, *optional*):
                Names recorded in the config (default: the source's `name_or_path`).
            block_lora_rank, block_lora_alpha:
                Block adapters to create (see `D3DConfig`; rank 0 = none). Fresh adapters leave the output unchanged.
            shares_target_weights (`bool`, defaults to `False`):
                Reference `model`'s tensors instead of copying them, and save only drafter-specific weights (the
                source must then be the target the drafter is used with).

        Returns:
            `D3DForDiffusionDrafting` in the source model's dtype and on its device, in eval mode.

        Raises:
            ValueError: if both `num_layers` and `layer_ids` are given, a layer index is out of range, or the
                source's layers do not have the supported layout.
        """
        if num_layers is not None and layer_ids is not None:
            raise ValueError("Give either `num_layers` or `layer_ids`, not both.")
        src_cfg = model.config.get_text_config()
        total = src_cfg.num_hidden_layers
        if layer_ids is None:
            n = total if num_layers is None else int(num_layers)
            if not 1 <= n <= total:
                raise ValueError(f"`num_layers` must be in 1..{total} (the source has {total} layers), got {n}.")
            layer_ids = list(range(n))
        layer_ids = [int(i) for i in layer_ids]
        if not layer_ids or any(not 0 <= i < total for i in layer_ids):
            raise ValueError(f"`layer_ids` must be a non-empty list of indices in 0..{total - 1}, got {layer_ids}.")
        backbone = getattr(model, "model", None)
        if backbone is None or not hasattr(backbone, "layers") or not hasattr(backbone, "embed_tokens"):
            raise ValueError(
                f"{type(model).__name__} does not have the Llama/Qwen3 layout (`model.model.layers`, "
                "`model.model.embed_tokens`); load the source with `AutoModelForCausalLM`."
            )
        first_attn = backbone.layers[0].self_attn
        rope_parameters = getattr(src_cfg, "rope_parameters", None) or {
            "rope_type": "default",
            "rope_theta": float(getattr(src_cfg, "rope_theta", 10000.0)),
        }
        num_heads = src_cfg.num_attention_heads
        config = D3DConfig(
            vocab_size=src_cfg.vocab_size,
            hidden_size=src_cfg.hidden_size,
            intermediate_size=src_cfg.intermediate_size,
            num_hidden_layers=len(layer_ids),
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(src_cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(src_cfg, "head_dim", None) or src_cfg.hidden_size // num_heads,
            hidden_act=getattr(src_cfg, "hidden_act", "silu"),
            max_position_embeddings=src_cfg.max_position_embeddings,
            rms_norm_eps=src_cfg.rms_norm_eps,
            rope_parameters=dict(rope_parameters),
            attention_bias=bool(getattr(src_cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(src_cfg, "mlp_bias", False)),
            use_qk_norm=hasattr(first_attn, "q_norm"),
            tie_word_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
            block_size=block_size,
            mask_token_id=mask_token_id,
            source_model=source_model or getattr(model, "name_or_path", None) or None,
            source_layer_ids=layer_ids,
            target_model=target_model or source_model or getattr(model, "name_or_path", None) or None,
            block_lora_rank=block_lora_rank,
            block_lora_alpha=block_lora_alpha,
            shares_target_weights=shares_target_weights,
            bos_token_id=getattr(src_cfg, "bos_token_id", None),
            eos_token_id=getattr(src_cfg, "eos_token_id", None),
            pad_token_id=getattr(src_cfg, "pad_token_id", None),
        )
        ref = backbone.embed_tokens.weight
        drafter = cls(config).to(device=ref.device, dtype=ref.dtype)

        if shares_target_weights:
            drafter.attach_target_weights(model)
        else:
            src_state = model.state_dict()
            new_state = {}
            for dst_idx, src_idx in enumerate(layer_ids):
                prefix = f"model.layers.{src_idx}."
                for key, value in src_state.items():
                    if key.startswith(prefix):
                        new_state[f"model.layers.{dst_idx}.{key[len(prefix) :]}"] = value
            new_state["model.embed_tokens.weight"] = src_state["model.embed_tokens.weight"]
            new_state["model.norm.weight"] = src_state["model.norm.weight"]
            new_state["lm_head.weight"] = src_state.get("lm_head.weight", src_state["model.embed_tokens.weight"])
            expected = {k for k in drafter.state_dict() if not drafter.is_drafter_specific(k)}
            missing, unexpected = expected - set(new_state), set(new_state) - expected
            if missing or unexpected:
                raise ValueError(
                    f"{type(model).__name__} has layers of an unsupported layout: missing {sorted(missing)[:6]}, "
                    f"unexpected {sorted(unexpected)[:6]}. Supported: Llama-, Mistral- and Qwen3-style decoder "
                    "layers."
                )
            drafter.load_state_dict(new_state, strict=False)
            if config.tie_word_embeddings:
                drafter.tie_weights()
        if drafter.model.mask_embedding is not None:
            with torch.no_grad():
                drafter.model.mask_embedding.weight.copy_(ref.float().mean(dim=0).to(ref.dtype))
        return drafter.eval()


D3DConfig.register_for_auto_class()
D3DForDiffusionDrafting.register_for_auto_class("AutoModel")

__all__ = [
    "D3DCache",
    "D3DForDiffusionDrafting",
    "D3DModel",
    "D3DModelOutput",
    "D3DPreTrainedModel",
    "causal_attention_mask",
    "draft_attention_mask",
]
