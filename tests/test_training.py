"""D3D training (d3d_hf.training) on a tiny random Llama target: objective against a direct computation, attention
mask, logging, trainable parameters, resume, adapter save/load, several processes; the autoregressive-only objective
of the baseline assistant (examples/train_ar_assistant.sh trains and exports one); edges (sequences shorter than a
block, blocks with nothing or everything masked, batches with nothing to score) and runs killed while writing a
checkpoint (resume picks the last complete one, also through `d3d-hf train`)."""

import shlex
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _tiny import crash_safetensors_writer, random_prompt, tiny_tokenizer
from d3d_hf.modeling.drafting_d3d import draft_attention_mask
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.cli import main
from d3d_hf.training import (
    D3DDataCollator,
    D3DTrainer,
    D3DTrainingConfig,
    block_diffusion_attention_mask,
    d3d_losses,
    is_complete_checkpoint,
    last_complete_checkpoint,
)
from d3d_hf.training import main as train_main

BLOCK = 4
TOKENIZER = tiny_tokenizer()  # the tiny targets' 97 ids


def _answered_rows(target, count, same_length=False):
    """`count` rows of a random prompt (prompt i: seed i, 4 + i % 3 tokens) and the target's greedy continuation of it
    (10 + i tokens, eos ignored); with `same_length`, every prompt has 4 tokens and every continuation 10."""
    rows = []
    for i in range(count):
        prompt = random_prompt(4 if same_length else 4 + i % 3, seed=i)
        new_tokens = 10 if same_length else 10 + i
        out = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        rows.append({"prompt_ids": prompt[0].tolist(), "response_ids": out[0, prompt.shape[1] :].tolist()})
    return rows


@pytest.fixture(scope="module")
def dataset(target):
    rows = _answered_rows(target, 12)
    rows.append({"prompt_ids": [5, 6, 7], "response_ids": [8]})  # a one-token response: the shortest with a target
    return Dataset.from_list(rows)


def _drafter(target, block_size=BLOCK, **kwargs):
    torch.manual_seed(0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=block_size, **kwargs)
    with torch.no_grad():
        drafter.model.mask_embedding.weight.normal_()
    return drafter


def test_block_diffusion_mask_position_by_position():
    anchors = torch.tensor([[1, 3], [2, -1]])
    clean = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    mask = block_diffusion_attention_mask(anchors, clean, BLOCK)[:, 0]
    span, length = BLOCK - 1, 6
    assert mask.shape == (2, 2 * span, length + 2 * span)
    for b in range(2):
        for k in range(2):
            for j in range(span):
                row = mask[b, k * span + j]
                for t in range(length):
                    assert row[t] == (t <= anchors[b, k] and clean[b, t] == 1), (b, k, j, t)
                for k2 in range(2):
                    for j2 in range(span):
                        assert row[length + k2 * span + j2] == (k2 == k)


@pytest.mark.parametrize("mask_ratio", [(1.0, 1.0), (0.3, 0.7)])
def test_losses_match_a_direct_computation(target, dataset, mask_ratio):
    drafter = _drafter(target)
    torch.manual_seed(3)
    collator = D3DDataCollator(BLOCK, anchors_per_sequence=3, mask_ratio=mask_ratio, max_length=64)
    batch = collator([dataset[i] for i in (0, 5, 12)])
    gamma = 2.0
    with torch.no_grad():
        got = d3d_losses(drafter, batch, block_size=BLOCK, gamma=gamma)

    # direct: one sequence and one block at a time, through the inference attention mask
    block_num = block_den = 0.0
    ar_terms = []
    for b in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][b].sum())
        x = batch["input_ids"][b, :n]
        start = int(batch["response_start"][b])
        if n > 1:
            with torch.no_grad():
                logits = drafter(x[None]).logits[0]
            for t in range(max(start - 1, 0), n - 1):
                ar_terms.append(F.cross_entropy(logits[t], x[t + 1]))
        for k, a in enumerate(batch["anchors"][b].tolist()):
            if a < 0:
                continue
            masked = batch["block_masked"][b, k].clone()
            block_tokens = []
            for j in range(1, BLOCK):
                if a + j >= n:
                    masked[j - 1] = True
                block_tokens.append(0 if masked[j - 1] else int(x[a + j]))
            ids = torch.cat([x[: a + 1], torch.tensor(block_tokens)])[None]
            mpos = torch.zeros_like(ids, dtype=torch.bool)
            mpos[0, a + 1 :] = masked
            bpos = torch.zeros_like(mpos)
            bpos[0, a + 1 :] = True
            attn = draft_attention_mask(a + 1, BLOCK - 1, 0)
            with torch.no_grad():
                logits = drafter(ids, masked_positions=mpos, block_positions=bpos, attention_mask=attn).logits[0]
            for j in range(1, BLOCK):
                next_masked = j == BLOCK - 1 or bool(masked[j])
                if a + j + 1 < n and next_masked:
                    w = torch.exp(torch.tensor(-j / gamma))
                    block_num += w * F.cross_entropy(logits[a + j], x[a + j + 1])
                    block_den += w
    torch.testing.assert_close(got["block_loss"], block_num / block_den, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["ar_loss"], torch.stack(ar_terms).mean(), rtol=1e-4, atol=1e-5)
    assert int(got["ar_tokens"]) == len(ar_terms)


