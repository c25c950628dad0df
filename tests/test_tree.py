"""D3D's own decoding loop and tree verification (modeling/decoding_d3d.py, modeling/tree_d3d.py).

Draft trees: best-first construction against brute-force enumeration, the tree mask and positions against a
brute-force reference, the accepted-path cache against a fresh forward over the accepted tokens, the greedy and
sampling acceptance rules (exact distribution of one step, by chi-square). The loop: chain mode gives exactly what
transformers' loop gives (tokens and statistics, greedy and sampled with a seed); trees are lossless on tiny Llama and
Qwen3 targets for several budgets and keep every generate argument's meaning (eos, length, streamer, processors,
scores, stop strings); sampling with trees keeps the target's distribution; calls the loop cannot take go to
transformers' loop (chain) or are refused (tree); the hook is reversible.
"""

import itertools

import pytest
import torch
from _tiny import FAMILIES, chi_square_p_value, perturbed_drafter, random_prompt, tiny_target
from d3d_hf.modeling.estimates_d3d import CostCurve
from d3d_hf.modeling.policy_d3d import DraftPolicy
from d3d_hf.modeling.tree_d3d import (
    DraftTree,
    build_draft_tree,
    greedy_tree_path,
    keep_cache_path,
    sample_tree_path,
    tree_attention_inputs,
)
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation import GenerationMixin
from transformers.generation.streamers import BaseStreamer

from d3d_hf import D3DForDiffusionDrafting, install_generation_hook, remove_generation_hook

# ----------------------------------------------------------------------------------------------------------------------
# trees


def _random_tree(num_nodes, seed):
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree()
    for i in range(num_nodes):
        parent = int(torch.randint(-1, i, (1,), generator=g)) if i else -1
        tree.add(int(torch.randint(0, 50, (1,), generator=g)), parent, 0.5)
    return tree


@pytest.mark.parametrize("num_nodes,num_committed,past", [(1, 1, 0), (7, 1, 5), (12, 4, 3), (5, 3, 0)])
def test_tree_mask_and_positions_match_a_brute_force_reference(num_nodes, num_committed, past):
    tree = _random_tree(num_nodes, seed=num_nodes + past)
    mask, positions = tree_attention_inputs(tree, num_committed, past, torch.float32)
    q = num_committed + num_nodes
    assert mask.shape == (1, 1, q, past + q) and positions.shape == (1, q)
    for row in range(q):
        for col in range(past + q):
            if col < past:
                want = True
            elif col < past + num_committed:
                want = row >= col - past if row < num_committed else True
            else:
                node = col - past - num_committed
                if row < num_committed:
                    want = False
                else:
                    ancestors, walk = set(), row - num_committed
                    while walk >= 0:
                        ancestors.add(walk)
                        walk = tree.parents[walk]
                    want = node in ancestors
            assert (mask[0, 0, row, col] == 0).item() == want, (row, col)
        if row < num_committed:
            assert positions[0, row] == past + row
        else:
            node, depth = row - num_committed, 0
            while node >= 0:
                depth, node = depth + 1, tree.parents[node]
            assert positions[0, row] == past + num_committed - 1 + depth


def _brute_force_best(probabilities, budget, branching):
    """Every path through the per-depth top-`branching` tokens, scored by its probability product; the best
    `budget` of them that are prefix-closed (best-first order, ties by depth)."""
    depths, _ = probabilities.shape
    tops = probabilities.topk(branching, dim=-1)
    paths = {}
    for d in range(1, depths + 1):
        for choice in itertools.product(range(branching), repeat=d):
            tokens = tuple(int(tops.indices[j, c]) for j, c in enumerate(choice))
            paths[tokens] = float(torch.prod(torch.stack([tops.values[j, c] for j, c in enumerate(choice)])))
    ranked = sorted(paths, key=lambda t: (-paths[t], len(t)))
    return set(ranked[:budget]), paths


