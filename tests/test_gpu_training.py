"""Training on a GPU (marked `gpu`: skipped without CUDA): the Trainer puts the drafter on the GPU, and what it
reads beside it must follow. A block-adapter drafter (its teacher is its own clean stream) and a standalone drafter
distilled from the target (a no-grad target forward per batch) each train a few steps on CUDA and then decode
losslessly there. Run by `benchmarks/gpu/run_scale.sh prepare` before a lease's training runs."""

import pytest
import torch
from _tiny import random_prompt, tiny_target, tiny_tokenizer
from datasets import Dataset

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.training import D3DTrainer, D3DTrainingConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rows(target, count=12):
    rows = []
    for i in range(count):
        prompt = random_prompt(4 + i % 3, seed=i)
        out = target.generate(prompt, max_new_tokens=10 + i, do_sample=False, eos_token_id=None, pad_token_id=0)
        rows.append({"prompt_ids": prompt[0].tolist(), "response_ids": out[0, prompt.shape[1] :].tolist()})
    return Dataset.from_list(rows)


@pytest.mark.parametrize("kind", ["block_adapter", "standalone_distilled"])
def test_trains_on_cuda_and_decodes_losslessly(kind, tmp_path):
    target = tiny_target("llama", seed=4, sharpen=10.0)
    dataset = _rows(target)
    torch.manual_seed(0)
    extra = {"num_layers": 2} if kind == "standalone_distilled" else {}
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, **extra)
    mode = {"train_mode": "full", "distill_weight": 1.0} if extra else {"train_mode": "block_adapter"}
    config = D3DTrainingConfig(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=5e-3, logging_steps=1,
        save_strategy="no", seed=7, anchors_per_sequence=3, block_lora_rank=4, disable_tqdm=True, report_to="none",
        **mode,
    )  # fmt: skip
    trainer = D3DTrainer(drafter, config, train_dataset=dataset, processing_class=tiny_tokenizer(), target=target)
    trainer.train()
    assert trainer.model.device.type == "cuda"
    assert all(h["loss"] > 0 for h in trainer.state.log_history if "loss" in h)
    target, drafter = target.cuda(), trainer.drafter.eval()
    for seed in (1, 2):
        ids = random_prompt(6, seed=seed).cuda()
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), target.generate(ids, **kwargs))
