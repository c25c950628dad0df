"""Trainer callbacks of `D3DTrainer`: the collator's epoch, and tau measured during training."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import TrainerCallback

from .collator import D3DDataCollator

if TYPE_CHECKING:
    from .trainer import D3DTrainer


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


__all__ = ["TauCallback"]
