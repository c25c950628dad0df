"""D3DTrainer on TRL (d3d_hf.training on trl.SFTTrainer): TRL-format datasets (conversational, prompt-completion,
text) train a tiny drafter with and without `peft_config`; TRL's label masks become the objective's `loss_mask`;
PEFT drafters saved merged or as an adapter folder load through `load_drafter`, `AutoModel` and `d3d-hf bench`;
`d3d-hf train --config FILE.yaml` and `d3d-hf data` output; evaluation prompts are refused."""

import json
import shutil

import pytest
import torch
from _tiny import random_prompt, tiny_target, tiny_tokenizer
from datasets import Dataset, load_dataset
from peft import LoraConfig
from transformers import AutoModel

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.cli import main
from d3d_hf.drafters import load_drafter
from d3d_hf.training import D3DDataCollator, D3DTrainer, D3DTrainingConfig, d3d_losses

BLOCK = 4
# a chat template with generation markers (TRL's assistant-only loss): "t1" ends a user turn, "t2" an answer
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} t2 {% endgeneration %}"
    "{% else %}{{ m['content'] }} t1 {% endif %}{% endfor %}"
)


def _tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# ids whose words the tokenizer reads back: `tiny_tokenizer` matches its special tokens t0/t1/t2 inside words too
# ("t14" -> t1, unk), so the texts use only t3..t9 and t30..t96
WORD_IDS = [i for i in range(3, 97) if not str(i).startswith(("1", "2"))]
OTHER_IDS = [i for i in range(97) if i not in WORD_IDS]


def _words(ids) -> str:
    return " ".join(f"t{i}" for i in ids)


def _prompt(length: int, seed: int) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor(WORD_IDS)[torch.randint(len(WORD_IDS), (1, length), generator=g)]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=4, sharpen=10.0)


@pytest.fixture(scope="module")
def answers(target):
    """240 (prompt ids, greedy answer ids) pairs of the target, in `WORD_IDS` only (the answers are the target's
    greedy choice among them)."""
    pairs = []
    for i in range(240):
        prompt = _prompt(4 + i % 3, seed=1000 + i)
        out = target.generate(
            prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0, suppress_tokens=OTHER_IDS
        )
        pairs.append((prompt[0].tolist(), out[0, prompt.shape[1] :].tolist()))
    return pairs


@pytest.fixture(scope="module")
def conversations(answers):
    """A TRL conversational dataset (`messages`): 240 rows, every fourth with two user/assistant turns."""
    rows = []
    for i, (prompt, answer) in enumerate(answers):
        messages = [{"role": "user", "content": _words(prompt)}, {"role": "assistant", "content": _words(answer)}]
        if i % 4 == 3:
            follow, reply = answers[(i + 1) % len(answers)]
            messages += [{"role": "user", "content": _words(follow)}, {"role": "assistant", "content": _words(reply)}]
        rows.append({"messages": messages})
    return Dataset.from_list(rows)


def _drafter(target):
    torch.manual_seed(0)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=BLOCK)
    with torch.no_grad():
        drafter.model.mask_embedding.weight.normal_()
    return drafter


def _config(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, learning_rate=5e-3, logging_steps=1,
        save_strategy="no", use_cpu=True, seed=7, anchors_per_sequence=3, block_lora_rank=4, disable_tqdm=True,
        report_to="none",
    )  # fmt: skip
    return D3DTrainingConfig(**{**defaults, **kwargs})


def _assert_lossless(target, drafter, seeds=(1, 2, 3)):
    """Greedy decoding with the drafter gives the target's own tokens (float32)."""
    for seed in seeds:
        ids = random_prompt(6, seed=seed)
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        want = target.generate(ids, **kwargs)
        assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), want), seed
    assert drafter.last_generation_stats is not None and drafter.last_generation_stats.rounds > 0


def _assert_trains(trainer):
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(k in logged[0] for k in ("block_loss", "ar_loss", "num_tokens"))
    assert all(h["loss"] > 0 for h in logged)
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n, p in trainable.items() if torch.equal(p, after[n].detach())]
    assert not unchanged, unchanged
    return trainable


