"""The expert-learning block KVLearn (``serving/policies/kvlearn_experts.py``): with one expert it
is that expert (``lru`` → ``mooncake``, ``lfu`` → ``lfu``) event for event through the real
engine; with two, the ghost histories, the regret and the weights on a hand-worked trace; the
pure update functions; hyper-parameter validation."""

import math

import numpy as np
import pytest
from test_kvlearn_classical_serving import random_requests

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine, predictors
from jaxkv.kvlearn.serving import policies as policies_lib
from jaxkv.kvlearn.serving.policies import kvlearn_experts as experts_lib
from jaxkv.kvlearn.serving.policies.kvlearn import DepthCosts
from jaxkv.kvlearn.serving.policies.kvlearn_experts import (
    ExpertConfig,
    ExpertKVLearn,
    ShadowPool,
    guard,
    lead,
    penalise,
    queued_behind,
    regret,
)
from jaxkv.kvlearn.serving.prefix import PrefixCache
from jaxkv.kvlearn.traces import MooncakeTrace

COST = CostModel.llama3_8b_a100()
BT = 512


def _trace(reqs) -> MooncakeTrace:
    """Requests (lists of dense block ids), 1000 s apart: every offer lands before the next
    lookup."""
    n = len(reqs)
    return MooncakeTrace(
        time_s=np.arange(n) * 1000.0,
        input_len=np.array([BT * len(r) for r in reqs], np.int64),
        output_len=np.ones(n, np.int64),
        blocks=tuple(np.array(r, np.int64) for r in reqs),
        n_blocks=1 + max(max(r) for r in reqs),
    )


def _random_requests(seed: int, n_req: int = 400) -> list[list[int]]:
    """Requests of a random, skewed prefix tree (16 paths), sometimes with one-off tails."""
    return random_requests(seed, n_req, n_paths=16)


def _evictions(monkeypatch, name, tr, pool_blocks, nodes=1, **options):
    """(hit blocks per request, every evicted block in order) of one engine run."""
    log: list[int] = []
    cls = policies_lib.REGISTRY[name]

    class Recording(cls):
        def on_evict(self, b):
            log.append(b)
            super().on_evict(b)

    monkeypatch.setitem(policies_lib.REGISTRY, name, Recording)
    cfg = engine.ServingConfig(pool_blocks=pool_blocks, prefill_nodes=nodes)
    rec = engine.simulate(tr, name, cfg=cfg, cost=COST, **options)
    return rec["hit_blocks"].tolist(), list(log)  # a copy: a later call nests its class in this one


@pytest.mark.parametrize("expert, reference", [("lru", "mooncake"), ("lfu", "lfu")])
@pytest.mark.parametrize("seed", [0, 1])
def test_one_expert_is_that_expert_event_for_event(monkeypatch, expert, reference, seed):
    tr = _trace(_random_requests(seed))
    for pool in (3, 8, 20):
        ref = _evictions(monkeypatch, reference, tr, pool)
        got = _evictions(
            monkeypatch, "kvlearn_experts", tr, pool, experts=(expert,), predictor="logistic"
        )
        assert got == ref
        assert len(ref[1]) > 20  # the pool is under pressure


def _replay(pol: ExpertKVLearn, tr: MooncakeTrace, cache: PrefixCache):
    """The engine's order for sequential requests: lookup, touch the hits, offer the rest."""
    rec = {
        "start_s": np.zeros(len(tr)),
        "service_ms": np.zeros(len(tr)),
        "admitted_tokens": np.zeros(len(tr), np.int64),
    }
    counts = {"admits": 0, "discards": 0}
    for i, blk in enumerate(tr.blocks):
        hit = cache.match(blk)
        pol.on_access(blk, hit, i, 0.0)
        for j in range(hit):
            cache.touch(int(blk[j]), pol.prio(int(blk[j]), i, j, 0.0))
        engine.offer(cache, pol, tr, i, hit, rec, counts)
        yield i


