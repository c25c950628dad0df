"""D3D drafting state and passes: the drafter's KV cache, attention masks of the draft passes, the synchronous
draft pass and packed successor drafting (arXiv 2611.06425; d3d-hf docs/DESIGN.md sections 2 and 8).

Part of the self-contained remote-code bundle: imports only torch (the passes call the drafter they are given, so
this module imports no other bundle file and nothing from d3d_hf).

Attention convention: every attention mask built here is boolean, `True` where a query may attend to a key, of
shape `(batch_size, 1, query_len, key_len)` (or `(query_len, key_len)` for `packed_attention_mask`); `key_len`
counts the cached tokens first, then the current ones.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

import torch


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


#: how the attention of a packed pass may run: "auto" (a registered kernel on CUDA, the dense mask elsewhere),
#: "dense" (always the dense boolean mask of `packed_attention_mask`) or "kernel" (the registered kernel wherever
#: it says it can run, e.g. on CPU under Triton's interpreter, for tests)
PACKED_ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "kernel")
#: entry-point group through which an installed package offers its packed-attention kernel: the entry is a function
#: returning `(kernel, unavailable_reason)` as `register_packed_attention_kernel` takes them (d3d_hf declares
#: `d3d_hf.kernels:packed_attention_kernel`), so a drafter loaded as remote code finds it too
PACKED_ATTENTION_KERNELS_GROUP = "d3d.packed_attention_kernels"
_PACKED_ATTENTION_KERNEL: dict[str, Callable] = {}


def _registered_kernel() -> tuple[Callable | None, Callable | None]:
    if "kernel" not in _PACKED_ATTENTION_KERNEL:  # first use: the installed entry point, if any (looked up once)
        kernel, reason = None, None
        for entry in sorted(entry_points(group=PACKED_ATTENTION_KERNELS_GROUP), key=lambda e: e.name):
            try:
                kernel, reason = entry.load()()
                break
            except ImportError:  # registered but not importable here: the dense mask it is
                continue
        _PACKED_ATTENTION_KERNEL.update(kernel=kernel, unavailable_reason=reason)
    return _PACKED_ATTENTION_KERNEL["kernel"], _PACKED_ATTENTION_KERNEL["unavailable_reason"]


def register_packed_attention_kernel(
    kernel: Callable, unavailable_reason: Callable[[torch.device], str | None]
) -> None:
    """Registers the attention kernel that packed passes use instead of a dense mask (d3d-hf docs/DESIGN.md section 5).

    The bundle ships no kernel. Without a call to this function, the first packed pass looks up the
    `d3d.packed_attention_kernels` entry point: with `d3d_hf` installed that is
    `d3d_hf.kernels.packed_attention_triton`; with only torch + transformers there is none and packed passes use the
    dense mask.

    Args:
        kernel (`Callable`): `kernel(query, key, value, segment_ids, positions, chain_lengths, *, scale)` with `query`
            `[B, H, T, D]`, `key`/`value` `[B, H_kv, P + T, D]` and the metadata of `packed_metadata`, returning
            `[B, H, T, D]`: the attention of `packed_attention_mask(segment_ids, positions, chain_lengths, P)`.
        unavailable_reason (`Callable`): `unavailable_reason(device)` is `None` when the kernel can run on `device`,
            else a sentence saying why not.
    """
    _PACKED_ATTENTION_KERNEL["kernel"] = kernel
    _PACKED_ATTENTION_KERNEL["unavailable_reason"] = unavailable_reason


def resolve_packed_attention_kernel(implementation: str, device: torch.device, batch_size: int) -> Callable | None:
    """The one decision, per forward, of how a packed pass attends: the registered kernel, or `None` for the dense
    mask (see `PACKED_ATTENTION_IMPLEMENTATIONS`).

    Raises:
        ValueError: for an unknown `implementation`.
        RuntimeError: for `"kernel"` when no kernel is registered (import `d3d_hf`) or it cannot run on `device`.
    """
    if implementation not in PACKED_ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"`packed_attention_implementation` must be one of {PACKED_ATTENTION_IMPLEMENTATIONS}, got "
            f"{implementation!r}."
        )
    if implementation == "dense":
        return None
    kernel, unavailable_reason = _registered_kernel()
    reason = "no packed-attention kernel is installed (`pip install d3d-hf[kernels]` provides the Triton kernel)"
    if kernel is not None:
        reason = unavailable_reason(device)
        if reason is None and batch_size != 1:
            reason = f"the kernel's metadata is shared across the batch, which holds {batch_size} sequences"
    if implementation == "kernel" and reason is not None:
        raise RuntimeError(f"packed_attention_implementation='kernel' cannot run: {reason}. Use 'auto' or 'dense'.")
    if reason is not None or (implementation == "auto" and device.type != "cuda"):
        return None
    return kernel


@torch.no_grad()
def draft_logits(
    drafter,
    committed_ids: torch.LongTensor,
    cache: D3DCache,
    num_masks: int | None = None,
    anchor_hidden_state: torch.FloatTensor | None = None,
) -> torch.FloatTensor:
    r"""
    One synchronous draft pass (d3d-hf docs/DESIGN.md section 2): extends `cache` with `committed_ids` (causal) and
    predicts the block that follows, without keeping the masks in the cache.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter that runs the pass.
        committed_ids (`torch.LongTensor` of shape `(1, num_committed)`):
            Tokens committed since the last call (at least one: the last is the anchor).
        cache (`D3DCache`):
            The drafter's cache of the committed context before `committed_ids`; extended in place.
        num_masks (`int`, *optional*):
            Mask tokens after the anchor; defaults to `block_size - 1`.
        anchor_hidden_state (`torch.FloatTensor` of shape `(1, hidden_size)`, *optional*):
            Required by (and only for) a drafter with `config.reads_target_hidden_state`: the target's last hidden
            state at the position before the anchor (what its verification forward computed); the anchor's row
            reads it, the other rows get zeros (`D3DModel.forward`'s `target_hidden_states`).

    Returns:
        `torch.FloatTensor` of shape `(1, num_masks + 1, vocab_size)`: row `j` scores draft token `d_{j+1}`
        (row `num_masks` is the guess one past the block).

    Raises:
        ValueError: if `committed_ids` is empty, or (`D3DModel.forward`) `anchor_hidden_state` is missing for a
            drafter that reads it or given to one that does not.
    """
    num_committed = committed_ids.shape[1]
    if num_committed < 1:
        raise ValueError("A draft pass needs at least one committed token (the anchor).")
    num_masks = drafter.config.block_size - 1 if num_masks is None else num_masks
    past_len = cache.get_seq_length()
    device = drafter.model.embed_tokens.weight.device
    filler = committed_ids.new_zeros((1, num_masks))
    input_ids = torch.cat([committed_ids.to(device), filler.to(device)], dim=1)
    masked_positions = torch.zeros_like(input_ids, dtype=torch.bool)
    masked_positions[:, num_committed:] = True
    attention_mask = draft_attention_mask(num_committed, num_masks, past_len, device)
    outputs = drafter(
        input_ids=input_ids,
        masked_positions=masked_positions,
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=num_masks + 1,
        target_hidden_states=anchor_rows(anchor_hidden_state, input_ids.shape[1], num_committed - 1),
    )
    cache.crop(past_len + num_committed)
    return outputs.logits


def anchor_rows(anchor_hidden_state: torch.Tensor | None, num_rows: int, anchor: int) -> torch.Tensor | None:
    """`(1, num_rows, hidden_size)` zeros but for row `anchor`, which is `anchor_hidden_state` (`(1, hidden_size)`
    or `(hidden_size,)`); `None` stays `None`."""
    if anchor_hidden_state is None:
        return None
    state = anchor_hidden_state.reshape(1, -1)
    rows = state.new_zeros((1, num_rows, state.shape[-1]))
    rows[0, anchor] = state[0]
    return rows


def timing_state(drafter) -> dict:
    """Keyword arguments that let `draft_logits` run a timed pass of any drafter (calibration, cost timing): for one
    that reads the target's hidden state (`config.reads_target_hidden_state`), a zero `anchor_hidden_state`, whose
    pass costs the same; else none."""
    if not getattr(drafter.config, "reads_target_hidden_state", False):
        return {}
    device = drafter.model.embed_tokens.weight.device
    return {"anchor_hidden_state": torch.zeros(1, drafter.config.hidden_size, device=device)}


@torch.no_grad()
def packed_draft_logits(
    drafter,
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
    How attention runs (the registered kernel, which computes the mask from per-token metadata, or a dense mask)
    is decided once per pass by `resolve_packed_attention_kernel`.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter that runs the pass.
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
    block_size = drafter.config.block_size
    device = drafter.model.embed_tokens.weight.device
    prefix_length = cache.get_seq_length()
    segment_ids, positions, chain_lengths = packed_metadata(chain_length, hypothesis_chain_lengths, block_size, device)
    num_blocks = len(hypothesis_chain_lengths)
    blocks = torch.zeros((num_blocks, block_size), dtype=torch.long, device=device)
    blocks[:, 0] = torch.tensor(bonus_guesses, dtype=torch.long, device=device)
    input_ids = torch.cat([chain_ids.to(device)[0], blocks.flatten()])[None]
    masked_positions = ((segment_ids > 0) & (positions > 0))[None]
    # a block token sits right after its hypothesis' chain: position = prefix + chain length + index in block
    position_ids = prefix_length + torch.where(segment_ids == 0, positions, chain_lengths + positions)[None]
    work = D3DCache()  # a shallow copy: `update` concatenates into new tensors, the caller's cache is untouched
    work.key_cache, work.value_cache = list(cache.key_cache), list(cache.value_cache)
    outputs = drafter(
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


__all__ = [
    "PACKED_ATTENTION_IMPLEMENTATIONS",
    "PACKED_ATTENTION_KERNELS_GROUP",
    "D3DCache",
    "D3DPackedDraft",
    "causal_attention_mask",
    "draft_attention_mask",
    "anchor_rows",
    "draft_logits",
    "packed_attention_mask",
    "packed_draft_logits",
    "timing_state",
    "packed_metadata",
    "register_packed_attention_kernel",
    "resolve_packed_attention_kernel",
]
