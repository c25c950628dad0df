"""Training D3D drafters: `D3DTrainingConfig` + `D3DTrainer` on the transformers `Trainer` machinery.

Objective (docs/DESIGN.md section 3; BD3-LM block-diffusion attention, arXiv 2503.09573):

- **Blockwise denoising.** For `anchors_per_sequence` random anchors `a` per sequence, the block after the anchor,
  positions `a+1 .. a+B-1`, is masked (every position, or a random fraction in `[mask_ratio_min,
  mask_ratio_max]`). With the drafter's "shifted, causal anchor" alignment the output at block position `a+j`
  predicts token `x[a+j+1]`, i.e. draft token `d_{j+1}`; its cross-entropy is weighted by
  `w_k = exp(-(k-1)/gamma)` with `k = j+1`, favouring early draft positions (targets given as clean tokens inside
  the block are not scored). The first draft token `d1` is the anchor's ordinary next-token prediction.
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

import json
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainerCallback, TrainingArguments

from .modeling import D3DCache, D3DForDiffusionDrafting


@dataclass
class D3DTrainingConfig(TrainingArguments):
    r"""
    Configuration of `D3DTrainer`: every `transformers.TrainingArguments` field plus the D3D objective.

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
        max_length (`int`, defaults to 512): prompt + response tokens kept per sequence (the prompt is cut from
            the left first).

    What trains:
        train_mode (`str`, defaults to `"block_adapter"`): `"block_adapter"` trains block adapters
            (`block_lora_rank`) and the mask embedding, everything else frozen, so the committed-context path,
            and with it the first draft token, stays exactly the source model's; `"full"` trains every weight
            except, with `freeze_embeddings`, the embeddings and LM head; `"peft"` wraps the drafter with PEFT
            LoRA (`peft_lora_rank`, `peft_lora_alpha`, all seven projections) and trains the mask embedding as a
            module to save.
        block_lora_rank (`int`, defaults to 32): rank of the block adapters created for `"block_adapter"` when the
            drafter has none.
        block_lora_alpha (`float`, defaults to 64.0): their scaling numerator.
        freeze_embeddings (`bool`, defaults to `True`): keep embeddings and LM head frozen in `"full"` mode.
        peft_lora_rank (`int`, defaults to 16), peft_lora_alpha (`float`, defaults to 32.0): PEFT LoRA settings.

    Evaluation of tau during training:
        tau_eval_steps (`int`, defaults to 0): every this many steps, measure tau through
            `target.generate(..., assistant_model=drafter)` on the trainer's `tau_prompts` (0 = never).
        tau_eval_max_new_tokens (`int`, defaults to 64): new tokens per tau prompt.

    Raises:
        ValueError: for an unknown `train_mode`, a mask ratio outside (0, 1], `anchors_per_sequence < 1`, a negative
            loss weight, both loss weights 0, or `block_loss_weight=0` with `train_mode="block_adapter"` (nothing
            would train).
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
    max_length: int = field(default=512, metadata={"help": "Tokens kept per sequence."})
    train_mode: str = field(default="block_adapter", metadata={"help": "block_adapter | full | peft"})
    block_lora_rank: int = field(default=32, metadata={"help": "Rank of new block adapters."})
    block_lora_alpha: float = field(default=64.0, metadata={"help": "Scaling numerator of new block adapters."})
    freeze_embeddings: bool = field(default=True, metadata={"help": "Freeze embeddings/LM head in full mode."})
    peft_lora_rank: int = field(default=16, metadata={"help": "PEFT LoRA rank (train_mode=peft)."})
    peft_lora_alpha: float = field(default=32.0, metadata={"help": "PEFT LoRA alpha (train_mode=peft)."})
    tau_eval_steps: int = field(default=0, metadata={"help": "Measure tau every N steps (0 = never)."})
    tau_eval_max_new_tokens: int = field(default=64, metadata={"help": "New tokens per tau prompt."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the collator's columns."})

    def __post_init__(self):
        super().__post_init__()
        if self.train_mode not in ("block_adapter", "full", "peft"):
            raise ValueError(f"`train_mode` must be block_adapter, full or peft, got {self.train_mode!r}.")
        if not 0 < self.mask_ratio_min <= self.mask_ratio_max <= 1:
            raise ValueError(
                f"Need 0 < mask_ratio_min <= mask_ratio_max <= 1, got {self.mask_ratio_min}, {self.mask_ratio_max}."
            )
        if self.anchors_per_sequence < 1:
            raise ValueError(f"`anchors_per_sequence` must be >= 1, got {self.anchors_per_sequence}.")
        if self.ar_loss_weight < 0 or self.block_loss_weight < 0:
            raise ValueError(
                f"Loss weights must be >= 0, got ar_loss_weight={self.ar_loss_weight}, "
                f"block_loss_weight={self.block_loss_weight}."
            )
        if self.ar_loss_weight == 0 and self.block_loss_weight == 0:
            raise ValueError("`ar_loss_weight` and `block_loss_weight` are both 0: nothing to train.")
        if self.block_loss_weight == 0 and self.train_mode == "block_adapter":
            raise ValueError(
                "`block_loss_weight=0` trains only the next-token loss, which block adapters do not affect (they act "
                "only inside draft blocks): use `train_mode='full'` or `'peft'` for an autoregressive drafter."
            )


class D3DDataCollator:
    """Batches `{prompt_ids, response_ids}` rows for the D3D objective and samples the noisy blocks.

    Returns a dict of tensors:
        `input_ids` `(batch, L)` long, right-padded with `pad_token_id`; `attention_mask` `(batch, L)` long;
        `response_start` `(batch,)` long, index of the first response token; `anchors` `(batch, K)` long, anchor
        positions (-1 = no block: the response is too short); `block_masked` `(batch, K, B-1)` bool, which block
        positions `a+1 .. a+B-1` are masked.

    Anchors are drawn without replacement from `[response_start - 1, length - 2]` (the last prompt token is a valid
    anchor: it drafts the start of the response, as at inference). The blocks of a row are drawn from a generator
    seeded by `(seed, epoch, the row's tokens)`, not from a global random state (which data-loader prefetching
    advances at unpredictable times), so a resumed run draws exactly the blocks of an uninterrupted one and every
    epoch draws new blocks. `D3DTrainer` sets `epoch` at the start of each epoch.
    """

    def __init__(
        self,
        block_size: int,
        anchors_per_sequence: int = 8,
        mask_ratio: tuple[float, float] = (1.0, 1.0),
        max_length: int = 512,
        pad_token_id: int = 0,
        seed: int = 0,
    ) -> None:
        self.block_size = block_size
        self.num_anchors = anchors_per_sequence
        self.mask_ratio = mask_ratio
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.seed = seed
        self.epoch = 0

    def _generator(self, prompt: list[int], response: list[int]) -> torch.Generator:
        data = np.asarray([self.seed, self.epoch, len(prompt), *prompt, *response], dtype=np.int64).tobytes()
        return torch.Generator().manual_seed(zlib.crc32(data))

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences, starts = [], []
        for row in rows:
            prompt, response = list(row["prompt_ids"]), list(row["response_ids"])
            response = response[: self.max_length - 1]
            prompt = prompt[-(self.max_length - len(response)) :] if prompt else []
            sequences.append(prompt + response)
            starts.append(len(prompt))
        length = max(1, max(len(s) for s in sequences))
        batch = len(rows)
        input_ids = torch.full((batch, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, length), dtype=torch.long)
        anchors = torch.full((batch, self.num_anchors), -1, dtype=torch.long)
        block_masked = torch.ones((batch, self.num_anchors, self.block_size - 1), dtype=torch.bool)
        for i, (seq, start) in enumerate(zip(sequences, starts, strict=True)):
            input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[i, : len(seq)] = 1
            gen = self._generator(rows[i]["prompt_ids"], rows[i]["response_ids"])
            first = max(start - 1, 0)
            num_candidates = max(len(seq) - 1 - first, 0)
            chosen = first + torch.randperm(num_candidates, generator=gen)[: self.num_anchors].sort().values
            anchors[i, : len(chosen)] = chosen
            low, high = self.mask_ratio
            if low < 1.0:
                ratios = low + (high - low) * torch.rand(len(chosen), 1, generator=gen)
                block_masked[i, : len(chosen)] = torch.rand(len(chosen), self.block_size - 1, generator=gen) < ratios
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_start": torch.tensor(starts, dtype=torch.long),
            "anchors": anchors,
            "block_masked": block_masked,
        }


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


def d3d_losses(
    drafter: D3DForDiffusionDrafting,
    inputs: dict[str, torch.Tensor],
    block_size: int,
    gamma: float,
    compute_ar: bool = True,
    clean_requires_grad: bool = True,
    compute_block: bool = True,
) -> dict[str, torch.Tensor]:
    """The D3D training losses of one batch (module docstring), vectorised over sequences and blocks.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter (or a PEFT model wrapping it: anything whose call accepts
            the drafter's forward arguments).
        inputs (`dict`): a `D3DDataCollator` batch.
        block_size (`int`): `B`.
        gamma (`float`): position-weight decay.
        compute_ar (`bool`): whether to compute the next-token loss on the clean stream.
        clean_requires_grad (`bool`): run the clean stream under autograd (needed when trainable weights act on
            committed tokens).
        compute_block (`bool`): whether to run the noisy blocks and compute the block loss (0 and no block
            tokens when not).

    Returns:
        `dict` with scalar float32 tensors `block_loss` (weighted mean over scored block positions; 0 when none),
        `ar_loss` (mean next-token loss over response tokens; 0 when not computed), and counts `block_tokens`,
        `ar_tokens`. A loss with nothing to score is an exact 0 that is still connected to the forward passes, so a
        batch of sequences too short to score trains as a zero-gradient step instead of failing in `backward`.
    """
    input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
    anchors, block_masked = inputs["anchors"], inputs["block_masked"]
    batch, length = input_ids.shape
    span = block_size - 1
    device = input_ids.device

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
        keep = (positions >= (inputs["response_start"][:, None] - 1)) & attention_mask[:, 1:].bool()
        if keep.any():
            unwrapped = getattr(drafter, "module", drafter)  # DistributedDataParallel wraps the model
            head = unwrapped.get_output_embeddings()
            logits = head(hidden[keep]).float()
            losses["ar_loss"] = F.cross_entropy(logits, input_ids[:, 1:][keep])
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
    targets = torch.gather(input_ids, 1, target_pos.clamp(max=length - 1).view(batch, -1)).view_as(pos)

    attn = block_diffusion_attention_mask(anchors, attention_mask, block_size)
    noisy = drafter(
        input_ids=noisy_ids.view(batch, -1),
        masked_positions=masked.view(batch, -1),
        block_positions=torch.ones_like(masked.view(batch, -1)),
        attention_mask=attn,
        position_ids=pos.view(batch, -1),
        past_key_values=cache,
        use_cache=True,
    )
    weights = _position_weights(span, gamma, device)[None, None].expand_as(pos) * scored
    if scored.any():
        logits = noisy.logits.view(batch, -1, span, noisy.logits.shape[-1])[scored].float()
        ce = F.cross_entropy(logits, targets[scored], reduction="none")
        losses["block_loss"] = (ce * weights[scored]).sum() / weights[scored].sum()
    else:
        losses["block_loss"] = noisy.logits[:, :0].float().sum()  # 0, on the autograd graph of the trained weights
    losses["block_tokens"] = scored.sum()
    return losses


_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether a `Trainer` checkpoint folder was written to the end.

    `Trainer` writes `trainer_state.json` after the model, optimizer, scheduler and RNG state, so a folder whose
    `trainer_state.json` is missing or unreadable is the remainder of an interrupted save.
    """
    try:
        json.loads((Path(path) / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The `checkpoint-N` folder of `output_dir` with the largest `N` that `is_complete_checkpoint` accepts (`None`
    if there is none). transformers' `get_last_checkpoint` takes the largest `N` even when its save was cut short."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    steps = [
        (int(match.group(1)), child)
        for child in folder.iterdir()
        if (match := _CHECKPOINT_NAME.match(child.name)) and child.is_dir() and is_complete_checkpoint(child)
    ]
    return str(max(steps)[1]) if steps else None


class _EpochCallback(TrainerCallback):
    """Tells the collator which epoch it is collating, so that each epoch draws new blocks."""

    def __init__(self, collator: D3DDataCollator) -> None:
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(state.epoch or 0)
        return control


class TauCallback(TrainerCallback):
    """Every `tau_eval_steps` steps, measures tau through `target.generate(..., assistant_model=drafter)`."""

    def __init__(self, trainer: D3DTrainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if args.tau_eval_steps and state.global_step % args.tau_eval_steps == 0:
            tau = self.trainer.measure_tau()
            self.trainer.log({"tau": tau})
        return control


class D3DTrainer(Trainer):
    """`transformers.Trainer` for D3D drafters (objective in the module docstring).

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


@dataclass
class D3DTrainScriptArguments:
    r"""
    What `d3d-hf train` trains on (the `D3DTrainingConfig` fields say how).

    Args:
        target (`str`): the target model (a known name such as `smollm2-135m-instruct`, a folder or a hub id).
        data (`str`): a dataset folder written by `d3d-hf data` (its `dataset/` subfolder or the folder itself).
        drafter (`str`, *optional*): start from this drafter folder instead of initialising from the target.
        num_layers (`int`, *optional*): layers copied from the target when initialising (default: all).
        init_block_size (`int`, defaults to 16): block size of a newly initialised drafter.
        shares_target_weights (`bool`, defaults to `True`): a newly initialised drafter references the target's
            weights and saves only its own (valid with `train_mode="block_adapter"`; ignored otherwise).
        dtype (`str`, defaults to `"float32"`): dtype of the target (and shared weights) during training.
        tau_holdout (`int`, defaults to 4): rows held out of training (the last ones) whose prompts measure tau
            every `tau_eval_steps`.
        threads (`int`, *optional*): torch CPU threads.
        overwrite (`bool`, defaults to `False`): allow a non-empty `output_dir` without resuming.
    """

    target: str = field(metadata={"help": "Target model name, folder or hub id."})
    data: str = field(metadata={"help": "Dataset folder written by `d3d-hf data`."})
    drafter: str | None = field(default=None, metadata={"help": "Start from this drafter folder."})
    num_layers: int | None = field(default=None, metadata={"help": "Layers of a new drafter (default all)."})
    init_block_size: int = field(default=16, metadata={"help": "Block size of a new drafter."})
    shares_target_weights: bool = field(default=True, metadata={"help": "New drafter references target weights."})
    dtype: str = field(default="float32", metadata={"help": "Training dtype of the target."})
    tau_holdout: int = field(default=4, metadata={"help": "Rows held out for tau evaluation."})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads."})
    overwrite: bool = field(default=False, metadata={"help": "Allow a non-empty output_dir without resuming."})


def load_training_dataset(path: str):
    """Loads a `d3d-hf data` dataset (`datasets.load_from_disk`) from `path` or `path/dataset`.

    Raises:
        FileNotFoundError: if neither holds a saved dataset.
    """
    from datasets import load_from_disk

    for candidate in (Path(path) / "dataset", Path(path)):
        if (candidate / "dataset_info.json").exists() or (candidate / "state.json").exists():
            return load_from_disk(str(candidate))
    raise FileNotFoundError(f"No dataset at {path}: create one with `d3d-hf data --output {path}`.")


def train_drafter(script: D3DTrainScriptArguments, config: D3DTrainingConfig) -> D3DForDiffusionDrafting:
    """Runs `d3d-hf train`: loads target, data and drafter, trains, saves the drafter to `config.output_dir`.

    Returns:
        The trained `D3DForDiffusionDrafting` (block adapters merged into nothing: saved as they are).

    Raises:
        FileExistsError: if `output_dir` is non-empty and neither resuming nor `overwrite`.
        ValueError: if the dataset is too small for the hold-out, or shared weights are asked with a mode that
            trains them.
    """
    from .drafters import load_drafter
    from .targets import load_target

    if script.threads:
        torch.set_num_threads(script.threads)
    output = Path(config.output_dir)
    resume = config.resume_from_checkpoint
    if resume in ("auto", "true", "True", True):
        resume = last_complete_checkpoint(output)  # never a checkpoint whose save was interrupted
    if output.exists() and any(output.iterdir()) and not resume and not script.overwrite:
        raise FileExistsError(
            f"{output} is not empty: pass --resume_from_checkpoint auto to continue a run there, or --overwrite."
        )
    target, tokenizer = load_target(script.target, dtype=script.dtype)
    dataset = load_training_dataset(script.data)
    if len(dataset) <= script.tau_holdout:
        raise ValueError(f"The dataset has {len(dataset)} rows; need more than --tau_holdout {script.tau_holdout}.")
    train_rows = dataset.select(range(len(dataset) - script.tau_holdout))
    held_out = dataset.select(range(len(dataset) - script.tau_holdout, len(dataset)))
    tau_prompts = [torch.tensor([row["prompt_ids"]], dtype=torch.long) for row in held_out]

    if script.drafter:
        drafter = load_drafter(script.drafter, dtype=script.dtype)
        if drafter.config.shares_target_weights:
            drafter.attach_target_weights(target)
    else:
        shares = script.shares_target_weights and config.train_mode == "block_adapter"
        drafter = D3DForDiffusionDrafting.from_autoregressive(
            target,
            num_layers=script.num_layers,
            block_size=script.init_block_size,
            source_model=script.target,
            target_model=script.target,
            shares_target_weights=shares,
        )
    if drafter.config.shares_target_weights and config.train_mode != "block_adapter":
        raise ValueError("A drafter that shares the target's weights can only train with train_mode=block_adapter.")
    trainer = D3DTrainer(
        drafter,
        config,
        train_dataset=train_rows,
        processing_class=tokenizer,
        target=target,
        tau_prompts=tau_prompts if config.tau_eval_steps else None,
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(output))
    trainer.save_state()
    return drafter


def main(argv: list[str] | None = None) -> int:
    """`d3d-hf train`: every `D3DTrainScriptArguments` and `D3DTrainingConfig` field as `--name value`."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser((D3DTrainScriptArguments, D3DTrainingConfig), prog="d3d-hf train")
    script, config = parser.parse_args_into_dataclasses(args=argv)
    train_drafter(script, config)
    return 0


__all__ = [
    "D3DDataCollator",
    "D3DTrainScriptArguments",
    "D3DTrainer",
    "D3DTrainingConfig",
    "TauCallback",
    "block_diffusion_attention_mask",
    "d3d_losses",
    "is_complete_checkpoint",
    "last_complete_checkpoint",
    "load_training_dataset",
    "train_drafter",
]
