"""D3D block-diffusion drafter (arXiv 2611.06425): Llama/Qwen3-family decoder stack with a mask token.

The model only: `D3DModel` (the decoder stack of `layers_d3d`) and `D3DForDiffusionDrafting` (plus an LM head), the
ground floor of the remote-code bundle: at module level it imports only torch, the public transformers API and the
model's own sibling files, never the generation engine, which comes in through one lazy seam (`__init__` imports
`hooks_d3d`, `build_candidate_generator` imports `generation_d3d`; transformers' remote-code loading still copies
them with a checkpoint, as it follows relative imports inside functions too).

Attention convention: every attention mask handled here is boolean, `True` where a query may attend to a key, of
shape `(batch_size, 1, query_len, key_len)`; `key_len` counts the cached tokens first, then the current ones.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .adapters_d3d import D3DLinear
from .checkpoint_d3d import check_weight_files, push_handler, save_folder_atomically, save_hooks
from .configuration_d3d import BUNDLE_VERSION, D3DConfig, validate_config
from .drafting_d3d import (
    D3DCache,
    D3DPackedDraft,
    causal_attention_mask,
    draft_logits,
    packed_attention_mask,
    packed_draft_logits,
    resolve_packed_attention_kernel,
)
from .fast_paths_d3d import FastPathSettings
from .initialization_d3d import from_autoregressive
from .layers_d3d import (
    D3DDecoderLayer,
    D3DMaskEmbedding,
    D3DRMSNorm,
    D3DRotaryEmbedding,
    add_target_hidden_states,
    create_block_adapters,
    create_hidden_state_input,
    eager_attention_forward,
    kernel_attention_interface,
)
from .vocabulary_d3d import expand_draft_logits, set_draft_vocabulary


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
                Run the installed `d3d.save_hooks` entry points after the save (`checkpoint_d3d.save_hooks`):
                with `d3d_hf` installed, `d3d_hf.hub.write_model_card` writes `README.md` rendered from
                `self.card_data` and the config, and that data as `d3d_card_data.json` (a `README.md` that d3d-hf
                did not generate is kept); with only torch + transformers there is none.
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

        def write(staging: str):
            result = super(D3DPreTrainedModel, self).save_pretrained(staging, *args, **kwargs)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            return result

        result = save_folder_atomically(write, save_directory, kwargs.get("variant"))
        if model_card:
            for hook in save_hooks():  # d3d_hf's renders the model card
                hook(self, save_directory)
        if push_kwargs is not None:
            repo_id = push_kwargs.pop("repo_id", os.path.basename(os.path.normpath(save_directory)))
            self.push_to_hub(repo_id, tokenizer=tokenizer, **push_kwargs)
        return result

    def push_to_hub(self, repo_id: str, *, tokenizer=None, **kwargs):
        r"""
        Uploads the folder `save_pretrained` writes (model card included) to the Hub: with `d3d_hf` installed its
        `d3d.push_handlers` entry point, `d3d_hf.hub.push_drafter` (transformers' `push_to_hub` arguments, plus
        `tokenizer` and `overwrite_card`); else transformers' `push_to_hub`, then `tokenizer.push_to_hub`.

        Returns:
            `huggingface_hub.CommitInfo` of the model upload.
        """
        handler = push_handler()
        if handler is not None:
            return handler(self, repo_id, tokenizer=tokenizer, **kwargs)
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
        if getattr(module, "_d3d_zero_init", False):
            nn.init.zeros_(module.weight)


class D3DModel(D3DPreTrainedModel):
    """The bare D3D decoder stack (embeddings, layers, final norm), returning final hidden states. Plain linears and
    transformers' attention registry: `patches_d3d.apply_fast_paths` adds the CPU fast paths from outside."""

    def __init__(self, config: D3DConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(D3DDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = D3DRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = D3DRotaryEmbedding(config)
        # A vocabulary that fills every id (SmolLM2) has no spare row for the mask token: keep it separately so the
        # drafter's `vocab_size` stays equal to the target's (transformers' assisted generation requires it).
        self.mask_embedding = D3DMaskEmbedding(config.hidden_size) if config.mask_token_id is None else None
        self.hidden_state_norm, self.hidden_state_proj = create_hidden_state_input(config)  # EAGLE's feature, or None
        # how packed passes attend (not saved): `drafting_d3d.PACKED_ATTENTION_IMPLEMENTATIONS`
        self.packed_attention_implementation = "auto"
        self.fast_path_settings = FastPathSettings()  # the fast paths' switches and derived weights (not saved)
        self.post_init()

    # the fast-path switches, forwarded to `fast_path_settings` (`FastPathSettings`: meaning, defaults, errors)
    autotune_matmuls = property(
        lambda self: self.fast_path_settings.autotune_matmuls,
        lambda self, value: self.fast_path_settings.set_autotune_matmuls(value, self),
        doc="`fast_path_settings.autotune_matmuls`: draft passes' matmuls on the machine's fastest layout.",
    )
    fused_projections = property(
        lambda self: self.fast_path_settings.fused_projections,
        lambda self, value: setattr(self.fast_path_settings, "fused_projections", value),
        doc="`fast_path_settings.fused_projections`: projection groups on one fused weight copy.",
    )

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
        target_hidden_states: torch.FloatTensor | None = None,
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
                inside the registered packed-attention kernel (`d3d_hf` registers its Triton kernel) or
                materialised, as `self.packed_attention_implementation` says (`"auto"`: the kernel on CUDA, the
                dense mask elsewhere; `"dense"`; `"kernel"`: the kernel wherever it can run, e.g. on CPU under
                `TRITON_INTERPRET=1`), decided once for the whole forward.
            target_hidden_states (`torch.FloatTensor` of shape `(batch_size, seq_len, hidden_size)`, *optional*):
                For (and only for) a `config.reads_target_hidden_state` drafter: per row, the target's last hidden
                state before it, zeros where none (`layers_d3d.add_target_hidden_states`; EAGLE, arXiv 2401.15077).

        Returns:
            `D3DModelOutput` with `last_hidden_state` of shape `(batch_size, seq_len, hidden_size)`.

        Raises:
            ValueError: if neither or both of `input_ids` and `inputs_embeds` are given, a mask or
                `target_hidden_states` has the wrong shape, or the latter is missing or not expected.
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
        inputs_embeds = add_target_hidden_states(inputs_embeds, target_hidden_states, self)

        if use_cache and past_key_values is None:
            past_key_values = D3DCache()
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        device = inputs_embeds.device
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + seq_len, device=device)[None].expand(batch_size, -1)

        key_len = past_len + seq_len
        # the one decision of this forward about how attention runs (transformers' registry; `apply_fast_paths`
        # switches "sdpa" to the copy-free grouped-query function `GQA_SDPA` registered there)
        attention_interface = eager_attention_forward
        if self.config._attn_implementation not in (None, "eager"):
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        if packed_metadata is not None:
            if attention_mask is not None:
                raise ValueError("Pass either `packed_metadata` or `attention_mask`, not both.")
            kernel = resolve_packed_attention_kernel(self.packed_attention_implementation, device, batch_size)
            if kernel is not None:
                attention_interface = kernel_attention_interface(kernel)
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
        block_gate = None  # 1 at the rows where the block adapters apply
        if self.config.block_lora_rank > 0 and block_positions is not None:
            block_gate = block_positions[..., None].to(hidden_states.dtype)
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, position_embeddings, attention_mask, cache, block_gate, attention_interface
            )
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
    #: the stamp of the bundle copy this class comes from: the installed generate hook drives only its own version
    _d3d_bundle_version = BUNDLE_VERSION

    def __init__(self, config: D3DConfig) -> None:
        validate_config(config)  # a config edited by hand after it was built is checked here too
        super().__init__(config)
        if config.shares_target_weights:
            # embeddings and LM head are the target's tensors (`attach_target_weights`), not tied copies stored here
            self._tied_weights_keys = {}
        self.model = D3DModel(config)
        head_rows = config.draft_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, head_rows, bias=False)
        if config.draft_vocab_size:
            # the target id of each LM-head row (FR-Spec draft vocabulary); set by `set_draft_vocabulary`
            self._tied_weights_keys = {}
            self.register_buffer("draft_vocab_ids", torch.arange(head_rows, dtype=torch.long), persistent=True)
        self.model._output_embeddings = weakref.ref(self)  # whose LM head's packed copy `autotune_matmuls` frees
        self.post_init()
        from .hooks_d3d import install_generation_hook  # the engine's seam (module docstring)

        install_generation_hook()
        # `d3d_*` options set here are read by `D3DCandidateGenerator` unless the call sets them (as transformers reads
        # `num_assistant_tokens` from an assistant's generation config); none is set: the declared defaults apply
        self.generation_config = GenerationConfig()
        self.last_generation_stats = None
        self._attached_target = None
        if config.shares_target_weights:
            # only drafter-specific weights are stored; the rest comes from the target (`attach_target_weights`)
            self._keys_to_ignore_on_load_missing = [r"^(?!.*(lora_A|lora_B|mask_embedding)).*$"]

    def set_draft_vocabulary(self, token_ids, source_head: torch.Tensor | None = None) -> None:
        """Sets the target ids the LM head covers: `vocabulary_d3d.set_draft_vocabulary(self, ...)` (arguments and
        errors there)."""
        set_draft_vocabulary(self, token_ids, source_head)

    def expand_draft_logits(self, logits: torch.FloatTensor) -> torch.FloatTensor:
        """`(..., draft_vocab_size)` -> `(..., vocab_size)` logits: `vocabulary_d3d.expand_draft_logits`."""
        return expand_draft_logits(logits, self.draft_vocab_ids, self.config.vocab_size)

    @staticmethod
    def is_drafter_specific(name: str) -> bool:
        """Whether a state-dict key is the drafter's own (mask embedding, block adapters, target-state projection)."""
        return any(part in name for part in ("mask_embedding", ".lora_A", ".lora_B", "hidden_state_"))

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        """The drafter-specific part of `state_dict()` (what a `shares_target_weights` checkpoint stores)."""
        return {k: v for k, v in self.state_dict().items() if self.is_drafter_specific(k)}

    def add_block_adapter(
        self, rank: int, alpha: float = 16.0, modules: list[str] | None = None, full_layers: int = 0
    ) -> None:
        """Adds fresh block adapters (see `D3DLinear`) to every decoder layer and records them in the config; the last
        `full_layers` layers get full-rank ones (`D3DConfig.block_lora_full_layers`: block-row-only full weights).

        Raises:
            ValueError: if `rank < 1`, `full_layers` is not in `[0, num_hidden_layers]`, or the drafter already has
                adapters.
        """
        if self.config.block_lora_rank > 0:
            raise ValueError(f"The drafter already has block adapters of rank {self.config.block_lora_rank}.")
        create_block_adapters(self.config, self.model.layers, rank, alpha, modules, full_layers)

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
                check_weight_files(folder, kwargs.get("variant"))
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
        draft_vocab_logits: bool = False,
        target_hidden_states: torch.FloatTensor | None = None,
    ) -> D3DModelOutput:
        r"""
        Runs the drafter. Arguments as in `D3DModel.forward`, plus:

        Args:
            logits_to_keep (`int`, defaults to 0):
                Compute logits only for the last `logits_to_keep` positions (0 = all positions).
            draft_vocab_logits (`bool`, defaults to `False`):
                With a draft vocabulary (`config.draft_vocab_size`), return the LM head's own logits over the
                draft-vocabulary rows (what training scores) instead of full-vocabulary ones. Ignored without one.

        Returns:
            `D3DModelOutput` with `logits` of shape `(batch_size, num_kept, vocab_size)` in the model dtype (with a
            draft vocabulary: ids outside it at the dtype's lowest value, see `expand_draft_logits`; or
            `(batch_size, num_kept, draft_vocab_size)` with `draft_vocab_logits=True`).

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
            target_hidden_states=target_hidden_states,
        )
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        outputs.logits = self.lm_head(hidden_states)
        if self.config.draft_vocab_size and not draft_vocab_logits:
            outputs.logits = self.expand_draft_logits(outputs.logits)
        return outputs

    def draft_logits(self, committed_ids: torch.LongTensor, cache: D3DCache, num_masks: int | None = None,
                     anchor_hidden_state: torch.FloatTensor | None = None) -> torch.FloatTensor:  # fmt: skip
        """One synchronous draft pass: `drafting_d3d.draft_logits(self, ...)` (arguments, returns and errors there)."""
        return draft_logits(self, committed_ids, cache, num_masks, anchor_hidden_state)

    def packed_draft_logits(self, chain_ids: torch.LongTensor, cache: D3DCache, hypothesis_chain_lengths: list[int],
                            bonus_guesses: list[int]) -> D3DPackedDraft:  # fmt: skip
        """Packed successor drafting: `drafting_d3d.packed_draft_logits(self, ...)` (arguments, returns, errors)."""
        return packed_draft_logits(self, chain_ids, cache, hypothesis_chain_lengths, bonus_guesses)

    def build_candidate_generator(self, target=None, **kwargs):
        """Called by the patched `GenerationMixin._get_candidate_generator` of the target (see
        `hooks_d3d.install_generation_hook`): returns the `D3DCandidateGenerator` for one `generate` call
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
        from .generation_d3d import D3DCandidateGenerator  # the engine's seam (module docstring)

        return D3DCandidateGenerator(drafter=self, target=target, **kwargs)

    @classmethod
    def from_autoregressive(cls, model: PreTrainedModel, *args, **kwargs) -> D3DForDiffusionDrafting:
        """Initialises a drafter from an autoregressive causal LM of the same tokenizer:
        `initialization_d3d.from_autoregressive(cls, model, ...)` (its keyword arguments, e.g. `layer_ids`,
        `block_size`, `block_lora_rank`, `draft_vocab_ids`, `shares_target_cache`, `reads_target_hidden_state`, their
        meaning, the returns and the errors there)."""
        return from_autoregressive(cls, model, *args, **kwargs)


D3DConfig.register_for_auto_class()
D3DForDiffusionDrafting.register_for_auto_class("AutoModel")

__all__ = ["D3DForDiffusionDrafting", "D3DModel", "D3DModelOutput", "D3DPreTrainedModel"]
