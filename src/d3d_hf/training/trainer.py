"""`D3DTrainer`: `trl.SFTTrainer` for D3D drafters (objective: `d3d_hf.training.objective`)."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from trl import SFTTrainer
from trl.data_utils import get_dataset_column_names

from ..adapter_rank import expand_block_adapters
from ..drafters import BASE_DRAFTER_DIR, EMBEDDED_BASE
from ..modeling import D3DConfig, D3DForDiffusionDrafting
from ..prompts import refuse_evaluation_rows
from .callbacks import TauCallback, _EpochCallback
from .checkpoints import is_complete_checkpoint, last_complete_checkpoint
from .collator import D3DDataCollator
from .config import D3DTrainingConfig
from .objective import d3d_losses, target_cache_losses
from .rows import check_max_length, check_training_rows

PEFT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections `train_mode="peft"` adapts when no `peft_config` is given."""

"""Subfolder of an adapter folder (`peft_save_merged=False`) that holds a base drafter that had no folder of its own."""


def _local_tokenizer(model: D3DForDiffusionDrafting):
    """The tokenizer of the first local folder among the drafter's target, source and own folder, else `None`."""
    from transformers import AutoTokenizer

    config = model.config
    for name in (getattr(config, "target_model", None), getattr(config, "source_model", None), model.name_or_path):
        if name and os.path.isdir(name):
            try:
                return AutoTokenizer.from_pretrained(name)
            except (OSError, ValueError):
                continue
    return None


def check_adapter_request(saved: D3DConfig, args: D3DTrainingConfig) -> None:
    """Refuses adapter settings that a drafter with block adapters (`saved.block_lora_rank > 0`) cannot train with.

    `d3d-hf train --drafter DIR` calls it before the target loads; `D3DTrainer` again on the model it trains.

    Args:
        saved (`D3DConfig`): the configuration of the drafter to train on.
        args (`D3DTrainingConfig`): the run's settings; only `train_mode="block_adapter"` is checked.

    Raises:
        ValueError: if `block_lora_rank` is below the saved rank (growing is allowed: `expand_block_adapters`), or
            `block_lora_modules` / `block_lora_full_layers` ask for adapters other than the saved ones.
    """
    if args.train_mode != "block_adapter" or not saved.block_lora_rank:
        return
    if args.block_lora_rank is not None and args.block_lora_rank < saved.block_lora_rank:
        raise ValueError(
            f"`block_lora_rank={args.block_lora_rank}` is below the drafter's adapter rank "
            f"({saved.block_lora_rank}): leave block_lora_rank unset to train them at their rank, or "
            "lower it first with `d3d_hf.pruning.truncate_block_adapters` and train the saved result."
        )
    if args.block_lora_modules is not None and args.block_lora_modules != saved.block_lora_modules:
        raise ValueError(
            f"`block_lora_modules={args.block_lora_modules}` asks for new adapters, but the drafter already "
            f"has block adapters on {saved.block_lora_modules}: leave block_lora_modules unset to "
            "train those, or start from a drafter without adapters."
        )
    if args.block_lora_full_layers not in (0, saved.block_lora_full_layers):
        raise ValueError(
            f"`block_lora_full_layers={args.block_lora_full_layers}` asks for new adapters, but the drafter "
            f"already has block adapters with {saved.block_lora_full_layers} full-rank layers: leave "
            "block_lora_full_layers at 0 to train those, or start from a drafter without adapters."
        )