@pytest.mark.parametrize("peft", [False, True], ids=["block_adapter", "peft_config"])
def test_conversational_dataset_trains_saves_and_decodes_losslessly(target, conversations, tmp_path, peft):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if peft else None
    trainer = D3DTrainer(
        _drafter(target),
        _config(tmp_path / "run", assistant_only_loss=True),
        train_dataset=conversations,
        processing_class=_tokenizer(),
        peft_config=peft_config,
    )
    assert trainer.args.train_mode == ("peft" if peft else "block_adapter")
    trainable = _assert_trains(trainer)
    if peft:
        assert any("lora_A.default" in n for n in trainable) and any("mask_embedding" in n for n in trainable)
        assert peft_config.modules_to_save is None  # the caller's config is left alone
    trainer.save_model(str(tmp_path / "out"))
    folder = tmp_path / "out"
    assert not (folder / "adapter_config.json").exists()  # merged: a plain drafter folder
    card = (folder / "README.md").read_text()
    assert "D3D drafter" in card and "trl" in card and "D3DTrainer (trl.SFTTrainer" in card
    loaded = load_drafter(str(folder))
    _assert_lossless(target, loaded)
    ids = random_prompt(6, seed=9)
    from d3d_hf import D3DCache

    with torch.no_grad():
        torch.testing.assert_close(
            loaded.draft_logits(ids, D3DCache()), trainer.drafter.draft_logits(ids, D3DCache()), rtol=1e-4, atol=1e-4
        )


def test_assistant_masks_become_the_loss_mask(target, conversations, tmp_path):
    """TRL tokenizes the conversations and masks the user turns (-100 labels); the collator's loss mask is exactly
    the assistant tokens, anchors only draft assistant tokens, and no block scores a user-turn token."""
    trainer = D3DTrainer(
        _drafter(target),
        _config(tmp_path, assistant_only_loss=True),
        train_dataset=conversations,
        processing_class=_tokenizer(),
    )
    rows = [trainer.train_dataset[i] for i in (0, 3, 7)]  # 3 and 7 have two turns
    batch = trainer.data_collator(rows)
    for b, row in enumerate(rows):
        labels = torch.tensor(row["labels"])
        n = len(labels)
        assert torch.equal(batch["loss_mask"][b, :n], labels != -100)
        assert not batch["loss_mask"][b, n:].any()
        # the assistant turns of the row, each with its end token t2, and nothing else
        answers = sum(len(m["content"].split()) + 1 for m in conversations[[0, 3, 7][b]]["messages"][1::2])
        assert int((labels != -100).sum()) == answers
        for a in batch["anchors"][b].tolist():
            assert a < 0 or batch["loss_mask"][b, a + 1]
    with torch.no_grad():
        losses = d3d_losses(trainer.drafter, batch, block_size=BLOCK, gamma=7.0)
    # scored block targets: position a+j+1 exists, is learned, and the block shows it masked (full masking here)
    lengths = batch["attention_mask"].sum(-1).tolist()
    expected = sum(
        a + j + 1 < lengths[b] and bool(batch["loss_mask"][b, a + j + 1])
        for b, anchors in enumerate(batch["anchors"].tolist())
        for a in anchors
        if a >= 0
        for j in range(1, BLOCK)
    )
    assert int(losses["block_tokens"]) == expected
    assert int(losses["ar_tokens"]) == int(batch["loss_mask"][:, 1:].sum())


