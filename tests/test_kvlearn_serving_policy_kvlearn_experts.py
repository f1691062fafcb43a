"""The expert-learning block KVLearn (``serving/policies/kvlearn_experts.py``): with one expert it
is that expert (``lru`` → ``mooncake``, ``lfu`` → ``lfu``) event for event through the real
engine; with two, the ghost histories, the regret and the weights on a hand-worked trace; the
pure update functions; hyper-parameter validation."""

import math

import numpy as np
import pytest
from test_kvlearn_classical_serving import random_requests

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine
from jaxkv.kvlearn.serving import policies as policies_lib
from jaxkv.kvlearn.serving.policies.kvlearn_experts import (
    ExpertConfig,
    ExpertKVLearn,
    ShadowPool,
    lead,
    penalise,
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


def _evictions(monkeypatch, name, tr, pool_blocks, **options):
    """(hit blocks per request, every evicted block in order) of one engine run."""
    log: list[int] = []
    cls = policies_lib.REGISTRY[name]

    class Recording(cls):
        def on_evict(self, b):
            log.append(b)
            super().on_evict(b)

    monkeypatch.setitem(policies_lib.REGISTRY, name, Recording)
    cfg = engine.ServingConfig(pool_blocks=pool_blocks, prefill_nodes=1)
    rec = engine.simulate(tr, name, cfg=cfg, cost=COST, **options)
    return rec["hit_blocks"].tolist(), log


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


def test_shadow_pool_keeps_what_its_expert_alone_would_keep():
    """An ``lru`` shadow of capacity 3 against a plain-Python LRU prefix cache (touch the hit
    prefix, store the rest at once, evict the least recently touched leaf), request by request:
    the saving is Σ s_j over its hit prefix."""
    reqs = _random_requests(2, n_req=300)
    tr = _trace(reqs)
    pol = ExpertKVLearn(tr, COST, pool_blocks=3, experts=("lru",), predictor="logistic")
    sh = ShadowPool("lru", 3, tr.n_blocks)
    resident: dict[int, int] = {}  # block → last touch
    parent: dict[int, int] = {}
    clock = 0
    for blk in tr.blocks:
        blk = blk.tolist()
        hit = 0
        while hit < len(blk) and blk[hit] in resident:
            hit += 1
        assert sh.step(pol, np.array(blk)) == pytest.approx(sum(pol.costs.save_ms[:hit]))
        for b in blk[:hit]:
            clock += 1
            resident[b] = clock
        for j in range(hit, len(blk)):
            if len(resident) >= 3:
                pinned = blk[j - 1] if j else None
                leaves = [
                    x for x in resident if x != pinned and not any(parent[y] == x for y in resident)
                ]
                if not leaves:  # only the pinned parent is a leaf: the rest is refused
                    break
                del resident[min(leaves, key=resident.get)]
            clock += 1
            resident[blk[j]] = clock
            parent[blk[j]] = blk[j - 1] if j else -1
        assert set(np.flatnonzero(sh.cache.resident).tolist()) == set(resident)


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
    tr = _trace([[0, 1]])
    pol = ExpertKVLearn(tr, COST, pool_blocks=4, experts=["lfu", "gd"], predictor="logistic")
    assert pol.xcfg.experts == ("lfu", "gd") and pol.cfg.write_cost is False
    assert ExpertConfig() == ExpertConfig(experts=("gd", "gdsf", "lru", "lfu"), choice="shadow")
    assert "kvlearn_experts" in policies_lib.BLOCK_POLICIES