def test_ghost_histories_and_weights_by_hand():
    """Capacity 2, experts (lru, lfu), the heaviest evicts (ties: lru), LeCaR's λ = 0.45 and
    d = 0.005^(1/2). Requests: A A B C A B (one block each; t = block accesses so far).

    C: full; lru evicts A (touched before B); H_lru = {A: t=4}. A misses at t=5, in H_lru:
    r = d^1 = 0.005^0.5, w_lru ·= e^(−λr): w = (f, 1)/(1 + f), f = e^(−λr). Storing A, lfu (now
    heavier) evicts B (count 1, older than C); H_lfu = {B: 5}. B misses at t=6: r is the same,
    so w_lfu ·= f and the weights are equal again; storing B, lru (ties) evicts C (older than A).
    """
    A, B, C = 0, 1, 2
    tr = _trace([[A], [A], [B], [C], [A], [B]])
    pol = ExpertKVLearn(
        tr,
        COST,
        pool_blocks=2,
        experts=("lru", "lfu"),
        choice="max",
        cost_weighted=False,
        predictor="logistic",
    )
    evicted: list[int] = []
    cache = PrefixCache(
        2, n_blocks=tr.n_blocks, on_evict=lambda b: (evicted.append(b), pol.on_evict(b))
    )
    pol.attach(cache)
    f = math.exp(-0.45 * 0.005**0.5)
    weights, ghosts = [], []
    for _ in _replay(pol, tr, cache):
        weights.append(pol.xs.weights_E.tolist())
        ghosts.append([dict(g) for g in pol.xs.ghosts])
    assert evicted == [A, B, C]
    np.testing.assert_allclose(weights[3], [0.5, 0.5])
    assert ghosts[3] == [{A: 4}, {}]
    np.testing.assert_allclose(weights[4], [f / (1 + f), 1 / (1 + f)], rtol=1e-12)
    assert ghosts[4] == [{}, {B: 5}]  # A left H_lru at its miss; lfu's victim B went in
    np.testing.assert_allclose(weights[5], [0.5, 0.5], rtol=1e-12)
    assert ghosts[5] == [{C: 6}, {}]
    assert pol.xs.ghost_hits_E.tolist() == [1, 1]
    assert pol.xs.evictions_E.tolist() == [2, 1]
    assert cache.resident[[A, B, C]].tolist() == [True, True, False]


def test_ghost_history_keeps_the_last_capacity_evictions():
    """One expert, capacity 1, history 2 capacities: the ghost list keeps the last 2 victims."""
    tr = _trace([[k] for k in range(6)])
    pol = ExpertKVLearn(
        tr, COST, pool_blocks=1, experts=("lru",), history=2.0, predictor="logistic"
    )
    cache = PrefixCache(1, n_blocks=tr.n_blocks, on_evict=pol.on_evict)
    pol.attach(cache)
    for _ in _replay(pol, tr, cache):
        pass
    # request k (t = k + 1 after its lookup) stores block k, evicting block k − 1 at t = k + 1
    assert dict(pol.xs.ghosts[0]) == {3: 5, 4: 6}


def test_gd_expert_inflation_follows_the_lowest_gd_leaf():
    """With (lru, gd) and lru evicting, GreedyDual's L still rises to the lowest gd value among
    the leaves at each eviction (what gd would have evicted), not to lru's victim's value."""
    tr = _trace([[0], [1], [2]])
    pol = ExpertKVLearn(
        tr, COST, pool_blocks=2, experts=("lru", "gd"), choice="max", predictor="logistic"
    )
    cache = PrefixCache(2, n_blocks=tr.n_blocks, on_evict=pol.on_evict)
    pol.attach(cache)
    pol.state.p_hat_P[:] = [0.9, 0.3, 0.5]  # gd values P̂ · s_0 (L = 0 so far)
    for i, b in enumerate((0, 1)):
        assert cache.insert(b, -1, pol.prio(b, i, 0, 0.0))
    assert cache.insert(2, -1, pol.prio(2, 2, 0, 0.0))  # lru (tie → index 0) evicts block 0
    assert not cache.resident[0] and cache.resident[1]
    assert pol.xs.inflation_E.tolist() == [0.0, pytest.approx(0.3 * pol.costs.save_ms[0])]


