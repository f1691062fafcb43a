"""The serving simulator's KVLearn policy (``serving/policies/kvlearn.py``): the write-cost
admission rule by hand, the host-side PRP (``serving.predictors.HostPRP``) against the core's
``prp``, the label windows, the horizon, and its state and eviction hook."""

import json

import jax
import numpy as np
import pytest

from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn.core import prp as prp_lib
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine
from jaxkv.kvlearn.serving.policies.kvlearn import BlockKVLearn, BlockKVLearnConfig
from jaxkv.kvlearn.serving.predictors import DeferredPRP, HostPRP
from jaxkv.kvlearn.serving.prefix import PrefixCache

COST = CostModel.llama3_8b_a100()
BT = 512


def _trace(tmp_path, hashes):
    lines = [
        json.dumps(
            {"timestamp": 1000 * i, "input_length": BT * len(h), "output_length": 1, "hash_ids": h}
        )
        for i, h in enumerate(hashes)
    ]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    return traces_lib.load_mooncake_trace(tmp_path / "t.jsonl")


# LLaMA-3-8B / A100 by hand: |512 tokens| = 512 · 2·32·8·128·2 B = 64 MiB; T = 2^26 B / 25e9 B/s
# = 2.68435456 ms. R(L) = max(0.026 L, 8e-6 L²): s_0 = R(512) − R(0) − T = 13.312 − 2.68435456
# = 10.62764544 ms (break-even P̂ = 0.2526); s_10 = R(5632) − R(5120) − T = 253.755392 −
# 209.7152 − 2.68435456 = 41.35583744 ms (break-even P̂ = 0.0649).
T_BLOCK = 2.68435456
S_0, S_10 = 10.62764544, 41.35583744


def _policy(trace, **hparams) -> BlockKVLearn:
    return BlockKVLearn(trace, COST, pool_blocks=10, **hparams)


def test_save_and_write_cost_match_the_hand_computation(tmp_path):
    pol = _policy(_trace(tmp_path, [list(range(12))]), predictor="logistic")
    assert pol.costs.write_ms == pytest.approx(T_BLOCK, rel=1e-12)
    assert pol.costs.save_ms[0] == pytest.approx(S_0, rel=1e-12)
    assert pol.costs.save_ms[10] == pytest.approx(S_10, rel=1e-12)


@pytest.mark.parametrize(
    "p_hat, j, theta, write_cost, admit",
    [
        (0.25, 0, 0.0, True, False),  # 0.25 · 10.63 = 2.657 ms < T = 2.684 ms: not worth a write
        (0.26, 0, 0.0, True, True),  # 2.763 ms > 2.684 ms
        (0.25, 10, 0.0, True, True),  # deep block: 0.25 · 41.36 = 10.34 ms > T
        (0.06, 10, 0.0, True, False),  # 0.06 · 41.36 = 2.481 ms < T
        (0.25, 0, 0.0, False, True),  # without the write cost only θ decides
        (0.10, 10, 0.2, True, False),  # 4.14 ms > T, but P̂ < θ
        (0.25, 0, 0.2, True, False),  # P̂ ≥ θ, but the saving is below the write cost
    ],
)
def test_admission_needs_expected_saving_above_the_write_cost(
    tmp_path, p_hat, j, theta, write_cost, admit
):
    tr = _trace(tmp_path, [list(range(12))])
    pol = _policy(tr, theta=theta, write_cost=write_cost, predictor="logistic")
    pol.state.p_hat_P[j] = p_hat
    ok, prio = pol.gate(j, 0, j, 0.0)
    assert ok is admit
    assert prio == (pytest.approx(p_hat * pol.costs.save_ms[j]),)  # GreedyDual, L = 0


def test_simulated_pool_refuses_blocks_below_the_write_cost(tmp_path):
    # a constant predictor P̂ = 0.2 (≥ θ = 0.2): with a 512-token block at the bandwidth-bound
    # depths 0..5 a hit saves 10.63 ms, 0.2 · 10.63 < T, so nothing shallow is admitted
    tr = _trace(tmp_path, [[0, 1, 2]] * 5)

    class Const:
        trained = True

        def learn(self, x, y):
            pass

        def predict(self, x):
            return np.full(len(x), 0.2)

        def observe(self, x):
            return x

        def resolve(self, x):
            return self.predict(x)

    for write_cost, admits in ((True, 0), (False, 3)):
        pol = _policy(tr, theta=0.2, write_cost=write_cost, predictor="logistic")
        pol.pred = Const()
        cache = PrefixCache(10, n_blocks=tr.n_blocks, on_evict=pol.on_evict)
        pol.attach(cache)
        counts = {"admits": 0, "discards": 0}
        rec = {"start_s": np.zeros(5), "service_ms": np.zeros(5), "admitted_tokens": np.zeros(5)}
        pol.on_access(tr.blocks[0], 0, 0, 0.0)
        engine.offer(cache, pol, tr, 0, 0, rec, counts)
        assert counts["admits"] == admits


