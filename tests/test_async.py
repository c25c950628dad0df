"""Asynchronous D3D generation (modeling/generation_d3d.py's async engine: packed successor drafting during
verification) on tiny random targets: lossless greedy decoding, forced hits and misses, options from the call or
the drafter, the worker thread, no pass left running after generate, CUDA."""

import pytest
import torch
from _tiny import perturbed_drafter, random_prompt, tiny_target
from transformers import GenerationConfig

from d3d_hf import D3DForDiffusionDrafting


def _greedy(target, ids, drafter=None, max_new_tokens=40, **options):
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, **options)
    return target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                           generation_config=config)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_hypotheses", [1, 4, "B"])
@pytest.mark.parametrize("reuse_on_miss", [False, True])
def test_async_greedy_is_lossless(block_size, num_hypotheses, reuse_on_miss):
    num_hypotheses = block_size if num_hypotheses == "B" else num_hypotheses
    target = tiny_target(sharpen=4.0)
    drafter = perturbed_drafter(target, block_size)
    for seed in range(3):
        ids = random_prompt(5 + seed, seed=seed)
        reference = _greedy(target, ids)
        out = _greedy(target, ids, drafter, d3d_async=True, d3d_num_hypotheses=num_hypotheses,
                      d3d_reuse_on_miss=reuse_on_miss)
        assert torch.equal(out, reference)
        stats = drafter.last_generation_stats
        assert stats.asynchronous and stats.num_hypotheses == num_hypotheses
        assert stats.new_tokens == reference.shape[1] - ids.shape[1]
        assert stats.hits + stats.reused + stats.misses >= stats.rounds - 2
        # every joined packed pass is timed, on the worker and at the join
        assert len(stats.packed_seconds) == len(stats.join_wait_seconds) == stats.hits + stats.reused + stats.misses


class _OracleDrafter(D3DForDiffusionDrafting):
    """Drafts the target's own continuation (`reference`), with the real cache mechanics of the parent class."""

    reference: list[int] = []
    corrupt_guesses = False

    def _oracle(self, context_length, rows):
        vocab = self.config.vocab_size
        logits = torch.full((rows, vocab), -30.0)
        for j in range(rows):
            position = context_length + j
            logits[j, self.reference[position] if position < len(self.reference) else 0] = 30.0
        return logits

    def draft_logits(self, committed_ids, cache, num_masks=None):
        context = cache.get_seq_length() + committed_ids.shape[1]
        logits = super().draft_logits(committed_ids, cache, num_masks)
        return self._oracle(context, logits.shape[1])[None]

    def packed_draft_logits(self, chain_ids, cache, hypothesis_chain_lengths, bonus_guesses):
        if self.corrupt_guesses:  # a wrong bonus guess for every hypothesis: every round must miss
            bonus_guesses = [(g + 1) % self.config.vocab_size for g in bonus_guesses]
        packed = super().packed_draft_logits(chain_ids, cache, hypothesis_chain_lengths, bonus_guesses)
        prefix = cache.get_seq_length()
        packed.logits = torch.stack(
            [self._oracle(prefix + m + 1, self.config.block_size) for m in hypothesis_chain_lengths]
        )
        return packed


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("forced", ["hit", "miss", "reuse"])
def test_forced_hits_and_misses_stay_lossless(block_size, forced):
    target = tiny_target(sharpen=4.0)
    target.generation_config.eos_token_id = None
    ids = random_prompt(6)
    reference = _greedy(target, ids, max_new_tokens=50)
    drafter = _OracleDrafter.from_autoregressive(target, block_size=block_size)
    drafter.reference = reference[0].tolist()
    drafter.corrupt_guesses = forced != "hit"
    out = _greedy(target, ids, drafter, max_new_tokens=50, d3d_async=True, d3d_num_hypotheses=1,
                  d3d_reuse_on_miss=forced == "reuse")
    assert torch.equal(out, reference)
    stats = drafter.last_generation_stats
    assert stats.accepted_drafts == stats.drafted_tokens > 0  # every draft accepted
    judged = stats.hits + stats.reused + stats.misses
    assert judged >= stats.rounds - 2
    expected = {"hit": "hits", "miss": "misses", "reuse": "reused"}[forced]
    assert getattr(stats, expected) == judged, stats
    if forced == "hit":
        assert stats.hit_rate == 1.0