def test_a_pretokenized_completion_row_is_the_d3d_data_row(target, answers):
    """`{input_ids, labels}` with the prompt masked gives the blocks and losses of the `{prompt_ids, response_ids}`
    row (`d3d-hf data`): the objective is the same whichever way the data came."""
    collator = D3DDataCollator(BLOCK, anchors_per_sequence=3, mask_ratio=(0.3, 0.9), max_length=64, seed=5)
    ours = [{"prompt_ids": p, "response_ids": r} for p, r in answers[:5]]
    trl_rows = [{"input_ids": p + r, "labels": [-100] * len(p) + r} for p, r in answers[:5]]
    a, b = collator(ours), collator(trl_rows)
    for key in ("input_ids", "attention_mask", "response_start", "anchors", "block_masked"):
        assert torch.equal(a[key], b[key]), key
    drafter = _drafter(target)
    with torch.no_grad():
        want, got = d3d_losses(drafter, a, BLOCK, 7.0), d3d_losses(drafter, b, BLOCK, 7.0)
    for key in ("block_loss", "ar_loss", "block_tokens", "ar_tokens"):
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("kind", ["prompt_completion", "text"])
def test_other_trl_dataset_formats_train(target, answers, tmp_path, kind):
    if kind == "prompt_completion":
        rows = [
            {
                "prompt": [{"role": "user", "content": _words(p)}],
                "completion": [{"role": "assistant", "content": _words(r)}],
            }
            for p, r in answers[:64]
        ]
    else:
        rows = [{"text": _words(p + r)} for p, r in answers[:64]]
    trainer = D3DTrainer(
        _drafter(target), _config(tmp_path, max_steps=3), train_dataset=Dataset.from_list(rows),
        processing_class=_tokenizer(),
    )  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[0]])
    prompt, answer = answers[0]
    if kind == "prompt_completion":  # completion-only loss: the answer and its end token
        assert int(batch["response_start"][0]) == len(prompt) + 1 and int(batch["loss_mask"].sum()) == len(answer) + 1
    else:  # a text row is learned whole (TRL appends the eos token)
        assert bool(batch["loss_mask"].all()) and batch["input_ids"].shape[1] == len(prompt) + len(answer) + 1
    _assert_trains(trainer)


def test_tau_prompts_of_trl_rows_end_before_the_last_answer():
    from d3d_hf.training.script import _tau_prompt

    tokenizer = _tokenizer()
    chat = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}]
    chat += [{"role": "user", "content": "t8"}, {"role": "assistant", "content": "t9 t30"}]
    assert _tau_prompt({"messages": chat}, tokenizer) == [5, 6, 1, 7, 2, 8, 1]
    assert _tau_prompt({"prompt": chat[:1], "completion": chat[1:2]}, tokenizer) == [5, 6, 1]
    assert _tau_prompt({"prompt": "t5 t6", "completion": " t7"}, tokenizer) == [5, 6]
    assert _tau_prompt({"prompt_ids": [3, 4], "response_ids": [5]}, tokenizer) == [3, 4]
    with pytest.raises(ValueError, match="--tau_eval_steps 0"):
        _tau_prompt({"text": "t5"}, tokenizer)


def test_config_refuses_what_the_objective_cannot_use(tmp_path):
    for option in ({"packing": True}, {"padding_free": True}, {"gradient_checkpointing": True}, {"loss_type": "dft"}):
        with pytest.raises(ValueError, match="does not support"):
            _config(tmp_path, **option)
    with pytest.raises(ValueError, match="max_length"):
        _config(tmp_path, max_length=1)
    config = _config(tmp_path)
    assert config.learning_rate == 5e-3 and not config.bf16 and not config.gradient_checkpointing