class RefKeyedPrefix:
    """A plain-Python prefix cache whose victim is the leaf with the lowest (value, clock) of
    its last touch, ``value(ref, b, j, resident)`` read at that touch (before the store's
    evictions); an eviction raises the inflation L to the victim's value (GreedyDual's)."""

    def __init__(self, capacity: int, value):
        self.capacity, self.value = capacity, value
        self.resident: dict[int, tuple[float, int]] = {}
        self.parent: dict[int, int] = {}
        self.clock, self.inflation = 0, 0.0

    def _touch(self, b: int, j: int) -> None:
        self.clock += 1
        self.resident[b] = (self.value(self, b, j, b in self.resident), self.clock)

    def lookup(self, blk: list[int]) -> int:
        hit = 0
        while hit < len(blk) and blk[hit] in self.resident:
            hit += 1
        for j in range(hit):
            self._touch(blk[j], j)
        return hit

    def store(self, blk: list[int], hit: int) -> None:
        """Stores blk's blocks after its hit prefix (a resident one is touched), evicting as
        needed; stops when nothing is evictable or the parent has left."""
        for j in range(hit, len(blk)):
            if j and blk[j - 1] not in self.resident:
                return
            if blk[j] in self.resident:
                self._touch(blk[j], j)
                continue
            key = (self.value(self, blk[j], j, False), self.clock + 1)
            while len(self.resident) >= self.capacity:
                pinned = blk[j - 1] if j else None
                leaves = [
                    x
                    for x in self.resident
                    if x != pinned and not any(self.parent[y] == x for y in self.resident)
                ]
                if not leaves:
                    return
                victim = min(leaves, key=self.resident.get)
                self.inflation = max(self.inflation, self.resident.pop(victim)[0])
            self.clock += 1
            self.resident[blk[j]] = key
            self.parent[blk[j]] = blk[j - 1] if j else -1


def ref_lru(capacity: int) -> RefKeyedPrefix:
    """A plain-Python LRU prefix cache: every value equal, so the least recently touched leaf
    goes first."""
    return RefKeyedPrefix(capacity, lambda *_: 0.0)


@pytest.mark.parametrize("kind", ["lru", "lfu", "gdsf", "gd"])
def test_shadow_pool_keeps_what_its_expert_alone_would_keep(kind):
    """Each expert's shadow of capacity 4 against ``RefKeyedPrefix`` (touch the hit prefix,
    store the rest at once, evict the leaf of lowest value, then least recently touched) with
    the expert's value written out from the policy's arrays (random access counts and P̂;
    ``lru``: all equal), request by request: the same resident blocks, and the saving Σ s_j
    over the hit prefix."""
    reqs = _random_requests(3, n_req=300)
    tr = _trace(reqs)
    pol = ExpertKVLearn(tr, COST, pool_blocks=4, experts=("lru",), predictor="logistic")
    rng = np.random.default_rng(0)
    pol.state.count_P[:] = rng.integers(0, 5, tr.n_blocks)
    pol.state.p_hat_P[:] = rng.random(tr.n_blocks)
    freq: dict[int, int] = {}

    def value(ref, b, j, resident):
        if kind == "lru":
            return 0.0
        if kind == "lfu":
            return int(pol.state.count_P[b])
        if kind == "gd":
            return ref.inflation + float(pol.state.p_hat_P[b]) * float(pol.costs.save_ms[j])
        freq[b] = freq.get(b, 0) + 1 if resident else 1
        return ref.inflation + freq[b] * float(pol.block_save_P[b])

    sh, ref = ShadowPool(kind, 4, tr.n_blocks), RefKeyedPrefix(4, value)
    for blk in tr.blocks:
        blk = blk.tolist()
        hit = ref.lookup(blk)
        assert sh.step(pol, np.array(blk)) == pytest.approx(sum(pol.costs.save_ms[:hit]))
        ref.store(blk, hit)
        assert set(np.flatnonzero(sh.cache.resident).tolist()) == set(ref.resident)


def test_shadow_leader_needs_a_margin():
    assert lead(np.array([10.0, 10.1]), 0, margin=0.02) == 0  # 1 % ahead: not enough
    assert lead(np.array([10.0, 10.3]), 0, margin=0.02) == 1
    assert lead(np.array([10.0, 10.3, 12.0]), 1, margin=0.02) == 2
    assert lead(np.zeros(2), 1, margin=0.0) == 1  # ties keep the leader


def test_shadow_choice_follows_the_best_shadow(tmp_path):
    """(lfu, lru) with shadows on a scan-then-reuse trace: the expert whose own pool saved
    more leads, and the real pool evicts by its order."""
    hot = [[0], [1]]
    reqs = (hot * 3 + [[10 + k] for k in range(4)]) * 6
    tr = _trace(reqs)
    pol = ExpertKVLearn(
        tr, COST, pool_blocks=3, experts=("lru", "lfu"), choice="shadow", predictor="logistic"
    )
    cache = PrefixCache(3, n_blocks=tr.n_blocks, on_evict=pol.on_evict)
    pol.attach(cache)
    for _ in _replay(pol, tr, cache):
        pass
    # capacity 3: lfu keeps the hot blocks 0 and 1 through every scan of 4 one-off blocks (one
    # slot cycles), lru loses both to each scan and misses them twice per round
    assert pol.shadows[1].cache.resident[[0, 1]].all()
    assert pol.xs.score_E[1] > pol.xs.score_E[0] and pol.xs.leader == 1
    assert cache.resident[[0, 1]].all() and pol.xs.evictions_E[1] > 0