def _feed(m, rng, n_labels):
    x = rng.normal(size=(n_labels, 16)).astype(np.float32)
    m.learn(x, (x[:, 0] > 0).astype(np.float32))


def test_host_forward_equals_prp_predict_and_training_is_mirrored():
    rng = np.random.default_rng(0)
    m = HostPRP(seed=0)
    seen = []
    for n_rows, n_labels in ((30, 60), (7, 60), (200, 1500), (1, 0), (50, 99)):
        x = (rng.normal(size=(n_rows, 16)) * rng.uniform(0.1, 5, 16) + 3).astype(np.float32)
        p = m.predict(x)  # observes x first
        seen.append(x)
        n_obs, mean_I, m2_I = m.stats
        state = m.state.replace(n_obs=n_obs, mean_F=mean_I, m2_F=m2_I)
        np.testing.assert_allclose(p, prp_lib.predict(state, x, cfg=m.cfg), rtol=1e-5, atol=1e-6)
        if n_labels:
            _feed(m, rng, n_labels)
        # the host knows when prp.maybe_train ran a round, and holds its parameters
        assert m.labels_since == int(m.state.labels_since)
        assert m.trained == (int(m.state.n_updates) > 0)
        for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(m.state.params), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
    allx = np.concatenate(seen).astype(np.float64)
    n_obs, mean_I, m2_I = m.stats
    assert float(n_obs) == len(allx)
    np.testing.assert_allclose(mean_I, allx.mean(0), rtol=1e-5)
    np.testing.assert_allclose(m2_I / n_obs, allx.var(0), rtol=1e-4)
    # at most one round per pushed chunk: 60; 120 → round, 20; + 1024 → round, 944; + 476 →
    # round, 1320; + 99 → round, 1319
    assert int(m.state.n_updates) == 4 * m.cfg.updates_per_round
    assert m.labels_since == 1319


def test_label_windows_close_on_reuse_or_after_the_horizon(tmp_path):
    hashes = [[0, 1], [0, 2]] + [[10 + k] for k in range(25)] + [[0, 1]]
    tr = _trace(tmp_path, hashes)
    pol = _policy(tr, predictor="logistic", horizon_min=20.0)
    pol.attach(PrefixCache(1, n_blocks=tr.n_blocks))  # H = max(2 · 1 / blocks per req, 20)

    labels = []

    class Record:
        trained = False

        def learn(self, x, y):
            labels.append((i, y.tolist()))

        def predict(self, x):
            return np.zeros(len(x))

        def observe(self, x):
            return x

        def resolve(self, x):
            return self.predict(x)

    pol.pred = Record()
    for i, blk in enumerate(tr.blocks):
        pol.on_access(blk, 0, i, 0.0)
    assert pol.state.horizon == 20.0
    # request 1 reuses block 0 (label 1); request 0's block 1 expires at 21 (0 + 20 < 21),
    # request 1's blocks 0 and 2 at 22, request k's single block at k + 21
    assert labels[0] == (1, [1.0])
    assert labels[1] == (21, [0.0])
    assert labels[2] == (22, [0.0, 0.0])
    assert labels[3:] == [(k, [0.0]) for k in range(23, 28)]  # requests 2..6 expire
    # request 27 reopens blocks 0 and 1, whose windows had closed: no label 1 for them
    assert pol.state.n_child_P[0] == 2  # children 1 and 2; the repeated pair (0, 1) counts once
    assert pol.state.count_P[0] == 3 and pol.state.count_P[1] == 2


def test_horizon_follows_the_turnover_between_its_bounds(tmp_path):
    """H = 2 × capacity / blocks per request before the pool evicts, clipped to [20, 800]."""
    tr = _trace(tmp_path, [[k, k + 100] for k in range(60)])  # 2 blocks per request
    for cap, expected in ((4, 20.0), (100, 100.0), (10_000, 800.0)):
        pol = _policy(tr, predictor="logistic")
        pol.attach(PrefixCache(cap, n_blocks=tr.n_blocks))
        for _ in range(2000):  # the EMA of blocks per request settles at 2
            pol._update_horizon(2)
        assert pol.state.horizon == pytest.approx(expected, rel=1e-6)