def test_degenerate_batches_give_finite_zero_losses(target):
    drafter = _drafter(target)
    collator = D3DDataCollator(BLOCK, anchors_per_sequence=2, max_length=64)
    batch = collator([{"prompt_ids": [3], "response_ids": []}, {"prompt_ids": [], "response_ids": [4]}])
    losses = d3d_losses(drafter, batch, block_size=BLOCK, gamma=7.0)
    assert torch.isfinite(losses["block_loss"]) and float(losses["block_loss"]) == 0.0
    assert int(losses["block_tokens"]) == 0


def _training_config(tmp_path, **kwargs):
    """A few CPU steps: what the presets below share; `kwargs` override it."""
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=5e-3, logging_steps=1,
                    save_strategy="no", use_cpu=True, seed=7, anchors_per_sequence=3, disable_tqdm=True)
    defaults.update(kwargs)
    return D3DTrainingConfig(**defaults)


def _config(tmp_path, **kwargs):
    return _training_config(tmp_path, **{"max_steps": 4, "block_lora_rank": 4, **kwargs})


@pytest.mark.parametrize("mode", ["block_adapter", "full", "peft"])
def test_loss_logged_and_every_trainable_parameter_changes(target, dataset, tmp_path, mode):
    drafter = _drafter(target)
    trainer = D3DTrainer(drafter, _config(tmp_path, train_mode=mode), train_dataset=dataset, processing_class=TOKENIZER)
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(k in logged[0] for k in ("block_loss", "ar_loss"))
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n, p in trainable.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, unchanged
    if mode == "block_adapter":
        assert all(drafter.is_drafter_specific(n) for n in trainable)
        # the committed-context path is untouched: the first draft token is still the target's
        ids = random_prompt(7, seed=40)
        from d3d_hf import D3DCache

        with torch.no_grad():
            torch.testing.assert_close(drafter.draft_logits(ids, D3DCache())[:, 0], target(ids).logits[:, -1])


def test_bad_config_raises(tmp_path):
    with pytest.raises(ValueError, match="train_mode"):
        _config(tmp_path, train_mode="everything")
    with pytest.raises(ValueError, match="mask_ratio"):
        _config(tmp_path, mask_ratio_min=0.0)