class D3DTrainer(SFTTrainer):
    """`trl.SFTTrainer` for D3D drafters: TRL's dataset handling, PEFT, callbacks, logging and model card, with the D3D
    objective (`d3d_hf.training.objective`) as the loss.

    Why `SFTTrainer`: a drafter is trained on the target's answers exactly as a causal LM is fine-tuned on
    completions, so SFT's dataset handling is what a drafter needs: conversational (`messages`), prompt-completion
    and text datasets are tokenized with the chat template, and TRL's `completion_mask` / `assistant_masks`
    (`completion_only_loss`, `assistant_only_loss`) become `labels` of -100 on the tokens not to learn, which
    `D3DDataCollator` turns into the objective's `loss_mask`. Only the loss differs, so `compute_loss` is replaced;
    the rest (PEFT wrapping through `peft_config`, accelerate, checkpoints, logging of `num_tokens`) is TRL's.
    Rows written by `d3d-hf data` (`prompt_ids`, `response_ids`: the target's exact generated ids) skip TRL's
    tokenization and train as before.

    Args (the first six in the order of the earlier `transformers.Trainer`-based `D3DTrainer`; the rest by keyword):
        model (`D3DForDiffusionDrafting`): the drafter to train (block adapters are added for
            `train_mode="block_adapter"` when it has none, initialised from `args.seed`).
        args (`D3DTrainingConfig`): configuration.
        train_dataset (`datasets.Dataset` or `datasets.IterableDataset`): rows of `d3d-hf data`
            (`prompt_ids`, `response_ids`) or any dataset `trl.SFTTrainer` takes (`messages`; `prompt` +
            `completion`; a text field; `input_ids` with optional `labels` / `completion_mask` /
            `assistant_masks`). Refused if it holds a prompt of an evaluation set the bench knows
            (`d3d_hf.prompts.refuse_evaluation_rows`).
        processing_class (`PreTrainedTokenizerBase`, *optional*): the target's tokenizer (its pad id pads the
            batches; saved with checkpoints). Defaults to the tokenizer of the drafter's target or source folder
            when that is a local folder.
        target (`PreTrainedModel`, *optional*): the target, needed for tau evaluation.
        tau_prompts (`list[torch.LongTensor]`, *optional*): encoded held-out prompts `(1, seq_len)` for tau.
        eval_dataset (*optional*): the same kinds as `train_dataset`, for `evaluate` (the loss of the D3D objective).
        data_collator (*optional*): defaults to a `D3DDataCollator` built from `args`.
        peft_config (`peft.PeftConfig`, *optional*): PEFT adapters to train (`train_mode` becomes `"peft"`).
            Without one, `train_mode="peft"` uses LoRA of rank `peft_lora_rank` on the seven projections. The mask
            embedding is added to `modules_to_save` when the block loss is on (a new mask embedding must learn).
        Other keyword arguments go to `trl.SFTTrainer` (`callbacks`, `optimizers`, `formatting_func`, ...).

    Raises:
        ValueError: if `model` is not a D3D drafter, `args` is not a `D3DTrainingConfig`, no tokenizer is given
            or found, `peft_config` comes with `train_mode="full"`, the block size is < 2 or above `max_length`, tau
            evaluation is requested without a target and prompts, a dataset holds evaluation prompts, is empty or
            has rows with nothing to learn (`d3d_hf.training.rows.check_training_rows`), or truncation to
            `max_length` leaves no row to learn from.
    """

    _tag_names = ["trl", "sft", "d3d", "speculative-decoding"]
    _name = "D3D"

    def __init__(
        self,
        model,
        args: D3DTrainingConfig,
        train_dataset=None,
        processing_class=None,
        target=None,
        tau_prompts=None,
        *,
        eval_dataset=None,
        data_collator=None,
        peft_config=None,
        **kwargs,
    ):
        if not isinstance(model, D3DForDiffusionDrafting):
            raise ValueError(f"D3DTrainer trains D3DForDiffusionDrafting models, got {type(model).__name__}.")
        if not isinstance(args, D3DTrainingConfig):
            raise ValueError(f"D3DTrainer needs a D3DTrainingConfig, got {type(args).__name__}.")
        if args.tau_eval_steps and (target is None or not tau_prompts):
            raise ValueError("`tau_eval_steps` needs `target=` and `tau_prompts=`.")
        self.block_size = args.block_size or model.config.block_size
        if self.block_size < 2:
            raise ValueError(f"Training needs a block size >= 2, got {self.block_size}.")
        check_max_length(args.max_length, self.block_size)
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            check_training_rows(dataset, name, args.dataset_text_field, model.config.vocab_size)
            datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
            for part in datasets:
                if part is not None:
                    refuse_evaluation_rows(part, where=name)
        if processing_class is None:
            processing_class = _local_tokenizer(model)
            if processing_class is None:
                raise ValueError(
                    "D3DTrainer needs `processing_class=` (the target's tokenizer): the drafter names no local target "
                    "or source folder to load one from."
                )
        self.drafter = model
        self.target = target
        self._cache_target = self._target_for_cache(model, args, target)
        self._distill_teacher = (
            None if self._cache_target is not None else self._teacher_for_distillation(model, args, target)
        )
        self.tau_prompts = tau_prompts or []
        peft_config = self._peft_config(model, args, peft_config)
        self._prepare_trainable(model, args)
        pad = getattr(processing_class, "pad_token_id", None)
        if pad is None:
            pad = getattr(processing_class, "eos_token_id", None)
        collator = data_collator or D3DDataCollator(
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
            data_collator=collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            peft_config=peft_config,
            **kwargs,
        )
        if self.train_dataset is not None and hasattr(self.train_dataset, "__len__") and not len(self.train_dataset):
            raise ValueError(
                f"No row of `train_dataset` keeps a token to learn within max_length={args.max_length}: TRL drops the "
                "rows whose learned tokens truncation cuts off (a prompt longer than max_length). Raise max_length, "
                "or pass truncation_mode='keep_end'."
            )
        if isinstance(collator, D3DDataCollator):
            self.add_callback(_EpochCallback(collator))
        if args.tau_eval_steps:
            self.add_callback(TauCallback(self))

    @staticmethod
    def _peft_config(model: D3DForDiffusionDrafting, args: D3DTrainingConfig, peft_config):
        """The PEFT config to wrap the drafter with (`None` for block adapters and full fine-tuning)."""
        if peft_config is None and args.train_mode != "peft":
            return None
        if peft_config is not None and args.train_mode == "full":
            raise ValueError(
                "`peft_config` trains PEFT adapters, but `train_mode='full'` asks for every weight: pass "
                "`train_mode='peft'` (or leave the default) with a `peft_config`, or drop the `peft_config`."
            )
        try:
            from peft import LoraConfig
        except ImportError as err:  # pragma: no cover - peft is in the train extra
            raise ValueError("train_mode='peft' needs peft: pip install 'd3d-hf[train]'.") from err
        args.train_mode = "peft"
        if peft_config is None:
            peft_config = LoraConfig(
                r=args.peft_lora_rank, lora_alpha=args.peft_lora_alpha, target_modules=list(PEFT_TARGET_MODULES)
            )
        else:
            peft_config = copy.deepcopy(peft_config)  # the caller's config is not changed
        if model.model.mask_embedding is not None and args.block_loss_weight > 0:
            to_save = list(peft_config.modules_to_save or [])
            if "mask_embedding" not in to_save:
                peft_config.modules_to_save = [*to_save, "mask_embedding"]
        return peft_config

    def _prepare_trainable(self, model: D3DForDiffusionDrafting, args: D3DTrainingConfig) -> None:
        """Freezes/unfreezes parameters for `train_mode` (PEFT freezes the base itself when it wraps the model)."""
        self.clean_requires_grad = True
        if args.train_mode == "block_adapter":
            layers = len(model.model.layers)
            if model.config.block_lora_rank == 0 and args.block_lora_full_layers > layers:
                raise ValueError(
                    f"`block_lora_full_layers={args.block_lora_full_layers}` is more than the drafter's {layers} "
                    f"layers: set --block_lora_full_layers to a number in [0, {layers}]."
                )
            if model.config.block_lora_rank == 0:
                # new adapters follow `args.seed`, not whatever state the global generator is in (two runs of the
                # same command in one process would otherwise start from different adapters)
                devices = [model.device.index or 0] if model.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices):
                    torch.manual_seed(args.seed)
                    adapters = (args.block_lora_rank or 32, args.block_lora_alpha, args.block_lora_modules)
                    model.add_block_adapter(*adapters, full_layers=args.block_lora_full_layers)
            else:
                check_adapter_request(model.config, args)
            if args.block_lora_rank is not None and args.block_lora_rank > model.config.block_lora_rank > 0:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(args.seed)
                    expand_block_adapters(model, args.block_lora_rank)
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

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """`SFTTrainer._prepare_dataset`, except for `d3d-hf data` rows (`prompt_ids` and `response_ids`: already
        the target's exact ids), which `D3DDataCollator` batches as they are."""
        columns = set(get_dataset_column_names(dataset))
        if {"prompt_ids", "response_ids"} <= columns:
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)

    @staticmethod
    def _target_for_cache(model, args, target):
        """The target whose cache a `shares_target_cache` drafter reads (`target_cache_losses`), on the drafter's
        device without gradients; `None` for other drafters.

        Raises:
            ValueError: for such a drafter without `target`, or with `ar_loss_weight > 0` or `block_loss_weight == 0`
                (it has no autoregressive path of its own: its first draft token is scored in the block loss).
        """
        if not getattr(model.config, "shares_target_cache", False):
            return None
        if target is None:
            raise ValueError(
                "This drafter attends to the target's cache (`shares_target_cache=True`), so every training batch runs "
                "the target: pass `target=` to D3DTrainer (d3d-hf train does)."
            )
        if args.ar_loss_weight > 0 or args.block_loss_weight <= 0:
            raise ValueError(
                "A drafter over the target's cache (`shares_target_cache=True`) has no autoregressive path of its own: "
                "its first draft token is scored in the block loss. Set ar_loss_weight=0 and block_loss_weight > 0 "
                f"(got {args.ar_loss_weight} and {args.block_loss_weight})."
            )
        target.requires_grad_(False)
        return target.to(args.device).eval()

    @staticmethod
    def _teacher_for_distillation(model, args, target):
        """Where `distill_weight` reads the target's distribution: `None` (the clean stream, which is the target's for
        a drafter sharing its weights in `block_adapter` mode) or `target` (a no-grad forward per batch).

        Raises:
            ValueError: `distill_weight > 0` for a drafter with its own committed path and no `target`.
        """
        if args.distill_weight <= 0:
            return None
        if model.config.shares_target_weights and args.train_mode == "block_adapter":
            return None
        if target is None:
            raise ValueError(
                "`distill_weight > 0` distils the target's distribution, and this drafter's committed path is not the "
                "target's (its own weights, or a train_mode that changes them): pass `target=` to D3DTrainer (d3d-hf "
                "train does), or set distill_weight=0."
            )
        target.requires_grad_(False)
        # on the device the Trainer puts the drafter on (a GPU unless `use_cpu`): the teacher reads the batch there
        return target.to(args.device).eval()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The D3D objective: `block_loss_weight * block_loss + ar_loss_weight * ar_loss` (`d3d_losses`); both parts
        are logged (averaged over processes and the steps since the last log) next to TRL's `num_tokens`."""
        if self._cache_target is not None:
            losses = target_cache_losses(
                model,
                inputs,
                block_size=self.block_size,
                gamma=self.args.position_weight_gamma,
                target=self._cache_target,
                distill=self.args.distill_weight > 0,
            )
        else:
            losses = d3d_losses(
                model,
                inputs,
                block_size=self.block_size,
                gamma=self.args.position_weight_gamma,
                compute_ar=self.args.ar_loss_weight > 0,
                clean_requires_grad=self.clean_requires_grad,
                compute_block=self.args.block_loss_weight > 0,
                distill=self.args.distill_weight > 0,
                teacher=self._distill_teacher,
            )
        loss = self.args.block_loss_weight * losses["block_loss"] + self.args.ar_loss_weight * losses["ar_loss"]
        if self.args.distill_weight > 0:
            loss = loss + self.args.distill_weight * losses["distill_loss"]
        mode = "train" if self.model.training else "eval"
        for key in ("block_loss", "ar_loss", *(("distill_loss",) if self.args.distill_weight > 0 else ())):
            value = self.accelerator.gather_for_metrics(losses[key].detach().reshape(1)).mean()
            self._metrics[mode][key].append(float(value))
        if mode == "train":
            tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum().reshape(1)).sum()
            self._total_train_tokens += int(tokens)
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return (loss, losses) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss of the D3D objective only (there are no logits to compare with labels)."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log (the metrics since the last log merged in) for loss and evaluation logs; other logs (`tau`,
        the end-of-training summary) as they are, so that they do not take the loss parts away."""
        if "loss" in logs or any(key.startswith("eval_") for key in logs):
            super().log(logs, start_time)
        else:
            Trainer.log(self, logs, start_time)

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
        if resume_from_checkpoint:
            self._check_checkpoint_shapes(resume_from_checkpoint)
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    #: the config fields that decide the drafter's weight shapes, hence whether a checkpoint loads into this run
    SHAPE_FIELDS = ("num_hidden_layers", "block_lora_rank", "block_lora_modules", "block_lora_full_layers",
                    "draft_vocab_size")  # fmt: skip

    def _check_checkpoint_shapes(self, checkpoint: str) -> None:
        """Refuses, before any step, a checkpoint whose drafter has other weight shapes than this run's (made with
        other `--block_lora_*` flags, say), which transformers would otherwise fail to load with a size mismatch."""
        saved = Path(checkpoint) / "config.json"
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model.get_base_model() if hasattr(model, "get_base_model") else model, "config", None)
        if not saved.is_file() or config is None or getattr(config, "model_type", None) != "d3d":
            return
        saved = json.loads(saved.read_text())
        differ = [
            f"{name}={saved.get(name)!r} there, {getattr(config, name, None)!r} here"
            for name in self.SHAPE_FIELDS
            if name in saved and saved.get(name) != getattr(config, name, None)
        ]
        if differ:
            raise ValueError(
                f"{checkpoint} holds a drafter of other weight shapes than this run builds ({'; '.join(differ)}): "
                "resume with the flags of the run that wrote it (e.g. the same --block_lora_rank, --block_lora_modules "
                "and --block_lora_full_layers), or train into a new output_dir."
            )

    # ------------------------------------------------------------------------------------------------------------
    # saving: the drafter's own card, PEFT drafters merged or as an adapter folder naming its base drafter

    def _update_card_data(self, dataset_name: str | None = None, tags=None) -> None:
        """Records the training run in `drafter.card_data` (rendered into the drafter card by every save)."""
        import trl

        from ..hub import DrafterCardData

        args = self.args
        data = copy.deepcopy(DrafterCardData.coerce(getattr(self.drafter, "card_data", None)))
        extra = [tags] if isinstance(tags, str) else list(tags or [])
        data.tags = list(dict.fromkeys([*data.tags, *self._tag_names, *extra]))
        if dataset_name and dataset_name not in data.datasets:
            data.datasets.append(dataset_name)
        data.training = {
            **(data.training or {}),
            "trainer": f"d3d_hf.training.D3DTrainer (trl.SFTTrainer, trl {trl.__version__})",
            "train_mode": args.train_mode,
            "steps": self.state.global_step,
            "learning_rate": args.learning_rate,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "processes": args.world_size,
            "block_size": self.block_size,
            "anchors_per_sequence": args.anchors_per_sequence,
            "block_loss_weight": args.block_loss_weight,
            "ar_loss_weight": args.ar_loss_weight,
            "distill_weight": args.distill_weight,
            "position_weight_gamma": args.position_weight_gamma,
            "max_length": args.max_length,
            "seed": args.seed,
        }
        self.drafter.card_data = data

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None, tags=None, **kwargs):
        """Writes the drafter's card (`d3d_hf.hub.write_model_card`) into `output_dir`, with TRL's tags and the
        training run recorded, instead of TRL's generic SFT card (called by TRL at each checkpoint and by
        `push_to_hub`; `model_name` and the other keyword arguments of TRL's card are not used)."""
        if not self.is_world_process_zero():
            return
        from ..hub import write_model_card

        self._update_card_data(dataset_name, tags)
        os.makedirs(self.args.output_dir, exist_ok=True)
        write_model_card(self.drafter, self.args.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """`Trainer.save_model`, with the drafter's card; a PEFT drafter (outside checkpoints) is saved merged
        (`peft_save_merged`, a plain drafter folder) or as the adapter folder whose `adapter_config.json` names the
        base drafter (`d3d_hf.load_drafter` and `AutoModel.from_pretrained(..., trust_remote_code=True)` load both).
        """
        output_dir = output_dir or self.args.output_dir
        self._update_card_data()
        if _internal_call or not is_peft_model(self.model):
            return super().save_model(output_dir, _internal_call)
        if not self.args.should_save:
            return None
        peft_model = self.accelerator.unwrap_model(self.model)
        os.makedirs(output_dir, exist_ok=True)
        tokenizer = self.processing_class
        if self.args.peft_save_merged:
            merged = copy.deepcopy(peft_model).merge_and_unload()
            merged.__dict__.pop("forward", None)  # TRL's fused-head forward is bound to the training copy
            merged.save_pretrained(output_dir, tokenizer=tokenizer)
        else:
            config = peft_model.peft_config[peft_model.active_adapter]
            base = self.drafter.name_or_path
            if not base or not (os.path.isdir(base) and os.path.isfile(os.path.join(base, "config.json"))):
                # a drafter made in memory: its unadapted weights go into the adapter folder itself, transformers'
                # layout for a local model with an embedded adapter, so that the folder loads wherever it is moved
                unadapted = copy.deepcopy(peft_model).unload()
                unadapted.__dict__.pop("forward", None)
                unadapted.save_pretrained(output_dir, tokenizer=tokenizer, model_card=False)
                base = EMBEDDED_BASE
            else:
                base = os.path.abspath(base)  # found from any working directory
            config.base_model_name_or_path = base
            from ..hub import is_generated_card, write_model_card

            readme = Path(output_dir) / "README.md"
            users_card = readme.exists() and not is_generated_card(readme)
            # the embeddings are never resized: no hub lookup of the base to find out; PEFT writes its generic card,
            # which the drafter's replaces
            peft_model.save_pretrained(output_dir, save_embedding_layers=False)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            write_model_card(self.drafter, output_dir, overwrite=not users_card)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        return None

    @torch.no_grad()
    def measure_tau(self) -> float:
        """tau of the drafter itself: greedy `target.generate(..., assistant_model=drafter)` over `tau_prompts` (all
        new tokens over all target forwards) with a full block of drafts verified every round (`d3d_num_drafts=
        "full"`): the cost-aware engine's default would mix in plain target steps and
        prompt-lookup rounds chosen by this machine's timings, which measures the engine, not the drafter."""
        from transformers import GenerationConfig

        drafter = self.drafter
        was_training = drafter.training
        drafter.eval()
        tokens = rounds = 0
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=self.args.tau_eval_max_new_tokens,
            d3d_num_drafts="full",
            d3d_prompt_lookup=False,
        )
        for ids in self.tau_prompts:
            ids = ids.to(self.target.device)
            self.target.generate(
                ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, generation_config=config
            )
            stats = drafter.last_generation_stats
            tokens, rounds = tokens + stats.new_tokens, rounds + stats.rounds
        drafter.train(was_training)
        return tokens / rounds if rounds else math.nan


__all__ = ["BASE_DRAFTER_DIR", "EMBEDDED_BASE", "PEFT_TARGET_MODULES", "D3DTrainer"]
