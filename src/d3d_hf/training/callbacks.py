"""Trainer callbacks of `D3DTrainer`: the collator's epoch, and tau measured during training.

They know the trainer only through what they call on it (`TauMeasuring`), so this module does not import
`trainer`, which imports it."""

from __future__ import annotations

from typing import Protocol

from transformers import TrainerCallback

from .collator import D3DDataCollator


class TauMeasuring(Protocol):
    """What `TauCallback` calls on its trainer (`D3DTrainer` has both)."""

    def measure_tau(self) -> float: ...

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...


class _EpochCallback(TrainerCallback):
    """Tells the collator which epoch it is collating, so that each epoch draws new blocks."""

    def __init__(self, collator: D3DDataCollator) -> None:
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(state.epoch or 0)
        return control


class TauCallback(TrainerCallback):
    """Every `tau_eval_steps` steps, measures tau through `target.generate(..., assistant_model=drafter)`."""

    def __init__(self, trainer: TauMeasuring) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if args.tau_eval_steps and state.global_step % args.tau_eval_steps == 0:
            tau = self.trainer.measure_tau()
            self.trainer.log({"tau": tau})
        return control


__all__ = ["TauCallback"]