def test_resume_gives_the_same_state(target, dataset, tmp_path):
    full = D3DTrainer(
        _drafter(target), _config(tmp_path / "a", max_steps=4), train_dataset=dataset, processing_class=TOKENIZER,
    )
    full.train()
    first = D3DTrainer(_drafter(target), _config(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2),
                       train_dataset=dataset, processing_class=TOKENIZER)
    first.train()
    resumed = D3DTrainer(
        _drafter(target), _config(tmp_path / "b", max_steps=4), train_dataset=dataset, processing_class=TOKENIZER,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    want = dict(full.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_block_adapter_drafter_saves_only_its_own_weights(target, dataset, tmp_path):
    drafter = _drafter(target, shares_target_weights=True)
    D3DTrainer(drafter, _config(tmp_path, max_steps=2), train_dataset=dataset, processing_class=TOKENIZER).train()
    drafter.save_pretrained(tmp_path / "out")
    from transformers import AutoModel

    loaded = AutoModel.from_pretrained(tmp_path / "out")
    loaded.attach_target_weights(target)
    ids = random_prompt(6, seed=50)
    from d3d_hf import D3DCache

    # matmul layouts still being timed alternate kernels between calls (last-bit differences): compare on `x W^T`
    loaded.model.autotune_matmuls = drafter.model.autotune_matmuls = False
    assert torch.equal(loaded.draft_logits(ids, D3DCache()), drafter.draft_logits(ids, D3DCache()))
    size = (tmp_path / "out" / "model.safetensors").stat().st_size
    assert size < 0.2 * sum(p.numel() * 4 for p in target.parameters())


def test_block_lora_modules_choose_the_projections_adapted(target, dataset, tmp_path):
    """A capacity option (issue 35): new block adapters on the MLP only; the others stay plain and nothing of theirs
    trains; the saved drafter records the modules."""
    drafter = _drafter(target, shares_target_weights=True)
    mlp = ["gate_proj", "up_proj", "down_proj"]
    config = _config(tmp_path, max_steps=2, block_lora_modules=mlp)
    trainer = D3DTrainer(drafter, config, train_dataset=dataset, processing_class=TOKENIZER)
    adapted = {n.rsplit(".", 2)[-2] for n, p in drafter.named_parameters() if p.requires_grad and "lora_" in n}
    assert adapted == set(mlp) and drafter.config.block_lora_modules == mlp
    trainer.train()
    drafter.save_pretrained(tmp_path / "out")
    import json

    assert json.loads((tmp_path / "out" / "config.json").read_text())["block_lora_modules"] == mlp
    ids = random_prompt(6, seed=70)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter.eval(), max_new_tokens=12,
                          do_sample=False)  # fmt: skip
    assert torch.equal(out, ref)
    # the list is checked, accepted comma-separated as the CLI may pass it, and must match existing adapters
    assert _config(tmp_path, block_lora_modules="gate_proj, up_proj").block_lora_modules == ["gate_proj", "up_proj"]
    for bad in (["gate"], [], ["up_proj", "up_proj"]):
        with pytest.raises(ValueError, match="block_lora_modules"):
            _config(tmp_path, block_lora_modules=bad)
    with pytest.raises(ValueError, match="already has block adapters on"):
        D3DTrainer(drafter, _config(tmp_path, block_lora_modules=["q_proj"]), train_dataset=dataset,
                   processing_class=TOKENIZER)  # fmt: skip


def test_peft_adapter_round_trip(target, dataset, tmp_path):
    from peft import PeftModel

    drafter = _drafter(target)
    trainer = D3DTrainer(
        drafter, _config(tmp_path, train_mode="peft", max_steps=2), train_dataset=dataset, processing_class=TOKENIZER,
    )
    trainer.train()
    trainer.model.save_pretrained(tmp_path / "adapter")
    ids = random_prompt(6, seed=60)
    from d3d_hf import D3DCache

    want = trainer.model.base_model.model.draft_logits(ids, D3DCache())
    reloaded = PeftModel.from_pretrained(_drafter(target), tmp_path / "adapter")
    got = reloaded.base_model.model.draft_logits(ids, D3DCache())
    torch.testing.assert_close(got, want)
    # the fully trained mask embedding travelled with the adapter
    assert not torch.equal(reloaded.base_model.model.model.mask_token_embedding(),
                           _drafter(target).model.mask_token_embedding())


def test_two_processes_match_one_process_with_doubled_accumulation(tmp_path):
    """2 CPU processes (torch.distributed, gloo; what `accelerate launch` starts) give the loss curve and weights of
    1 process with 2 gradient-accumulation steps."""
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parent / "scripts" / "train_tiny.py")
    common = ["--per-device", "1"]
    for attempt in range(2):
        two = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, *common, "--accum", "1",
             "--out", str(tmp_path / "two.json"), "--output-dir", str(tmp_path / f"two{attempt}")],
            capture_output=True, text=True, timeout=600, check=False,
        )
        # one retry only when a worker was killed by a signal (seen rarely on a heavily loaded 2-core machine,
        # "terminate called without an active exception"); any other failure, or a second one, fails the test
        if two.returncode == 0 or "exitcode: -" not in two.stderr:
            break
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, script, *common, "--accum", "2", "--out", str(tmp_path / "one.json"),
         "--output-dir", str(tmp_path / "one")],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    _assert_two_processes_match_one(tmp_path)


