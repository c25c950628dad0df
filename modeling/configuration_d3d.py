"""Configuration of D3D block-diffusion drafters.

Part of the self-contained remote-code bundle: imports only the public transformers API.
"""

import math
from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

#: The version stamp of this remote-code bundle (the `modeling/` files, copied next to every saved checkpoint). One
#: process has one generate hook, installed by the first bundle copy that asks (`hooks_d3d.install_generation_hook`:
#: `d3d_hf.modeling`, or a checkpoint's copy loaded with `trust_remote_code=True`), and it drives every D3D drafter
#: of the process; it refuses a drafter whose class carries another stamp (`hooks_d3d.check_bundle_version`).
#: Bump it whenever the contract between the hook and the bundle's generator changes: what the hook calls on the
#: drafter or passes to `build_candidate_generator`, what it stores on the call's `GenerationConfig` for the
#: generator to read (the resolved options), or what `decoding_d3d`'s loops expect of the generator.
BUNDLE_VERSION = 1

DEFAULT_BLOCK_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Fields a saved config (`config.json`) must hold: their defaults would silently build a different drafter
#: (other shapes, other numerics, a different block size) from the same weights. `save_pretrained` writes them all.
REQUIRED_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_parameters",
    "use_qk_norm",
    "tie_word_embeddings",
    "block_size",
    "block_lora_rank",
    "shares_target_weights",
)


