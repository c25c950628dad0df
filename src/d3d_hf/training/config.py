"""`D3DTrainingConfig`: the configuration of `D3DTrainer` (`trl.SFTConfig` plus the D3D objective)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import SFTConfig


@dataclass
class D3DTrainingConfig(SFTConfig):
    r"""
    Configuration of `D3DTrainer`: every `trl.SFTConfig` field (so every `transformers.TrainingArguments` field, and
    TRL's dataset fields: `dataset_text_field`, `completion_only_loss`, `assistant_only_loss`, `chat_template_path`,
    `max_length`, `truncation_mode`, `dataset_kwargs`, ...) plus the D3D objective.

    Defaults that differ from `SFTConfig` (they keep what `D3DTrainer` did on `transformers.TrainingArguments`):
    `learning_rate` 5e-5 (SFTConfig: 2e-5), `gradient_checkpointing` False (the drafter does not support it),
    `bf16` False (SFTConfig: True unless fp16; pass `--bf16` for mixed precision), `max_length` 512
    (SFTConfig: 1024), `remove_unused_columns` False (the collator reads `prompt_ids` / `response_ids`). The
    SFTConfig fields that change the loss (`loss_type`, `label_smoothing_factor`, `router_aux_loss_coef`) and the
    layouts the D3D objective cannot use (`packing`, `padding_free`: a block must not cross from one document into
    the next) are refused.

    Objective:
        block_size (`int`, *optional*): draft block size `B`; defaults to the drafter's `config.block_size`.
        anchors_per_sequence (`int`, defaults to 8): blocks sampled per training sequence (`K`).
        mask_ratio_min, mask_ratio_max (`float`, default 1.0 and 1.0): each block masks a fraction drawn uniformly
            from this range of its `B-1` positions (1.0 = full masking, the inference regime).
        position_weight_gamma (`float`, defaults to 7.0): `gamma` of the weights `exp(-(k-1)/gamma)`.
        ar_loss_weight (`float`, defaults to 0.5): weight of the next-token loss on the clean stream.
        block_loss_weight (`float`, defaults to 1.0): weight of the block-diffusion loss. 0 turns it off (the noisy
            blocks are not computed): only the next-token loss trains, i.e. an autoregressive drafter; this needs
            `ar_loss_weight > 0` and `train_mode` `"full"` or `"peft"`.
        distill_weight (`float`, defaults to 0.0): weight of the distillation term, `KL(p || q)` between the
            target's next-token distribution `p` and the drafter's `q` at each scored block position, position-weighted
            like the block loss (`d3d_losses(distill=True)`). The target's distribution comes from the clean stream
            for a drafter that shares the target's weights in `block_adapter` mode (no extra pass), otherwise from a
            no-grad target forward per batch (the trainer needs `target=`). 0 (default) turns it off.
        max_length (`int` or `None`, defaults to 512): tokens kept per sequence; for `d3d-hf data` rows the prompt
            is cut from the left first, TRL datasets are cut from the right (`truncation_mode="keep_start"`).

    What trains:
        train_mode (`str`, defaults to `"block_adapter"`): `"block_adapter"` trains block adapters
            (`block_lora_rank`) and the mask embedding, everything else frozen, so the committed-context path,
            and with it the first draft token, stays exactly the source model's; `"full"` trains every weight
            except, with `freeze_embeddings`, the embeddings and LM head; `"peft"` wraps the drafter with PEFT
            LoRA (`peft_lora_rank`, `peft_lora_alpha`, all seven projections) and trains the mask embedding as a
            module to save.
        block_lora_rank (`int`, *optional*): rank of the block adapters created for `"block_adapter"` when the
            drafter has none; `None` (default) means 32. For a drafter that already has adapters, `None` trains them
            at their own rank, and a higher rank grows them first without changing what the drafter drafts
            (`d3d_hf.adapter_rank.expand_block_adapters`: a warm start with more capacity); a lower one is
            refused.
        block_lora_alpha (`float`, defaults to 64.0): their scaling numerator.
        block_lora_modules (`list[str]`, *optional*): the projections new block adapters act on, a non-empty subset
            of `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj` (a capacity option: e.g.
            the MLP only). `None` (default) means all seven. A drafter that already has adapters keeps its own, and
            the trainer refuses a different list here.
        block_lora_full_layers (`int`, defaults to 0): the last this many layers get full-rank block adapters
            (`D3DConfig.block_lora_full_layers`: block-row-only full weights in the last layers, a capacity option).
            Like `block_lora_modules`, it shapes new adapters only; the trainer refuses a value other than the
            drafter's for a drafter that has adapters.
        freeze_embeddings (`bool`, defaults to `True`): keep embeddings and LM head frozen in `"full"` mode.
        peft_lora_rank (`int`, defaults to 16), peft_lora_alpha (`float`, defaults to 32.0): PEFT LoRA settings of
            `train_mode="peft"` when the trainer gets no `peft_config`.
        peft_save_merged (`bool`, defaults to `True`): with PEFT, the final `save_model` writes the drafter with the
            LoRA weights merged in (a plain drafter folder); `False` writes the PEFT adapter folder instead, whose
            `adapter_config.json` names the base drafter's folder, or `"."` when the base had no folder and was
            saved into `output_dir` itself beside the adapter (the folder then loads wherever it is moved).
            Checkpoints (`checkpoint-N`) always hold the adapter, so that runs resume.

    Evaluation of tau during training:
        tau_eval_steps (`int`, defaults to 0): every this many steps, measure tau through
            `target.generate(..., assistant_model=drafter)` on the trainer's `tau_prompts` (0 = never).
        tau_eval_max_new_tokens (`int`, defaults to 64): new tokens per tau prompt.

    Raises:
        ValueError: for an unknown `train_mode`, a mask ratio outside (0, 1], `anchors_per_sequence < 1`, a negative
            or non-finite loss weight, both loss weights 0, `block_loss_weight=0` with `train_mode="block_adapter"`
            (nothing would train), `block_size` (when given) or `max_length` below 2, a rank below 1, a
            `position_weight_gamma` or LoRA alpha that is not a finite number > 0, `tau_eval_steps < 0` or
            `tau_eval_max_new_tokens < 1`, each naming the field; or an SFTConfig option the D3D objective cannot
            honour (`packing`, `padding_free`, `gradient_checkpointing`, `loss_type` other than "nll",
            `label_smoothing_factor`, `router_aux_loss_coef`).
    """

    block_size: int | None = field(default=None, metadata={"help": "Draft block size B (default: the drafter's)."})
    anchors_per_sequence: int = field(default=8, metadata={"help": "Blocks sampled per sequence (K)."})
    mask_ratio_min: float = field(default=1.0, metadata={"help": "Lowest fraction of masked block positions."})
    mask_ratio_max: float = field(default=1.0, metadata={"help": "Highest fraction of masked block positions."})
    position_weight_gamma: float = field(default=7.0, metadata={"help": "gamma of exp(-(k-1)/gamma)."})
    ar_loss_weight: float = field(default=0.5, metadata={"help": "Weight of the clean next-token loss."})
    block_loss_weight: float = field(
        default=1.0, metadata={"help": "Weight of the block-diffusion loss (0 = autoregressive drafter only)."}
    )
    distill_weight: float = field(
        default=0.0, metadata={"help": "Weight of KL(target || drafter) at the block positions (logit distillation)."}
    )
    max_length: int | None = field(default=512, metadata={"help": "Tokens kept per sequence."})
    train_mode: str = field(default="block_adapter", metadata={"help": "block_adapter | full | peft"})
    block_lora_rank: int | None = field(
        default=None,
        metadata={"help": "Rank of new block adapters (default 32); a higher rank than a drafter's own grows them."},
    )
    block_lora_alpha: float = field(default=64.0, metadata={"help": "Scaling numerator of new block adapters."})
    block_lora_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Projections new block adapters act on (default: all seven: q,k,v,o,gate,up,down _proj)."},
    )
    block_lora_full_layers: int = field(
        default=0, metadata={"help": "The last N layers get full-rank block adapters (block-row-only full weights)."}
    )
    freeze_embeddings: bool = field(default=True, metadata={"help": "Freeze embeddings/LM head in full mode."})
    peft_lora_rank: int = field(default=16, metadata={"help": "PEFT LoRA rank (train_mode=peft)."})
    peft_lora_alpha: float = field(default=32.0, metadata={"help": "PEFT LoRA alpha (train_mode=peft)."})
    peft_save_merged: bool = field(
        default=True, metadata={"help": "PEFT: save the merged drafter (False: the adapter folder naming its base)."}
    )
    tau_eval_steps: int = field(default=0, metadata={"help": "Measure tau every N steps (0 = never)."})
    tau_eval_max_new_tokens: int = field(default=64, metadata={"help": "New tokens per tau prompt."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the collator's columns."})
    # SFTConfig defaults put back to what D3DTrainer had on TrainingArguments (class docstring)
    learning_rate: float = field(default=5e-5, metadata={"help": "The initial learning rate for AdamW."})
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Not supported by D3D drafters (must stay unset or False)."}
    )
    bf16: bool | None = field(default=False, metadata={"help": "bf16 mixed precision (default off)."})

    def __post_init__(self):
        super().__post_init__()
        refused = {
            "packing": self.packing,
            "padding_free": self.padding_free,
            "gradient_checkpointing": self.gradient_checkpointing,
            "label_smoothing_factor": self.label_smoothing_factor,
            "router_aux_loss_coef": self.router_aux_loss_coef,
        }
        set_options = [name for name, value in refused.items() if value]
        if self.loss_type != "nll":
            set_options.append(f"loss_type={self.loss_type!r}")
        if set_options:
            raise ValueError(
                f"D3DTrainingConfig does not support {', '.join(set_options)}: the loss is the D3D objective (block "
                "denoising + next-token loss on one padded sequence per row, blocks never crossing rows), and D3D "
                "drafters do not support gradient checkpointing. Leave these options at their defaults."
            )
        if self.block_lora_modules is not None:
            from ..modeling.configuration_d3d import DEFAULT_BLOCK_LORA_MODULES

            modules = self.block_lora_modules
            if isinstance(modules, str):
                modules = [m.strip() for m in modules.split(",") if m.strip()]
            unknown = [m for m in modules if m not in DEFAULT_BLOCK_LORA_MODULES]
            if not modules or unknown or len(set(modules)) != len(modules):
                raise ValueError(
                    f"`block_lora_modules` must be distinct names among {list(DEFAULT_BLOCK_LORA_MODULES)}, got "
                    f"{self.block_lora_modules!r}: set --block_lora_modules to e.g. gate_proj up_proj down_proj."
                )
            self.block_lora_modules = list(modules)
        if self.train_mode not in ("block_adapter", "full", "peft"):
            raise ValueError(f"`train_mode` must be block_adapter, full or peft, got {self.train_mode!r}.")
        if self.block_lora_full_layers and self.train_mode != "block_adapter":
            raise ValueError(
                f"`block_lora_full_layers={self.block_lora_full_layers}` shapes block adapters, which only "
                f"train_mode=block_adapter trains (this run: {self.train_mode!r}): drop --block_lora_full_layers, or "
                "pass --train_mode block_adapter."
            )
        whole = {
            "block_size": (self.block_size, 2, "None (the drafter's) or a block size such as 16"),
            "max_length": (self.max_length, 2, "512 (or None: no limit)"),
            "block_lora_rank": (
                self.block_lora_rank,
                1,
                "32 for new adapters, or leave it unset to train a saved drafter's adapters at their rank",
            ),
            "block_lora_full_layers": (self.block_lora_full_layers, 0, "0, or a few such as 2"),
            "peft_lora_rank": (self.peft_lora_rank, 1, "16"),
            "tau_eval_steps": (self.tau_eval_steps, 0, "0 (never) or a step interval"),
            "tau_eval_max_new_tokens": (self.tau_eval_max_new_tokens, 1, "64"),
        }
        for name, (value, low, example) in whole.items():
            if value is None and name in ("block_size", "max_length", "block_lora_rank"):  # the drafter's / no limit
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be a whole number >= {low}, got {value!r}: set --{name} to {example}.")
        positive = {
            "position_weight_gamma": self.position_weight_gamma,
            "block_lora_alpha": self.block_lora_alpha,
            "peft_lora_alpha": self.peft_lora_alpha,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"`{name}` must be a finite number > 0, got {value!r}: set --{name} (default "
                    f"{self.__dataclass_fields__[name].default})."
                )
        for name in ("mask_ratio_min", "mask_ratio_max", "ar_loss_weight", "block_loss_weight", "distill_weight"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"`{name}` must be a finite number, got {getattr(self, name)!r}.")
        if not 0 < self.mask_ratio_min <= self.mask_ratio_max <= 1:
            raise ValueError(
                f"Need 0 < mask_ratio_min <= mask_ratio_max <= 1, got {self.mask_ratio_min}, {self.mask_ratio_max}."
            )
        if self.anchors_per_sequence < 1:
            raise ValueError(f"`anchors_per_sequence` must be >= 1, got {self.anchors_per_sequence}.")
        if self.ar_loss_weight < 0 or self.block_loss_weight < 0 or self.distill_weight < 0:
            raise ValueError(
                f"Loss weights must be >= 0, got ar_loss_weight={self.ar_loss_weight}, "
                f"block_loss_weight={self.block_loss_weight}, distill_weight={self.distill_weight}."
            )
        if self.distill_weight > 0 and self.block_loss_weight == 0:
            raise ValueError("`distill_weight` distils at the block positions: it needs `block_loss_weight > 0`.")
        if self.ar_loss_weight == 0 and self.block_loss_weight == 0:
            raise ValueError("`ar_loss_weight` and `block_loss_weight` are both 0: nothing to train.")
        if self.block_loss_weight == 0 and self.train_mode == "block_adapter":
            raise ValueError(
                "`block_loss_weight=0` trains only the next-token loss, which block adapters do not affect (they act "
                "only inside draft blocks): use `train_mode='full'` or `'peft'` for an autoregressive drafter."
            )


__all__ = ["D3DTrainingConfig"]