@pytest.mark.slow
def test_accelerate_launch_two_processes_match_one_process_with_doubled_accumulation(tmp_path):
    """`accelerate launch --config_file examples/accelerate/multi_cpu.yaml` (2 CPU processes, gloo) gives the loss
    curve and weights of 1 process with 2 gradient-accumulation steps (about 1 minute on 2 busy cores: marked slow)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = str(root / "tests" / "scripts" / "train_tiny.py")
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    config = str(root / "examples" / "accelerate" / "multi_cpu.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run(
        [*accelerate, "--config_file", config, script, "--per-device", "1", "--accum", "1",
         "--out", str(tmp_path / "two.json"), "--output-dir", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=600, check=False, env=env,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, script, "--per-device", "1", "--accum", "2", "--out", str(tmp_path / "one.json"),
         "--output-dir", str(tmp_path / "one")],
        capture_output=True, text=True, timeout=600, check=False, env=env,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    _assert_two_processes_match_one(tmp_path)


def test_ar_loss_has_no_gradient_on_block_adapters(target, dataset):
    """Why the shipped recipe uses ar_loss_weight 0: with block adapters (gated to block positions) and a frozen
    shared path, the next-token loss on the clean stream does not depend on any trainable parameter, so every
    ar_loss_weight trains the same drafter (the ablation is exact, not measured)."""
    drafter = _drafter(target)
    drafter.add_block_adapter(4)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "lora_B" in name:
                p.normal_()  # non-zero adapters, so the block path really depends on them
    trainable = [p for n, p in drafter.named_parameters() if drafter.is_drafter_specific(n)]
    collator = D3DDataCollator(BLOCK, anchors_per_sequence=3, mask_ratio=(0.5, 1.0), max_length=64)
    batch = collator([dataset[i] for i in (0, 5)])
    losses = d3d_losses(drafter, batch, block_size=BLOCK, gamma=2.0)
    ar_grads = torch.autograd.grad(losses["ar_loss"], trainable, allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in ar_grads)
    block_grads = torch.autograd.grad(losses["block_loss"], trainable, allow_unused=True)
    assert sum(int(torch.count_nonzero(g)) for g in block_grads if g is not None) > 0


# ----------------------------------------------------------------------------------------------------------------------
# the autoregressive-only objective: the baseline assistant (ar-assist) and its recipe


RECIPE = Path(__file__).resolve().parents[1] / "examples" / "train_ar_assistant.sh"


@pytest.fixture(scope="module")
def ar_dataset(target):
    return Dataset.from_list(_answered_rows(target, 8))


def _ar_config(tmp_path, **kwargs):
    """The autoregressive-only objective: the block loss off, every weight trained."""
    defaults = {"max_steps": 3, "train_mode": "full", "block_loss_weight": 0.0, "ar_loss_weight": 1.0}
    return _training_config(tmp_path, **{**defaults, **kwargs})


def test_config_allows_the_ar_loss_alone_and_rejects_what_cannot_train(tmp_path):
    assert _ar_config(tmp_path).block_loss_weight == 0.0
    with pytest.raises(ValueError, match="block adapters do not affect"):
        _ar_config(tmp_path, train_mode="block_adapter")
    with pytest.raises(ValueError, match="both 0"):
        _ar_config(tmp_path, ar_loss_weight=0.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        _ar_config(tmp_path, block_loss_weight=-1.0)


def test_losses_without_blocks_skip_the_noisy_pass(target, ar_dataset):
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    batch = D3DDataCollator(block_size=4, anchors_per_sequence=3)(list(ar_dataset))
    full = d3d_losses(drafter, batch, block_size=4, gamma=7.0)
    ar_only = d3d_losses(drafter, batch, block_size=4, gamma=7.0, compute_block=False)
    torch.testing.assert_close(ar_only["ar_loss"], full["ar_loss"])
    assert float(ar_only["block_loss"]) == 0.0 and int(ar_only["block_tokens"]) == 0
    assert int(full["block_tokens"]) > 0


@pytest.mark.parametrize("mode", ["full", "peft"])
def test_ar_only_training_changes_every_trainable_parameter(target, ar_dataset, tmp_path, mode):
    torch.manual_seed(0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=2, block_size=4)
    trainer = D3DTrainer(
        drafter, _ar_config(tmp_path, train_mode=mode), train_dataset=ar_dataset, processing_class=TOKENIZER,
    )
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and not any("mask_embedding" in n for n in trainable)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(h["block_loss"] == 0.0 and h["ar_loss"] > 0 for h in logged)
    after = dict(trainer.model.named_parameters())
    assert not [n for n, p in trainable.items() if torch.equal(p, after[n].detach())]


def _recipe_command(name: str) -> list[str]:
    """The `d3d-hf NAME ...` command of the recipe, continuation lines joined, split like the shell would."""
    text = RECIPE.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith(f"d3d-hf {name} "))
    return shlex.split(line)[2:]


def _override(argv: list[str], **values: str) -> list[str]:
    out = list(argv)
    for flag, value in values.items():
        out[out.index(f"--{flag}") + 1] = value
    return out


def test_recipe_trains_and_exports_an_assistant_on_a_tiny_target(target, ar_dataset, tmp_path):
    """examples/train_ar_assistant.sh's own train and export flags, with a tiny target, its data and 2 steps."""
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    ar_dataset.save_to_disk(str(tmp_path / "data" / "dataset"))
    train = _recipe_command("train")
    assert "--block_loss_weight" in train and train[train.index("--block_loss_weight") + 1] == "0"
    train = _override(
        train,
        target=str(tmp_path / "target"),
        data=str(tmp_path / "data"),
        output_dir=str(tmp_path / "run"),
        max_steps="2",
        num_layers="2",
        threads="1",
    )
    assert train_main(train + ["--disable_tqdm", "true", "--report_to", "none"]) == 0
    export = _override(
        _recipe_command("export-causal-lm"), drafter=str(tmp_path / "run"), output=str(tmp_path / "assistant")
    )
    assert main(["export-causal-lm", *export]) == 0
    assistant = AutoModelForCausalLM.from_pretrained(tmp_path / "assistant")
    assert isinstance(assistant, LlamaForCausalLM) and assistant.config.num_hidden_layers == 2
    assert (tmp_path / "assistant" / "tokenizer.json").is_file()
    ids = random_prompt(7, seed=6)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, assistant_model=assistant, **kwargs), target.generate(ids, **kwargs))


