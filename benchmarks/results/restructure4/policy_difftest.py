"""Old vs new round decisions on random states (issue 36 item 3): the policy of commit 682a93e (chain `decide` and
`choose`, the tree warm-up override and `_adaptive_tree_size`, `BatchedRounds._decide` / `_choose`) against the one
`DraftPolicy.decide` / `choose` of this commit, over 300 random policies x 60 chain rounds, 20 tree rounds and 30
batch rounds each (random cost curves, acceptance, lookup matches, limits, ready blocks; the policies learn the same
outcomes as they go). Prints every differing decision and `bad N`.

    git worktree add /tmp/old 682a93e && mkdir -p /tmp/oldpkg && cp -r /tmp/old/modeling /tmp/oldpkg/old_modeling
    python benchmarks/results/restructure4/policy_difftest.py /tmp/oldpkg
"""
import random, sys, types
sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "/tmp/oldpkg")
import old_modeling.policy_d3d as OP
import old_modeling.estimates_d3d as OE
import old_modeling.batched_decoding_d3d as OB
from d3d_hf.modeling import policy_d3d as NP
from d3d_hf.modeling import estimates_d3d as NE

def curves(E, rng):
    pts = {1: rng.uniform(0.01, 0.05)}
    for q in (2, 4, 8, 16, 32, 64):
        pts[q] = pts[max(pts)] * rng.uniform(0.95, 1.5)
    d = {1: rng.uniform(0.005, 0.06)}
    for q in (4, 16, 64):
        d[q] = d[max(d)] * rng.uniform(0.95, 1.6)
    return E.CostCurve(pts), E.CostCurve(d)

def make(P, E, seed, mode, explore):
    rng = random.Random(seed)
    v, d = curves(E, rng)
    if rng.random() < 0.1: d = None
    return P.DraftPolicy(v, d, max_drafts=15, mode=mode, explore_every=explore)

def same(a, b, what):
    if a != b:
        print("DIFF", what, a, b); return False
    return True

bad = 0
for seed in range(300):
    rng = random.Random(1000 + seed)
    mode = rng.choice(["adaptive"] * 4 + [3, 15, "off"])
    explore = rng.choice([None, 4, 256])
    old, new = make(OP, OE, seed, mode, explore), make(NP, NE, seed, mode, explore)
    for rnd in range(60):
        num_pending = rng.randint(1, 4)
        lookup = rng.choice([0, 0, 3, 10])
        maxc = rng.choice([None, 15, 15, 15, 5, 0, 1])
        ngram = rng.choice([None, 2, 3])
        ready = rng.choice([0, 0, 0, 15]) if mode != "off" else 0
        kw = dict(max_candidates=maxc, lookup_ngram_size=ngram)
        if ready: kw["ready_masks"] = ready
        do = old.decide(num_pending, lookup, **kw); dn = new.decide(num_pending, lookup, **kw)
        fields = ["source", "num_masks", "num_lookup", "num_pending", "explore", "target_rate", "drafter_rate", "lookup_rate", "expected_rate", "lookup_ngram_size", "ready"]
        od = {f: getattr(do, f) for f in fields}; nd = {f: getattr(dn, f) for f in fields}
        if isinstance(mode, int) and mode and do.source == "drafter" and not ready:
            # new: num_masks = min(k, limit) as before; the pass keeps the whole block
            assert dn.pass_masks == mode, (dn, mode)
        if isinstance(mode, int):  # fixed: rates informational; the draft curve learns the whole block's rows now
            for f in ("drafter_rate", "expected_rate"): od.pop(f); nd.pop(f)
        if not same(od, nd, (seed, rnd, "decide")): bad += 1; break
        # choose
        confs = [rng.random() for _ in range(rng.randint(0, 8))]
        secs = rng.uniform(0, 0.05)
        if not same(old.choose(confs, secs, do), new.choose(confs, secs, dn), (seed, rnd, "choose")): bad += 1; break
        sent = rng.randint(0, len(confs)) if do.source == "drafter" else (do.num_lookup if do.source == "lookup" else 0)
        acc = rng.randint(0, sent)
        kwo = dict(num_sent=sent, num_accepted=acc, confidences=confs if len(confs) >= sent else None, draft_seconds=None if do.ready or do.source != "drafter" else secs, verify_seconds=rng.uniform(0.01, 0.08), verify_rows=sent + 1)
        old.observe_round(do, **kwo); new.observe_round(dn, **kwo)
    # tree
    for rnd in range(20):
        if mode != "adaptive": break
        gain = rng.choice([None, 1.3, 0.8])
        lookup = rng.choice([0, 5])
        if gain is None:
            do = old.decide(1, lookup, max_candidates=15)
            if old.draft_curve is not None:
                import dataclasses
                do = dataclasses.replace(do, source="drafter", num_masks=15, num_lookup=0, explore=True)
        else:
            do = old.decide(1, lookup, max_candidates=15, tree=(16, gain))
        dn = new.decide(1, lookup, max_candidates=15, tree=(16, gain))
        if not same({f: getattr(do, f) for f in fields}, {f: getattr(dn, f) for f in fields}, (seed, rnd, "tree")): bad += 1; break
        probs = sorted((rng.random() for _ in range(rng.randint(0, 16))), reverse=True)
        tree = types.SimpleNamespace(probabilities=probs, __len__=lambda: len(probs))
        class T: pass
        t = T(); t.probabilities = probs; T.__len__ = lambda self: len(self.probabilities)
        fake = types.SimpleNamespace(planner=types.SimpleNamespace(policy=old))
        import old_modeling.tree_rounds_d3d as OT
        a = OT.TreeRounds._adaptive_tree_size(fake, t, 1, 0.01)
        if not same(a, new.choose_tree_size(probs, 0.01), (seed, rnd, "tree size")): bad += 1; break