def _lfu_guard(tr, **settings):
    """A zero-slack guard over mooncake with lfu as the learner, in a 2-block pool that
    records its evictions: (policy, cache, evicted)."""
    pol = ExpertKVLearn(
        tr,
        COST,
        pool_blocks=2,
        experts=("lfu",),
        baselines=("mooncake",),
        choice="guard",
        slack=0.0,
        predictor="logistic",
        **settings,
    )
    evicted: list[int] = []
    cache = PrefixCache(
        2, n_blocks=tr.n_blocks, on_evict=lambda b: (evicted.append(b), pol.on_evict(b))
    )
    pol.attach(cache)
    return pol, cache, evicted


def test_guard_backs_off_to_the_baseline_by_hand(monkeypatch):
    """Capacity 2, guard over (lfu, lru), slack 0: lfu evicts while the real pool has saved at
    least what the lru shadow saved. Requests A A B C B C (one block each, saving s_0 per hit).

    Shadow (``mooncake``): hits at requests 1, 4, 5 (C evicts A, touched before B). Real: A hits
    at 1 (S = S_b = s_0, lfu leads); C's store evicts lfu's lowest, B (1 access against A's 2).
    B misses at 4 where the shadow hits: S = s_0 < S_b = 2 s_0, the learner backs off, and B's
    store evicts A, the leaf the shadow does not hold. Now the pools agree; C hits at 5 in both
    (S = 2 s_0 < S_b = 3 s_0). lfu alone evicts C at 4 (1 access against A's 2) and misses it
    at 5."""
    A, B, C = 0, 1, 2
    tr = _trace([[A], [A], [B], [C], [B], [C]])
    pol, cache, evicted = _lfu_guard(tr)
    s0 = pol.costs.save_ms[0]
    trail = [
        (pol.xs.saved_real / s0, pol.xs.saved_base_B[0] / s0, pol.xs.leader)
        for _ in _replay(pol, tr, cache)
    ]
    assert trail == [(0, 0, 0), (1, 1, 0), (1, 1, 0), (1, 1, 0), (1, 2, 1), (2, 3, 1)]
    assert evicted == [B, A]
    assert pol.xs.backoff_requests == 2 and pol.xs.follow_evictions == 1
    shadow = pol.shadows[0].cache
    assert shadow.resident[[A, B, C]].tolist() == [False, True, True]
    assert cache.resident[[A, B, C]].tolist() == [False, True, True]
    alone = _evictions(
        monkeypatch, "kvlearn_experts", tr, 2, experts=("lfu",), predictor="logistic"
    )
    assert alone == ([0, 1, 0, 0, 0, 0], [B, C, A])  # lfu alone: C evicted at 4, missed at 5


def test_guard_window_spends_only_a_recent_lead_by_hand():
    """Capacity 2, guard over mooncake (learner lfu, slack 0). Requests A A B C A D C D C (one
    block each). lfu keeps A (3 accesses) where the lru shadow lets it go at C, so the real
    pool banks one hit at A (request 4: S = 2 s_0 against S_b = s_0); from D (request 5) on, lfu
    keeps A and loses D and C in turn, while the shadow holds {D, C} and hits at 7 and 8.

    Cumulative rule (window 0): at 7 S = S_b = 2 s_0, a tie, so lfu still evicts (C, the
    lower count), C misses at 8 and only then does the guard back off (C's store evicts A). Window 1 (only this
    request counts): at 7 the real pool saved 0 where the shadow saved s_0, so it backs off at
    once, evicts A (the leaf the shadow does not hold) for D, and C hits at 8."""
    A, B, C, D = 0, 1, 2, 3
    tr = _trace([[A], [A], [B], [C], [A], [D], [C], [D], [C]])
    trails = {}
    for window in (0.0, 1.0):
        pol, cache, evicted = _lfu_guard(tr, window=window)
        s0 = pol.costs.save_ms[0]
        trail = [(pol.xs.saved_real / s0, pol.xs.leader) for _ in _replay(pol, tr, cache)]
        trails[window] = trail, evicted, pol.xs.saved_base_B[0] / s0
    #                  A       A       B       C       A       D       C       D       C
    assert trails[0.0] == (
        [(0, 0), (1, 0), (1, 0), (1, 0), (2, 0), (2, 0), (2, 0), (2, 0), (2, 1)],
        [B, C, D, C, A],
        3,
    )
    assert trails[1.0] == (
        [(0, 0), (1, 0), (1, 0), (1, 0), (2, 0), (2, 0), (2, 0), (2, 1), (3, 0)],
        [B, C, D, A],
        3,
    )