def test_trainer_needs_a_tokenizer_and_rejects_peft_with_full_training(target, conversations, tmp_path):
    with pytest.raises(ValueError, match="processing_class"):
        D3DTrainer(_drafter(target), _config(tmp_path), train_dataset=conversations)
    with pytest.raises(ValueError, match="train_mode='full'"):
        D3DTrainer(
            _drafter(target), _config(tmp_path, train_mode="full"), train_dataset=conversations,
            processing_class=_tokenizer(), peft_config=LoraConfig(r=2, target_modules=["q_proj"]),
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------------
# PEFT drafters: merged, or an adapter folder naming its base drafter


@pytest.fixture(scope="module")
def model_folders(target, tmp_path_factory):
    """`target/` (the tiny target with the chat tokenizer) and `prompts.jsonl` (two prompts) for the commands."""
    root = tmp_path_factory.mktemp("trl_models")
    target.save_pretrained(root / "target")
    _tokenizer().save_pretrained(root / "target")
    lines = [json.dumps({"prompt": _words(_prompt(6, seed=s)[0].tolist())}) for s in (20, 21)]
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _bench_is_lossless(model_folders, drafter_folder, tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "--target", str(model_folders / "target"), "--drafter", str(drafter_folder), "--methods"]
    argv += ["target,d3d", "--prompts", str(model_folders / "prompts.jsonl"), "--max-new-tokens", "8"]
    assert main([*argv, "--output", str(out), "--overwrite"]) == 0
    assert json.loads(out.read_text())["summary"]["d3d"]["lossless_match"] == 1.0


def test_peft_adapter_folder_loads_every_way(target, conversations, model_folders, tmp_path, monkeypatch):
    trainer = D3DTrainer(
        _drafter(target), _config(tmp_path / "run", train_mode="peft", peft_lora_rank=4, peft_save_merged=False),
        train_dataset=conversations, processing_class=_tokenizer(),
    )  # fmt: skip
    _assert_trains(trainer)
    saved = tmp_path / "saved" / "adapter"
    trainer.save_model(str(saved))
    adapter = json.loads((saved / "adapter_config.json").read_text())
    assert (saved / "adapter_model.safetensors").is_file()
    # the drafter was made in memory: its unadapted weights are saved into the folder itself (transformers' layout
    # for a local model with an embedded adapter), named relative to the folder
    assert (saved / "config.json").is_file() and (saved / "model.safetensors").is_file()
    assert adapter["base_model_name_or_path"] == "."
    assert "mask_embedding" in adapter["modules_to_save"]
    assert "D3DTrainer (trl.SFTTrainer" in (saved / "README.md").read_text()  # the drafter's card, not PEFT's
    # the folder is self-contained: moved, and loaded from another working directory, it loads every way
    folder = tmp_path / "moved"
    shutil.move(str(saved.parent), str(folder))
    folder = folder / "adapter"
    monkeypatch.chdir(tmp_path / "run")
    ids = random_prompt(6, seed=9)
    from d3d_hf import D3DCache

    with torch.no_grad():
        want = trainer.drafter.draft_logits(ids, D3DCache())
    # 1. d3d_hf.load_drafter (and so d3d-hf bench / generate): the adapter merged into its base
    import d3d_hf

    assert d3d_hf.load_drafter is load_drafter
    loaded = load_drafter(str(folder))
    assert type(loaded) is D3DForDiffusionDrafting
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert not any(isinstance(m, BaseTunerLayer) for m in loaded.modules())  # merged, plain layers
    with torch.no_grad():
        torch.testing.assert_close(loaded.draft_logits(ids, D3DCache()), want, rtol=1e-4, atol=1e-4)
    _assert_lossless(target, loaded)
    _bench_is_lossless(model_folders, folder, tmp_path)
    # 2. transformers' own PEFT integration: AutoModel.from_pretrained on the adapter folder
    auto = AutoModel.from_pretrained(str(folder), trust_remote_code=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(auto.draft_logits(ids, D3DCache()), want, rtol=1e-4, atol=1e-4)
    _assert_lossless(target, auto)
    # 3. PEFT itself, over the base drafter
    from peft import PeftModel

    from d3d_hf.drafters import _load_base_without_adapter

    base = _load_base_without_adapter(str(folder), torch.float32, "cpu")
    with torch.no_grad():
        assert not torch.allclose(base.draft_logits(ids, D3DCache()), want, rtol=1e-4, atol=1e-4)
    peft_model = PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            peft_model.base_model.model.draft_logits(ids, D3DCache()), want, rtol=1e-4, atol=1e-4
        )
    # 4. a folder saved before the embedded layout (base in `base_drafter/`, named by absolute path), then moved
    legacy = tmp_path / "legacy" / "adapter"
    (legacy / "base_drafter").mkdir(parents=True)
    for item in folder.iterdir():
        inside = item.name.startswith("adapter_") or item.name == "README.md"
        shutil.copy2(item, legacy / item.name if inside else legacy / "base_drafter" / item.name)
    old_place = tmp_path / "old" / "adapter" / "base_drafter"
    (legacy / "adapter_config.json").write_text(json.dumps({**adapter, "base_model_name_or_path": str(old_place)}))
    with torch.no_grad():
        torch.testing.assert_close(load_drafter(str(legacy)).draft_logits(ids, D3DCache()), want, rtol=1e-4, atol=1e-4)


def test_train_command_with_a_yaml_config_and_peft(model_folders, conversations, tmp_path):
    """`d3d-hf train --config FILE.yaml` on a conversational JSONL file (loaded with datasets' json builder), PEFT
    merged into the saved drafter; a flag spelled with dashes overrides the file."""
    import yaml

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in conversations.select(range(60))))
    config = {
        "target": str(model_folders / "target"), "data": str(data), "output_dir": str(tmp_path / "run"),
        "init_block_size": BLOCK, "tau_holdout": 1, "train_mode": "peft", "peft_lora_rank": 4,
        "assistant_only_loss": True, "max_steps": 5, "per_device_train_batch_size": 4, "learning_rate": 5e-3,
        "logging_steps": 1, "save_strategy": "no", "use_cpu": True, "report_to": "none", "disable_tqdm": True,
        "anchors_per_sequence": 3, "threads": 1, "tau_eval_steps": 2, "tau_eval_max_new_tokens": 6,
    }  # fmt: skip
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(tmp_path / "train.yaml"), "--max-steps", "2"]) == 0
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and [h for h in state["log_history"] if "block_loss" in h]
    # tau measured on the held-out row's prompt: its messages before the last answer, through the chat template
    assert [h["tau"] for h in state["log_history"] if "tau" in h][0] >= 1.0
    drafter = load_drafter(str(tmp_path / "run"))
    _assert_lossless(tiny_target("llama", seed=4, sharpen=10.0), drafter)
    assert "D3DTrainer (trl.SFTTrainer" in (tmp_path / "run" / "README.md").read_text()


