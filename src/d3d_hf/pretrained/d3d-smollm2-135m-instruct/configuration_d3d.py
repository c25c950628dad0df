"""Configuration of D3D block-diffusion drafters.

Part of the self-contained remote-code bundle: imports only the public transformers API.
"""

from transformers import PretrainedConfig

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
        block_lora_modules (`list[str]`, *optional*):
            Projections that get a block adapter; defaults to all seven (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
            `gate_proj`, `up_proj`, `down_proj`).
        shares_target_weights (`bool`, *optional*, defaults to `False`):
            The checkpoint stores only drafter-specific weights (mask embedding, block adapters); embeddings,
            layers (`source_layer_ids` of the target), final norm and LM head are the target's own tensors,
            attached with `attach_target_weights(target)` (done automatically by `target.generate(...,
            assistant_model=drafter)`). Keeps a full-depth drafter a few MB on disk and free in memory.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal initialiser for freshly created weights.
        attention_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on attention probabilities during training.

    Raises:
        ValueError: if `block_size < 1`, the heads do not divide evenly, `source_layer_ids` has the wrong length,
            or `mask_token_id` is outside the vocabulary; from `from_dict` / `from_pretrained`, if the saved config
            lacks one of `REQUIRED_CONFIG_FIELDS`.

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
        shares_target_weights: bool = False,
        initializer_range: float = 0.02,
        attention_dropout: float = 0.0,
        bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        if head_dim is None:
            head_dim = hidden_size // num_attention_heads
        if rope_parameters is None:
            rope_parameters = {"rope_type": "default", "rope_theta": float(kwargs.pop("rope_theta", 10000.0))}
        if int(block_size) < 1:
            raise ValueError(f"`block_size` must be >= 1, got {block_size}.")
        if num_attention_heads % num_key_value_heads != 0:
            raise ValueError(
                f"`num_attention_heads` ({num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({num_key_value_heads})."
            )
        if mask_token_id is not None and not 0 <= int(mask_token_id) < vocab_size:
            raise ValueError(
                f"`mask_token_id` {mask_token_id} is outside the vocabulary (size {vocab_size}); use a spare id "
                "of the vocabulary or `mask_token_id=None` for a separate learned mask embedding."
            )
        if source_layer_ids is not None and len(source_layer_ids) != num_hidden_layers:
            raise ValueError(
                f"`source_layer_ids` has {len(source_layer_ids)} entries but `num_hidden_layers` is "
                f"{num_hidden_layers}: give one source index per drafter layer."
            )
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
        self.rope_parameters = dict(rope_parameters)
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.use_qk_norm = use_qk_norm
        self.block_size = int(block_size)
        self.mask_token_id = mask_token_id
        self.source_model = source_model
        self.source_layer_ids = list(source_layer_ids) if source_layer_ids is not None else None
        if pruned_layer_ids is not None and len(pruned_layer_ids) != num_hidden_layers:
            raise ValueError(
                f"`pruned_layer_ids` has {len(pruned_layer_ids)} entries but `num_hidden_layers` is "
                f"{num_hidden_layers}: give one index per drafter layer."
            )
        self.pruned_layer_ids = list(pruned_layer_ids) if pruned_layer_ids is not None else None
        self.target_model = target_model
        self.block_lora_rank = int(block_lora_rank)
        self.block_lora_alpha = float(block_lora_alpha)
        self.block_lora_modules = list(block_lora_modules or DEFAULT_BLOCK_LORA_MODULES)
        unknown = sorted(set(self.block_lora_modules) - set(DEFAULT_BLOCK_LORA_MODULES))
        if unknown:
            raise ValueError(f"Unknown `block_lora_modules` {unknown}; choose from {list(DEFAULT_BLOCK_LORA_MODULES)}.")
        if self.block_lora_rank < 0:
            raise ValueError(f"`block_lora_rank` must be >= 0, got {block_lora_rank}.")
        self.shares_target_weights = bool(shares_target_weights)
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
            ValueError: naming the missing fields.
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
        return super().from_dict(config_dict, **kwargs)


__all__ = ["DEFAULT_BLOCK_LORA_MODULES", "REQUIRED_CONFIG_FIELDS", "D3DConfig"]
