"""Simulator: LRU / No-Cache / random admission equal plain-Python simulations exactly; vmap equals
single runs; oracle set; KVLearn beats LRU."""

from collections import OrderedDict

import jax
import numpy as np
import pytest

from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.core import control as control_lib
from jaxkv.kvlearn.cost import GIB, MIB, CostModel
from jaxkv.kvlearn.sim import simulate as simulate_lib
from jaxkv.kvlearn.sim.policies.oracle_static import static_oracle_set

COST = CostModel.llama3_8b_a100()
TRACE = workloads.zipf_multimodal(3000, 0.8, seed=11)


def python_lru(trace, capacity_bytes, *, admit_u=None, p_admit=1.0):
    """Admit-all (or random-admission) LRU over KiB-rounded blocks; per-request events."""
    cap = -(-int(capacity_bytes) // 1024)
    lru, used = OrderedDict(), 0
    hit, admitted, evicted = [], [], []
    for i, (k, tok) in enumerate(zip(trace.key.tolist(), trace.tokens.tolist(), strict=True)):
        kib = -(-tok * 131072 // 1024)
        if k in lru:
            lru.move_to_end(k)
            hit.append(True), admitted.append(False), evicted.append(0)
            continue
        hit.append(False)
        n_ev = 0
        wants = admit_u is None or admit_u[i] < p_admit
        if wants and kib <= cap:
            while used + kib > cap:
                _, v = lru.popitem(last=False)
                used -= v
                n_ev += 1
            lru[k] = kib
            used += kib
        admitted.append(wants and kib <= cap)
        evicted.append(n_ev)
    return np.array(hit), np.array(admitted), np.array(evicted)


def python_metrics(trace, hit, admitted):
    ttft, xfer = [], 0.0
    for tok, h, a in zip(trace.tokens.tolist(), hit, admitted, strict=True):
        nbytes = tok * 131072
        t_ms = nbytes / 25e9 * 1e3
        r_ms = max(0.026 * tok, 8e-6 * tok * tok)
        ttft.append(t_ms if h else r_ms + t_ms)
        xfer += nbytes * (2 if a else 1)
    return float(np.mean(ttft)), xfer / 2**30


def _events(name, trace, capacity, seed=0):
    sim_cfg = simulate_lib.SimConfig()
    fn = simulate_lib._runner(
        name, max_keys=trace.n_keys, n_requests=len(trace), sim_cfg=sim_cfg, batched=False
    )
    inputs = simulate_lib._inputs(trace, capacity_bytes=capacity, seed=seed, cost=COST)
    events, _ = fn(
        simulate_lib.sim_requests(trace, cost=COST, seed=seed),
        inputs.replace(key=jax.random.wrap_key_data(inputs.key)),
    )
    return tuple(np.asarray(a) for a in (events.hit, events.admitted, events.n_evicted))


@pytest.mark.parametrize("capacity", [300 * MIB, 1 * GIB, 3 * GIB])
def test_lru_equals_python_exactly(capacity):
    hit, admitted, evicted = _events("lru", TRACE, capacity)
    p_hit, p_adm, p_ev = python_lru(TRACE, capacity)
    np.testing.assert_array_equal(hit, p_hit)
    np.testing.assert_array_equal(admitted, p_adm)
    np.testing.assert_array_equal(evicted, p_ev)
    assert p_ev.sum() > 100  # the capacity binds
    m = simulate_lib.run("lru", TRACE, capacity_bytes=capacity, seed=0)
    ttft, xfer = python_metrics(TRACE, p_hit, p_adm)
    assert m["ttft_ms_mean"] == pytest.approx(ttft, rel=1e-12)
    assert m["transfer_gib"] == pytest.approx(xfer, rel=1e-12)
    assert (
        m["hit_rate"] == p_hit.mean()
        and m["admits"] == p_adm.sum()
        and m["evictions"] == p_ev.sum()
    )


def test_random_admission_lru_equals_python_exactly():
    u = simulate_lib.sim_requests(TRACE, cost=COST, seed=5).u
    hit, admitted, evicted = _events("random_lru", TRACE, 1 * GIB, seed=5)
    p_hit, p_adm, p_ev = python_lru(TRACE, 1 * GIB, admit_u=u, p_admit=0.1)
    np.testing.assert_array_equal(hit, p_hit)
    np.testing.assert_array_equal(admitted, p_adm)
    np.testing.assert_array_equal(evicted, p_ev)


def test_no_cache_equals_python_exactly():
    m = simulate_lib.run("no_cache", TRACE, capacity_bytes=4 * GIB)
    n = len(TRACE)
    ttft, xfer = python_metrics(TRACE, [False] * n, [False] * n)
    assert m["ttft_ms_mean"] == pytest.approx(ttft, rel=1e-12)
    assert m["transfer_gib"] == pytest.approx(xfer, rel=1e-12)
    assert (m["hit_rate"], m["admits"], m["evictions"], m["discards"]) == (0.0, 0, 0, n)
    r = [max(0.026 * t, 8e-6 * t * t) + t * 131072 / 25e9 * 1e3 for t in TRACE.tokens.tolist()]
    assert m["ttft_ms_p50"] == pytest.approx(np.percentile(r, 50)) and m[
        "ttft_ms_p99"
    ] == pytest.approx(np.percentile(r, 99))


def test_static_oracle_set_is_greedy_by_value_per_byte():
    pop = np.array([0.4, 0.3, 0.2, 0.1])
    tokens = np.array([64, 576, 64, 1440])
    keep = static_oracle_set(
        popularity_P=pop, tokens_P=tokens, cost=COST, capacity_bytes=80 * MIB, max_blocks=4
    )
    # densities ∝ p in the bandwidth regime: key 0 (8 MiB), key 1 (72 MiB) fits exactly, key 2 no room
    np.testing.assert_array_equal(keep, [True, True, False, False])
    keep = static_oracle_set(
        popularity_P=pop, tokens_P=tokens, cost=COST, capacity_bytes=20 * MIB, max_blocks=4
    )
    np.testing.assert_array_equal(keep, [True, False, True, False])  # key 1 skipped, key 2 fits


def test_oracle_and_belady_behave():
    res = {
        p: simulate_lib.run(p, TRACE, capacity_bytes=1 * GIB)
        for p in ("lru", "oracle_static", "belady")
    }
    assert res["oracle_static"]["evictions"] == 0
    assert res["belady"]["hit_rate"] > max(res["lru"]["hit_rate"], res["oracle_static"]["hit_rate"])


@pytest.mark.slow
def test_vmap_batch_equals_single_runs():
    traces = [workloads.zipf_multimodal(1000, a, seed=s) for a, s in ((0.8, 0), (1.4, 1), (1.1, 2))]
    caps = [1 * GIB, 2 * GIB, 512 * MIB]
    for policy in ("lru", "kvlearn"):
        batch = simulate_lib.run_batch(policy, traces, capacities_bytes=caps, seeds=[0, 1, 2])
        for tr, cap, seed, b in zip(traces, caps, [0, 1, 2], batch, strict=True):
            single = simulate_lib.run(policy, tr, capacity_bytes=cap, seed=seed)
            assert single.pop("policy") == b.pop("policy") == policy
            assert single == pytest.approx(b, rel=1e-6), policy


def test_bad_inputs():
    with pytest.raises(ValueError, match="capacity"):
        simulate_lib.run("lru", TRACE, capacity_bytes=-1)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate_lib.run("fifo", TRACE, capacity_bytes=GIB)
    with pytest.raises(ValueError, match="share length"):
        simulate_lib.run_batch(
            "lru", [TRACE, TRACE.head(10)], capacities_bytes=[GIB, GIB], seeds=[0, 1]
        )


def test_kvlearn_beats_lru_at_20k_requests():
    tr = workloads.zipf_multimodal(20_000, 1.1, seed=0)
    lru = simulate_lib.run("lru", tr, capacity_bytes=4 * GIB)
    kv = simulate_lib.run("kvlearn", tr, capacity_bytes=4 * GIB)
    assert kv["ttft_ms_mean"] < 0.92 * lru["ttft_ms_mean"]
    assert kv["transfer_gib"] < 0.9 * lru["transfer_gib"]
    assert kv["admits"] < lru["admits"]


def test_scan_carry_keeps_shapes_and_dtypes():
    """One KVLearn step and one tick map the state pytree onto itself (eval_shape, no compile)."""
    cfg = control_lib.KVLearnConfig(max_blocks=64, max_keys=64)
    state = control_lib.init(cfg, capacity_bytes=GIB, key=jax.random.key(0))
    req = control_lib.Request(
        jax.numpy.int32(3), jax.numpy.int32(576), jax.numpy.int32(1), jax.numpy.float32(0.1)
    )

    def step(s):
        s, _ = control_lib.lookup(s, req, cfg=cfg)
        s, _ = control_lib.admit(s, req, cfg=cfg)
        return control_lib.tick(s, req.time, cfg=cfg)

    spec = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    before = jax.eval_shape(lambda: state)
    after = jax.eval_shape(step, state)
    assert jax.tree.structure(before) == jax.tree.structure(after)
    assert spec(before) == spec(after)


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady", "kvlearn"])
def test_victim_bound_changes_no_event(policy):
    """Padding victim arrays to ⌈largest / smallest block⌉ instead of 128 changes nothing."""
    tr = TRACE.head(1500)
    bound = simulate_lib.victim_bound([tr], cost=COST)
    assert bound == -(-(1440 * 128) // (64 * 128))  # 1440- and 64-token blocks: 23 victims
    sim_cfg = simulate_lib.SimConfig()
    inputs = simulate_lib._inputs(tr, capacity_bytes=300 * MIB, seed=0, cost=COST)
    inputs = inputs.replace(key=jax.random.wrap_key_data(inputs.key))
    reqs = simulate_lib.sim_requests(tr, cost=COST, seed=0)
    events = []
    for mv in (128, bound):
        fn = simulate_lib._runner(
            policy,
            max_keys=tr.n_keys,
            n_requests=len(tr),
            sim_cfg=sim_cfg,
            batched=False,
            max_victims=mv,
        )
        ev, _ = fn(reqs, inputs)
        events.append([np.asarray(a) for a in (ev.hit, ev.admitted, ev.n_evicted)])
    for a, b in zip(*events, strict=True):
        np.testing.assert_array_equal(a, b)
    assert events[0][2].sum() > 50 and events[0][2].max() >= 2  # evictions, some multiple


def test_inactive_admit_changes_nothing():
    """``admit(active=False)`` (the simulator's branch-free hit path) leaves the state as is."""
    cfg = control_lib.KVLearnConfig(max_blocks=8, max_keys=16)
    state = control_lib.init(cfg, capacity_bytes=GIB, key=jax.random.key(0))
    jnp = jax.numpy
    for k in range(6):  # fill the pool so an active admit would evict
        req = control_lib.Request(jnp.int32(k), jnp.int32(1440), jnp.int32(2), jnp.float32(0.1 * k))
        state, _ = control_lib.lookup(state, req, cfg=cfg)
        state, _ = control_lib.admit(state, req, cfg=cfg)
    req = control_lib.Request(jnp.int32(9), jnp.int32(1440), jnp.int32(2), jnp.float32(1.0))
    state, _ = control_lib.lookup(state, req, cfg=cfg)
    after, res = control_lib.admit(state, req, cfg=cfg, active=jnp.bool_(False))
    assert not bool(res.admitted) and int(res.n_evicted) == 0
    same = jax.tree.map(lambda a, b: bool(jnp.all(a == b)), state, after)
    assert all(jax.tree.leaves(same))
    active, _ = control_lib.admit(state, req, cfg=cfg)  # the same call, active: admits or discards
    decided = lambda s: int(s.counters.admits) + int(s.counters.discards)
    assert decided(active) == decided(state) + 1