@pytest.mark.parametrize("budget", [1, 3, 6, 10])
def test_best_first_tree_holds_the_likeliest_paths(budget):
    g = torch.Generator().manual_seed(budget)
    probabilities = torch.softmax(3 * torch.randn(3, 9, generator=g), dim=-1)
    tree = build_draft_tree(probabilities, budget, branching=2)
    want, scores = _brute_force_best(probabilities, budget, 2)
    got = {tuple(tree.path_tokens(i)) for i in range(len(tree))}
    assert got == want
    assert all(p < i for i, p in enumerate(tree.parents))  # parents first
    for i in range(len(tree)):
        assert tree.probabilities[i] == pytest.approx(scores[tuple(tree.path_tokens(i))])
    # every prefix is a tree and the best one of its size
    for n in range(1, budget):
        assert {tuple(tree.prefix(n).path_tokens(i)) for i in range(n)} == _brute_force_best(probabilities, n, 2)[0]


def test_tree_options_exact_first_lookup_stop_and_allow():
    probabilities = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.6, 0.4, 0.0, 0.0], [0.7, 0.3, 0.0, 0.0]])
    exact = build_draft_tree(probabilities, 6, exact_first=True, branching=2)
    assert [i for i in range(len(exact)) if exact.depths[i] == 1] == [0]  # no branching where the drafter is exact
    assert exact.tokens[0] == 0 and exact.probabilities[0] == 1.0
    # a lookup chain is a branch of its own, merged where it meets a drafter node; deeper than the block
    lookup = build_draft_tree(probabilities, 9, branching=1, extra_chains=[([1, 1, 0, 3], [0.9, 0.9, 0.9, 0.9])])
    paths = {tuple(lookup.path_tokens(i)): lookup.sources[i] for i in range(len(lookup))}
    assert paths[(1,)] == "lookup" and paths[(1, 1, 0, 3)] == "lookup" and paths[(0,)] == "drafter"
    # an eos node has no children; `allow` prunes a subtree
    stopped = build_draft_tree(probabilities, 10, branching=2, stop_tokens=[0])
    assert all(stopped.tokens[p] != 0 for p in stopped.parents if p >= 0)
    pruned = build_draft_tree(probabilities, 10, branching=2, allow=lambda path: path[0] != 1)
    assert all(pruned.path_tokens(i)[0] != 1 for i in range(len(pruned)))
    sampled = build_draft_tree(probabilities, 4, exact_first=True, sample_first=True, generator=torch.Generator())
    assert list(sampled.proposals) == [0] and torch.equal(sampled.proposals[0], probabilities[0])
    with pytest.raises(ValueError, match="exact_first"):
        build_draft_tree(probabilities, 4, sample_first=True)
    with pytest.raises(ValueError, match="budget"):
        build_draft_tree(probabilities, -1)


def test_greedy_path_is_the_longest_agreeing_path():
    tree = DraftTree()
    a = tree.add(5, -1, 1.0)
    b = tree.add(6, -1, 0.5)
    c = tree.add(7, a, 0.5)
    d = tree.add(8, b, 0.4)
    tree.add(9, d, 0.3)
    # target: root -> 6, after 6 -> 8, after 8 -> 1 (not a child)
    choices = [6, 7, 8, 0, 1, 2]
    assert greedy_tree_path(tree, choices) == ([b, d], 1)
    assert greedy_tree_path(tree, [3, 0, 0, 0, 0, 0]) == ([], 3)
    assert c == 2


def test_sampling_rule_draws_exactly_from_the_target():
    """One step of `sample_tree_path` (a sampled child, then two fixed siblings) is distributed as `p`."""
    vocab = 6
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    q = torch.tensor([0.4, 0.1, 0.1, 0.2, 0.1, 0.1])
    g = torch.Generator().manual_seed(0)
    n = 6000
    counts = torch.zeros(vocab)
    for _ in range(n):
        tree = DraftTree()
        first = int(torch.multinomial(q, 1, generator=g))
        tree.add(first, -1, 1.0)
        tree.proposals[0] = q
        for token in (3, 4):
            if token != first:
                tree.add(token, -1, 0.5)
        path, token = sample_tree_path(tree, lambda node: p if node < 0 else torch.full((vocab,), 1 / vocab), g)
        counts[tree.tokens[path[0]] if path else token] += 1
    assert chi_square_p_value(counts, p, n) > 1e-3