def test_d3d_data_output_loads_as_json_and_trains(target, model_folders, tmp_path):
    """The shards `d3d-hf data` writes load with `datasets.load_dataset("json", ...)` and train directly, through the
    trainer and through `d3d-hf train --data 'DIR/shards/*.jsonl'`."""
    from d3d_hf.data import generate_dataset
    from d3d_hf.prompts import load_prompts

    prompts = load_prompts(str(model_folders / "prompts.jsonl"))
    generate_dataset(
        target, _tokenizer(), prompts, tmp_path / "data", max_new_tokens=10, progress=False, shard_format="jsonl"
    )
    rows = load_dataset("json", data_files=str(tmp_path / "data" / "shards" / "*.jsonl"), split="train")
    assert {"prompt_ids", "response_ids", "messages"} <= set(rows.column_names)
    trainer = D3DTrainer(
        _drafter(target), _config(tmp_path / "a", max_steps=2, per_device_train_batch_size=2), train_dataset=rows,
        processing_class=_tokenizer(),
    )  # fmt: skip
    assert trainer.train_dataset is rows  # the target's exact ids, not re-tokenized
    _assert_trains(trainer)
    argv = ["train", "--target", str(model_folders / "target"), "--data", str(tmp_path / "data" / "shards" / "*.jsonl")]
    argv += ["--output-dir", str(tmp_path / "b"), "--max_steps", "1", "--tau_holdout", "0", "--init-block-size", "4"]
    argv += ["--use_cpu", "--report_to", "none", "--disable_tqdm", "true", "--block_lora_rank", "2"]
    assert main(argv) == 0
    _assert_lossless(target, load_drafter(str(tmp_path / "b")))