def test_guard_window_as_long_as_the_trace_is_the_cumulative_rule(monkeypatch):
    """A window far longer than the trace decays nothing that matters: the guard is the
    cumulative one event for event (hits and evictions), with overlapping requests."""
    reqs = _random_requests(5)
    tr = _overlapping(reqs)
    kw = dict(experts=("gd",), baselines=("mooncake", "gdsf"), choice="guard", slack=0.003)
    ref = _evictions(monkeypatch, "kvlearn_experts", tr, 8, 3, **kw)
    got = _evictions(monkeypatch, "kvlearn_experts", tr, 8, 3, window=1e12, **kw)
    assert got == ref and len(ref[1]) > 20


def test_guard_rule():
    """Back off iff full − S > (1 + slack)(full − S_b): the queue-free TTFT of the real pool
    above (1 + slack) × the baseline's."""
    assert guard(50.0, 50.0, 100.0, slack=0.0) == 0
    assert guard(49.0, 50.0, 100.0, slack=0.0) == 1
    assert guard(49.0, 50.0, 100.0, slack=0.02) == 0  # 51 ≤ 1.02 × 50
    assert guard(48.9, 50.0, 100.0, slack=0.02) == 1
    assert guard(60.0, 50.0, 100.0, slack=0.0) == 0


def _overlapping(reqs) -> MooncakeTrace:
    """Requests 2 ms apart: on 3 prefill nodes many start before an earlier one finishes."""
    n = len(reqs)
    return MooncakeTrace(
        time_s=np.arange(n) * 0.002,
        input_len=np.array([BT * len(r) for r in reqs], np.int64),
        output_len=np.ones(n, np.int64),
        blocks=tuple(np.array(r, np.int64) for r in reqs),
        n_blocks=1 + max(max(r) for r in reqs),
    )


def test_guard_shadow_has_the_real_timing(monkeypatch):
    """The guard's lru shadow stores a request's blocks when the real pool is offered them.
    Overlapping requests (3 prefill nodes, 2 ms apart; learner lfu, never backing off or at
    once): its hits equal a plain-Python LRU prefix cache replayed with the run's own order of
    lookups and offers, request by request, and its saving is Σ s_j over them. Sequential
    requests (each offered before the next lookup): that is ``mooncake``'s pool, whatever the
    real pool does."""
    events: list[tuple] = []

    class Recording(ExpertKVLearn):
        def on_access(self, blocks, hit, i, now):
            super().on_access(blocks, hit, i, now)
            events.append(("lookup", i, self.shadows[0].hits[i], self.xs.saved_base_B[0]))

        def on_offer(self, i):
            events.append(("offer", i))
            super().on_offer(i)

    monkeypatch.setitem(policies_lib.REGISTRY, "kvlearn_experts", Recording)
    reqs = _random_requests(3)
    kw = dict(experts=("lfu",), choice="guard", predictor="logistic")
    for tr, nodes in ((_overlapping(reqs), 3), (_trace(reqs), 1)):
        cfg = engine.ServingConfig(pool_blocks=8, prefill_nodes=nodes)
        s_j = DepthCosts.of(tr, COST, write_cost=False).save_ms
        for slack in (0.99, 0.0):
            events.clear()
            rec = engine.simulate(tr, "kvlearn_experts", cfg=cfg, cost=COST, slack=slack, **kw)
            ref, hits, saved = ref_lru(8), {}, 0.0
            for e in events:
                if e[0] == "lookup":
                    hits[e[1]] = ref.lookup(reqs[e[1]])
                    saved += s_j[: hits[e[1]]].sum()
                    assert e[2] == hits[e[1]] and e[3] == pytest.approx(saved, rel=1e-12)
                else:
                    ref.store(reqs[e[1]], hits[e[1]])
            assert len(hits) == len(reqs)
        if nodes == 3:
            finish = rec["start_s"] + rec["service_ms"] / 1e3
            assert (rec["start_s"][1:] < finish[:-1]).sum() > 100  # requests overlap
    moon = engine.simulate(tr, "mooncake", cfg=cfg, cost=COST)["hit_blocks"]
    assert [e[2] for e in events if e[0] == "lookup"] == moon.tolist()