def test_accepted_path_cache_equals_a_fresh_forward():
    target = tiny_target("llama", seed=2)
    ids = random_prompt(6, seed=2)
    tree = _random_tree(9, seed=3)
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=ids[:, :-1], cache=cache, use_cache=True)
        past = cache.get_seq_length()
        mask, positions = tree_attention_inputs(tree, 1, past, torch.float32)
        nodes = torch.tensor([tree.tokens])
        out = target(input_ids=torch.cat([ids[:, -1:], nodes], 1), attention_mask=mask, position_ids=positions,
                     cache=cache, use_cache=True)
        leaf = max(range(len(tree)), key=lambda i: tree.depths[i])
        path = tree.path(leaf)
        keep_cache_path(cache, past + 1, path)
        fresh = DynamicCache(config=target.config)
        full = torch.cat([ids, torch.tensor([tree.path_tokens(leaf)])], 1)
        want = target(input_ids=full, cache=fresh, use_cache=True)
    assert cache.get_seq_length() == full.shape[1]
    for got_layer, want_layer in zip(cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(got_layer.keys, want_layer.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_layer.values, want_layer.values, rtol=1e-5, atol=1e-5)
    # and the tree rows' logits are those of the causal forward over each path
    rows = [0] + [i + 1 for i in path]
    torch.testing.assert_close(out.logits[0, rows], want.logits[0, ids.shape[1] - 1 :], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------------------
# the loop


def _sharing_drafter(target, block_size=6, scale=0.05):
    """A drafter on the target's own weights (`shares_target_weights`) with rank-4 block adapters moved by `scale`
    times N(0, 1) noise (seed 0): exact at depth 1, imperfect deeper."""
    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=block_size, shares_target_weights=True,
                                                          block_lora_rank=4)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "lora" in name:
                p.add_(scale * torch.randn_like(p))
    return drafter


def _generate(target, ids, drafter, **options):
    config = GenerationConfig(max_new_tokens=options.pop("max_new_tokens", 30), do_sample=False,
                              d3d_num_drafts=options.pop("d3d_num_drafts", "full"), **options)
    return target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, generation_config=config)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [1, 4, 16, "adaptive"])
@pytest.mark.parametrize("shares", [False, True])
def test_tree_greedy_is_target_alone(family, budget, shares):
    target = tiny_target(family, seed=3, sharpen=5.0)
    drafter = perturbed_drafter(target, 8, scale=0.01)
    if shares:
        drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=8, shares_target_weights=True,
                                                              block_lora_rank=4)
    accepted = 0
    for seed in range(3):
        ids = random_prompt(7, seed=seed)
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        out = _generate(target, ids, drafter, d3d_tree_budget=budget,
                        d3d_num_drafts="adaptive" if budget == "adaptive" else "full")
        assert out.tolist() == ref.tolist()
        stats = drafter.last_generation_stats
        assert stats.decoding_loop == "d3d" and stats.tree_budget == budget
        if budget != "adaptive":
            assert max(stats.round_candidates) <= budget
        accepted += stats.accepted_drafts
    if budget != "adaptive":
        assert accepted > 0, "the drafter should have some drafts accepted"


def test_trees_accept_more_than_a_chain():
    target = tiny_target("qwen3", seed=3, sharpen=5.0)
    drafter = perturbed_drafter(target, 8, scale=0.01)
    taus = {}
    for budget in (None, 16):
        committed = rounds = 0
        for seed in range(4):
            _generate(target, random_prompt(7, seed=seed), drafter, d3d_tree_budget=budget)
            committed += drafter.last_generation_stats.new_tokens
            rounds += drafter.last_generation_stats.rounds
        taus[budget] = committed / rounds
    assert taus[16] > taus[None]


@pytest.mark.parametrize("do_sample", [False, True])
def test_chain_mode_is_transformers_loop(do_sample):
    """Same tokens and the same statistics as transformers' assisted loop (sampling: same seed, same draws)."""
    target = tiny_target("llama", seed=3, sharpen=5.0)
    drafter = perturbed_drafter(target, 6, scale=0.01)
    results = {}
    for loop in ("transformers", "d3d"):
        torch.manual_seed(7)
        outs = []
        for seed in range(3):
            ids = random_prompt(7, seed=seed)
            # speculative sampling: transformers' loop has no drafter-invariant sampling to compare with
            config = GenerationConfig(max_new_tokens=25, do_sample=do_sample, temperature=0.8, top_k=20,
                                      d3d_num_drafts="full", d3d_decoding_loop=loop, return_dict_in_generate=True,
                                      d3d_sampling="speculative",
                                      output_scores=True, output_logits=True)
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                  generation_config=config)
            stats = drafter.last_generation_stats
            assert stats.decoding_loop == loop
            outs.append((out.sequences.tolist(), torch.stack(out.scores), torch.stack(out.logits),
                         stats.acceptance_lengths, stats.drafted_tokens, stats.round_candidates))
        results[loop] = outs
    for (seq_a, sc_a, lg_a, *rest_a), (seq_b, sc_b, lg_b, *rest_b) in zip(results["transformers"], results["d3d"],
                                                                          strict=True):
        assert seq_a == seq_b and rest_a == rest_b
        torch.testing.assert_close(sc_a, sc_b)
        torch.testing.assert_close(lg_a, lg_b)