def test_train_reads_token_shards_and_takes_the_first_max_samples_rows(target, model_folders, tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    """`d3d-hf train --data FOLDER` reads the token shards of a run without its final dataset (data committed as
    shards), `--max_samples N` trains on the first N rows outside the hold-out (a learning curve's prefixes), and
    `--skip_samples K` on the rows after the first K."""
    import shutil

    from d3d_hf.data import generate_dataset
    from d3d_hf.prompts import load_prompts
    from d3d_hf.training import trainer as trainer_module

    prompts = load_prompts(str(model_folders / "prompts.jsonl"))
    generate_dataset(target, _tokenizer(), prompts, tmp_path / "data", max_new_tokens=10, progress=False)
    shutil.rmtree(tmp_path / "data" / "dataset")
    seen = []
    original = trainer_module.D3DTrainer.__init__

    def recording(self, *args, train_dataset=None, **kwargs):
        seen.append([row["id"] for row in train_dataset])
        original(self, *args, train_dataset=train_dataset, **kwargs)

    monkeypatch.setattr(trainer_module.D3DTrainer, "__init__", recording)
    base = ["train", "--target", str(model_folders / "target"), "--data", str(tmp_path / "data"), "--max_steps", "1"]
    base += ["--tau_holdout", "0", "--init-block-size", "4", "--use_cpu", "--report_to", "none"]
    base += ["--disable_tqdm", "true", "--block_lora_rank", "2"]
    assert main([*base, "--output-dir", str(tmp_path / "a"), "--max_samples", "2"]) == 0
    first_two = seen[-1]
    assert len(first_two) == 2
    # `--skip_samples K` continues on the rows after the first K, `--max_samples` counting from there
    assert main([*base, "--output-dir", str(tmp_path / "s"), "--skip_samples", "1", "--max_samples", "1"]) == 0
    assert seen[-1] == first_two[1:]
    assert main([*base, "--output-dir", str(tmp_path / "c"), "--max_samples", str(len(prompts) + 1)]) == 2
    assert "--max_samples" in capsys.readouterr().err
    assert main([*base, "--output-dir", str(tmp_path / "d"), "--skip_samples", str(len(prompts))]) == 2
    assert "--skip_samples" in capsys.readouterr().err


def test_training_on_from_a_saved_drafter_records_where_it_came_from(target, model_folders, tmp_path, capsys,
                                                                     monkeypatch):  # fmt: skip
    """`d3d-hf train --drafter DIR`: the result's card names the drafter it went on from (with the steps and recipe
    that drafter's card recorded), the adapter rank it grew and the rows it trained on; it keeps the saved card's
    target and datasets, adds this run's data, and never carries the saved drafter's measured results. A rank below
    the saved one and rows that do not exist are refused before the target loads."""
    import d3d_hf.targets
    from d3d_hf.data import generate_dataset
    from d3d_hf.hub import DrafterCardData, MeasuredResult, load_card_data
    from d3d_hf.prompts import load_prompts

    prompts = load_prompts(str(model_folders / "prompts.jsonl"))
    generate_dataset(target, _tokenizer(), prompts, tmp_path / "data", max_new_tokens=10, progress=False)
    saved = _drafter(target)
    saved.add_block_adapter(2, alpha=4.0)
    saved.card_data = DrafterCardData(
        target_model="org/target", datasets=["org/rows"], training={"steps": 7, "recipe": "recipe.sh"},
        results=[MeasuredResult(prompts="humaneval", tau=9.9)],
    )  # fmt: skip
    saved.save_pretrained(tmp_path / "saved")
    base = ["train", "--target", str(model_folders / "target"), "--data", str(tmp_path / "data"), "--drafter"]
    base += [str(tmp_path / "saved"), "--max_steps", "1", "--tau_holdout", "0", "--use_cpu", "--report_to", "none"]
    base += ["--disable_tqdm", "true"]
    assert main([*base, "--output-dir", str(tmp_path / "on"), "--block_lora_rank", "4", "--skip_samples", "1"]) == 0
    card = load_card_data(tmp_path / "on")
    assert card.training["continued_from"] == f"{tmp_path / 'saved'} (its card: 7 steps, recipe.sh)"
    assert card.training["adapter_rank"] == "grown from 2 to 4 (expand_block_adapters)"
    assert card.training["training_rows"] == f"{tmp_path / 'data'}: rows 1-1"
    assert card.training["steps"] == 1 and card.results == [] and card.target_model == "org/target"
    assert card.datasets == ["org/rows", str(tmp_path / "data")]
    assert "9.9" not in (tmp_path / "on" / "README.md").read_text()

    def no_target(*args, **kwargs):
        raise AssertionError("the target loaded before the flags were checked")

    monkeypatch.setattr(d3d_hf.targets, "load_target", no_target)
    assert main([*base, "--output-dir", str(tmp_path / "low"), "--block_lora_rank", "1"]) == 2
    assert "below the drafter's adapter rank (2)" in capsys.readouterr().err
    assert main([*base, "--output-dir", str(tmp_path / "far"), "--skip_samples", "2"]) == 2
    assert "--skip_samples 2 leaves no rows" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# never on evaluation prompts


@pytest.mark.parametrize("evaluation_set", ["humaneval", "gsm8k", "mt-bench", "vicuna-bench"])
def test_trainer_refuses_evaluation_prompts(target, evaluation_set, tmp_path):
    from d3d_hf.prompts import load_prompts

    leaked = load_prompts(evaluation_set, limit=3)[2]
    rows = [{"messages": [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}]}] * 3
    rows.append({"messages": [*leaked.messages, {"role": "assistant", "content": "t7"}]})
    with pytest.raises(ValueError, match=f"evaluation prompt '{leaked.id}'"):
        D3DTrainer(
            _drafter(target), _config(tmp_path), train_dataset=Dataset.from_list(rows), processing_class=_tokenizer()
        )
    by_id = Dataset.from_list([{"id": leaked.id, "prompt_ids": [5], "response_ids": [6]}])
    with pytest.raises(ValueError, match="never train"):
        D3DTrainer(_drafter(target), _config(tmp_path), train_dataset=by_id, processing_class=_tokenizer())