def test_options_come_from_the_call_or_the_drafter():
    target = tiny_target()
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    ids = random_prompt()
    _greedy(target, ids, drafter, max_new_tokens=8)
    assert not drafter.last_generation_stats.asynchronous
    drafter.generation_config.d3d_async = True
    drafter.generation_config.d3d_num_hypotheses = 2
    _greedy(target, ids, drafter, max_new_tokens=8)
    assert drafter.last_generation_stats.asynchronous and drafter.last_generation_stats.num_hypotheses == 2
    _greedy(target, ids, drafter, max_new_tokens=8, d3d_async=False)
    assert not drafter.last_generation_stats.asynchronous
    for bad in (0, 5):
        with pytest.raises(ValueError, match="d3d_num_hypotheses"):
            _greedy(target, ids, drafter, max_new_tokens=8, d3d_num_hypotheses=bad)


def _instrumented(drafter, monkeypatch):
    """Records, for every packed pass, the torch thread count it ran with and whether it finished."""
    import time

    calls = []
    original = drafter.packed_draft_logits

    def packed_draft_logits(*args, **kwargs):
        call = {"threads": torch.get_num_threads(), "done": False}
        calls.append(call)
        result = original(*args, **kwargs)
        time.sleep(0.02)  # long enough that a pass left running would be seen running
        call["done"] = True
        return result

    monkeypatch.setattr(drafter, "packed_draft_logits", packed_draft_logits)
    return calls


def test_worker_threads_option_sets_the_worker_only(monkeypatch):
    """`d3d_worker_threads` sets the packed-pass worker's torch threads; the caller's count, and the count that threads
    created afterwards start with, stay as they were (also when the call ends with a pass never joined, and for a
    count never used before); output stays identical."""
    import threading

    from d3d_hf import experiments

    monkeypatch.setattr(experiments, "_EXECUTORS", {})  # every worker count below is new to this process
    target = tiny_target(sharpen=4.0)
    drafter = perturbed_drafter(target, 4)
    calls = _instrumented(drafter, monkeypatch)
    ids = random_prompt(6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for max_new_tokens in (2, 24):  # 2: one round, its packed pass is never used
            reference = _greedy(target, ids, max_new_tokens=max_new_tokens)
            for requested, expected in ((1, 1), (2, 2), (None, 1), (2.0, 2)):  # None: half of the caller's 2
                calls.clear()
                out = _greedy(target, ids, drafter, max_new_tokens=max_new_tokens, d3d_async=True,
                              d3d_worker_threads=requested)
                assert torch.equal(out, reference)
                # (with 2 new tokens the one pass may be cancelled before it starts: then no call is recorded)
                assert {c["threads"] for c in calls} <= {expected} and (calls or max_new_tokens == 2), calls
                assert drafter.last_generation_stats.worker_threads == expected
                assert torch.get_num_threads() == 2
                seen = []
                thread = threading.Thread(target=lambda seen=seen: seen.append(torch.get_num_threads()))
                thread.start()
                thread.join()
                assert seen == [2], (requested, max_new_tokens)
        _greedy(target, ids, drafter, max_new_tokens=8)
        assert drafter.last_generation_stats.worker_threads == 0  # synchronous: no worker
        for bad in (0, -1, 1.5, True, "2", "abc", float("nan"), float("inf"), [2], 10**12):
            with pytest.raises(ValueError, match="d3d_worker_threads"):
                _greedy(target, ids, drafter, max_new_tokens=8, d3d_async=True, d3d_worker_threads=bad)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("stop", ["length", "eos"])
def test_no_packed_pass_runs_on_after_generate_returns(monkeypatch, stop):
    """The pass launched in the last round (its round never comes) is finished or cancelled before `generate`
    returns, so it takes no CPU from what the caller does next."""
    target = tiny_target(sharpen=4.0, seed=3)
    drafter = perturbed_drafter(target, 8)
    calls = _instrumented(drafter, monkeypatch)
    ids = random_prompt(6, seed=1)
    continuation = _greedy(target, ids, max_new_tokens=30)[0, ids.shape[1] :].tolist()
    if stop == "eos":
        target.generation_config.eos_token_id = continuation[9]
    for max_new_tokens in (2, 5, 30):
        calls.clear()
        out = _greedy(target, ids, drafter, max_new_tokens=max_new_tokens, d3d_async=True, d3d_num_hypotheses=8)
        assert torch.equal(out, _greedy(target, ids, max_new_tokens=max_new_tokens))
        # a pass not started when generation ends is cancelled (no call recorded); one that started has finished
        assert all(c["done"] for c in calls) and (calls or max_new_tokens < 30), (max_new_tokens, calls)


def test_async_options_of_the_wrong_type_are_refused():
    target = tiny_target()
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=4)
    ids = random_prompt()
    for name, bad in [("d3d_num_hypotheses", 1.5), ("d3d_num_hypotheses", "2"), ("d3d_num_hypotheses", True),
                      ("d3d_reuse_on_miss", "no"), ("d3d_async", "yes"), ("d3d_async", 1)]:
        with pytest.raises(ValueError, match=name):
            _greedy(target, ids, drafter, max_new_tokens=8, **{name: bad})
    out = _greedy(target, ids, drafter, max_new_tokens=8, d3d_async=True, d3d_num_hypotheses=2.0)
    assert torch.equal(out, _greedy(target, ids, max_new_tokens=8))