# ----------------------------------------------------------------------------------------------------------------------
# edges: sequences shorter than a block, blocks with nothing or everything masked, nothing to score


EDGE_BLOCK = 6


def _edge_drafter(target, **kwargs):
    return _drafter(target, block_size=EDGE_BLOCK, **kwargs)


def _assert_finite_with_finite_grads(drafter, batch):
    drafter.train()
    drafter.zero_grad()
    losses = d3d_losses(drafter, batch, block_size=EDGE_BLOCK, gamma=7.0)
    loss = losses["block_loss"] + 0.5 * losses["ar_loss"]
    assert torch.isfinite(losses["block_loss"]) and torch.isfinite(losses["ar_loss"])
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    return losses


@pytest.mark.parametrize("mask_ratio", [(1.0, 1.0), (0.4, 0.6)])
def test_sequences_shorter_than_a_block(target, mask_ratio):
    drafter = _edge_drafter(target)
    collator = D3DDataCollator(EDGE_BLOCK, anchors_per_sequence=3, mask_ratio=mask_ratio, max_length=64)
    rows = [
        {"prompt_ids": [3], "response_ids": [4]},
        {"prompt_ids": [3, 5], "response_ids": [6, 7]},
        {"prompt_ids": [], "response_ids": [8, 9, 10]},
        {"prompt_ids": [3, 4, 5], "response_ids": []},
        {"prompt_ids": [], "response_ids": []},
    ]
    batch = collator(rows)
    losses = _assert_finite_with_finite_grads(drafter, batch)
    assert int(losses["block_tokens"]) > 0 and int(losses["ar_tokens"]) > 0


