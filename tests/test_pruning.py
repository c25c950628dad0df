"""Progressive layer pruning (d3d_hf.pruning) on tiny random targets."""

import json

import pytest
import torch
from _tiny import perturbed_drafter, random_prompt, tiny_target
from transformers import AutoModel

from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.pruning import (
    expand_block_adapters,
    layer_subset,
    offline_acceptance,
    plot_pruning_path,
    prune_drafter,
    pruned_drafter,
    target_continuations,
    truncate_block_adapters,
)


def _drafter(target, block_size=4, seed=0):
    return perturbed_drafter(target, block_size, seed=seed, scale=0.05).eval()


def _prompts(n=3):
    return [random_prompt(5 + i, seed=i)[0].tolist() for i in range(n)]


@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("max_new_tokens", [3, 30])
def test_offline_acceptance_equals_real_decoding(block_size, max_new_tokens):
    """In float32 the replay against the target's continuation gives the real run's rounds, token for token."""
    target = tiny_target(sharpen=4.0, num_layers=4)
    drafter = _drafter(target, block_size)
    for prompt in _prompts():
        ids = torch.tensor([prompt])
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=drafter,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            d3d_num_drafts="full",  # the replay measures the drafter at full blocks: the real run must draft them
        )
        stats = drafter.last_generation_stats
        continuation = out[0, ids.shape[1] :].tolist()
        replay = offline_acceptance(drafter, prompt, continuation, max_new_tokens, [2])
        assert replay.acceptance_lengths == stats.acceptance_lengths
        assert replay.tau == pytest.approx(stats.tau)


def test_offline_acceptance_stops_at_eos_like_generate():
    target = tiny_target(sharpen=4.0, seed=3)
    drafter = _drafter(target, 8)
    prompt = random_prompt(6, seed=1)
    free = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False)
    for stop in (0, 3, 9):
        target.generation_config.eos_token_id = free[0, prompt.shape[1] + stop].item()
        out = target.generate(
            prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, max_new_tokens=30, do_sample=False,
            d3d_num_drafts="full",  # a fixed plan, as the replay's
        )
        continuation = out[0, prompt.shape[1] :].tolist()
        replay = offline_acceptance(
            drafter, prompt[0].tolist(), continuation, 30, [target.generation_config.eos_token_id]
        )
        assert replay.acceptance_lengths == drafter.last_generation_stats.acceptance_lengths


def test_layer_subset_is_temporary_and_equals_a_pruned_copy():
    target = tiny_target(num_layers=4)
    drafter = _drafter(target)
    ids = torch.tensor([_prompts(1)[0]])
    before = drafter(ids).logits
    with layer_subset(drafter, [0, 2, 3]):
        subset = drafter(ids).logits
    torch.testing.assert_close(drafter(ids).logits, before)
    copy = pruned_drafter(drafter, [0, 2, 3])
    torch.testing.assert_close(copy(ids).logits, subset)
    assert copy.config.num_hidden_layers == 3 and copy.config.source_layer_ids == [0, 2, 3]
    assert copy.config.pruned_layer_ids == [0, 2, 3]
    again = pruned_drafter(copy, [0, 2])  # indices compose over repeated pruning
    assert again.config.pruned_layer_ids == [0, 3] and again.config.source_layer_ids == [0, 3]
    with pytest.raises(ValueError, match="increasing"):
        with layer_subset(drafter, [2, 1]):
            pass


def test_pruning_removes_the_brute_force_best_layer():
    target = tiny_target(sharpen=4.0, num_layers=4)
    drafter = _drafter(target)
    prompts = _prompts()
    continuations = target_continuations(target, prompts, 24)

    def tau_without(layer):
        copy = pruned_drafter(drafter, [i for i in range(4) if i != layer])
        total = [offline_acceptance(copy, p, c, 24, [2]) for p, c in zip(prompts, continuations, strict=True)]
        return sum(r.new_tokens for r in total) / sum(r.rounds for r in total)

    brute = {layer: tau_without(layer) for layer in range(4)}
    expected = max(range(4), key=lambda i: (brute[i], i))
    pruned, steps = pruned_and_steps = prune_drafter(
        drafter, target, prompts, num_layers=3, max_new_tokens=24, progress=False
    )
    assert steps[1].removed_layer == expected
    assert steps[1].candidates == pytest.approx({str(k): v for k, v in brute.items()})
    assert steps[1].tau == pytest.approx(brute[expected])
    assert pruned.config.num_hidden_layers == 3 and pruned.config.pruned_layer_ids == steps[1].kept_layers
    assert len(pruned_and_steps) == 2