@pytest.mark.parametrize("baseline", ["lru", "s3fifo", "arc", "slru", "wtinylfu"])
def test_an_independent_key_shadow_is_its_policy(monkeypatch, baseline):
    """A baseline that keeps blocks as independent keys (``lru``, ``s3fifo``, ``arc``,
    ``slru``, ``wtinylfu``: it may hold a
    block without its parent) runs in its shadow exactly as alone, whatever the real pool does:
    on sequential requests its hits are the policy's own engine run's, request by request,
    with the learner never backing off (slack 0.99) and backing off whenever behind (0). The
    real pool, prefix-closed, then only approximates it (no event-for-event claim)."""
    hits: list[int] = []

    class Recording(ExpertKVLearn):
        def on_access(self, blocks, hit, i, now):
            super().on_access(blocks, hit, i, now)
            hits.append(self.shadows[1].hits[i])

    monkeypatch.setitem(policies_lib.REGISTRY, "kvlearn_experts", Recording)
    tr = _trace(_random_requests(6))
    cfg = engine.ServingConfig(pool_blocks=8, prefill_nodes=1)
    want = engine.simulate(tr, baseline, cfg=cfg, cost=COST)["hit_blocks"].tolist()
    kw = dict(experts=("gd",), baselines=("mooncake", baseline), choice="guard")
    for slack in (0.99, 0.0):
        hits.clear()
        rec = engine.simulate(tr, "kvlearn_experts", cfg=cfg, cost=COST, slack=slack, **kw)
        assert hits == want and rec["evictions"] > 20
    assert sum(want) > 50


@pytest.mark.parametrize("baseline", ["mooncake", "lfu", "gdsf", "cost_aware"])
def test_a_guard_that_always_backs_off_is_its_baseline(monkeypatch, baseline):
    """Forced to back off from the first request, the guard's real pool evicts only blocks its
    baseline's shadow no longer holds: with both pools starting empty and the same timing, it is
    that classical policy event for event (every request's hits and every eviction in order),
    on sequential and on overlapping requests (3 prefill nodes)."""
    monkeypatch.setattr(experts_lib, "guard", lambda *a, **k: True)
    reqs = _random_requests(4)
    for tr, nodes in ((_trace(reqs), 1), (_overlapping(reqs), 3)):
        for pool in (4, 9):
            kw = dict(experts=("gd",), baselines=(baseline,), choice="guard")
            got = _evictions(monkeypatch, "kvlearn_experts", tr, pool, nodes, **kw)
            want = _evictions(monkeypatch, baseline, tr, pool, nodes)
            assert got == want and len(want[1]) > 20


@pytest.mark.parametrize(
    "baseline, policy, options",
    [
        ("mooncake", "mooncake", {}),
        ("gdsf", "gdsf", {}),
        ("cost_aware", "cost_aware", {}),
        ("gd", "kvlearn", {"retention": "gd", "write_cost": False}),  # block KVLearn itself
        ("gdlog", "kvlearn", {"retention": "gd", "write_cost": False, "predictor": "logistic"}),
    ],
)
def test_a_guard_with_no_learner_is_its_baseline(monkeypatch, baseline, policy, options):
    """``learner=False`` follows the best baseline from the first request: with one baseline
    it is that policy event for event (hits and every eviction in order), on sequential and on
    overlapping requests, and it never trains the guard's own PRP."""
    reqs = _random_requests(5)
    kw = dict(experts=("lru",), baselines=(baseline,), choice="guard", learner=False)
    for tr, nodes in ((_trace(reqs), 1), (_overlapping(reqs), 3)):
        for pool in (4, 9):
            got = _evictions(monkeypatch, "kvlearn_experts", tr, pool, nodes, **kw)
            want = _evictions(monkeypatch, policy, tr, pool, nodes, **options)
            assert got == want and len(want[1]) > 20
    pol = ExpertKVLearn(_trace(reqs), COST, pool_blocks=4, **kw)
    monkeypatch.setitem(policies_lib.REGISTRY, "kvlearn_experts", lambda *a, **k: pol)
    engine.simulate(_trace(reqs), "kvlearn_experts", cfg=engine.ServingConfig(4), cost=COST)
    assert pol.xs.backoff_requests == len(reqs) and not pol.pred.trained