def test_adapter_folder_names_a_base_drafter_that_has_a_folder(target, conversations, tmp_path, monkeypatch):
    """A drafter loaded from a folder is named by that folder's absolute path (found from any working directory);
    no copy of it is saved next to the adapter."""
    _drafter(target).save_pretrained(tmp_path / "base", tokenizer=_tokenizer())
    monkeypatch.chdir(tmp_path)
    trainer = D3DTrainer(
        load_drafter("base"), _config(tmp_path / "run", train_mode="peft", peft_lora_rank=2, max_steps=1,
                                      peft_save_merged=False),
        train_dataset=conversations, processing_class=_tokenizer(),
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert not (tmp_path / "adapter" / "base_drafter").exists()
    monkeypatch.chdir(tmp_path / "run")
    _assert_lossless(target, load_drafter(str(tmp_path / "adapter")))


def test_the_trainer_grows_a_drafters_adapters_to_a_higher_rank(target, conversations, tmp_path):
    """`block_lora_rank` above a drafter's own adapter rank grows them first (a warm start with more capacity):
    the drafts are unchanged before the first step, then every factor trains; unset keeps the rank; lower is refused."""
    drafter = _drafter(target)
    drafter.add_block_adapter(2, alpha=4.0)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    ids = random_prompt(6, seed=5)
    masked = torch.zeros_like(ids, dtype=torch.bool)
    masked[:, -3:] = True
    with torch.no_grad():
        before = drafter(ids, masked_positions=masked).logits
    rows = Dataset.from_list(list(conversations)[:8])
    with pytest.raises(ValueError, match=r"`block_lora_rank=1` is below the drafter's adapter rank \(2\)"):
        D3DTrainer(
            drafter, _config(tmp_path / "low", block_lora_rank=1), train_dataset=rows, processing_class=_tokenizer()
        )
    kept = D3DTrainer(
        drafter, _config(tmp_path / "own", block_lora_rank=None), train_dataset=rows, processing_class=_tokenizer()
    )
    assert kept.model.config.block_lora_rank == 2
    trainer = D3DTrainer(
        drafter,
        _config(tmp_path / "grow", max_steps=2, block_lora_rank=6),
        train_dataset=conversations,
        processing_class=_tokenizer(),
    )
    up = trainer.model.model.layers[0].mlp.up_proj
    assert trainer.model.config.block_lora_rank == 6 and up.lora_A.shape[0] == 6 and up.lora_B.shape[1] == 6
    with torch.no_grad():
        torch.testing.assert_close(trainer.model(ids, masked_positions=masked).logits, before, rtol=1e-5, atol=1e-5)
    trained = _assert_trains(trainer)
    assert any(name.endswith("mlp.up_proj.lora_B") for name in trained)
    assert up.lora_B[:, 2:].abs().sum() > 0  # the added columns learned
    _assert_lossless(target, trainer.model)