#: Keys each non-default rope type reads from `rope_parameters` (transformers' `ROPE_INIT_FUNCTIONS`); `rope_theta`
#: is required for every type.
_ROPE_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
#: Whole-number fields: (smallest allowed value, an example value for the message). `None` means "the default" for
#: `num_key_value_heads` and `head_dim` (see `D3DConfig`).
_WHOLE_NUMBER_FIELDS = {
    "vocab_size": (1, "the target's `config.vocab_size`"),
    "hidden_size": (1, "576"),
    "intermediate_size": (1, "1536"),
    "num_hidden_layers": (1, "30"),
    "num_attention_heads": (1, "9"),
    "num_key_value_heads": (1, "a divisor of `num_attention_heads`, or None for `num_attention_heads`"),
    "head_dim": (2, "an even number such as 64, or None for `hidden_size // num_attention_heads`"),
    "max_position_embeddings": (1, "8192"),
    "block_size": (1, "16 (the default)"),
    "block_lora_rank": (0, "0 (no block adapters) or a rank such as 32"),
    "block_lora_full_layers": (0, "0 (every adapter of rank `block_lora_rank`) or a few, such as 2"),
}
_BOOL_FIELDS = (
    "attention_bias",
    "mlp_bias",
    "use_qk_norm",
    "tie_word_embeddings",
    "shares_target_weights",
    "shares_target_cache",
    "reads_target_hidden_state",
)
_OPTIONAL_STR_FIELDS = ("source_model", "target_model")
#: Every field `validate_config` checks (the arguments of `D3DConfig.__init__`).
_ALL_FIELDS = (
    *_WHOLE_NUMBER_FIELDS,
    *_BOOL_FIELDS,
    *_OPTIONAL_STR_FIELDS,
    "mask_token_id",
    "source_layer_ids",
    "pruned_layer_ids",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "block_lora_alpha",
    "block_lora_modules",
    "draft_vocab_size",
    "initializer_range",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def _config_error(name: str, requirement: str, value: Any, fix: str) -> ValueError:
    return ValueError(
        f"D3D drafter config: `{name}` must be {requirement}, got {value!r} ({type(value).__name__}). {fix} (in "
        f"`D3DConfig(...)`, `from_pretrained(..., {name}=...)`, config.json or `drafter.config.{name}`)."
    )


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_id_list(name: str, value: Any, num_layers: int, distinct: bool) -> None:
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not all(_is_whole(i) and i >= 0 for i in value):
        raise _config_error(
            name, "None or a list of non-negative layer indices (ints)", value, f"Set `{name}` to a list such as [0, 1]"
        )
    if len(value) != num_layers:
        raise ValueError(
            f"D3D drafter config: `{name}` has {len(value)} entries but `num_hidden_layers` is {num_layers}: give "
            f"one index per drafter layer (or change `num_hidden_layers` to {len(value)})."
        )
    if distinct and len(set(value)) != len(value):
        raise _config_error(name, "a list of distinct layer indices", value, f"Remove the repeated entries of `{name}`")


def validate_config(config: PretrainedConfig | Mapping[str, Any]) -> None:
    """Checks every field of a D3D drafter config: types, ranges and the combinations that must agree.

    The one validation of the drafter's configuration, called wherever values enter: `D3DConfig(...)` (on the raw
    arguments, before any default is derived from them), `D3DConfig.from_dict` / `from_pretrained` (after keyword
    overrides such as `from_pretrained(dir, block_size=8)` are applied), and at the start of every `generate` call
    with the drafter (for fields set by hand, such as `drafter.config.block_size = 8`).

    Args:
        config (`D3DConfig` or `Mapping[str, Any]`): a config, or the constructor's keyword arguments, where `None`
            for `num_key_value_heads`, `head_dim`, `rope_parameters` and `block_lora_modules` means the default.
            Fields absent from a mapping are not checked.

    Raises:
        ValueError: naming the first invalid field (in backticks, e.g. `` `block_size` ``) and what to change it to.
            Whole-number fields must be `int` (not `bool`, `float` or `str`): `vocab_size`, `hidden_size`,
            `intermediate_size`, `num_hidden_layers`, `num_attention_heads`, `max_position_embeddings`, `block_size`
            >= 1, `num_key_value_heads` >= 1 and dividing `num_attention_heads`, `head_dim` even and >= 2,
            `block_lora_rank` >= 0; `block_size` at most `max_position_embeddings`; `mask_token_id` None or an int in
            `[0, vocab_size)`; `source_layer_ids` / `pruned_layer_ids` None or one non-negative int per layer
            (`pruned_layer_ids` distinct); `hidden_act` a transformers activation name; `rms_norm_eps` a finite
            number > 0; `rope_parameters` a dict with a known `rope_type`, a finite `rope_theta` > 0 and the keys its
            type reads; the flags (`attention_bias`, `mlp_bias`, `use_qk_norm`, `tie_word_embeddings`,
            `shares_target_weights`, `shares_target_cache`, `reads_target_hidden_state`) bools, and
            `reads_target_hidden_state` only with `shares_target_cache`; `block_lora_alpha` a finite number > 0;
            `block_lora_modules` None or a non-empty list of distinct names from `DEFAULT_BLOCK_LORA_MODULES`;
            `initializer_range` a finite number >= 0; `attention_dropout` a number in `[0, 1)`; `source_model` /
            `target_model` None or a str;
            `bos_token_id` / `pad_token_id` None or an int, `eos_token_id` None, an int or a list of ints.
    """
    if isinstance(config, Mapping):
        present = dict(config)
    else:
        present = {name: getattr(config, name) for name in _ALL_FIELDS if hasattr(config, name)}

    def given(name: str) -> bool:
        return name in present

    for name, (low, example) in _WHOLE_NUMBER_FIELDS.items():
        if not given(name):
            continue
        value = present[name]
        if value is None and name in ("num_key_value_heads", "head_dim"):
            continue
        if not _is_whole(value) or value < low:
            raise _config_error(name, f"a whole number (int) >= {low}", value, f"Set `{name}` to {example}")
    heads = present.get("num_attention_heads")
    kv_heads = present.get("num_key_value_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ValueError(
            f"D3D drafter config: `num_attention_heads` ({heads}) must be a multiple of `num_key_value_heads` "
            f"({kv_heads}); set `num_key_value_heads` to a divisor of {heads} (or None for {heads})."
        )
    head_dim = present.get("head_dim")
    derived = head_dim is None and heads is not None and given("hidden_size")
    if derived:
        head_dim = present["hidden_size"] // heads
    if head_dim is not None and (head_dim < 2 or head_dim % 2):
        source = f" (`head_dim=None`: `hidden_size // num_attention_heads` = {present['hidden_size']} // {heads})"
        raise ValueError(
            f"D3D drafter config: `head_dim` must be even and >= 2 (rotary embeddings rotate pairs of dimensions), got "
            f"{head_dim}{source if derived else ''}. Set `head_dim` to an even number such as 64"
            f"{', or change `hidden_size` / `num_attention_heads`' if derived else ''}."
        )
    if (
        given("block_size")
        and given("max_position_embeddings")
        and present["block_size"] > present["max_position_embeddings"]
    ):
        raise ValueError(
            f"D3D drafter config: `block_size` ({present['block_size']}) is larger than `max_position_embeddings` "
            f"({present['max_position_embeddings']}): a draft block must fit in the drafter's context. Lower "
            "`block_size` (16 is the default)."
        )
    if given("mask_token_id") and present["mask_token_id"] is not None:
        mask, vocab = present["mask_token_id"], present.get("vocab_size")
        if not _is_whole(mask) or mask < 0 or (vocab is not None and mask >= vocab):
            raise _config_error(
                "mask_token_id",
                f"None or an int in [0, `vocab_size`) = [0, {vocab}) (a spare id of the vocabulary)",
                mask,
                "Use a spare id of the vocabulary, or `mask_token_id=None` for a separate learned mask embedding",
            )
    layers = present.get("num_hidden_layers")
    full = present.get("block_lora_full_layers") or 0
    rank = present.get("block_lora_rank", 0)
    if full and (rank < 1 or (layers is not None and full > layers)):
        raise ValueError(
            f"D3D drafter config: `block_lora_full_layers={full}` gives the last {full} layers full-rank block "
            f"adapters, which needs block adapters (`block_lora_rank` >= 1, got {rank}) and at most "
            f"`num_hidden_layers` ({layers}) layers. Set `block_lora_rank` (e.g. 8), or `block_lora_full_layers` to "
            f"a number in [0, {layers}]."
        )
    if layers is not None:
        for name, distinct in (("source_layer_ids", False), ("pruned_layer_ids", True)):
            if given(name):
                _check_id_list(name, present[name], layers, distinct)
    if given("hidden_act") and (not isinstance(present["hidden_act"], str) or present["hidden_act"] not in ACT2FN):
        raise _config_error(
            "hidden_act",
            "the name of a transformers activation",
            present["hidden_act"],
            f'Set `hidden_act` to one of {sorted(ACT2FN)[:8]}... ("silu" for Llama/Qwen3)',
        )
    if given("rms_norm_eps") and not (_is_real(present["rms_norm_eps"]) and present["rms_norm_eps"] > 0):
        raise _config_error(
            "rms_norm_eps", "a finite number > 0", present["rms_norm_eps"], "Set `rms_norm_eps` to 1e-5"
        )
    if given("rope_parameters") and present["rope_parameters"] is not None:
        _check_rope_parameters(present["rope_parameters"])
    for name in _BOOL_FIELDS:
        if given(name) and not isinstance(present[name], bool):
            raise _config_error(name, "True or False (a bool)", present[name], f"Set `{name}` to True or False")
    if given("block_lora_alpha") and not (_is_real(present["block_lora_alpha"]) and present["block_lora_alpha"] > 0):
        raise _config_error(
            "block_lora_alpha",
            "a finite number > 0 (adapter scale alpha / rank)",
            present["block_lora_alpha"],
            "Set `block_lora_alpha` to 16.0 (the default) or twice the rank",
        )
    if given("block_lora_modules") and present["block_lora_modules"] is not None:
        modules = present["block_lora_modules"]
        allowed = list(DEFAULT_BLOCK_LORA_MODULES)
        if (
            not isinstance(modules, (list, tuple))
            or not modules
            or not all(isinstance(m, str) and m in allowed for m in modules)
            or len(set(modules)) != len(modules)
        ):
            raise _config_error(
                "block_lora_modules",
                f"None (all seven) or a non-empty list of distinct names from {allowed}",
                modules,
                "Set `block_lora_modules` to such a list (or `block_lora_rank=0` for no adapters)",
            )
    if given("initializer_range") and not (
        _is_real(present["initializer_range"]) and present["initializer_range"] >= 0
    ):
        raise _config_error(
            "initializer_range", "a finite number >= 0", present["initializer_range"], "Set `initializer_range` to 0.02"
        )
    dropout = present.get("attention_dropout", 0.0)
    if not (_is_real(dropout) and 0 <= dropout < 1):
        raise _config_error("attention_dropout", "a number in [0, 1)", dropout, "Set `attention_dropout` to 0.0")
    _check_draft_vocab(present)
    if present.get("reads_target_hidden_state") and not present.get("shares_target_cache"):
        raise ValueError(
            "D3D drafter config: `reads_target_hidden_state=True` needs `shares_target_cache=True`: the target's "
            "hidden state reaches the drafter only in the synchronous rounds in which it reads the target's cache. "
            "Set `shares_target_cache=True` or `reads_target_hidden_state=False`."
        )
    for name in _OPTIONAL_STR_FIELDS:
        if given(name) and present[name] is not None and not isinstance(present[name], str):
            raise _config_error(name, "None or a str (a model name or path)", present[name], f"Set `{name}` to a name")
    for name in ("bos_token_id", "pad_token_id", "eos_token_id"):
        value = present.get(name)
        ids = value if name == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
        if value is not None and not all(_is_whole(i) for i in ids):
            kind = "None, an int or a list of ints" if name == "eos_token_id" else "None or an int"
            raise _config_error(name, kind, value, f"Set `{name}` to the target's token id")


def _check_draft_vocab(present: Mapping[str, Any]) -> None:
    """`draft_vocab_size`: None, or an int in [1, vocab_size] on a drafter with its own weights and an untied head."""
    size = present.get("draft_vocab_size")
    if size is None:
        return
    vocab = present.get("vocab_size")
    if not _is_whole(size) or size < 1 or (vocab is not None and size > vocab):
        raise _config_error(
            "draft_vocab_size",
            f"None (the full vocabulary) or an int in [1, `vocab_size`] = [1, {vocab}]",
            size,
            "Set `draft_vocab_size` to the number of ids the LM head covers, such as 8192",
        )
    if present.get("shares_target_weights"):
        raise ValueError(
            "D3D drafter config: `draft_vocab_size` needs a drafter with weights of its own, but "
            "`shares_target_weights=True` makes its LM head the target's full-vocabulary head. Set "
            "`shares_target_weights=False` (a standalone drafter) or `draft_vocab_size=None`."
        )
    if present.get("tie_word_embeddings"):
        raise ValueError(
            "D3D drafter config: `draft_vocab_size` gives the LM head its own rows (one per draft-vocabulary id), "
            "so it cannot be tied to the full input embeddings: set `tie_word_embeddings=False`."
        )


def _check_rope_parameters(rope: Any) -> None:
    known = sorted({"default", *ROPE_INIT_FUNCTIONS})
    if not isinstance(rope, Mapping):
        raise _config_error(
            "rope_parameters",
            "a dict such as {'rope_type': 'default', 'rope_theta': 10000.0}",
            rope,
            "Set `rope_parameters` to the target's `config.rope_parameters`",
        )
    rope_type = rope.get("rope_type", "default")
    if rope_type not in known:
        raise _config_error(
            "rope_parameters",
            f"a dict whose 'rope_type' is one of {known}",
            rope,
            "Set `rope_parameters['rope_type']` to the target's rope type",
        )
    theta = rope.get("rope_theta")
    if not (_is_real(theta) and theta > 0):
        raise _config_error(
            "rope_parameters",
            "a dict with a finite 'rope_theta' > 0",
            rope,
            "Set `rope_parameters['rope_theta']` to the target's rope theta (e.g. 10000.0)",
        )
    missing = [key for key in _ROPE_REQUIRED_KEYS.get(rope_type, ()) if rope.get(key) is None]
    if missing:
        raise _config_error(
            "rope_parameters",
            f"a dict with the keys rope type {rope_type!r} reads ({missing} missing)",
            rope,
            f"Add {missing} to `rope_parameters` (as in the target's config)",
        )


class D3DConfig(PretrainedConfig):
    r"""
    Configuration of a D3D drafter (`D3DForDiffusionDrafting`): a standalone block-diffusion language model
    (arXiv 2611.06425) that drafts `block_size - 1` tokens in one forward pass for speculative decoding.

    The decoder stack is of the Llama / Qwen3 family (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP,
    optional per-head q/k RMSNorm as in Qwen3), so a drafter can be initialised from layers of its target.

    Args:
        vocab_size (`int`, *optional*, defaults to 49152):
            Size of the vocabulary. Must equal the target's `config.vocab_size` (transformers refuses an
            assistant with a different one).
        hidden_size (`int`, *optional*, defaults to 576):
            Dimension of the hidden states.
        intermediate_size (`int`, *optional*, defaults to 1536):
            Dimension of the SwiGLU MLP.
        num_hidden_layers (`int`, *optional*, defaults to 30):
            Number of decoder layers.
        num_attention_heads (`int`, *optional*, defaults to 9):
            Number of query heads.
        num_key_value_heads (`int`, *optional*):
            Number of key/value heads (grouped-query attention). Defaults to `num_attention_heads`.
        head_dim (`int`, *optional*):
            Dimension of one attention head. Defaults to `hidden_size // num_attention_heads`.
        hidden_act (`str`, *optional*, defaults to `"silu"`):
            Activation of the gated MLP.
        max_position_embeddings (`int`, *optional*, defaults to 8192):
            Longest sequence (committed context + draft block) the drafter accepts.
        rms_norm_eps (`float`, *optional*, defaults to 1e-5):
            Epsilon of the RMSNorm layers.
        rope_parameters (`dict`, *optional*):
            Rotary embedding parameters in the transformers 5 format, e.g. `{"rope_type": "default",
            "rope_theta": 100000.0}`. Non-default rope types are computed with transformers'
            `ROPE_INIT_FUNCTIONS`.
        attention_bias (`bool`, *optional*, defaults to `False`):
            Whether q/k/v/o projections have a bias.
        mlp_bias (`bool`, *optional*, defaults to `False`):
            Whether the MLP projections have a bias.
        use_qk_norm (`bool`, *optional*, defaults to `False`):
            Per-head RMSNorm on queries and keys before RoPE (Qwen3-style layers).
        tie_word_embeddings (`bool`, *optional*, defaults to `True`):
            Whether the LM head shares the input embedding matrix.
        block_size (`int`, *optional*, defaults to 16):
            Draft block size `B`: one block is `[anchor, MASK x (B-1)]` and yields `B-1` draft tokens
            (d3d-hf docs/DESIGN.md section 2). Must be >= 1; `B = 1` drafts nothing (plain target decoding).
        mask_token_id (`int`, *optional*):
            A spare vocabulary id whose embedding row is the mask token (possible for padded vocabularies
            such as Qwen3's 151936 rows). When `None` (the default, and the only choice for a vocabulary that
            fills every id, such as SmolLM2's 49152) the drafter keeps a separate learned `mask_embedding`
            vector, so the mask never grows the vocabulary.
        source_model (`str`, *optional*):
            Name or path of the autoregressive checkpoint the drafter was initialised from.
        source_layer_ids (`list[int]`, *optional*):
            For each drafter layer, the index of the source-model layer it was copied from (kept up to date by
            pruning).
        pruned_layer_ids (`list[int]`, *optional*):
            Set by layer pruning (`d3d_hf.pruning`): for each drafter layer, its index in the drafter before any
            pruning. `None` for an unpruned drafter.
        target_model (`str`, *optional*):
            Name or path of the target model the drafter was made for.
        block_lora_rank (`int`, *optional*, defaults to 0):
            Rank of the low-rank adapters applied only at draft-block positions (0 = none). The committed context
            and the anchor always use the unmodified weights (see `D3DLinear`).
        block_lora_alpha (`float`, *optional*, defaults to 16.0):
            Adapter scaling numerator (`alpha / rank`).
        block_lora_full_layers (`int`, *optional*, defaults to 0):
            The last this many layers get block adapters of full rank (`min(in_features, out_features)` of each adapted
            projection) instead of `block_lora_rank`: block-row-only full weights in the last layers, a capacity option
            of the weight-sharing drafter (d3d-hf issue 35). Their scale `alpha / rank` is the other layers' (`alpha`
            grows with the rank). Needs `block_lora_rank >= 1`.
        block_lora_modules (`list[str]`, *optional*):
            Projections that get a block adapter; defaults to all seven (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
            `gate_proj`, `up_proj`, `down_proj`).
        shares_target_weights (`bool`, *optional*, defaults to `False`):
            The checkpoint stores only drafter-specific weights (mask embedding, block adapters); embeddings,
            layers (`source_layer_ids` of the target), final norm and LM head are the target's own tensors,
            attached with `attach_target_weights(target)` (done automatically by `target.generate(...,
            assistant_model=drafter)`). Keeps a full-depth drafter a few MB on disk and free in memory.
        shares_target_cache (`bool`, *optional*, defaults to `False`):
            The drafter has no path of its own for the committed context: in a draft pass, its layer `i` attends to
            the target's cached keys and values of layer `source_layer_ids[i]` (the layers it was initialised
            from; layer `i` when `None`) for every committed token before the anchor, and computes keys and
            values only for the anchor and the masks ("query-only layers over the target's keys and values",
            d3d-hf issue 37; EAGLE-style drafters read target features likewise). A few such layers then draft
            over a context the target's full depth has already computed. Such a drafter drafts only in D3D's own
            synchronous loop, which keeps the target's cache at the committed tokens (`generate` refuses the
            other configurations), and it trains with the target in the loop (`d3d_hf.training`: the target's
            no-grad forward gives the keys and values).
        reads_target_hidden_state (`bool`, *optional*, defaults to `False`):
            With `shares_target_cache`: the anchor's input is its token embedding plus
            `hidden_state_proj(hidden_state_norm(h))`, `h` the target's last hidden state (after its final norm) at
            the position before the anchor, the state whose LM-head row chose the anchor (EAGLE's feature, arXiv
            2401.15077). The target's verification forward already computes `h`; D3D's loop keeps it for the next
            pass. `hidden_state_proj` starts at zero, so a new drafter starts as one without the feature.
        draft_vocab_size (`int`, *optional*):
            A draft vocabulary (FR-Spec, arXiv 2502.14856): the LM head has rows for only these many ids, the most
            frequent of the target's answers, saved as the buffer `draft_vocab_ids` (`torch.LongTensor` of shape
            `(draft_vocab_size,)`, target ids). The model's logits are still over the full vocabulary, the other ids
            at the dtype's lowest value, so they are never drafted and every candidate is a target id; the LM head
            costs `draft_vocab_size / vocab_size` of a full one. `None` (default): the full vocabulary. Needs
            `shares_target_weights=False` and `tie_word_embeddings=False`.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal initialiser for freshly created weights.
        attention_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on attention probabilities during training.

    Raises:
        ValueError: from `validate_config`, naming the field and what to change, for any field of the wrong type
            (whole numbers must be `int`, flags `bool`) or out of range (`block_size < 1`, heads that do not divide
            evenly, an odd `head_dim`, `source_layer_ids` of the wrong length, `mask_token_id` outside the
            vocabulary, an unknown `hidden_act` or `rope_type`, ...); from `from_dict` / `from_pretrained`, the same
            for keyword overrides, and if the saved config lacks one of `REQUIRED_CONFIG_FIELDS`.

    Example:

    ```python
    >>> from d3d_hf import D3DConfig, D3DForDiffusionDrafting
    >>> config = D3DConfig(num_hidden_layers=2, block_size=16)
    >>> drafter = D3DForDiffusionDrafting(config)
    ```
    """

    model_type = "d3d"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 49152,
        hidden_size: int = 576,
        intermediate_size: int = 1536,
        num_hidden_layers: int = 30,
        num_attention_heads: int = 9,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 8192,
        rms_norm_eps: float = 1e-5,
        rope_parameters: dict | None = None,
        attention_bias: bool = False,
        mlp_bias: bool = False,
        use_qk_norm: bool = False,
        tie_word_embeddings: bool = True,
        block_size: int = 16,
        mask_token_id: int | None = None,
        source_model: str | None = None,
        source_layer_ids: list[int] | None = None,
        pruned_layer_ids: list[int] | None = None,
        target_model: str | None = None,
        block_lora_rank: int = 0,
        block_lora_alpha: float = 16.0,
        block_lora_modules: list[str] | None = None,
        block_lora_full_layers: int = 0,
        shares_target_weights: bool = False,
        shares_target_cache: bool = False,
        reads_target_hidden_state: bool = False,
        draft_vocab_size: int | None = None,
        initializer_range: float = 0.02,
        attention_dropout: float = 0.0,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        if rope_parameters is None:
            rope_parameters = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta", 10000.0)}
        elif isinstance(rope_parameters, Mapping) and "rope_theta" not in rope_parameters:
            # a theta given next to the dict (older configs), else transformers' default, as its `__post_init__` does
            rope_parameters = {**rope_parameters, "rope_theta": kwargs.pop("rope_theta", 10000.0)}
        arguments = dict(locals())
        validate_config({name: arguments[name] for name in _ALL_FIELDS})  # before any default is derived from them
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        if head_dim is None:
            head_dim = hidden_size // num_attention_heads
        rope_parameters = dict(rope_parameters)
        rope_parameters["rope_theta"] = float(rope_parameters["rope_theta"])
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = rope_parameters
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.use_qk_norm = use_qk_norm
        self.block_size = int(block_size)
        self.mask_token_id = mask_token_id
        self.source_model = source_model
        self.source_layer_ids = list(source_layer_ids) if source_layer_ids is not None else None
        self.pruned_layer_ids = list(pruned_layer_ids) if pruned_layer_ids is not None else None
        self.target_model = target_model
        self.block_lora_rank = int(block_lora_rank)
        self.block_lora_alpha = float(block_lora_alpha)
        self.block_lora_modules = list(DEFAULT_BLOCK_LORA_MODULES if block_lora_modules is None else block_lora_modules)
        self.block_lora_full_layers = int(block_lora_full_layers)
        self.shares_target_weights = bool(shares_target_weights)
        self.shares_target_cache = bool(shares_target_cache)
        self.reads_target_hidden_state = bool(reads_target_hidden_state)
        self.draft_vocab_size = draft_vocab_size
        self.initializer_range = initializer_range
        self.attention_dropout = attention_dropout
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """`PretrainedConfig.from_dict` (what `from_pretrained` and `AutoConfig` call on a loaded `config.json`), after
        checking that the dict holds every field of `REQUIRED_CONFIG_FIELDS` (given here or as a keyword argument).

        Raises:
            ValueError: naming the missing fields, or (`validate_config`) a field whose value, from the dict or from a
                keyword override such as `from_pretrained(dir, block_size=0)`, is of the wrong type or out of range.
        """
        present = set(config_dict) | set(kwargs)
        if "rope_theta" in present:  # the pre-transformers-5 spelling of the rope parameters
            present.add("rope_parameters")
        missing = [name for name in REQUIRED_CONFIG_FIELDS if name not in present]
        if missing:
            raise ValueError(
                f"This D3D drafter's config (config.json) lacks the required field(s) {missing}; their defaults would "
                "build a different drafter than the one the weights belong to. Add them to config.json with the "
                "values the drafter was built with, or save the drafter again with `save_pretrained` (it writes "
                "every field)."
            )
        loaded = super().from_dict(config_dict, **kwargs)
        validate_config(loaded[0] if isinstance(loaded, tuple) else loaded)  # keyword overrides are set after __init__
        return loaded


__all__ = ["BUNDLE_VERSION", "DEFAULT_BLOCK_LORA_MODULES", "REQUIRED_CONFIG_FIELDS", "D3DConfig", "validate_config"]