def test_the_gd_shadow_ends_its_lookups_late_with_the_same_decisions(monkeypatch):
    """The ``gd`` shadow's lookup ends late: its counts at the shadow's next lookup or store,
    P̂ (after its PRP's training round) and its touches at its next store, so the round runs
    while the other pools work; it also looks up first. With several shadows, overlapping
    requests and a pool small enough for many evictions, every hit and every eviction in order
    is what ending each lookup at once (in the baselines' order) gives, and stores did end
    lookups late, two or more at once, with the PRP training in between."""
    reqs = _random_requests(7, 600)
    kw = dict(experts=("lru",), baselines=("lfu", "gdsf", "gd"), choice="guard", learner=False)
    late, rounds, shadow = [], [], experts_lib.ShadowPolicy
    finish, flush = shadow.finish, predictors.DeferredPRP._flush

    def ending(sh):
        late.append(len(sh._unset) + (sh._unfinished is not None))  # lookups this ends
        finish(sh)

    monkeypatch.setattr(shadow, "finish", ending)
    monkeypatch.setattr(predictors.DeferredPRP, "_flush", lambda p: rounds.append(1) or flush(p))
    init = shadow.__init__

    def at_once(self, *a, **k):
        init(self, *a, **k)
        self.defers = False  # the gd shadow's on_access whole, inside its lookup

    for tr, nodes in ((_trace(reqs), 1), (_overlapping(reqs), 3)):
        got = _evictions(monkeypatch, "kvlearn_experts", tr, 9, nodes, **kw)
        with monkeypatch.context() as m:
            m.setattr(shadow, "__init__", at_once)
            want = _evictions(monkeypatch, "kvlearn_experts", tr, 9, nodes, **kw)
        assert got == want and len(want[1]) > 50
    assert sum(n >= 1 for n in late) > 500 and sum(n >= 2 for n in late) > 0
    assert len(rounds) > 20


def test_a_guard_with_no_learner_follows_the_baseline_that_saved_most(monkeypatch):
    """With two baselines and no learner, the real pool's hits are, request by request, those
    of a guard forced to back off from the first request (``guard`` patched to True), whose
    learner's order (``lru``, neither baseline's) then decides nothing either."""
    tr = _trace(_random_requests(6))
    kw = dict(experts=("lru",), baselines=("lfu", "gdsf"), choice="guard")
    got = _evictions(monkeypatch, "kvlearn_experts", tr, 8, learner=False, **kw)
    monkeypatch.setattr(experts_lib, "guard", lambda *a, **k: True)
    want = _evictions(monkeypatch, "kvlearn_experts", tr, 8, **kw)
    assert got == want and len(want[1]) > 20


def test_a_guard_backed_off_to_a_longer_decay_is_cost_aware_with_it(monkeypatch):
    """``cost_aware@3`` is ``cost_aware`` with its τ scaled by 3, event for event."""
    monkeypatch.setattr(experts_lib, "guard", lambda *a, **k: True)
    tr = _trace(_random_requests(4))
    kw = dict(experts=("gd",), baselines=("cost_aware@3",), choice="guard")
    got = _evictions(monkeypatch, "kvlearn_experts", tr, 9, **kw)
    want = _evictions(monkeypatch, "cost_aware", tr, 9, tau_scale=3.0)
    assert got == want and len(want[1]) > 20
    assert want != _evictions(monkeypatch, "cost_aware", tr, 9)  # the decay matters here


@pytest.mark.parametrize("name", ["cost_aware@0", "cost_aware@-1", "cost_aware@x", "gdsf@2"])
def test_a_scaled_baseline_must_be_cost_aware_with_a_positive_scale(name):
    with pytest.raises(ValueError, match="baselines"):
        ExpertConfig(experts=("gd",), choice="guard", baselines=(name,))
    with pytest.raises(ValueError, match="unknown baseline"):
        experts_lib.baseline_policy(name, _trace([[1]]), COST, pool_blocks=4)


def test_update_functions():
    assert regret(0, capacity=10, discount=0.005) == 1.0
    assert regret(10, capacity=10, discount=0.005) == pytest.approx(0.005)
    assert regret(5, capacity=10, discount=0.005) == pytest.approx(0.005**0.5)
    w = penalise(np.array([0.25, 0.75]), 0, 1.0, learning_rate=0.45)
    a = 0.25 * math.exp(-0.45)
    np.testing.assert_allclose(w, [a / (a + 0.75), 0.75 / (a + 0.75)], rtol=1e-12)
    assert w.sum() == pytest.approx(1.0)


