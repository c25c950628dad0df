"""`D3DTrainer`: the transformers `Trainer` for D3D drafters (objective: `d3d_hf.training.objective`)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import Trainer

from ..modeling import D3DForDiffusionDrafting
from .callbacks import TauCallback, _EpochCallback
from .checkpoints import is_complete_checkpoint, last_complete_checkpoint
from .collator import D3DDataCollator
from .config import D3DTrainingConfig
from .objective import d3d_losses


class D3DTrainer(Trainer):
    """`transformers.Trainer` for D3D drafters (objective: `d3d_hf.training.objective`).

    Args:
        model (`D3DForDiffusionDrafting`): the drafter to train (block adapters are added for
            `train_mode="block_adapter"` when it has none, initialised from `args.seed`).
        args (`D3DTrainingConfig`): configuration.
        train_dataset: rows with `prompt_ids` and `response_ids` (as `d3d-hf data` writes).
        processing_class: the tokenizer (its pad id is used for padding; saved with checkpoints).
        target (`PreTrainedModel`, *optional*): the target, needed for tau evaluation.
        tau_prompts (`list[torch.LongTensor]`, *optional*): encoded held-out prompts `(1, seq_len)` for tau.
        Other keyword arguments go to `transformers.Trainer`.

    Raises:
        ValueError: if `model` is not a D3D drafter, `train_mode="peft"` without peft installed, or tau evaluation
            is requested without a target and prompts.
    """

    def __init__(
        self,
        model,
        args: D3DTrainingConfig,
        train_dataset=None,
        processing_class=None,
        target=None,
        tau_prompts=None,
        **kwargs,
    ):
        if not isinstance(model, D3DForDiffusionDrafting):
            raise ValueError(f"D3DTrainer trains D3DForDiffusionDrafting models, got {type(model).__name__}.")
        if args.tau_eval_steps and (target is None or not tau_prompts):
            raise ValueError("`tau_eval_steps` needs `target=` and `tau_prompts=`.")
        self.block_size = args.block_size or model.config.block_size
        if self.block_size < 2:
            raise ValueError(f"Training needs a block size >= 2, got {self.block_size}.")
        self.drafter = model
        self.target = target
        self.tau_prompts = tau_prompts or []
        model = self._prepare_trainable(model, args)
        pad = getattr(processing_class, "pad_token_id", None)
        collator = kwargs.pop("data_collator", None) or D3DDataCollator(
            block_size=self.block_size,
            anchors_per_sequence=args.anchors_per_sequence,
            mask_ratio=(args.mask_ratio_min, args.mask_ratio_max),
            max_length=args.max_length,
            pad_token_id=pad if pad is not None else 0,
            seed=args.seed,
        )
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            data_collator=collator,
            **kwargs,
        )
        self._loss_parts: dict[str, list[float]] = {}
        if isinstance(collator, D3DDataCollator):
            self.add_callback(_EpochCallback(collator))
        if args.tau_eval_steps:
            self.add_callback(TauCallback(self))

    def _prepare_trainable(self, model: D3DForDiffusionDrafting, args: D3DTrainingConfig):
        """Freezes/unfreezes parameters for `train_mode`; returns the model to train (PEFT-wrapped for peft)."""
        self.clean_requires_grad = True
        if args.train_mode == "block_adapter":
            if model.config.block_lora_rank == 0:
                # new adapters follow `args.seed`, not whatever state the global generator is in (two runs of the
                # same command in one process would otherwise start from different adapters)
                devices = [model.device.index or 0] if model.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(args.seed)
                    model.add_block_adapter(args.block_lora_rank, args.block_lora_alpha)
            for name, param in model.named_parameters():
                trainable = model.is_drafter_specific(name)
                param.requires_grad_(trainable)
                if trainable and param.dtype != torch.float32:
                    # trainable weights stay float32 (optimizer master weights) whatever the target's dtype;
                    # D3DLinear and the mask embedding cast them to the activation dtype in forward
                    param.data = param.data.float()
            # the committed-context path uses only frozen weights (the mask embedding acts only on masks)
            self.clean_requires_grad = False
        elif args.train_mode == "full":
            for name, param in model.named_parameters():
                frozen = args.freeze_embeddings and ("embed_tokens" in name or name.startswith("lm_head"))
                # without the block loss no mask is ever embedded: the mask embedding gets no gradient
                frozen = frozen or (args.block_loss_weight == 0 and "mask_embedding" in name)
                param.requires_grad_(not frozen)
        else:
            try:
                from peft import LoraConfig, get_peft_model
            except ImportError as err:  # pragma: no cover - peft is in the train extra
                raise ValueError("train_mode='peft' needs peft: pip install 'd3d-hf[train]'.") from err
            config = LoraConfig(
                r=args.peft_lora_rank,
                lora_alpha=args.peft_lora_alpha,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                modules_to_save=(
                    ["mask_embedding"]
                    if model.model.mask_embedding is not None and args.block_loss_weight > 0
                    else None
                ),
            )
            model = get_peft_model(model, config)
        return model

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        losses = d3d_losses(
            model,
            inputs,
            block_size=self.block_size,
            gamma=self.args.position_weight_gamma,
            compute_ar=self.args.ar_loss_weight > 0,
            clean_requires_grad=self.clean_requires_grad,
            compute_block=self.args.block_loss_weight > 0,
        )
        loss = self.args.block_loss_weight * losses["block_loss"] + self.args.ar_loss_weight * losses["ar_loss"]
        for key in ("block_loss", "ar_loss"):
            self._loss_parts.setdefault(key, []).append(float(losses[key].detach()))
        return (loss, losses) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._loss_parts:
            for key, values in self._loss_parts.items():
                logs[key] = sum(values) / len(values)
            self._loss_parts = {}
        super().log(logs, *args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None):
        """`Trainer.train`, resuming only from complete checkpoints.

        Args:
            resume_from_checkpoint (`str` or `bool`, *optional*): a `checkpoint-N` folder, or `True` for the last
                complete one in `output_dir` (`last_complete_checkpoint`: folders that an interrupted save left
                half-written are skipped, where transformers would pick them).
            trial, ignore_keys_for_eval: as in `Trainer.train`.

        Raises:
            ValueError: if `resume_from_checkpoint=True` and `output_dir` holds no complete checkpoint, or the given
                folder is not a complete checkpoint (naming the last complete one).
        """
        if resume_from_checkpoint is True:
            found = last_complete_checkpoint(self.args.output_dir)
            if found is None:
                raise ValueError(
                    f"No complete checkpoint in {self.args.output_dir} (a `checkpoint-N` folder with a readable "
                    "trainer_state.json) to resume from: train without `resume_from_checkpoint`."
                )
            resume_from_checkpoint = found
        elif resume_from_checkpoint and not is_complete_checkpoint(resume_from_checkpoint):
            last = last_complete_checkpoint(Path(resume_from_checkpoint).parent)
            raise ValueError(
                f"{resume_from_checkpoint} is not a complete checkpoint (no readable trainer_state.json: its save "
                f"was interrupted). Resume from {last or 'an earlier complete checkpoint'} instead, or pass "
                "`resume_from_checkpoint=True` to pick the last complete one."
            )
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    @torch.no_grad()
    def measure_tau(self) -> float:
        """tau of greedy `target.generate(..., assistant_model=drafter)` over `tau_prompts` (all new tokens over
        all target forwards)."""
        drafter = self.drafter
        was_training = drafter.training
        drafter.eval()
        tokens = rounds = 0
        for ids in self.tau_prompts:
            ids = ids.to(self.target.device)
            self.target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                assistant_model=drafter,
                do_sample=False,
                max_new_tokens=self.args.tau_eval_max_new_tokens,
            )
            stats = drafter.last_generation_stats
            tokens, rounds = tokens + stats.new_tokens, rounds + stats.rounds
        drafter.train(was_training)
        return tokens / rounds if rounds else math.nan


__all__ = ["D3DTrainer"]