def test_evictions_reach_the_policy_through_its_hook(tmp_path):
    """The cache calls ``on_evict`` (no monkeypatching): GreedyDual's L rises to the victim's
    priority and the eviction counts toward the turnover."""
    tr = _trace(tmp_path, [[0], [1], [2]])
    pol = _policy(tr, predictor="logistic")
    cache = PrefixCache(1, n_blocks=tr.n_blocks, on_evict=pol.on_evict)
    pol.attach(cache)
    pol.state.p_hat_P[:] = 1.0
    assert cache.insert(0, -1, pol.prio(0, 0, 0, 0.0))
    assert cache.insert(1, -1, pol.prio(1, 1, 0, 0.0))  # evicts block 0
    assert cache.evictions == 1 and pol.state.n_evict == 1
    assert pol.state.inflation == pytest.approx(pol.costs.save_ms[0])  # block 0's priority


def test_hyper_parameters_are_validated():
    with pytest.raises(ValueError, match="retention"):
        BlockKVLearnConfig(retention="lfu")
    with pytest.raises(ValueError, match="predictor"):
        BlockKVLearnConfig(predictor="tree")
    assert BlockKVLearnConfig() == BlockKVLearnConfig(theta=0.0, horizon_max=800.0)


def test_host_twins_match_the_jax_prp():
    """``prp.host_observe`` / ``host_predict`` (numpy) against ``observe`` / ``predict`` (JAX):
    equal up to float rounding, which is why the serving simulator keeps its numpy path."""
    cfg = prp_lib.PRPConfig()
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(64, 16)) * 4 + 2).astype(np.float32)
    state = prp_lib.init_prp(cfg, key=jax.random.key(3))
    for row in x:
        state = prp_lib.observe(state, row)
    stats = prp_lib.host_observe(prp_lib.host_stats(), x)
    np.testing.assert_allclose(stats[1], np.asarray(state.mean_F), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats[2], np.asarray(state.m2_F), rtol=1e-4)
    params = jax.device_get(state.params)
    np.testing.assert_allclose(
        prp_lib.host_predict(params, stats, x),
        np.asarray(prp_lib.predict(state, x, cfg=cfg)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_deferred_prp_predicts_exactly_as_host_prp():
    """Holding the label pushes until a training round changes nothing the PRP predicts."""
    rng = np.random.default_rng(0)
    ref, fast = HostPRP(seed=0), DeferredPRP(seed=0)
    sizes = [*rng.integers(1, 60, 30).tolist(), 1500, 40, 1100, *rng.integers(1, 60, 10).tolist()]
    changed = 0  # requests after which the parameters moved (training rounds ran)
    for n in sizes:  # labels closed by one request; 1500 and 1100 span HostPRP's 1024-row chunks
        x = rng.normal(size=(n, 16)).astype(np.float32)
        y = (rng.random(n) < 0.4).astype(np.float32)
        before = ref.params
        ref.learn(x, y)
        fast.learn(x, y)
        changed += ref.params is not before
        q = rng.normal(size=(8, 16)).astype(np.float32)
        assert ref.trained == fast.trained and ref.step == fast.step + len(fast.held)
        assert np.array_equal(ref.predict(q), fast.predict(q))
    assert changed >= 10


@pytest.mark.parametrize("cls", [HostPRP, DeferredPRP])
def test_prp_resolves_later_what_it_would_predict_now(cls):
    """Rows observed before several training rounds and resolved after them get the P̂ that
    ``predict`` gave at the time (that moment's parameters and whitening statistics), bit for
    bit; the host's parameters (fetched as one flat array) are the state's."""
    rng = np.random.default_rng(0)
    now, later = cls(seed=3), cls(seed=3)
    want, observed = [], []
    for step in range(40):
        x = rng.normal(size=(int(rng.integers(1, 30)), 16)).astype(np.float32)
        want.append(now.predict(x))
        observed.append(later.observe(x))
        y = (rng.random(len(x) * 2) < 0.3).astype(np.float32)
        now.learn(np.concatenate([x, x]), y)
        later.learn(np.concatenate([x, x]), y)
        if step % 7 == 6:  # a backlog spanning rounds, resolved in order
            for o, w in zip(observed, want, strict=True):
                np.testing.assert_array_equal(later.resolve(o), w)
            want, observed = [], []
    assert later.rounds > 5
    host, state = jax.tree.leaves(later.params), jax.tree.leaves(later.state.params)
    for p, q in zip(host, state, strict=True):
        np.testing.assert_array_equal(p, np.asarray(q))
