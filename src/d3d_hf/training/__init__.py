"""Training D3D drafters: `D3DTrainingConfig` + `D3DTrainer` on TRL (`trl.SFTConfig` + `trl.SFTTrainer`).

One concept per module (every name is importable from `d3d_hf.training` itself):

- `config`: `D3DTrainingConfig`, every `trl.SFTConfig` field plus the D3D objective's;
- `objective`: the objective (its docstring), `block_diffusion_attention_mask` and `d3d_losses`;
- `collator`: `D3DDataCollator`, which batches rows and samples the noisy blocks;
- `checkpoints`: `is_complete_checkpoint`, `last_complete_checkpoint` (never resume from a half-written save);
- `callbacks`: the collator's epoch and `TauCallback` (tau measured during training);
- `trainer`: `D3DTrainer` (TRL datasets and PEFT; PEFT drafters saved merged or as an adapter folder);
- `script`: the `d3d-hf train` command (`D3DTrainScriptArguments`, `load_training_dataset`, `train_drafter`,
  `main`).
"""

# `X as X`: names the single-module `d3d_hf.training` defined besides `__all__`, importable from here as before
from .callbacks import TauCallback
from .callbacks import _EpochCallback as _EpochCallback
from .checkpoints import _CHECKPOINT_NAME as _CHECKPOINT_NAME
from .checkpoints import is_complete_checkpoint, last_complete_checkpoint
from .collator import D3DDataCollator
from .config import D3DTrainingConfig
from .objective import _position_weights as _position_weights
from .objective import block_diffusion_attention_mask, d3d_losses
from .script import D3DTrainScriptArguments, load_training_dataset, train_drafter
from .script import main as main
from .trainer import D3DTrainer

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