def test_resumed_pruning_reaches_the_same_result(tmp_path):
    target = tiny_target(sharpen=4.0, num_layers=5)
    drafter = _drafter(target, seed=1)
    prompts = _prompts(2)
    _, straight = prune_drafter(drafter, target, prompts, num_layers=2, max_new_tokens=16, progress=False)
    prune_drafter(drafter, target, prompts, num_layers=4, max_new_tokens=16, state_dir=tmp_path, progress=False)
    state = json.loads((tmp_path / "pruning_state.json").read_text())
    assert [s["num_layers"] for s in state["steps"]] == [5, 4]
    _, resumed = prune_drafter(
        drafter, target, prompts, num_layers=2, max_new_tokens=16, state_dir=tmp_path, progress=False
    )
    assert [s.kept_layers for s in resumed] == [s.kept_layers for s in straight]
    assert [s.tau for s in resumed] == pytest.approx([s.tau for s in straight])
    _, shorter = prune_drafter(
        drafter, target, prompts, num_layers=3, max_new_tokens=16, state_dir=tmp_path, progress=False
    )
    assert [s.kept_layers for s in shorter] == [s.kept_layers for s in straight[:3]]
    with pytest.raises(ValueError, match="other settings"):
        prune_drafter(drafter, target, prompts[:1], num_layers=2, max_new_tokens=16, state_dir=tmp_path, progress=False)
    plot_pruning_path(resumed, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_retention_floor_stops_before_falling_below():
    target = tiny_target(sharpen=4.0, num_layers=4)
    drafter = _drafter(target)
    _, steps = prune_drafter(drafter, target, _prompts(), min_tau_retention=0.999, max_new_tokens=16, progress=False)
    assert all(s.tau_retention >= 0.999 for s in steps)
    with pytest.raises(ValueError, match="exactly one"):
        prune_drafter(drafter, target, _prompts(), max_new_tokens=16)
    with pytest.raises(ValueError, match="num_layers"):
        prune_drafter(drafter, target, _prompts(), num_layers=4)


@pytest.mark.parametrize("shares", [False, True])
def test_pruned_checkpoint_reloads_with_the_same_logits(tmp_path, shares):
    target = tiny_target(num_layers=4)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, shares_target_weights=shares)
    drafter.add_block_adapter(4)
    if shares:
        drafter.attach_target_weights(target)
    pruned = pruned_drafter(drafter, [1, 3])
    pruned.save_pretrained(tmp_path / "pruned")
    ids = torch.tensor([_prompts(1)[0]])
    masked = torch.zeros_like(ids, dtype=torch.bool)
    masked[:, -2:] = True
    expected = pruned(ids, masked_positions=masked).logits
    for loaded in (
        D3DForDiffusionDrafting.from_pretrained(tmp_path / "pruned"),
        AutoModel.from_pretrained(tmp_path / "pruned", trust_remote_code=True),
    ):
        if shares:
            loaded.attach_target_weights(target)
        assert loaded.config.num_hidden_layers == 2 and loaded.config.source_layer_ids == [1, 3]
        assert loaded.config.pruned_layer_ids == [1, 3]
        torch.testing.assert_close(loaded(ids, masked_positions=masked).logits, expected)
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), assistant_model=loaded, max_new_tokens=12, do_sample=False
        )
        assert torch.equal(out, ref)


