"""Tiny D3D training run for the multi-process test (`torchrun --nproc_per_node 2 train_tiny.py ...`, gloo on CPU,
or plain `python train_tiny.py ...`). Writes the logged losses and the trained parameters' sums (main process)."""

import argparse
import json
import sys
from pathlib import Path

import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tiny import tiny_target, tiny_tokenizer  # noqa: E402

from d3d_hf import D3DForDiffusionDrafting  # noqa: E402
from d3d_hf.training import D3DTrainer, D3DTrainingConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--per-device", type=int, required=True)
parser.add_argument("--accum", type=int, required=True)
parser.add_argument("--output-dir", required=True)
args = parser.parse_args()

torch.manual_seed(0)
target = tiny_target("llama", seed=4)
g = torch.Generator().manual_seed(1)
rows = [
    {
        "prompt_ids": torch.randint(3, 97, (5,), generator=g).tolist(),
        "response_ids": torch.randint(3, 97, (20,), generator=g).tolist(),
    }
    for _ in range(32)
]
drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
config = D3DTrainingConfig(
    output_dir=args.output_dir, max_steps=5, per_device_train_batch_size=args.per_device,
    gradient_accumulation_steps=args.accum, learning_rate=1e-3, logging_steps=1, save_strategy="no", use_cpu=True,
    seed=3, train_mode="full", anchors_per_sequence=3, disable_tqdm=True, dataloader_drop_last=True,
    train_sampling_strategy="sequential",
)
trainer = D3DTrainer(drafter, config, train_dataset=Dataset.from_list(rows), processing_class=tiny_tokenizer())
trainer.train()
if trainer.is_world_process_zero():
    params = [p.detach().double().sum().item() for p in drafter.parameters() if p.requires_grad]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    Path(args.out).write_text(json.dumps({"loss": losses, "param_sums": params, "world_size": config.world_size}))
# shut the process group down explicitly (a gloo group left to interpreter teardown can abort the process)
if torch.distributed.is_available() and torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
