"""KVLearn's count-rate posterior (``features.rate_posterior``, ``KVLearnConfig.count_prior_s``):
against the Gamma-posterior formula in float64, its order against exact counts (LFU's), and a
hand-worked trace through ``control.lookup`` / ``admit``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.kvlearn.core import control as control_lib
from jaxkv.kvlearn.core import features as features_lib

H = 5.0


def _hist(counts):
    hist = features_lib.init_history(len(counts))
    table = hist.table_PJ.at[:, features_lib.N_REQ].set(jnp.float32(counts))
    return hist.replace(table_PJ=table)


def _reference(p_hat, n, *, t, t0, prior_s, expected_reuses=False):
    lam0 = -np.log1p(-np.asarray(p_hat, np.float64)) / H
    lam = (prior_s * lam0 + np.asarray(n, np.float64)) / (prior_s + (t - t0))
    return H * lam if expected_reuses else 1.0 - np.exp(-H * lam)


@pytest.mark.parametrize("expected_reuses", [False, True])
def test_rate_posterior_is_the_gamma_posterior_rate(expected_reuses):
    counts = [0.0, 1.0, 7.0, 40.0]
    p_hat = jnp.float32([0.3, 0.05, 0.6, 0.01])
    keys = jnp.arange(4)
    post = lambda hist, t: features_lib.rate_posterior(
        hist, keys, p_hat, t=t, t0=10.0, horizon_s=H, prior_s=60.0, expected_reuses=expected_reuses
    )
    expected = _reference(
        p_hat, counts, t=130.0, t0=10.0, prior_s=60.0, expected_reuses=expected_reuses
    )
    np.testing.assert_allclose(post(_hist(counts), 130.0), expected, rtol=1e-5)
    # no exposure and no requests yet: the MLP's prediction itself (as a rate: −ln(1 − P̂))
    at_start = post(_hist([0.0] * 4), 10.0)
    p64 = np.asarray(p_hat, np.float64)
    np.testing.assert_allclose(at_start, -np.log1p(-p64) if expected_reuses else p64, rtol=1e-5)


def test_rate_posterior_orders_keys_by_prior_plus_count_and_as_lfu_for_equal_priors():
    rng = np.random.default_rng(0)
    n_keys, prior_s, t = 64, 60.0, 400.0
    counts = rng.integers(0, 50, n_keys).astype(np.float64)
    p_hat = rng.uniform(0.01, 0.9, n_keys).astype(np.float32)
    got = np.asarray(
        features_lib.rate_posterior(
            _hist(counts), jnp.arange(n_keys), p_hat, t=t, t0=0.0, horizon_s=H, prior_s=prior_s
        )
    )
    # monotone in s·λ₀ + n (the exposure is shared): compare every pair whose evidence differs
    evidence = prior_s * (-np.log1p(-p_hat.astype(np.float64)) / H) + counts
    i, j = np.nonzero(evidence[:, None] > evidence[None, :] + 1e-3)
    assert i.size > 1000 and np.all(got[i] > got[j])
    # one prior for every key: exactly the order of the counts
    flat = np.asarray(
        features_lib.rate_posterior(
            _hist(counts),
            jnp.arange(n_keys),
            jnp.full(n_keys, 0.2, jnp.float32),
            t=t,
            t0=0.0,
            horizon_s=H,
            prior_s=prior_s,
        )
    )
    i, j = np.nonzero(counts[:, None] > counts[None, :])
    assert np.all(flat[i] > flat[j])
    i, j = np.nonzero(counts[:, None] == counts[None, :])
    np.testing.assert_array_equal(flat[i], flat[j])


def test_count_prior_must_be_positive():
    with pytest.raises(ValueError, match="count_prior_s"):
        control_lib.KVLearnConfig(count_prior_s=0.0)


def _replay(cfg, trace, *, tokens_of, capacity_bytes, seed=0):
    """Runs ``trace`` [(key, t)] through ``control.lookup`` / ``admit``; returns the events and
    the P̂ each admission decided with, by request time."""
    state = control_lib.init(cfg, capacity_bytes=capacity_bytes, key=jax.random.key(seed))
    lookup = jax.jit(control_lib.lookup, static_argnames="cfg")
    admit = jax.jit(control_lib.admit, static_argnames="cfg")
    events, p_hat = [], {}
    for key, t in trace:
        tok, mod = tokens_of[key]
        req = control_lib.Request(jnp.int32(key), jnp.int32(tok), jnp.int32(mod), jnp.float32(t))
        state, hit = lookup(state, req, cfg=cfg)
        if bool(hit):
            events.append(("hit", key))
            continue
        state, res = admit(state, req, cfg=cfg)
        evicted = [int(k) for k in np.asarray(res.evicted_keys) if k >= 0]
        events.append(("admit" if bool(res.admitted) else "refuse", key, evicted))
        p_hat[t] = float(res.p_hat)
    return events, p_hat


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_admission_and_eviction_follow_exact_counts_on_a_hand_worked_trace(seed):
    """A pool of two equal images and a negligible prior (any MLP, three random inits): A is
    requested 3 times, B once, then C twice. C's first request (one request in 4 s of
    exposure, against B's one in 3 s) is refused; its second (two in 5 s) is admitted and
    evicts B, the block with the fewest requests, not A. The rates are the hand-worked
    λ̂ = n / (t − t0) with t0 = 1 s."""
    cfg = control_lib.KVLearnConfig(max_blocks=4, max_keys=4, count_prior_s=1e-3)
    tokens = 576
    kib = int(cfg.cost.footprint_bytes(tokens)) // 1024 + 1
    A, B, C = 0, 1, 2
    trace = [(A, 1.0), (A, 2.0), (A, 3.0), (B, 4.0), (C, 5.0), (C, 6.0)]
    rate = {4.0: 1.0 / 3.0, 5.0: 1.0 / 4.0, 6.0: 2.0 / 5.0}  # B's, C's first, C's second
    events, p_hat = _replay(
        cfg,
        trace,
        tokens_of={k: (tokens, 1) for k in (A, B, C)},
        capacity_bytes=2 * kib * 1024,
        seed=seed,
    )
    for t, r in rate.items():  # the default P̂ is the expected number of requests within H
        assert p_hat[t] == pytest.approx(H * r, rel=1e-3)
    assert events == [
        ("admit", A, []),
        ("hit", A),
        ("hit", A),
        ("admit", B, []),
        ("refuse", C, []),
        ("admit", C, [B]),
    ]


@pytest.mark.parametrize("expected_reuses", [True, False])
def test_expected_reuses_admit_a_frequent_block_over_a_larger_rarer_one(expected_reuses):
    """A pool that holds one video V (1,440 tokens, U = 0, a negligible prior). V is requested
    at 1 s and 21 s (t0 = 1 s: λ̂ = 2/20 = 0.1/s, stored at its hit); then an image C (576
    tokens) every 0.5 s from 21.5 s, λ̂ = n/(20 + n/2). Replacing V by C saves more time per
    second once 576·λ̂_C > 1,440·0.1, i.e. λ̂_C > 0.25/s: at C's 6th request (6/23 = 0.261;
    the 5th has 5/22.5 = 0.222). With expected reuses (H·λ̂) C is admitted there, evicting V.
    With P(≥ 1 request within H) C would need 576·(1 − e^(−5λ̂)) > 1,440·(1 − e^(−0.5)),
    i.e. λ̂_C > 0.83/s, which these six requests never reach: all are refused."""
    cfg = control_lib.KVLearnConfig(
        max_blocks=4,
        max_keys=4,
        count_prior_s=1e-3,
        storage_dt_s=0.0,
        expected_reuses=expected_reuses,
    )
    V, C = 0, 1
    video_kib = int(cfg.cost.footprint_bytes(1440)) // 1024
    trace = [(V, 1.0), (V, 21.0)] + [(C, 21.0 + 0.5 * n) for n in range(1, 7)]
    events, _ = _replay(
        cfg, trace, tokens_of={V: (1440, 2), C: (576, 1)}, capacity_bytes=video_kib * 1024
    )
    assert events[:2] == [("admit", V, []), ("hit", V)]
    tail = [("refuse", C, [])] * 5 + [("admit", C, [V])]
    assert events[2:] == (tail if expected_reuses else [("refuse", C, [])] * 6)