@pytest.mark.parametrize("masked", [False, True], ids=["nothing_masked", "everything_masked"])
def test_blocks_with_nothing_or_everything_masked(target, masked):
    drafter = _edge_drafter(target)
    collator = D3DDataCollator(EDGE_BLOCK, anchors_per_sequence=3, max_length=64)
    rows = [
        {"prompt_ids": random_prompt(4, seed=i)[0].tolist(), "response_ids": list(range(10, 13 + 4 * i))}
        for i in range(3)
    ]
    batch = collator(rows)
    batch["block_masked"] = torch.full_like(batch["block_masked"], masked)
    losses = _assert_finite_with_finite_grads(drafter, batch)
    # scored: block position j of anchor a predicts token a+j+1, when it exists and the block does not show it
    lengths = batch["attention_mask"].sum(-1).tolist()
    expected = sum(
        a + j + 1 < lengths[b] and (masked or j == EDGE_BLOCK - 1)
        for b, row in enumerate(batch["anchors"].tolist())
        for a in row
        if a >= 0
        for j in range(1, EDGE_BLOCK)
    )
    assert expected > 0 and int(losses["block_tokens"]) == expected


def _edge_config(tmp_path, **kwargs):
    defaults = {"max_steps": 2, "per_device_train_batch_size": 2, "anchors_per_sequence": 2, "block_lora_rank": 4,
                "report_to": "none"}
    return _training_config(tmp_path, **{**defaults, **kwargs})


@pytest.mark.parametrize("mode", ["block_adapter", "full"])
def test_training_on_batches_with_nothing_to_score(target, tmp_path, mode):
    """Every row too short for a block or a next-token target: the losses are zero and stay on the graph (a
    collator's batch can be so), and `D3DTrainer` refuses such rows before any step rather than train on nothing."""
    from datasets import Dataset

    rows = Dataset.from_list([{"prompt_ids": [3 + i], "response_ids": []} for i in range(4)])
    drafter = _edge_drafter(target)
    batch = D3DDataCollator(EDGE_BLOCK, anchors_per_sequence=2)([rows[0], rows[1]])
    losses = d3d_losses(drafter, batch, block_size=EDGE_BLOCK, gamma=7.0)
    assert float(losses["block_loss"].detach()) == float(losses["ar_loss"].detach()) == 0.0
    assert losses["block_loss"].requires_grad, "a zero loss must stay on the graph so that backward works"
    config = _edge_config(tmp_path, train_mode=mode, logging_nan_inf_filter=False)
    with pytest.raises(ValueError, match=r"4 of 4 rows of `train_dataset` have an empty `response_ids`"):
        D3DTrainer(drafter, config, train_dataset=rows, processing_class=TOKENIZER)


# ----------------------------------------------------------------------------------------------------------------------
# runs killed while writing a checkpoint


def _edge_dataset(target):
    return Dataset.from_list(_answered_rows(target, 6, same_length=True))