class _Recorder(BaseStreamer):
    def __init__(self):
        self.tokens, self.ended = [], False

    def put(self, value):
        self.tokens.extend(value.flatten().tolist())

    def end(self):
        self.ended = True


class _PenaliseLast(LogitsProcessor):
    """A history-dependent processor: the last token may not repeat."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), input_ids[:, -1]] = -float("inf")
        return scores


@pytest.mark.parametrize("budget", [None, 6])
def test_generate_arguments_keep_their_meaning_with_trees(budget):
    target = tiny_target("llama", seed=3, sharpen=5.0)
    drafter = perturbed_drafter(target, 8, scale=0.01)
    drafter.generation_config.d3d_tree_budget = budget
    drafter.generation_config.d3d_num_drafts = "full"
    ids = random_prompt(7, seed=1)

    def run(assistant, **kwargs):
        return target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, do_sample=False,
                               **kwargs)

    ref = run(None, max_new_tokens=30)
    # eos inside the continuation stops exactly there
    eos = ref[0, ids.shape[1] + 9].item()
    assert run(drafter, max_new_tokens=30, eos_token_id=eos).tolist() == run(None, max_new_tokens=30,
                                                                              eos_token_id=eos).tolist()
    # max_length never exceeded
    for n in (1, 2, 5, 13):
        assert run(drafter, max_new_tokens=n).tolist() == ref[:, : ids.shape[1] + n].tolist()
    # streamer: exactly the output, then end
    streamer = _Recorder()
    out = run(drafter, max_new_tokens=30, streamer=streamer)
    assert streamer.tokens == out[0].tolist() and streamer.ended
    # logits processors, scored on each row's own history
    processors = LogitsProcessorList([_PenaliseLast()])
    assert run(drafter, max_new_tokens=30, logits_processor=processors).tolist() == run(
        None, max_new_tokens=30, logits_processor=processors).tolist()
    # scores and logits of the committed tokens
    got = run(drafter, max_new_tokens=20, return_dict_in_generate=True, output_scores=True, output_logits=True)
    want = run(None, max_new_tokens=20, return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert got.sequences.tolist() == want.sequences.tolist()
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4)
    assert drafter.last_generation_stats.decoding_loop == "d3d"


def _exact_two_token_distribution(target, ids, temperature):
    vocab = target.config.vocab_size
    with torch.no_grad():
        p1 = (target(ids).logits[0, -1] / temperature).softmax(-1)
        seqs = torch.cat([ids.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p2 = (target(seqs).logits[:, -1] / temperature).softmax(-1)
    return p1[:, None] * p2


@pytest.mark.parametrize("shares", [False, True], ids=["fixed-nodes", "sampled-first"])
def test_tree_sampling_preserves_the_target_distribution(shares):
    vocab = 8
    target = tiny_target("qwen3", vocab_size=vocab, seed=11, sharpen=10.0)
    target.generation_config.eos_token_id = None
    if shares:
        drafter = _sharing_drafter(target, block_size=4, scale=0.5)
    else:
        drafter = D3DForDiffusionDrafting.from_autoregressive(target, num_layers=1, block_size=4)
    drafter.generation_config.d3d_tree_budget = 5
    # speculative tree sampling (drafter-invariant sampling's exactness: tests/test_sampling.py), with a fixed plan so
    # that every round builds a tree
    drafter.generation_config.d3d_sampling = "speculative"
    drafter.generation_config.d3d_num_drafts = "full"
    ids = torch.tensor([[3, 5, 4]])
    temperature = 0.9
    exact = _exact_two_token_distribution(target, ids, temperature).flatten()
    torch.manual_seed(1234)
    n = 1500
    counts = torch.zeros(vocab * vocab)
    branched = rejected = 0
    for _ in range(n):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=True,
                              temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=2, pad_token_id=0)
        a, b = out[0, -2:].tolist()
        counts[a * vocab + b] += 1
        stats = drafter.last_generation_stats
        rejected += stats.acceptance_lengths[0] < 3
        branched += max(stats.round_candidates) > 1
    assert rejected > n // 10 and branched > n // 2
    p_value = chi_square_p_value(counts, exact, n)
    assert p_value > 1e-3, f"p={p_value:.2e}"


def test_calls_the_loop_cannot_take_go_to_transformers_or_are_refused():
    target = tiny_target("llama", seed=3, sharpen=5.0)
    drafter = perturbed_drafter(target, 4, scale=0.01)
    ids = random_prompt(7, seed=1)
    padded = torch.cat([torch.zeros((1, 2), dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros((1, 2), dtype=torch.long), torch.ones_like(ids)], 1)
    config = GenerationConfig(max_new_tokens=10, do_sample=False, d3d_num_drafts="full",
                              return_dict_in_generate=True, output_hidden_states=True)
    target.generate(ids, assistant_model=drafter, generation_config=config)
    assert drafter.last_generation_stats.decoding_loop == "transformers"
    tree = GenerationConfig(max_new_tokens=10, do_sample=False, d3d_num_drafts="full", d3d_tree_budget=4,
                            return_dict_in_generate=True, output_hidden_states=True)
    with pytest.raises(ValueError, match="output_hidden_states"):
        target.generate(ids, assistant_model=drafter, generation_config=tree)
    # a padded prompt runs D3D's batched loop, which verifies chains only
    with pytest.raises(ValueError, match="d3d_tree_budget=None"):
        target.generate(padded, attention_mask=mask, assistant_model=drafter, generation_config=tree)
    with pytest.raises(ValueError, match="own decoding loop"):
        target.generate(ids, assistant_model=drafter, generation_config=GenerationConfig(
            max_new_tokens=5, d3d_tree_budget=4, d3d_decoding_loop="transformers"))
    for bad in (0, -2, 1.5, "big"):
        with pytest.raises(ValueError, match="d3d_tree_budget"):
            target.generate(ids, assistant_model=drafter, generation_config=GenerationConfig(
                max_new_tokens=5, d3d_tree_budget=bad))
    with pytest.raises(ValueError, match="d3d_async"):
        target.generate(ids, assistant_model=drafter, generation_config=GenerationConfig(
            max_new_tokens=5, d3d_tree_budget=4, d3d_async=True))


def test_decoding_hook_is_reversible():
    hooked = GenerationMixin._assisted_decoding
    assert getattr(hooked, "_d3d_decoding_hook", False)
    remove_generation_hook()
    try:
        assert GenerationMixin._assisted_decoding is hooked._d3d_original
        assert not getattr(GenerationMixin._assisted_decoding, "_d3d_decoding_hook", False)
    finally:
        install_generation_hook()
    install_generation_hook()  # idempotent: one wrapper, around transformers' own method
    assert getattr(GenerationMixin._assisted_decoding, "_d3d_decoding_hook", False)
    assert GenerationMixin._assisted_decoding._d3d_original is hooked._d3d_original


@pytest.fixture(scope="module")
def shipped_drafter():
    from d3d_hf.drafters import load_drafter

    return load_drafter("d3d-smollm2-135m-instruct")


@pytest.mark.parametrize("budget", [4, 16])
def test_trees_on_smollm2_are_lossless_and_stop_where_the_target_stops(smollm2, shipped_drafter, budget):
    from d3d_hf.prompts import load_prompts
    from d3d_hf.prompts.prompt import encode_prompt

    model, tokenizer = smollm2
    config = dict(d3d_tree_budget=budget, d3d_num_drafts="full")
    total = rounds = 0
    for prompt in load_prompts("humaneval", limit=2):
        ids = encode_prompt(tokenizer, prompt)
        ref = model.generate(ids, max_new_tokens=40, do_sample=False)
        out = _generate(model, ids, shipped_drafter, max_new_tokens=40, **config)
        assert out.tolist() == ref.tolist()
        total += shipped_drafter.last_generation_stats.new_tokens
        rounds += shipped_drafter.last_generation_stats.rounds
    assert total / rounds > 2.0  # the trained drafter's trees are accepted deep
    text = tokenizer.decode(ref[0, ids.shape[1] :])
    stop = next(s for s in ("(", ":", "\n", " ") if s in text[1:-1])
    want = model.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    got = model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=shipped_drafter,
                         generation_config=GenerationConfig(max_new_tokens=40, do_sample=False, stop_strings=[stop],
                                                            **config), tokenizer=tokenizer)
    assert got.tolist() == want.tolist() and want.shape[1] < ids.shape[1] + 40


def test_policy_rates_a_tree_round_with_its_gain_and_nodes():
    verify = CostCurve({1: 0.05, 8: 0.06, 17: 0.07})
    draft = CostCurve({1: 0.04, 16: 0.08})
    policy = DraftPolicy(verify_curve=verify, draft_curve=draft, max_drafts=15, explore_every=None)
    chain = policy.decide(1, max_candidates=15)
    assert chain.source == "target"  # an untrained calibrator's chain does not pay
    tree = policy.decide(1, max_candidates=15, tree=(16, 6.0))
    assert tree.source == "drafter" and tree.num_masks == 15
    assert policy.decide(1, max_candidates=15, tree=(16, 0.0)).source == "target"
    # the same gain, with verification of 16 nodes made dear, does not pay
    dear = DraftPolicy(verify_curve=CostCurve({1: 0.05, 17: 0.5}), draft_curve=draft, max_drafts=15,
                       explore_every=None)
    assert dear.decide(1, max_candidates=15, tree=(16, 6.0)).source == "target"




@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("budget", [None, 6])
def test_drafter_attends_to_the_target_cache(family, budget):
    """A drafter that runs the target's own layers reads the committed tokens' keys and values from the target's
    cache: every pass after the first ingests one token, and the drafts are those of its own cache (same rounds)."""
    target = tiny_target(family, seed=3, sharpen=5.0)
    drafter = _sharing_drafter(target)
    ingested = []
    draft_logits = drafter.draft_logits

    def recording(committed, cache, **kwargs):
        ingested.append((committed.shape[1], cache.get_seq_length()))
        return draft_logits(committed, cache, **kwargs)

    drafter.draft_logits = recording
    caught_up = False
    for seed in range(3):
        ids = random_prompt(7, seed=seed)
        ref = target.generate(ids, max_new_tokens=30, do_sample=False)
        ingested.clear()
        shared = _generate(target, ids, drafter, d3d_tree_budget=budget)
        stats = drafter.last_generation_stats
        assert stats.shared_target_cache and shared.tolist() == ref.tolist()
        assert ingested[0] == (ids.shape[1], 0) and all(n == 1 for n, _ in ingested[1:])
        shared_lengths = stats.acceptance_lengths
        ingested.clear()
        own = _generate(target, ids, drafter, d3d_tree_budget=budget, d3d_share_target_cache=False)
        assert not drafter.last_generation_stats.shared_target_cache and own.tolist() == ref.tolist()
        caught_up |= any(n > 1 for n, _ in ingested[1:])  # its own cache catches up on accepted drafts
        assert drafter.last_generation_stats.acceptance_lengths == shared_lengths
    assert caught_up


def test_target_cache_is_not_shared_when_the_keys_would_differ():
    target = tiny_target("llama", seed=3, sharpen=5.0)
    copy = perturbed_drafter(target, 6, scale=0.01)  # its own (perturbed) weights
    _generate(target, random_prompt(7), copy)
    assert not copy.last_generation_stats.shared_target_cache
    skipping = D3DForDiffusionDrafting.from_autoregressive(target, layer_ids=[0, 2], block_size=6,
                                                           shares_target_weights=True)  # layer 1 skipped
    ids = random_prompt(7)
    assert _generate(target, ids, skipping).tolist() == target.generate(ids, max_new_tokens=30,
                                                                         do_sample=False).tolist()
    assert not skipping.last_generation_stats.shared_target_cache
    async_config = GenerationConfig(max_new_tokens=10, do_sample=False, d3d_num_drafts="full", d3d_async=True)
    sharing = _sharing_drafter(target)
    target.generate(ids, assistant_model=sharing, generation_config=async_config)
    assert not sharing.last_generation_stats.shared_target_cache  # asynchronous drafting must not wait for the target
