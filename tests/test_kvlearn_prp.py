"""PRP: online learning of a separable pattern, delayed labels, whitening before prediction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn.core import control as control_lib
from jaxkv.kvlearn.core import features as features_lib
from jaxkv.kvlearn.core import prp as prp_lib
from jaxkv.kvlearn.sim import policies as policies_lib
from jaxkv.kvlearn.sim import simulate as simulate_lib
from jaxkv.kvlearn.sim.policies.base import PolicySetup

PCFG = prp_lib.PRPConfig()


def test_readme_defaults():
    assert (PCFG.hidden, PCFG.learning_rate, PCFG.replay_size, PCFG.train_every) == (
        32,
        5e-3,
        20_000,
        100,
    )
    params = prp_lib.init_prp(PCFG, key=jax.random.key(0)).params
    assert params["Dense_0"]["kernel"].shape == (16, 32) and params["Dense_1"]["kernel"].shape == (
        32,
        1,
    )


def test_learns_separable_pattern_online():
    rng = np.random.default_rng(0)
    n_batches = 30
    x = rng.normal(size=(n_batches, 100, 16)).astype(np.float32) * 3.0 + 5.0  # needs whitening
    y = ((x[..., 0] - 5.0) - (x[..., 3] - 5.0) > 0).astype(np.float32)

    def step(state, batch):
        xb, yb = batch
        state = jax.lax.fori_loop(0, 100, lambda i, s: prp_lib.observe(s, xb[i]), state)
        state = prp_lib.push_labels(state, xb, yb, jnp.ones(100, bool))
        return prp_lib.maybe_train(
            state, key=jax.random.fold_in(jax.random.key(1), state.n_labels), cfg=PCFG
        ), None

    state, _ = jax.jit(lambda s, b: jax.lax.scan(step, s, b))(
        prp_lib.init_prp(PCFG, key=jax.random.key(0)), (x, y)
    )
    assert int(state.n_updates) == n_batches * PCFG.updates_per_round  # one round per 100 labels
    assert int(state.labels_since) == 0 and int(state.buf_size) == 3000
    x_test = rng.normal(size=(2000, 16)).astype(np.float32) * 3.0 + 5.0
    y_test = (x_test[:, 0] - x_test[:, 3]) > 0
    acc = np.mean((np.asarray(prp_lib.predict(state, x_test, cfg=PCFG)) > 0.5) == y_test)
    assert acc > 0.95


def test_whitening_is_used_before_the_first_prediction():
    # the MLP's own P̂ (no count posterior on top), which admit reports as p_hat
    cfg = control_lib.KVLearnConfig(max_blocks=4, max_keys=4, count_prior_s=None)
    state = control_lib.init(cfg, capacity_bytes=1 << 30, key=jax.random.key(0))
    req = control_lib.Request(jnp.int32(1), jnp.int32(576), jnp.int32(1), jnp.float32(0.05))
    state, hit = control_lib.lookup(state, req, cfg=cfg)
    assert not bool(hit) and float(state.prp.n_obs) == 1.0
    raw = features_lib.featurize(
        state.hist,
        1,
        t=0.05,
        signals=control_lib._signals(state),
        cost=cfg.cost,
        tau_fast_s=cfg.tau_fast_s,
        tau_slow_s=cfg.tau_slow_s,
    )
    state, res = control_lib.admit(state, req, cfg=cfg)
    # one observation: the whitened vector is exactly zero
    np.testing.assert_array_equal(np.asarray(prp_lib.whiten(state.prp, raw)), np.zeros(16))
    expected = jax.nn.sigmoid(prp_lib.logits(state.prp.params, jnp.zeros(16), hidden=32))
    assert float(res.p_hat) == pytest.approx(float(expected), abs=1e-7)
    unwhitened = float(jax.nn.sigmoid(prp_lib.logits(state.prp.params, raw, hidden=32)))
    assert abs(unwhitened - float(res.p_hat)) > 1e-3


def _labels(state):
    n = int(state.prp.buf_size)
    return np.asarray(state.prp.buf_x_MF[:n]), np.asarray(state.prp.buf_y_M[:n])


def test_labels_for_a_block_hit_exactly_once():
    cfg = control_lib.KVLearnConfig(max_blocks=4, max_keys=4, horizon_s=10.0)
    lookup = jax.jit(control_lib.lookup, static_argnames="cfg")
    admit = jax.jit(control_lib.admit, static_argnames="cfg")
    tick = jax.jit(control_lib.tick, static_argnames="cfg")
    req = lambda key, t: control_lib.Request(
        jnp.int32(key), jnp.int32(576), jnp.int32(1), jnp.float32(t)
    )
    state = control_lib.init(cfg, capacity_bytes=1 << 30, key=jax.random.key(0))
    A, Bk = 0, 1
    state, hit = lookup(state, req(A, 0.0), cfg=cfg)
    state, res = admit(state, req(A, 0.0), cfg=cfg)
    assert not bool(hit) and bool(res.admitted)
    x_open = np.asarray(state.hist.win_x_PI[A])
    x_expected = features_lib.featurize(
        state.hist,
        A,
        t=0.0,
        signals=features_lib.Signals(jnp.float32(0.0), jnp.float32(0.0)),
        cost=cfg.cost,
        tau_fast_s=30.0,
        tau_slow_s=600.0,
    )
    np.testing.assert_allclose(x_open, np.asarray(x_expected), rtol=1e-6)
    state, hit = lookup(state, req(A, 3.0), cfg=cfg)  # the single reuse, within H
    assert bool(hit)
    x, y = _labels(state)
    np.testing.assert_array_equal(y, [1.0])  # counted as reused (the reference needed 2 hits)
    np.testing.assert_array_equal(x[0], x_open)  # the features the decision was made with
    for t in (4.0, 5.0, 6.0):  # more hits inside the same horizon: no more labels
        state, _ = lookup(state, req(A, t), cfg=cfg)
    state, _ = lookup(state, req(Bk, 4.5), cfg=cfg)
    state = tick(state, jnp.float32(9.0), cfg=cfg)
    assert int(state.prp.n_labels) == 1
    state = tick(state, jnp.float32(15.0), cfg=cfg)  # B expired unreused (0); A re-opens at 15
    x, y = _labels(state)
    np.testing.assert_array_equal(y, [1.0, 0.0])
    state = tick(state, jnp.float32(26.0), cfg=cfg)  # A's second window expires unreused
    _, y = _labels(state)
    np.testing.assert_array_equal(y, [1.0, 0.0, 0.0])
    # each key's own labels, decayed with τ_slow: A got 1 at t=3 and 0 at t=26, B 0 at t=15
    d = np.exp(-23.0 / cfg.tau_slow_s)
    np.testing.assert_allclose(
        state.hist.table_PJ[A, features_lib.LABELS], [d, d + 1.0, 26.0], rtol=1e-6
    )
    np.testing.assert_allclose(
        state.hist.table_PJ[Bk, features_lib.LABELS], [0.0, 1.0, 15.0], rtol=1e-6
    )
    m, p = 50.0, jnp.float32([0.3, 0.3, 0.3])
    post = features_lib.label_posterior(
        state.hist, jnp.array([A, Bk, 2]), p, t=86.0, tau_s=cfg.tau_slow_s, prior_labels=m
    )
    w = lambda t_label: np.exp(-(86.0 - t_label) / cfg.tau_slow_s)  # weight of a label at 86 s
    expected = [
        (m * 0.3 + w(3.0)) / (m + w(3.0) + w(26.0)),
        (m * 0.3 + 0.0) / (m + w(15.0)),
        0.3,
    ]
    np.testing.assert_allclose(post, expected, rtol=1e-6)  # key 2 has no labels: the prior
    state = tick(state, jnp.float32(27.0), cfg=cfg)  # nothing new
    assert int(state.prp.n_labels) == 3


def test_online_prp_separates_hot_from_cold_prefixes_in_the_simulator():
    # even requests cycle 10 hot images (each reused every second); odd requests are fresh
    # videos never seen again: reuse is fully predictable from history and modality
    n = 6000
    n_cold = n // 2
    key = np.where(np.arange(n) % 2 == 0, (np.arange(n) // 2) % 10, 10 + np.arange(n) // 2).astype(
        np.int32
    )
    modality = np.where(key < 10, traces_lib.IMAGE, traces_lib.VIDEO).astype(np.int32)
    tokens = np.where(key < 10, 576, 720).astype(np.int32)
    trace = traces_lib.Trace(
        key,
        tokens,
        modality,
        np.arange(1, n + 1) * 0.05,
        tuple(f"k{i}" for i in range(10 + n_cold)),
    )
    sim_cfg = simulate_lib.SimConfig()
    kv_cfg = sim_cfg.kvlearn.replace(max_keys=trace.n_keys, max_blocks=trace.n_keys)
    setup = PolicySetup(max_keys=trace.n_keys, n_requests=len(trace), kvlearn=kv_cfg)
    policy = policies_lib.make_policy("kvlearn", setup)
    inputs = simulate_lib._inputs(trace, capacity_bytes=2 << 30, seed=0, cost=sim_cfg.cost)
    inputs = inputs.replace(key=jax.random.wrap_key_data(inputs.key))
    reqs = simulate_lib.sim_requests(trace, cost=sim_cfg.cost, seed=0)
    _, state = jax.jit(lambda r, i: simulate_lib.scan_policy(policy, r, i, tick_every=20))(
        reqs, inputs
    )
    x, y = _labels(state)
    assert y.sum() > 200 and (1 - y).sum() > 2000  # hot reuses and cold expiries
    p = np.asarray(prp_lib.predict(state.prp, x, cfg=kv_cfg.prp))
    assert np.mean(p[y == 1] > 0.5) > 0.95 and np.mean(p[y == 0] < 0.5) > 0.95
    assert int(state.prp.n_updates) > 0


def _prp_with_labels(n_labels: int, seed: int, cfg: prp_lib.PRPConfig) -> prp_lib.PRPState:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(n_labels, 16)), jnp.float32)
    y = jnp.asarray(rng.random(n_labels) < 0.5, jnp.float32)
    state = prp_lib.init_prp(cfg, key=jax.random.key(seed))
    for row in x:
        state = prp_lib.observe(state, row)
    return prp_lib.push_labels(state, x, y, jnp.ones(n_labels, bool))


def test_batched_training_trains_only_due_runs_like_single_runs():
    cfg = prp_lib.PRPConfig(replay_size=512, train_every=40, batch_size=16, updates_per_round=4)
    runs = [_prp_with_labels(n, s, cfg) for n, s in ((50, 0), (10, 1), (90, 2), (45, 3))]
    keys = jax.random.split(jax.random.key(7), len(runs))
    batch = jax.tree.map(lambda *a: jnp.stack(a), *runs)
    # parallel=2 with three due runs: the while loop takes two groups, one half empty
    out = jax.jit(lambda s, k: prp_lib.maybe_train_batch(s, key_B=k, cfg=cfg, parallel=2))(
        batch, keys
    )
    for i, run in enumerate(runs):
        single = prp_lib.maybe_train(run, key=keys[i], cfg=cfg)
        got = jax.tree.map(lambda a, i=i: a[i], out)
        assert int(got.labels_since) == int(single.labels_since)
        assert int(got.n_updates) == int(single.n_updates)
        leaves = zip(jax.tree.leaves(got.params), jax.tree.leaves(single.params), strict=True)
        for a, b in leaves:
            if i == 1:  # not due: untouched, bit for bit
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert [int(n) for n in out.n_updates] == [4, 0, 4, 4]
    trained = jax.tree.leaves(out.params)[0][0]
    assert not np.allclose(np.asarray(trained), np.asarray(jax.tree.leaves(runs[0].params)[0]))


def test_history_features_are_rates_that_settle_under_a_steady_stream():
    """Features 1, 2, 5, 6, 7 are rates or capped, so a key requested every 10 s looks the same
    at 1,000 s and at 2,000 s (totals and ages would have doubled); checked against closed
    forms."""
    cfg = control_lib.KVLearnConfig(max_blocks=4, max_keys=4)
    lookup = jax.jit(control_lib.lookup, static_argnames="cfg")
    state = control_lib.init(cfg, capacity_bytes=1 << 30, key=jax.random.key(0))
    feats = {}
    for i in range(201):
        t = 10.0 * i
        state, _ = lookup(
            state, control_lib.Request(jnp.int32(0), jnp.int32(576), jnp.int32(1), t), cfg=cfg
        )
        if i in (100, 200):
            sig = control_lib._signals(state)
            kw = dict(signals=sig, cost=cfg.cost, tau_fast_s=30.0, tau_slow_s=600.0)
            feats[t] = np.asarray(features_lib.featurize(state.hist, 0, t=t, **kw))
    for t, x in feats.items():
        n = t / 10.0 + 1.0
        slow = sum(np.exp(-10.0 * k / 600.0) for k in range(int(n)))
        exposure = 1.0 - np.exp(-(t + 30.0) / 600.0)
        np.testing.assert_allclose(x[1], np.log1p(slow / exposure), rtol=1e-4)
        np.testing.assert_allclose(x[2], np.log1p(n * 30.0 / (t + 30.0)), rtol=1e-5)
        np.testing.assert_allclose(x[[3, 4]], [0.0, np.log1p(10.0)], rtol=1e-6)
        np.testing.assert_allclose(x[5:7], [(n - 1.0) / n, 0.0], rtol=1e-6)  # all misses: ghosts
        np.testing.assert_allclose(x[7], np.log1p(600.0), rtol=1e-6)
    np.testing.assert_allclose(feats[1000.0][:8], feats[2000.0][:8], rtol=0.05)
