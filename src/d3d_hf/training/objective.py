"""The D3D training objective: the block-diffusion attention mask and the losses of one batch (`d3d_losses`).

Objective (docs/DESIGN.md section 3; BD3-LM block-diffusion attention, arXiv 2503.09573):

- **Blockwise denoising.** For `anchors_per_sequence` random anchors `a` per sequence, the block after the anchor,
  positions `a+1 .. a+B-1`, is masked (every position, or a random fraction in `[mask_ratio_min,
  mask_ratio_max]`). With the drafter's "shifted, causal anchor" alignment the output at block position `a+j`
  predicts token `x[a+j+1]`, i.e. draft token `d_{j+1}`; its cross-entropy is weighted by
  `w_k = exp(-(k-1)/gamma)` with `k = j+1`, favouring early draft positions (targets given as clean tokens inside
  the block are not scored). The first draft token `d1` is the anchor's ordinary next-token prediction.
- **Which tokens are learned.** The response tokens (`response_start` on), or, for TRL-prepared rows, the tokens
  of the batch's `loss_mask` (TRL's `labels` not -100: completions, assistant turns): a next-token target, an anchor
  (whose next token must be learned) and a scored block target are always such tokens.
- **Auxiliary autoregressive loss.** `ar_loss_weight` times the next-token loss on the clean response tokens.
  With `block_loss_weight=0` it is the only loss and the noisy blocks are not run at all: the trainer then trains
  an ordinary autoregressive drafter (with `train_mode="full"` or `"peft"`; block adapters act only inside blocks),
  the baseline that `d3d_hf.convert.export_causal_lm` turns into an assistant for transformers' assisted generation
  (`examples/train_ar_assistant.sh`).
- **One vectorised pass, no loop over blocks.** The clean stream (length `L`) runs first and leaves its keys and
  values in a `D3DCache`, exactly as at inference; then all `K` noisy blocks of all sequences run as one query
  batch of `K * (B-1)` tokens under a block-diffusion mask: block `k` sees clean positions `<= a_k` and itself,
  bidirectionally. This is the clean + noisy concatenation of BD3-LM with the noisy copy reduced to the sampled
  blocks (`L + K(B-1)` tokens instead of `2L`). When only drafter-specific weights train (block adapters, mask
  embedding), the clean stream does not depend on them and runs without autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..modeling import D3DCache, D3DForDiffusionDrafting


def block_diffusion_attention_mask(
    anchors: torch.LongTensor, clean_attention_mask: torch.Tensor, block_size: int
) -> torch.BoolTensor:
    """Attention mask of the noisy blocks over `[clean stream | noisy blocks]`.

    Args:
        anchors (`torch.LongTensor` of shape `(batch, K)`): anchor positions (-1 = unused block).
        clean_attention_mask (`torch.Tensor` of shape `(batch, L)`): 1 for real clean tokens.
        block_size (`int`): `B`; each block has `B - 1` query tokens.

    Returns:
        `torch.BoolTensor` of shape `(batch, 1, K*(B-1), L + K*(B-1))`: query `(k, j)` may attend to clean position
        `t` iff `t <= a_k` and `t` is real, and to noisy token `(k', j')` iff `k' == k` (bidirectional block).
        Rows of unused blocks attend only to their own block (their loss is ignored).
    """
    batch, num_blocks = anchors.shape
    span = block_size - 1
    length = clean_attention_mask.shape[1]
    t = torch.arange(length, device=anchors.device)
    clean = (t[None, None, :] <= anchors[:, :, None]) & clean_attention_mask.bool()[:, None, :]  # (batch, K, L)
    clean = clean[:, :, None, :].expand(batch, num_blocks, span, length).reshape(batch, num_blocks * span, length)
    block_id = torch.arange(num_blocks, device=anchors.device).repeat_interleave(span)
    noisy = (block_id[:, None] == block_id[None, :])[None].expand(batch, -1, -1)
    return torch.cat([clean, noisy], dim=-1)[:, None]


def _position_weights(span: int, gamma: float, device) -> torch.Tensor:
    """`w` for block positions j = 1..B-1, which predict draft token k = j + 1: `exp(-(k-1)/gamma)`."""
    j = torch.arange(1, span + 1, device=device, dtype=torch.float32)
    return torch.exp(-j / gamma)


def _draft_vocab_index(drafter, device) -> torch.LongTensor | None:
    """For a drafter with a draft vocabulary: target id -> its row of the LM head, -1 for ids outside; else `None`."""
    unwrapped = getattr(drafter, "module", drafter)  # DistributedDataParallel wraps the model
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped  # a PEFT model
    if not getattr(base.config, "draft_vocab_size", None):
        return None
    index = torch.full((base.config.vocab_size,), -1, dtype=torch.long, device=device)
    ids = base.draft_vocab_ids.to(device)
    index[ids] = torch.arange(ids.numel(), device=device)
    return index


def d3d_losses(
    drafter: D3DForDiffusionDrafting,
    inputs: dict[str, torch.Tensor],
    block_size: int,
    gamma: float,
    compute_ar: bool = True,
    clean_requires_grad: bool = True,
    compute_block: bool = True,
    distill: bool = False,
    teacher=None,
) -> dict[str, torch.Tensor]:
    """The D3D training losses of one batch (module docstring), vectorised over sequences and blocks.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter (or a PEFT model wrapping it: anything whose call accepts
            the drafter's forward arguments).
        inputs (`dict`): a `D3DDataCollator` batch. With a `loss_mask` (`torch.BoolTensor` of shape `(batch, L)`,
            True at the tokens to learn, as the collator makes from TRL's `labels`/`completion_mask`/`assistant_masks`),
            only those tokens are scored (next-token targets and block targets); without one, every real token from
            `response_start` on is (the same thing for a one-turn prompt + response).
        block_size (`int`): `B`.
        gamma (`float`): position-weight decay.
        compute_ar (`bool`): whether to compute the next-token loss on the clean stream.
        clean_requires_grad (`bool`): run the clean stream under autograd (needed when trainable weights act on
            committed tokens).
        compute_block (`bool`): whether to run the noisy blocks and compute the block loss (0 and no block
            tokens when not).
        distill (`bool`, defaults to `False`): also compute `distill_loss`, the position-weighted mean over the scored
            block positions of `KL(p || q)`, where `q` is the drafter's distribution at the position and `p` the
            target's next-token distribution at the same place (the target's logits at the block token's clean
            position, which predict the token the block position is scored on): distillation on the target's
            logits, as NVIDIA's DFlash recipe does. With a draft vocabulary `p` is renormalised over its ids.
        teacher (`PreTrainedModel`, *optional*): the target, run once without gradients on the clean batch to give
            `p`. `None`: `p` comes from the drafter's own clean stream, which is the target's when the drafter's
            committed path is the target's (a block-adapter drafter on all of the target's layers): no extra pass.

    Returns:
        `dict` with scalar float32 tensors `block_loss` (weighted mean over scored block positions; 0 when none),
        `ar_loss` (mean next-token loss over response tokens; 0 when not computed), and counts `block_tokens`,
        `ar_tokens`. With a draft vocabulary (`config.draft_vocab_size`) both losses are over the LM head's rows and
        a target token outside the draft vocabulary is not scored (it can never be drafted). A loss with nothing to
        score is an exact 0 that is still connected to the forward passes, so a batch of sequences too short to score
        trains as a zero-gradient step instead of failing in `backward`. With `distill`, also `distill_loss`.
    """
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    anchors, block_masked = inputs["anchors"], inputs["block_masked"]
    batch, length = input_ids.shape
    span = block_size - 1
    device = input_ids.device
    loss_mask = inputs.get("loss_mask")
    if loss_mask is not None:
        loss_mask = loss_mask.to(device=device, dtype=torch.bool)

    # a draft vocabulary (FR-Spec): losses over the LM head's own rows; a target outside it cannot be drafted and is
    # not scored
    vocab_index = _draft_vocab_index(drafter, device)
    head_kwargs = {} if vocab_index is None else {"draft_vocab_logits": True}
    cache = D3DCache()
    with torch.set_grad_enabled(clean_requires_grad and torch.is_grad_enabled()):
        clean = drafter(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
    losses: dict[str, torch.Tensor] = {}
    zero = torch.zeros((), device=device)

    # auxiliary autoregressive loss on the response tokens of the clean stream
    if compute_ar:
        hidden = clean.last_hidden_state[:, :-1]
        positions = torch.arange(length - 1, device=device)[None]
        if loss_mask is None:
            keep = (positions >= (inputs["response_start"][:, None] - 1)) & attention_mask[:, 1:].bool()
        else:
            keep = loss_mask[:, 1:] & attention_mask[:, 1:].bool()
        ar_targets = input_ids[:, 1:]
        if vocab_index is not None:
            ar_targets = vocab_index[ar_targets]
            keep = keep & (ar_targets >= 0)
        if keep.any():
            unwrapped = getattr(drafter, "module", drafter)  # DistributedDataParallel wraps the model
            head = unwrapped.get_output_embeddings()
            logits = head(hidden[keep]).float()
            losses["ar_loss"] = F.cross_entropy(logits, ar_targets[keep])
        else:
            losses["ar_loss"] = clean.last_hidden_state[:, :0].float().sum()  # 0, on the autograd graph if any
        losses["ar_tokens"] = keep.sum()
    else:
        losses["ar_loss"], losses["ar_tokens"] = zero, torch.zeros((), dtype=torch.long, device=device)

    if not compute_block:
        losses["block_loss"], losses["block_tokens"] = zero, torch.zeros((), dtype=torch.long, device=device)
        return losses

    # noisy blocks: one query batch of K*(B-1) tokens per sequence over the clean cache
    valid_block = anchors >= 0
    j = torch.arange(1, span + 1, device=device)
    pos = anchors.clamp(min=0)[:, :, None] + j  # (batch, K, span) position of block token j
    in_range = pos < length
    lengths = attention_mask.sum(-1)
    pos_c = pos.clamp(max=length - 1)
    clean_tokens = torch.gather(input_ids, 1, pos_c.view(batch, -1)).view_as(pos)
    masked = block_masked.to(device) | ~in_range | (pos >= lengths[:, None, None])
    noisy_ids = torch.where(masked, torch.zeros_like(clean_tokens), clean_tokens)
    target_pos = pos + 1
    target_ok = valid_block[:, :, None] & (target_pos < lengths[:, None, None])
    # a target that the block shows as a clean token is not scored (the last position predicts past the block)
    next_masked = torch.cat([masked[:, :, 1:], torch.ones_like(masked[:, :, :1])], dim=-1)
    scored = target_ok & next_masked
    if loss_mask is not None:  # a block that runs into tokens not to learn (a user turn) does not score them
        scored = scored & torch.gather(loss_mask, 1, target_pos.clamp(max=length - 1).view(batch, -1)).view_as(pos)
    targets = torch.gather(input_ids, 1, target_pos.clamp(max=length - 1).view(batch, -1)).view_as(pos)
    if vocab_index is not None:
        targets = vocab_index[targets]
        scored = scored & (targets >= 0)

    attn = block_diffusion_attention_mask(anchors, attention_mask, block_size)
    noisy = drafter(
        input_ids=noisy_ids.view(batch, -1),
        masked_positions=masked.view(batch, -1),
        block_positions=torch.ones_like(masked.view(batch, -1)),
        attention_mask=attn,
        position_ids=pos.view(batch, -1),
        past_key_values=cache,
        use_cache=True,
        **head_kwargs,
    )
    weights = _position_weights(span, gamma, device)[None, None].expand_as(pos) * scored

    def teacher_log_probs(rows, positions):
        return _teacher_log_probs(drafter, teacher, clean, inputs, rows, positions)

    losses.update(_scored_losses(noisy.logits, pos, targets, scored, weights, teacher_log_probs if distill else None))
    return losses


def _scored_losses(block_logits, pos, targets, scored, weights, teacher_log_probs=None) -> dict[str, torch.Tensor]:
    """`block_loss` (the `weights`-weighted cross-entropy of the `scored` block rows against `targets`),
    `block_tokens`, and with `teacher_log_probs` (`(rows, positions) -> (n, head rows)` float32 log-probabilities of
    the target at those clean positions) `distill_loss`, the same weighted mean of `KL(p || q)`. `block_logits` is
    `(batch, K * R, head rows)` for `pos`, `targets`, `scored`, `weights` of shape `(batch, K, R)`; nothing to score
    gives a 0 still on the autograd graph of `block_logits`."""
    losses = {"block_tokens": scored.sum()}
    empty = block_logits[:, :0].float().sum()  # 0, on the autograd graph of the trained weights
    if not scored.any():
        losses["block_loss"] = empty
        if teacher_log_probs is not None:
            losses["distill_loss"] = empty
        return losses
    batch, num_blocks, rows_per_block = pos.shape
    logits = block_logits.view(batch, num_blocks, rows_per_block, block_logits.shape[-1])[scored].float()
    ce = F.cross_entropy(logits, targets[scored], reduction="none")
    losses["block_loss"] = (ce * weights[scored]).sum() / weights[scored].sum()
    if teacher_log_probs is not None:
        rows = torch.arange(batch, device=pos.device)[:, None, None].expand_as(pos)[scored]
        teacher_logp = teacher_log_probs(rows, pos[scored])
        student_logp = F.log_softmax(logits, dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
        losses["distill_loss"] = (kl * weights[scored]).sum() / weights[scored].sum()
    return losses


def target_cache_attention_mask(anchors: torch.LongTensor, clean_attention_mask: torch.Tensor, block_size: int):
    """Attention mask of the blocks of a drafter over the target's cache (`target_cache_losses`).

    Args:
        anchors (`torch.LongTensor` of shape `(batch, K)`): anchor positions (-1 = unused block).
        clean_attention_mask (`torch.Tensor` of shape `(batch, L)`): 1 for real tokens of the target's stream.
        block_size (`int`): `B`; each block has `B` rows, the anchor then `B - 1` masks.

    Returns:
        `torch.BoolTensor` of shape `(batch, 1, K*B, L + K*B)`: row `(k, j)` may attend to the target's cached
        position `t` iff `t < a_k` and `t` is real (the cache a draft pass reads holds the tokens before the anchor),
        and to row `(k, j')` of its own block iff `j > 0` or `j' == 0`: the anchor attends causally (to itself), the
        masks to the whole block, as `drafting_d3d.draft_attention_mask` lays out a synchronous draft pass. Rows of
        unused blocks see only their own block (their loss is ignored).
    """
    batch, num_blocks = anchors.shape
    length = clean_attention_mask.shape[1]
    t = torch.arange(length, device=anchors.device)
    clean = (t[None, None, :] < anchors[:, :, None]) & clean_attention_mask.bool()[:, None, :]  # (batch, K, L)
    clean = clean[:, :, None, :].expand(batch, num_blocks, block_size, length)
    clean = clean.reshape(batch, num_blocks * block_size, length)
    block_id = torch.arange(num_blocks, device=anchors.device).repeat_interleave(block_size)
    row = torch.arange(block_size, device=anchors.device).repeat(num_blocks)
    same = (block_id[:, None] == block_id[None, :]) & ((row[:, None] > 0) | (row[None, :] == 0))
    return torch.cat([clean, same[None].expand(batch, -1, -1)], dim=-1)[:, None]


def target_cache_losses(
    drafter: D3DForDiffusionDrafting,
    inputs: dict[str, torch.Tensor],
    block_size: int,
    gamma: float,
    target,
    distill: bool = False,
) -> dict[str, torch.Tensor]:
    """The losses of one batch for a drafter over the target's cache (`D3DConfig.shares_target_cache`).

    The target runs once without gradients over the clean batch; its keys and values of layer
    `source_layer_ids[i]` are drafter layer `i`'s cache. Each block is then exactly the rows of a synchronous draft
    pass anchored at `a` (`target_cache_attention_mask`): the anchor token and `B - 1` masks (or, with a mask ratio
    below 1, some clean tokens) at positions `a .. a+B-1`, over the target's cache of positions `< a`. Row `j`
    predicts token `x[a+j+1]`, draft token `d_{j+1}`, weighted by `exp(-j / gamma)` as in `d3d_losses`, so the first
    draft token is scored in the block (this drafter has no autoregressive path of its own: there is no `ar_loss`).
    With `distill`, `distill_loss` is the same position-weighted `KL(p || q)` as in `d3d_losses`, `p` the target's
    next-token distribution at `a + j`, read from the same target forward (no extra pass). A drafter that reads the
    target's hidden state (`D3DConfig.reads_target_hidden_state`) gets, at each anchor row, the same forward's last
    hidden state at `a - 1`, as the engine gives it from the verification.

    Args:
        drafter (`D3DForDiffusionDrafting`): a drafter with `config.shares_target_cache=True`.
        inputs (`dict`): a `D3DDataCollator` batch.
        block_size (`int`): `B`.
        gamma (`float`): position-weight decay.
        target (`PreTrainedModel`): the target (a causal LM of the Llama/Qwen3 layout, `DynamicCache` of its layers).
        distill (`bool`, defaults to `False`): also compute `distill_loss`.

    Returns:
        `dict` with scalar float32 tensors `block_loss`, `ar_loss` (always 0), counts `block_tokens`, `ar_tokens`, and
        `distill_loss` with `distill`; as `d3d_losses` (a batch with nothing to score gives a connected exact 0).

    Raises:
        ValueError: if the target has no `.model` backbone or fewer layers than `source_layer_ids` names.
    """
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    anchors, block_masked = inputs["anchors"], inputs["block_masked"]
    batch, length = input_ids.shape
    device = input_ids.device
    loss_mask = inputs.get("loss_mask")
    if loss_mask is not None:
        loss_mask = loss_mask.to(device=device, dtype=torch.bool)
    unwrapped = getattr(drafter, "module", drafter)
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    config = base.config
    backbone = getattr(target, "model", None)
    if backbone is None:
        raise ValueError(f"{type(target).__name__} has no `.model` backbone: pass a causal LM (Llama/Qwen3 layout).")
    layer_ids = list(config.source_layer_ids or range(config.num_hidden_layers))
    with torch.no_grad():
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
    layers = getattr(out.past_key_values, "layers", None) or []
    if max(layer_ids) >= len(layers):
        raise ValueError(
            f"The drafter reads the target's cache of layers {layer_ids}, but {type(target).__name__} cached "
            f"{len(layers)} layers: pass the target the drafter was made for ({config.target_model})."
        )
    dtype = next(p for p in base.parameters() if p.is_floating_point()).dtype
    cache = D3DCache()
    for layer_id in layer_ids:
        cache.key_cache.append(layers[layer_id].keys.to(dtype))
        cache.value_cache.append(layers[layer_id].values.to(dtype))

    vocab_index = _draft_vocab_index(drafter, device)
    head_kwargs = {} if vocab_index is None else {"draft_vocab_logits": True}
    valid_block = anchors >= 0
    j = torch.arange(block_size, device=device)
    pos = anchors.clamp(min=0)[:, :, None] + j  # (batch, K, B): position of block row j
    lengths = attention_mask.sum(-1)
    beyond = pos >= lengths[:, None, None]
    pos_c = pos.clamp(max=length - 1)
    clean_tokens = torch.gather(input_ids, 1, pos_c.view(batch, -1)).view_as(pos)
    # row 0 is the anchor (a clean token); rows 1.. are masked as the collator drew (`block_masked`)
    masked = torch.cat([torch.zeros_like(block_masked[:, :, :1]), block_masked.to(device)], dim=-1) | beyond
    masked[:, :, 0] = False
    row_ids = torch.where(masked, torch.zeros_like(clean_tokens), clean_tokens)
    target_pos = pos + 1
    target_ok = valid_block[:, :, None] & (target_pos < lengths[:, None, None])
    # a target that the block shows as a clean token is not scored (the last row predicts past the block)
    next_masked = torch.cat([masked[:, :, 1:], torch.ones_like(masked[:, :, :1])], dim=-1)
    scored = target_ok & next_masked
    if loss_mask is not None:
        scored = scored & torch.gather(loss_mask, 1, target_pos.clamp(max=length - 1).view(batch, -1)).view_as(pos)
    targets = torch.gather(input_ids, 1, target_pos.clamp(max=length - 1).view(batch, -1)).view_as(pos)
    if vocab_index is not None:
        targets = vocab_index[targets]
        scored = scored & (targets >= 0)

    if getattr(config, "reads_target_hidden_state", False):  # the anchor row reads the state before it
        hidden = out.last_hidden_state.to(dtype)
        before = (anchors - 1).clamp(min=0)
        states = torch.gather(hidden, 1, before[:, :, None].expand(-1, -1, hidden.shape[-1]))
        states = states * (valid_block & (anchors >= 1))[:, :, None].to(dtype)
        rows = states.new_zeros((batch, anchors.shape[1], block_size, hidden.shape[-1]))
        rows[:, :, 0] = states
        head_kwargs["target_hidden_states"] = rows.view(batch, -1, hidden.shape[-1])
    blocks = drafter(
        input_ids=row_ids.view(batch, -1),
        masked_positions=masked.view(batch, -1),
        block_positions=masked.view(batch, -1),
        attention_mask=target_cache_attention_mask(anchors, attention_mask, block_size),
        position_ids=pos.view(batch, -1),
        past_key_values=cache,
        use_cache=True,
        **head_kwargs,
    )
    weights = torch.exp(-j.float() / gamma)[None, None].expand_as(pos) * scored

    @torch.no_grad()
    def teacher_log_probs(rows, positions):  # the target's own head at the clean positions, from the same forward
        logits = target.get_output_embeddings()(out.last_hidden_state[rows, positions]).float()
        if vocab_index is not None:
            logits = logits[:, base.draft_vocab_ids.to(device)]
        return F.log_softmax(logits, dim=-1)

    losses = {"ar_loss": torch.zeros((), device=device), "ar_tokens": torch.zeros((), dtype=torch.long, device=device)}
    losses.update(_scored_losses(blocks.logits, pos, targets, scored, weights, teacher_log_probs if distill else None))
    return losses


@torch.no_grad()
def _teacher_log_probs(drafter, teacher, clean, inputs, rows, positions) -> torch.Tensor:
    """The target's next-token log-probabilities at `(rows, positions)` of the clean batch, float32, over the
    drafter's head: its draft vocabulary (renormalised) when it has one, else the full vocabulary."""
    unwrapped = getattr(drafter, "module", drafter)
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    if teacher is None:
        hidden = clean.last_hidden_state[rows, positions]
        logits = base.get_output_embeddings()(hidden).float()
        vocab_ids = None  # the drafter's own head: already over its draft vocabulary
    else:
        backbone = getattr(teacher, "model", None)
        if backbone is None:
            raise ValueError(
                f"{type(teacher).__name__} has no `.model` backbone: pass a causal LM (Llama/Qwen3 layout)."
            )
        out = backbone(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        logits = teacher.get_output_embeddings()(out.last_hidden_state[rows, positions]).float()
        vocab_ids = getattr(base, "draft_vocab_ids", None) if getattr(base.config, "draft_vocab_size", None) else None
    if vocab_ids is not None:
        logits = logits[:, vocab_ids.to(logits.device)]
    return F.log_softmax(logits, dim=-1)


__all__ = ["block_diffusion_attention_mask", "d3d_losses", "target_cache_attention_mask", "target_cache_losses"]