def test_prune_command_on_smollm2(smollm2, tmp_path, capsys):
    """`d3d-hf prune` end to end on the real target with a 3-layer drafter cut from it (kept small for speed)."""
    from d3d_hf.cli import main

    drafter_dir = tmp_path / "drafter"
    assert (
        main(["init-drafter", "--from", "smollm2-135m-instruct", "--num-layers", "3", "--output", str(drafter_dir)])
        == 0
    )
    out = tmp_path / "pruned"
    argv = [
        "prune",
        "--target",
        "smollm2-135m-instruct",
        "--drafter",
        str(drafter_dir),
        "--prompts",
        "stdlib:3",
        "--offset",
        "1",
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--num-layers",
        "2",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    record = json.loads((out / "pruning_path.json").read_text())
    assert [s["num_layers"] for s in record["steps"]] == [3, 2]
    assert len(record["prompt_ids"]) == 2 and (out / "pruning_curve.png").exists()
    reloaded = D3DForDiffusionDrafting.from_pretrained(out)
    assert (
        reloaded.config.num_hidden_layers == 2 and reloaded.config.pruned_layer_ids == record["steps"][1]["kept_layers"]
    )
    assert main(argv) == 0  # resumed from the state: same result, nothing recomputed
    assert json.loads((out / "pruning_path.json").read_text())["steps"] == record["steps"]
    assert main([*argv[:-2], "--output", str(drafter_dir)]) == 2  # a non-empty folder without a state is refused
    assert "not empty" in capsys.readouterr().err
    assert main([*argv[:5], "--prompts", "humaneval", *argv[7:]]) == 2
    # the paper's recipe: fine-tune after each removal, here on a few rows of the target's own answers
    _, tokenizer = smollm2
    rows = tmp_path / "rows.jsonl"
    texts = [("Name a prime number.", "Seven is a prime number."), ("Say hello.", "Hello! How can I help you today?")]
    rows.write_text(
        "".join(
            json.dumps({"prompt_ids": tokenizer(q)["input_ids"], "response_ids": tokenizer(a)["input_ids"]}) + "\n"
            for q, a in texts * 2
        )
    )
    tuned_out = tmp_path / "tuned"
    tune = ["--finetune-data", str(rows), "--finetune-steps", "2", "--finetune-batch-size", "2"]
    assert main([*argv[:-2], "--output", str(tuned_out), *tune]) == 0
    record = json.loads((tuned_out / "pruning_path.json").read_text())
    step = record["steps"][1]
    assert step["finetune_seconds"] > 0 and step["tau_before_finetune"] is not None
    assert record["finetune"]["rows"] == 4 and record["finetune"]["steps"] == 2
    assert (tuned_out / "step-01" / "config.json").is_file()
    tuned = D3DForDiffusionDrafting.from_pretrained(tuned_out)
    assert tuned.config.num_hidden_layers == 2
    assert not torch.equal(tuned.model.layers[0].mlp.down_proj.weight, reloaded.model.layers[0].mlp.down_proj.weight)
    assert main([*argv[:-2], "--output", str(tmp_path / "x"), "--finetune-max-samples", "3"]) == 2  # needs data


def _adapted(target, rank=6):
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    drafter.add_block_adapter(rank, alpha=12.0)
    torch.manual_seed(3)
    for name, param in drafter.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.2)
    return drafter.eval()


def _updates(drafter):
    from d3d_hf.modeling.adapters_d3d import D3DLinear

    return {n: m.lora_scaling * m.lora_B @ m.lora_A for n, m in drafter.named_modules()
            if isinstance(m, D3DLinear) and m.rank > 0}


def _block_logits(drafter, grad=False):
    """The drafter's logits on a fixed prompt whose last 3 positions are a draft block (where the adapters act)."""
    ids = torch.tensor([_prompts(1)[0]])
    masked = torch.zeros_like(ids, dtype=torch.bool)
    masked[:, -3:] = True
    with torch.set_grad_enabled(grad):
        return drafter(ids, masked_positions=masked).logits


def _assert_lossless(target, drafter):
    ids = torch.tensor([_prompts(1)[0]])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, max_new_tokens=12,
                          do_sample=False)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)


def test_truncated_adapters_are_the_best_low_rank_approximation(tmp_path):
    target = tiny_target()
    drafter = _adapted(target)
    before = _updates(drafter)
    full = _block_logits(drafter)
    assert all(v == pytest.approx(1.0) for v in truncate_block_adapters(drafter, 6).values())
    torch.testing.assert_close(_block_logits(drafter), full, rtol=1e-4, atol=1e-4)
    kept = truncate_block_adapters(drafter, 2)
    assert drafter.config.block_lora_rank == 2 and set(kept) == set(before)
    for name, update in _updates(drafter).items():
        assert drafter.get_submodule(name).lora_A.shape[0] == 2
        u, sigma, vh = torch.linalg.svd(before[name])
        best = (u[:, :2] * sigma[:2]) @ vh[:2]  # Eckart-Young
        torch.testing.assert_close(update, best, rtol=1e-4, atol=1e-5)
        assert kept[name] == pytest.approx(float(sigma[:2].square().sum() / sigma.square().sum()), rel=1e-4)
    low = _block_logits(drafter)
    assert not torch.allclose(low, full, atol=1e-3)
    drafter.save_pretrained(tmp_path / "r2")
    loaded = D3DForDiffusionDrafting.from_pretrained(tmp_path / "r2")
    assert loaded.config.block_lora_rank == 2
    torch.testing.assert_close(_block_logits(loaded), low)
    _assert_lossless(target, loaded)