def test_hyper_parameters_are_validated(tmp_path):
    with pytest.raises(ValueError, match="experts"):
        ExpertConfig(experts=("lru", "arc"))
    with pytest.raises(ValueError, match="experts"):
        ExpertConfig(experts=("lru", "lru"))
    with pytest.raises(ValueError, match="experts"):
        ExpertConfig(experts=())
    with pytest.raises(ValueError, match="choice"):
        ExpertConfig(choice="vote")
    with pytest.raises(ValueError, match="margin"):
        ExpertConfig(choice="shadow", margin=-0.1)
    with pytest.raises(ValueError, match="discount"):
        ExpertConfig(discount=0.0)
    with pytest.raises(ValueError, match="one expert"):
        ExpertConfig(experts=("gd", "lru"), choice="guard")
    with pytest.raises(ValueError, match="baselines"):
        ExpertConfig(experts=("gd",), choice="guard", baselines=("belady",))
    with pytest.raises(ValueError, match="baselines"):
        ExpertConfig(experts=("gd",), choice="guard", baselines=())
    with pytest.raises(ValueError, match="slack"):
        ExpertConfig(experts=("gd",), choice="guard", slack=1.0)
    with pytest.raises(ValueError, match="window"):
        ExpertConfig(experts=("gd",), choice="guard", window=0.5)
    with pytest.raises(ValueError, match="learner=False"):
        ExpertConfig(experts=("gd",), choice="guard", learner=False)
    with pytest.raises(ValueError, match="learner=False"):
        ExpertConfig(experts=("lru",), choice="shadow", learner=False)
    tr = _trace([[0, 1]])
    pol = ExpertKVLearn(tr, COST, pool_blocks=4, experts=["lfu", "gd"], predictor="logistic")
    assert pol.xcfg.experts == ("lfu", "gd") and pol.cfg.write_cost is False
    assert ExpertConfig() == ExpertConfig(experts=("gd", "gdsf", "lru", "lfu"), choice="shadow")
    assert "kvlearn_experts" in policies_lib.BLOCK_POLICIES


def test_queued_behind_counts_the_later_arrivals_by_a_start():
    arrival = [0.0, 1.0, 1.0, 2.0, 5.0]
    assert [queued_behind(arrival, i, s) for i, s in enumerate([1.5, 2.0, 2.0, 4.0, 5.0])] == [
        2,  # requests 1 and 2 arrived by 1.5
        2,  # 2 and 3 (an arrival at the start itself waits)
        1,
        0,
        0,
    ]


def test_queue_weight_weights_each_request_by_the_queue_behind_it(monkeypatch):
    """The guard's full-TTFT sum with ``queue_weight`` c and ``size_power`` γ is Σ_i full_i ·
    (1 + c · q_i) · full_i^γ, q_i counted from the run's own start times (brute force); with no
    queue (requests 1000 s apart) c changes nothing, record for record."""
    seen = []

    class Keep(ExpertKVLearn):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setitem(policies_lib.REGISTRY, "kvlearn_experts", Keep)
    reqs = _random_requests(4)
    kw = dict(experts=("gd",), choice="guard", baselines=("mooncake", "lfu"), slack=0.0)
    kw |= dict(predictor="logistic")
    cfg = engine.ServingConfig(pool_blocks=8, prefill_nodes=1)
    tr = _overlapping(reqs)
    for c, power in ((0.5, 0.0), (0.5, 1.0), (0.0, 2.0)):
        rec = engine.simulate(
            tr, "kvlearn_experts", cfg=cfg, cost=COST, queue_weight=c, size_power=power, **kw
        )
        q = [int(np.sum(tr.time_s[i + 1 :] <= rec["start_s"][i])) for i in range(len(reqs))]
        assert max(q) > 10  # one node, requests 2 ms apart: a long queue
        pol = seen[-1]
        want = sum(f * (1.0 + c * n) * f**power for f, n in zip(pol.full_ms, q, strict=True))
        assert pol.xs.full == pytest.approx(want, rel=1e-12)
    quiet = _trace(reqs)
    runs = [
        engine.simulate(quiet, "kvlearn_experts", cfg=cfg, cost=COST, queue_weight=c, **kw)
        for c in (0.0, 0.5)
    ]
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        np.testing.assert_array_equal(runs[0][k], runs[1][k])
    with pytest.raises(ValueError, match="queue_weight must be"):
        ExpertConfig(experts=("gd",), choice="guard", queue_weight=-1.0)
    with pytest.raises(ValueError, match="size_power must be"):
        ExpertConfig(experts=("gd",), choice="guard", size_power=math.nan)