@pytest.mark.parametrize("crash_in", ["weights", "optimizer", "trainer_state"])
def test_resume_never_picks_a_half_written_checkpoint(target, tmp_path, monkeypatch, crash_in):
    """A run killed while writing checkpoint-4 (in the weights, the optimizer state, or the trainer state written
    last): `resume_from_checkpoint=True` resumes from checkpoint-2 and ends exactly where an uninterrupted run ends."""
    import transformers.trainer

    dataset = _edge_dataset(target)
    full = D3DTrainer(
        _edge_drafter(target), _edge_config(tmp_path / "full", max_steps=4), train_dataset=dataset,
        processing_class=TOKENIZER,
    )
    full.train()

    run = tmp_path / "run"
    saves = _edge_config(run, max_steps=4, save_strategy="steps", save_steps=2)
    crashed = D3DTrainer(_edge_drafter(target), saves, train_dataset=dataset, processing_class=TOKENIZER)
    with monkeypatch.context() as patch:
        if crash_in == "weights":
            real_save = D3DForDiffusionDrafting.save_pretrained

            def save(self, folder, *args, **kwargs):
                if str(folder).endswith("checkpoint-4"):
                    crash_safetensors_writer(patch)
                return real_save(self, folder, *args, **kwargs)

            patch.setattr(D3DForDiffusionDrafting, "save_pretrained", save)
        elif crash_in == "optimizer":
            real_torch_save = torch.save

            def torch_save(obj, f, *args, **kwargs):
                if "checkpoint-4" in str(f) and str(f).endswith("optimizer.pt"):
                    raise KeyboardInterrupt("killed while writing the optimizer state")
                return real_torch_save(obj, f, *args, **kwargs)

            patch.setattr(torch, "save", torch_save)
        else:
            real_state_save = transformers.trainer.TrainerState.save_to_json

            def state_save(self, path):
                if "checkpoint-4" in str(path):
                    with open(path, "w") as f:
                        f.write('{"global_step": 4, "log_hi')
                    raise KeyboardInterrupt("killed while writing the trainer state")
                return real_state_save(self, path)

            patch.setattr(transformers.trainer.TrainerState, "save_to_json", state_save)
        with pytest.raises(KeyboardInterrupt):
            crashed.train()
    assert (run / "checkpoint-4").is_dir() and not is_complete_checkpoint(run / "checkpoint-4")
    assert last_complete_checkpoint(run) == str(run / "checkpoint-2")

    resumed = D3DTrainer(
        _edge_drafter(target), _edge_config(run, max_steps=4), train_dataset=dataset, processing_class=TOKENIZER,
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    want = dict(full.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, want[name], rtol=1e-5, atol=1e-6, msg=name)

    again = D3DTrainer(
        _edge_drafter(target), _edge_config(run, max_steps=4), train_dataset=dataset, processing_class=TOKENIZER,
    )
    shutil.rmtree(run / "checkpoint-4")
    (run / "checkpoint-4").mkdir()
    with pytest.raises(ValueError, match="checkpoint-4 is not a complete checkpoint.*checkpoint-2"):
        again.train(resume_from_checkpoint=str(run / "checkpoint-4"))


def test_train_command_resumes_from_the_last_complete_checkpoint(target, tmp_path, monkeypatch):
    """`d3d-hf train --resume_from_checkpoint auto` after a run killed while writing checkpoint-4 resumes from
    checkpoint-2 and saves the drafter an uninterrupted run saves."""
    import d3d_hf.targets
    from d3d_hf.training import D3DTrainScriptArguments, train_drafter

    _edge_dataset(target).save_to_disk(str(tmp_path / "data"))
    monkeypatch.setattr(d3d_hf.targets, "load_target", lambda name, dtype="float32": (target, TOKENIZER))
    script = D3DTrainScriptArguments(
        target="tiny", data=str(tmp_path / "data"), tau_holdout=1, init_block_size=EDGE_BLOCK
    )

    def run(output, **kwargs):
        config = _edge_config(output, max_steps=4, save_strategy="steps", save_steps=2, **kwargs)
        return train_drafter(script, config)

    want = run(tmp_path / "full").drafter_state_dict()
    real_torch_save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        if "checkpoint-4" in str(f) and str(f).endswith("optimizer.pt"):
            raise KeyboardInterrupt("killed while writing the optimizer state")
        return real_torch_save(obj, f, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", torch_save)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path / "run")
    got = run(tmp_path / "run", resume_from_checkpoint="auto").drafter_state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def _assert_two_processes_match_one(tmp_path):
    """The 2-process run (two.json) and the 1-process run with doubled accumulation (one.json) of
    tests/scripts/train_tiny.py have the same 5 losses and trained weights."""
    import json

    two_run = json.loads((tmp_path / "two.json").read_text())
    one_run = json.loads((tmp_path / "one.json").read_text())
    assert two_run["world_size"] == 2 and one_run["world_size"] == 1
    assert len(two_run["loss"]) == len(one_run["loss"]) == 5
    assert two_run["loss"] == pytest.approx(one_run["loss"], rel=1e-4)
    assert two_run["param_sums"] == pytest.approx(one_run["param_sums"], rel=1e-4, abs=1e-4)


def test_tau_during_training_measures_the_drafter_not_the_engine(target, dataset, tmp_path, monkeypatch):
    """measure_tau verifies a full block every round whatever the engine's default (the cost-aware engine would mix
    in target steps and lookup rounds chosen by this machine's timings)."""
    drafter = _drafter(target)  # the default engine is the adaptive one
    config = _config(tmp_path, max_steps=1, tau_eval_steps=1, tau_eval_max_new_tokens=12)
    trainer = D3DTrainer(drafter, config, train_dataset=dataset, processing_class=TOKENIZER, target=target,
                         tau_prompts=[random_prompt(6, seed=70)])
    tau = trainer.measure_tau()
    stats = drafter.last_generation_stats
    assert stats.policy == str(drafter.config.block_size - 1)
    assert "lookup" not in stats.round_sources and stats.round_sources[:-1] == ["drafter"] * (stats.rounds - 1)
    assert tau == stats.tau


# ----------------------------------------------------------------------------------------------------------------------
# distillation on the target's logits (distill_weight)


def test_distill_loss_reads_the_target_where_the_block_is_scored_and_the_clean_stream_gives_it_free(
    target, dataset, monkeypatch
):
    """The teacher distribution of each scored block position is the target's next-token distribution at the right
    place: on rows that are the target's own greedy answers its argmax is the very token the position is scored on.
    For a drafter on the target's own weights (block adapters) the clean stream gives the same distribution as a
    separate target forward, so distillation costs no extra pass. `distill_loss` is a KL: >= 0, and 0 only where the
    drafter matches."""
    from d3d_hf.training import objective

    drafter = _drafter(target, block_lora_rank=2)
    collator = D3DDataCollator(BLOCK, anchors_per_sequence=3, max_length=64)
    torch.manual_seed(3)
    batch = collator([dataset[i] for i in range(4)])
    seen = []
    original = objective._teacher_log_probs

    def recording(drafter_, teacher, clean, inputs, rows, positions):
        out = original(drafter_, teacher, clean, inputs, rows, positions)
        seen.append((rows, positions, out))
        return out

    monkeypatch.setattr(objective, "_teacher_log_probs", recording)
    scored_targets = []
    cross_entropy = F.cross_entropy

    def recording_ce(logits, labels, *args, **kwargs):
        if kwargs.get("reduction") == "none":  # the block loss: its labels are the scored block tokens
            scored_targets.append(labels)
        return cross_entropy(logits, labels, *args, **kwargs)

    monkeypatch.setattr(F, "cross_entropy", recording_ce)
    with torch.no_grad():
        free = d3d_losses(drafter, batch, BLOCK, gamma=7.0, distill=True)
        paid = d3d_losses(drafter, batch, BLOCK, gamma=7.0, distill=True, teacher=target)
    assert free["distill_loss"] > 0
    torch.testing.assert_close(free["distill_loss"], paid["distill_loss"], rtol=1e-5, atol=1e-6)
    rows, positions, logp = seen[1]
    assert len(rows) == int(free["block_tokens"]) > 0
    assert torch.equal(logp.argmax(-1), scored_targets[1])  # the target's greedy answer is its own argmax
    torch.testing.assert_close(seen[0][2], logp, rtol=1e-5, atol=1e-5)


def test_distill_weight_trains_a_standalone_drafter_with_the_target_as_teacher(target, dataset, tmp_path):
    drafter = _drafter(target, num_layers=2)
    config = _config(tmp_path, train_mode="full", distill_weight=1.0, ar_loss_weight=0.5)
    with pytest.raises(ValueError, match="pass `target=`"):
        D3DTrainer(drafter, config, train_dataset=dataset, processing_class=TOKENIZER)
    trainer = D3DTrainer(drafter, config, train_dataset=dataset, processing_class=TOKENIZER, target=target)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(h["distill_loss"] > 0 for h in logged)
    assert not any(p.requires_grad for p in target.parameters())
    with pytest.raises(ValueError, match="distill_weight"):
        D3DTrainingConfig(output_dir=str(tmp_path / "x"), distill_weight=-1.0)
    with pytest.raises(ValueError, match="block_loss_weight > 0"):
        D3DTrainingConfig(output_dir=str(tmp_path / "x"), distill_weight=1.0, block_loss_weight=0.0, train_mode="full")