# batch
for seed in range(300):
    rng = random.Random(5000 + seed)
    mode = rng.choice(["adaptive"] * 5 + [3, "off"])
    old, new = make(OP, OE, seed, mode, 256), make(NP, NE, seed, mode, 256)
    for pol in (old, new):
        if rng.random() < 0.7:
            pass
    obs = rng.random() < 0.8
    for rnd in range(30):
        b = rng.randint(1, 5)
        limits = [rng.choice([15, 15, 7, 0, 2]) for _ in range(b)]
        lookups = [(list(range(rng.choice([0, 0, 4, 9]))), rng.choice([0, 2, 3])) for _ in range(b)]
        lookups = [(t[:lim], n) for (t, n), lim in zip(lookups, limits)]
        pending = [rng.randint(1, 3) for _ in range(b)]
        dpending = [rng.randint(1, 3) for _ in range(b)]
        shared = rng.random() < 0.3
        num_slots = rng.choice([0, 10])
        planner_mode = "adaptive" if mode == "adaptive" else str(mode)
        fake = types.SimpleNamespace(
            generator=types.SimpleNamespace(planner=types.SimpleNamespace(policy=old, mode=planner_mode, fixed_num_drafts=None if mode == "adaptive" else (0 if mode == "off" else mode))),
            active=list(range(b)), pending=lambda r: pending[r], draft_pending=lambda r: dpending[r],
            shared=shared, slots=types.SimpleNamespace(num_slots=num_slots))
        fake._rate_options = lambda l, lk, fake=fake: OB.BatchedRounds._rate_options(fake, l, lk)
        OB._BATCHED_COSTS[old] = OB._BATCHED_COSTS.get(old) or OE.BatchedCosts(old.curve_weight)
        src, masks, use = OB.BatchedRounds._decide(fake, limits, lookups)
        states = [NP.SequenceState(l, dp, p, len(t), n or None) for l, dp, p, (t, n) in zip(limits, dpending, pending, lookups)]
        dn = new.decide(batch=states, draft_pass=not (shared and num_slots == 0))
        nmasks = dn.num_lookup if dn.source == "lookup" else dn.pass_masks
        nuse = list(dn.lookup_rows or (False,) * b)
        if src == "target":
            ok = dn.source == "target"
        else:
            ok = (src, masks, list(use)) == (dn.source, nmasks, nuse)
        if not ok:
            print("DIFF batch decide", seed, rnd, (src, masks, use), (dn.source, nmasks, nuse), limits, lookups, pending, mode); bad += 1; break
        warm = getattr(fake, "warm_up", False)
        assert warm == (dn.explore), (warm, dn)
        # choose
        if src == "drafter" and planner_mode == "adaptive" and not warm:
            plans = []
            for r in range(b):
                if use[r] and min(len(lookups[r][0]), limits[r], masks) > 0:
                    cnt = min(len(lookups[r][0]), limits[r], masks)
                    pl = OB._Plan("lookup", [0] * cnt, [0] * cnt, ngram=lookups[r][1]); pl.probabilities = old.lookup.probabilities(cnt, lookups[r][1] or None)
                elif limits[r] == 0:
                    pl = OB._Plan()
                else:
                    n = min(masks, limits[r]); c = [rng.random() for _ in range(n)]
                    pl = OB._Plan("drafter", [0] * n, [0] * n, c)
                plans.append(pl)
            secs = rng.uniform(0, 0.05)
            OB.BatchedRounds._choose(fake, plans, secs)
            k_old = max((len(p.drafts) for p in plans if p.source == "drafter"), default=0)
            nstates = [NP.SequenceState(verify_pending=pending[r], lookup_tokens=len(p.drafts) if p.source == "lookup" else 0, lookup_ngram_size=(p.ngram or None) if p.source == "lookup" else None) for r, p in enumerate(plans)]
            confs = [p.confidences or [] if p.source == "drafter" else None for p in plans]
            k_new = new.choose(confs, secs, dn, batch=nstates)
            cut = [min(k_new, len(c)) for c in confs if c is not None]
            if [len(p.drafts) for p in plans if p.source == "drafter"] != cut:
                print("DIFF batch choose", seed, rnd, k_old, k_new); bad += 1; break
        if obs:
            c = [rng.random() for _ in range(4)]
            a = rng.randint(0, 4)
            old.calibrator.observe(c, a, 4); new.calibrator.observe(c, a, 4)
print("bad", bad)