def test_expanded_adapters_draft_the_same_and_train_at_the_new_rank(tmp_path):
    """Growing the rank keeps every update `s B A` (so the same drafts), adds rows that train, saves and reloads."""
    target = tiny_target()
    drafter = _adapted(target, rank=4)
    before = _updates(drafter)
    logits = _block_logits(drafter)
    assert expand_block_adapters(drafter, 12, generator=torch.Generator().manual_seed(0)) is drafter
    assert drafter.config.block_lora_rank == 12
    for name, update in _updates(drafter).items():
        module = drafter.get_submodule(name)
        assert module.lora_A.shape[0] == 12 and module.lora_B.shape[1] == 12 and module.lora_scaling == 12.0 / 12
        assert module.lora_A[4:].abs().sum() > 0 and module.lora_B[:, 4:].abs().sum() == 0
        torch.testing.assert_close(update, before[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(_block_logits(drafter), logits, rtol=1e-5, atol=1e-5)
    # the new columns of B get a gradient (their rows of A are not zero), so the added rank can learn
    _block_logits(drafter, grad=True).square().mean().backward()
    module = drafter.get_submodule(next(iter(before)))
    assert module.lora_B.grad[:, 4:].abs().sum() > 0
    drafter.zero_grad()
    drafter.save_pretrained(tmp_path / "r12")
    loaded = D3DForDiffusionDrafting.from_pretrained(tmp_path / "r12")
    assert loaded.config.block_lora_rank == 12
    _assert_lossless(target, loaded)


@pytest.mark.parametrize(
    ("change", "good", "bads", "match"),
    [
        (truncate_block_adapters, 2, (0, 5, 2.0, True), r"whole number in \[1, 4\]"),
        (expand_block_adapters, 8, (4, 3, 8.0, True), r"whole number above 4"),
    ],
    ids=["truncate", "expand"],
)
def test_rank_changes_refuse_what_they_cannot_do(change, good, bads, match):
    target = tiny_target()
    with pytest.raises(ValueError, match="no block adapters"):
        change(D3DForDiffusionDrafting.from_autoregressive(target, block_size=4), good)
    drafter = _adapted(target, rank=4)
    for bad in bads:
        with pytest.raises(ValueError, match=match):
            change(drafter, bad)
    assert drafter.config.block_lora_rank == 4 and drafter.model.layers[0].mlp.up_proj.lora_A.shape[0] == 4


# ---------------------------------------------------------------------------------------------------------------
# pruning with fine-tuning after each removal (the paper's recipe)


def test_pruning_with_an_identity_finetune_follows_the_same_path():
    """A fine-tune that changes nothing: every step prunes the returned copy, and the path is the in-place one."""
    target = tiny_target(sharpen=4.0, num_layers=5)
    drafter = _drafter(target, seed=1)
    prompts = _prompts(2)
    _, plain = prune_drafter(drafter, target, prompts, num_layers=2, max_new_tokens=16, progress=False)
    calls = []

    def finetune(pruned, step):
        calls.append((step, pruned.config.num_hidden_layers, list(pruned.config.pruned_layer_ids)))
        return pruned

    tuned, steps = prune_drafter(
        drafter, target, prompts, num_layers=2, max_new_tokens=16, progress=False, finetune=finetune
    )
    assert calls == [(s.step, s.num_layers, s.kept_layers) for s in plain[1:]]
    assert [s.kept_layers for s in steps] == [s.kept_layers for s in plain]
    assert [s.tau for s in steps] == pytest.approx([s.tau for s in plain])
    assert [s.tau_before_finetune for s in steps[1:]] == pytest.approx([s.tau for s in plain[1:]])
    assert all(s.finetune_seconds is not None for s in steps[1:]) and steps[0].finetune_seconds is None
    assert tuned.config.pruned_layer_ids == steps[-1].kept_layers


def test_each_step_prunes_the_finetuned_drafter():
    """The candidates of a step are scored on the drafter the previous fine-tune returned, and tau is measured after
    fine-tuning."""
    target = tiny_target(sharpen=4.0, num_layers=4)
    drafter = _drafter(target, seed=2)
    prompts = _prompts(2)
    continuations = target_continuations(target, prompts, 16)
    returned = {}

    def finetune(pruned, step):  # a stand-in for training: moves the weights
        with torch.no_grad():
            for i, layer in enumerate(pruned.model.layers):
                layer.mlp.down_proj.weight.mul_(-4.0 * (i + step))
        returned[step] = pruned
        return pruned

    def tau(model, keep=None):
        keep = list(range(model.config.num_hidden_layers)) if keep is None else keep
        with layer_subset(model, keep):
            total = [offline_acceptance(model, p, c, 16, [2]) for p, c in zip(prompts, continuations, strict=True)]
        return sum(r.new_tokens for r in total) / sum(r.rounds for r in total)

    kwargs = dict(num_layers=2, max_new_tokens=16, progress=False, finetune=finetune)
    _, steps = prune_drafter(drafter, target, prompts, **kwargs)
    assert steps[1].tau == pytest.approx(tau(returned[1]))
    first = returned[1]
    kept = steps[1].kept_layers
    expected = {str(layer): tau(first, [kept.index(i) for i in kept if i != layer]) for layer in kept}
    assert steps[2].candidates == pytest.approx(expected)
    untuned = {str(layer): tau(drafter, [i for i in kept if i != layer]) for layer in kept}
    assert untuned != pytest.approx(expected)  # the fine-tune mattered: the test can tell the two apart


def test_finetuned_pruning_resumes_from_the_saved_step(tmp_path):
    target = tiny_target(sharpen=4.0, num_layers=5)
    drafter = _drafter(target, seed=1)
    prompts = _prompts(2)
    calls = []

    def finetune(pruned, step):
        calls.append(step)
        with torch.no_grad():
            pruned.model.layers[0].mlp.down_proj.weight.mul_(1.1)
        return pruned

    kwargs = dict(max_new_tokens=16, progress=False, finetune=finetune)
    _, straight = prune_drafter(drafter, target, prompts, num_layers=2, **kwargs)
    calls.clear()
    prune_drafter(drafter, target, prompts, num_layers=4, state_dir=tmp_path, **kwargs)
    assert calls == [1] and (tmp_path / "step-01" / "config.json").is_file()
    resumed_drafter, resumed = prune_drafter(drafter, target, prompts, num_layers=2, state_dir=tmp_path, **kwargs)
    assert calls == [1, 2, 3]
    assert [s.kept_layers for s in resumed] == [s.kept_layers for s in straight]
    assert [s.tau for s in resumed] == pytest.approx([s.tau for s in straight])
    assert resumed_drafter.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="other settings"):  # a state of the other kind
        prune_drafter(drafter, target, prompts, num_layers=2, state_dir=tmp_path, max_new_tokens=16, progress=False)
    import shutil

    shutil.rmtree(tmp_path / "step-03")
    (tmp_path / "pruning_state.json").write_text(
        (tmp_path / "pruning_state.json").read_text()
    )  # the state still names step 3
    with pytest.raises(FileNotFoundError, match="step-03"):
        prune_drafter(drafter, target, prompts, num_layers=1, state_dir=tmp_path, **kwargs)


@pytest.mark.parametrize("shares", [False, True])
def test_trainer_finetune_trains_each_pruned_drafter(tmp_path, shares):
    from _tiny import tiny_tokenizer
    from datasets import Dataset

    from d3d_hf.pruning import trainer_finetune
    from d3d_hf.training import D3DTrainingConfig

    target = tiny_target(sharpen=4.0, num_layers=4)
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4, shares_target_weights=shares)
    drafter.add_block_adapter(4)
    if shares:
        drafter.attach_target_weights(target)
    prompts = _prompts(2)
    rows = []
    for i in range(8):
        ids = random_prompt(5, seed=50 + i)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        rows.append({"prompt_ids": ids[0].tolist(), "response_ids": out[0, ids.shape[1] :].tolist()})
    args = D3DTrainingConfig(
        output_dir=str(tmp_path / "finetune"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
        save_strategy="no", use_cpu=True, report_to="none", disable_tqdm=True, anchors_per_sequence=2,
        train_mode="block_adapter" if shares else "full",
    )  # fmt: skip
    finetune = trainer_finetune(Dataset.from_list(rows), args, target=target, processing_class=tiny_tokenizer())
    before = {}

    def recording(pruned, step):
        before[step] = {k: v.clone() for k, v in pruned.state_dict().items()}
        return finetune(pruned, step)

    tuned, steps = prune_drafter(
        drafter, target, prompts, num_layers=2, max_new_tokens=16, progress=False, finetune=recording
    )
    assert [s.num_layers for s in steps] == [4, 3, 2] and tuned.config.num_hidden_layers == 2
    changed = [k for k, v in tuned.state_dict().items() if k in before[2] and not torch.equal(v, before[2][k])]
    assert changed, "the fine-tune trained nothing"
    assert args.output_dir == str(tmp_path / "finetune")  # the caller's config is not changed
    assert "forward" not in tuned.__dict__  # no training-time forward left bound to the returned drafter
    ids = torch.tensor([prompts[0]])
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=tuned, max_new_tokens=12,
                          do_sample=False)  # fmt: skip
    assert torch.equal(out, ref)
