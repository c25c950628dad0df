"""Initialisation of a D3D drafter from an autoregressive causal LM of the same tokenizer (d3d-hf docs/DESIGN.md
section 3, "Initialisation").

Part of the self-contained remote-code bundle: imports only torch, the public transformers API and the configuration.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .configuration_d3d import D3DConfig


def from_autoregressive(
    cls: type[PreTrainedModel],
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
    draft_vocab_ids: list[int] | None = None,
    shares_target_cache: bool = False,
    reads_target_hidden_state: bool = False,
    hidden_state_init: str = "zeros",
) -> PreTrainedModel:
    r"""
    Initialises a drafter from an autoregressive causal LM of the same tokenizer (Llama-, Mistral- or
    Qwen3-style layers) by copying the chosen decoder layers, the final norm, the embeddings and the LM head
    (d3d-hf docs/DESIGN.md section 3, "Initialisation").

    Args:
        cls (`type`):
            `D3DForDiffusionDrafting` or a subclass (the class to instantiate).
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
        draft_vocab_ids (`list[int]`, *optional*):
            A draft vocabulary (FR-Spec, arXiv 2502.14856; `D3DConfig.draft_vocab_size`): the target ids the LM
            head covers, its rows copied from the source's head; the head is then untied from the embeddings.
            `None` (default): the full vocabulary. Not with `shares_target_weights`.
        shares_target_cache (`bool`, defaults to `False`):
            A drafter whose layers attend to the target's cached keys and values of the layers they were copied
            from (`D3DConfig.shares_target_cache`: query-only layers over the target's cache).
        reads_target_hidden_state (`bool`, defaults to `False`):
            With `shares_target_cache`: the anchor also reads the target's last hidden state before it
            (`D3DConfig.reads_target_hidden_state`, EAGLE's feature); its projection starts as `hidden_state_init`
            says.
        hidden_state_init (`str`, defaults to `"zeros"`):
            How `hidden_state_proj` starts with `reads_target_hidden_state`: `"zeros"` (the drafter starts as one
            without the feature; Adam then grows the projection by about the learning rate per step), or
            `"identity"`: `s * I` with `s` the source's mean input-embedding norm over `sqrt(hidden_size)`, so the
            anchor's input starts as its embedding plus the normed target state at the embeddings' scale.

    Returns:
        `D3DForDiffusionDrafting` in the source model's dtype and on its device, in eval mode.

    Raises:
        ValueError: if both `num_layers` and `layer_ids` are given, a layer index is out of range, the source's
            layers do not have the supported layout, `reads_target_hidden_state` comes without
            `shares_target_cache`, or `hidden_state_init` is not `"zeros"` or `"identity"`.
    """
    if num_layers is not None and layer_ids is not None:
        raise ValueError("Give either `num_layers` or `layer_ids`, not both.")
    if hidden_state_init not in ("zeros", "identity"):
        raise ValueError(f"`hidden_state_init` must be 'zeros' or 'identity', got {hidden_state_init!r}.")
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
        tie_word_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)) and draft_vocab_ids is None,
        draft_vocab_size=None if draft_vocab_ids is None else len(draft_vocab_ids),
        block_size=block_size,
        mask_token_id=mask_token_id,
        source_model=source_model or getattr(model, "name_or_path", None) or None,
        source_layer_ids=layer_ids,
        target_model=target_model or source_model or getattr(model, "name_or_path", None) or None,
        block_lora_rank=block_lora_rank,
        block_lora_alpha=block_lora_alpha,
        shares_target_weights=shares_target_weights,
        shares_target_cache=shares_target_cache,
        reads_target_hidden_state=reads_target_hidden_state,
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
        source_head = src_state.get("lm_head.weight", src_state["model.embed_tokens.weight"])
        new_state["lm_head.weight"] = source_head
        if draft_vocab_ids is not None:
            drafter.set_draft_vocabulary(draft_vocab_ids, source_head=source_head)
            new_state["lm_head.weight"] = drafter.lm_head.weight.detach().clone()
            new_state["draft_vocab_ids"] = drafter.draft_vocab_ids.clone()
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
    with torch.no_grad():
        if drafter.model.mask_embedding is not None:
            drafter.model.mask_embedding.weight.copy_(ref.float().mean(dim=0).to(ref.dtype))
        # "zeros" is how the model creates the projection (`create_hidden_state_input`)
        if drafter.model.hidden_state_proj is not None and hidden_state_init == "identity":
            weight = drafter.model.hidden_state_proj.weight  # the normed state (norm sqrt(H)) at the embeddings' norm
            scale = ref.float().norm(dim=-1).mean() / config.hidden_size**0.5
            weight.copy_(torch.eye(config.hidden_size, dtype=torch.float32).mul(scale).to(weight.dtype))
    return drafter.eval()


__all__ = ["from_autoregressive"]