def test_async_never_exceeds_the_budget_and_stops_at_eos():
    target = tiny_target(sharpen=4.0, seed=3)
    drafter = perturbed_drafter(target, 8)
    ids = random_prompt(6, seed=1)
    for max_new_tokens in (1, 2, 3, 7, 9):
        reference = _greedy(target, ids, max_new_tokens=max_new_tokens)
        out = _greedy(target, ids, drafter, max_new_tokens=max_new_tokens, d3d_async=True, d3d_num_hypotheses=8)
        assert torch.equal(out, reference)
    continuation = _greedy(target, ids, max_new_tokens=30)[0, ids.shape[1] :].tolist()
    for stop_index in (0, 3, 9):
        target.generation_config.eos_token_id = continuation[stop_index]
        reference = _greedy(target, ids, max_new_tokens=30)
        out = _greedy(target, ids, drafter, max_new_tokens=30, d3d_async=True, d3d_num_hypotheses=8)
        assert torch.equal(out, reference)


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("drafter_device", ["cuda", "cpu"])
def test_async_on_cuda_is_lossless(drafter_device):
    """Target on CUDA; drafter on the same GPU (packed pass on a side stream) or on the CPU (a second device: the
    packed pass on the worker thread while the GPU verifies). Greedy output equals target-only decoding; sampling
    runs (its draft scores must reach the target's device)."""
    target = tiny_target(sharpen=4.0)
    drafter = perturbed_drafter(target, 4)
    target.to("cuda")
    drafter.to(drafter_device)
    ids = random_prompt(7).to("cuda")
    reference = _greedy(target, ids, max_new_tokens=40)
    for num_hypotheses in (1, 4):
        out = _greedy(target, ids, drafter, max_new_tokens=40, d3d_async=True, d3d_num_hypotheses=num_hypotheses)
        assert torch.equal(out, reference), num_hypotheses
        assert drafter.last_generation_stats.hits + drafter.last_generation_stats.misses > 0
    torch.manual_seed(0)
    config = GenerationConfig(max_new_tokens=20, do_sample=True, temperature=0.8, d3d_async=True)
    sampled = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                              generation_config=config)
    assert sampled.device.type == "cuda" and 0 < sampled.shape[1] - ids.shape[1] <= 20
