"""The Plackett-Luce subset distribution against brute force, float64, and sampling statistics."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxkv.rl import plackett_luce as pl

# ---------------------------------------------------------------------------- references


def _brute_log_z(scores, valid, budget):
    """log Σ_{|a|=B} exp(Σ_{i∈a} s_i) over present items, float64, by enumeration."""
    items = np.flatnonzero(valid)
    sums = [
        np.sum(scores[list(c)], dtype=np.float64) for c in itertools.combinations(items, budget)
    ]
    return -np.inf if not sums else float(np.logaddexp.reduce(np.array(sums, np.float64)))


def _brute_subsets(scores, budget):
    """{subset: π(subset)} for all subsets of size B, float64."""
    scores = np.asarray(scores, np.float64)
    subsets = list(itertools.combinations(range(len(scores)), budget))
    logits = np.array([scores[list(a)].sum() for a in subsets])
    probs = np.exp(logits - np.logaddexp.reduce(logits))
    return dict(zip(subsets, probs, strict=True))


def _ordered_log_prob(scores, draw):
    """log P(draw) for items drawn one by one without replacement, P ∝ exp(s), float64."""
    scores = np.asarray(scores, np.float64)
    remaining, total = list(range(len(scores))), 0.0
    for item in draw:
        total += scores[item] - np.logaddexp.reduce(scores[remaining])
        remaining.remove(item)
    return total


def _gumbel_subsets(scores, budget):
    """{subset: P(Gumbel-top-B = subset)}: the ordered draw summed over orders, float64."""
    return {
        a: sum(math.exp(_ordered_log_prob(scores, p)) for p in itertools.permutations(a))
        for a in itertools.combinations(range(len(scores)), budget)
    }


def _np_log_e_tables(scores, budget):
    """Prefix/suffix tables of log e_j in float64 (the paper's log-space DP, as in Appendix C)."""
    n = len(scores)
    fwd = np.full((n + 1, budget + 1), -np.inf)
    bwd = np.full((n + 1, budget + 1), -np.inf)
    fwd[0, 0] = bwd[n, 0] = 0.0
    for i, s in enumerate(scores):
        fwd[i + 1] = fwd[i]
        fwd[i + 1, 1:] = np.logaddexp(fwd[i, 1:], fwd[i, :-1] + s)
    for i in range(n - 1, -1, -1):
        bwd[i] = bwd[i + 1]
        bwd[i, 1:] = np.logaddexp(bwd[i + 1, 1:], bwd[i + 1, :-1] + scores[i])
    return fwd, bwd


def _np_reference(scores, budget):
    """(log Z, inclusion probabilities) in float64 by a forward/backward DP (numpy)."""
    scores = np.asarray(scores, np.float64)
    fwd, bwd = _np_log_e_tables(scores, budget)
    log_z = fwd[-1, budget]
    # p_i = e^{s_i} Σ_j e_j(<i) e_{B-1-j}(>i) / Z
    pair = fwd[:-1, :budget] + bwd[1:, budget - 1 :: -1]
    with np.errstate(invalid="ignore"):
        log_p = scores + np.logaddexp.reduce(pair, axis=1) - log_z
    return log_z, np.exp(log_p)


def _frequencies(masks, num_items, budget):
    """Counts of each size-B subset among boolean sample masks [N, L]."""
    codes = masks.astype(np.int64) @ (1 << np.arange(num_items))
    subsets = list(itertools.combinations(range(num_items), budget))
    return {a: int(np.sum(codes == sum(1 << i for i in a))) for a in subsets}


# ---------------------------------------------------------------------------- log Z


def test_log_partition_equals_brute_force_for_every_small_case():
    """Every L ≤ 12 and B in 0..L (+ one impossible B), padded to 12 with absent items."""
    width, rows = 12, []
    for seed in range(3):
        rng = np.random.default_rng(seed)
        for num in range(width + 1):
            for budget in range(num + 2 if num < width else num + 1):
                scores = rng.normal(0.0, 2.0, width).astype(np.float32)
                valid = np.zeros(width, bool)
                valid[rng.choice(width, num, replace=False) if seed else np.arange(num)] = True
                rows.append((scores, valid, budget))
    scores, valid, budgets = (np.stack(x) for x in zip(*rows, strict=True))
    # Seed 2 marks absent items with -inf scores instead of the mask.
    by_score = np.repeat(np.arange(3), len(rows) // 3) == 2
    scores_in = np.where(by_score[:, None] & ~valid, -np.inf, scores).astype(np.float32)
    mask_in = valid | by_score[:, None]
    fn = jax.jit(jax.vmap(lambda s, m, b: pl.log_partition(s, b, mask_L=m, max_budget=width)))
    got = np.asarray(fn(scores_in, mask_in, budgets))
    want = np.array([_brute_log_z(s.astype(np.float64), v, b) for s, v, b in rows])
    impossible = budgets > valid.sum(1)
    assert np.all(np.isneginf(got[impossible])) and np.all(np.isneginf(want[impossible]))
    np.testing.assert_allclose(got[~impossible], want[~impossible], rtol=1e-6, atol=2e-6)


def test_log_partition_static_budget_and_edge_cases():
    scores = np.random.default_rng(0).normal(size=7).astype(np.float32)
    valid = np.ones(7, bool)
    for budget in (0, 4):
        got = float(pl.log_partition(scores, budget))
        assert got == pytest.approx(
            _brute_log_z(scores.astype(np.float64), valid, budget), abs=2e-6
        )
    assert np.isneginf(pl.log_partition(scores, 8))
    assert np.isnan(pl.log_partition(scores, 6, max_budget=5))  # beyond the compiled table
    assert float(pl.log_partition(np.zeros(4, np.float32), 2)) == pytest.approx(math.log(6))
    with pytest.raises(TypeError, match="max_budget"):
        jax.jit(lambda b: pl.log_partition(scores, b))(3)


def test_dp_carry_and_table_keep_shapes_and_dtypes():
    scores = jax.ShapeDtypeStruct((4096,), jnp.float32)
    table = jax.eval_shape(lambda s: pl.log_ratio_table(s, max_budget=1024), scores)
    assert (table.shape, table.dtype) == ((4096, 1025), jnp.float32)
    init = pl._dp_init(1025, jnp.float32)
    out, emitted = pl._dp_step(init, (jnp.float32(0.5), jnp.bool_(True)))
    assert out.shape == emitted.shape == init.shape and out.dtype == init.dtype


# ---------------------------------------------------------------------------- gradients


def test_gradients_match_finite_differences_in_float64():
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        scores = jnp.asarray(rng.normal(0.0, 1.5, 9), jnp.float64)
        mask = jnp.asarray([1, 1, 0, 1, 1, 1, 1, 0, 1], bool)
        fn = lambda s, b: pl.log_partition(s, b, mask_L=mask, max_budget=8)
        grad_fn, batch_fn = jax.jit(jax.grad(fn)), jax.jit(jax.vmap(fn, (0, None)))
        step = 1e-6 * jnp.eye(9, dtype=jnp.float64)
        for budget in (1, 4, 7):
            grad = np.asarray(grad_fn(scores, budget))
            fd = (
                np.asarray(batch_fn(scores + step, budget) - batch_fn(scores - step, budget)) / 2e-6
            )
            np.testing.assert_allclose(grad, fd, atol=1e-8)
            assert grad.sum() == pytest.approx(budget, abs=1e-12)
            assert np.all(grad[~np.asarray(mask)] == 0.0)


def test_inclusion_probs_and_entropy_match_brute_force():
    scores = np.random.default_rng(2).normal(0.0, 1.5, 8).astype(np.float32)
    fn = jax.jit(
        lambda b: (pl.inclusion_probs(scores, b, max_budget=6), pl.entropy(scores, b, max_budget=6))
    )
    for budget in (1, 3, 6):
        probs = _brute_subsets(scores, budget)
        marginals = np.zeros(8)
        for a, p in probs.items():
            marginals[list(a)] += p
        want_h = -sum(p * math.log(p) for p in probs.values())
        p_got, h_got = (np.asarray(x) for x in fn(budget))
        np.testing.assert_allclose(p_got, marginals, atol=2e-6)
        assert p_got.sum() == pytest.approx(budget, abs=1e-5)
        assert float(h_got) == pytest.approx(want_h, abs=1e-5)


# ---------------------------------------------------------------------------- stability


@pytest.mark.parametrize("sigma", [1.0, 10.0, 100.0])
def test_float32_stable_at_l4096_b1024(sigma):
    """Float32 DP vs an independent float64 numpy DP (log e_j form), L = 4096, B = 1024."""
    scores = np.random.default_rng(3).normal(0.0, sigma, 4096).astype(np.float32)
    want_z, want_p = _np_reference(scores.astype(np.float64), 1024)
    want_h = want_z - np.sum(want_p * scores)
    fn = jax.jit(lambda s: (*pl.log_partition_and_inclusion_probs(s, 1024), pl.entropy(s, 1024)))
    log_z, p, h = (np.asarray(x, np.float64) for x in fn(jnp.asarray(scores)))
    print(
        f"sigma={sigma} logZ rel err {abs(log_z - want_z) / abs(want_z):.1e}, "
        f"p max err {np.abs(p - want_p).max():.1e}, |sum p - B| {abs(p.sum() - 1024):.1e}, "
        f"H {h:.4f} vs {want_h:.4f}"
    )
    assert np.isfinite(log_z) and np.all(np.isfinite(p)) and np.isfinite(h)
    assert log_z == pytest.approx(want_z, rel=1e-6)
    np.testing.assert_allclose(p, want_p, atol=5e-4)
    assert p.sum() == pytest.approx(1024, abs=5e-3)
    # H = log Z − Σ p s cancels two O(B·σ) numbers: compare on that scale.
    assert h == pytest.approx(want_h, abs=2e-6 * float(np.sum(want_p * np.abs(scores))) + 1e-2)


def test_exact_sampler_and_gradient_at_l4096_b1024():
    rng = np.random.default_rng(4)
    scores = jnp.asarray(rng.normal(0.0, 10.0, 4096), jnp.float32)
    mask = jnp.asarray(rng.random(4096) > 0.1)

    def loss(s, key):
        sel, logp = pl.sample_and_log_prob(
            s, 1024, key=key, estimator="exact", mask_L=mask, max_budget=1024
        )
        return logp, sel

    (logp, sel), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(scores, jax.random.key(0))
    assert int(sel.sum()) == 1024 and not np.any(np.asarray(sel & ~mask))
    assert np.isfinite(float(logp)) and float(logp) <= 0.0 and np.all(np.isfinite(grad))


# ---------------------------------------------------------------------------- sampling


def _sample_many(estimator, scores, budget, num, *, seed=0, **kw):
    keys = jax.random.split(jax.random.key(seed), num)
    fn = lambda k: pl.sample_and_log_prob(scores, budget, key=k, estimator=estimator, **kw)[0]
    return np.asarray(jax.jit(jax.vmap(fn))(keys))


def test_exact_sampler_passes_chi_square():
    scores = np.random.default_rng(5).normal(0.0, 1.0, 5).astype(np.float32)
    masks = _sample_many("exact", scores, 2, 20_000)
    assert np.all(masks.sum(1) == 2)
    probs = _brute_subsets(scores, 2)
    counts = _frequencies(masks, 5, 2)
    observed = np.array([counts[a] for a in probs])
    expected = np.array([probs[a] for a in probs]) * len(masks)
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_exact_sampler_with_mask_and_traced_budget_passes_chi_square():
    scores = np.random.default_rng(6).normal(0.0, 1.5, 6).astype(np.float32)
    mask = np.array([1, 1, 0, 1, 1, 1], bool)
    budget = jnp.int32(3)  # traced inside the jit: one DP of width max_budget + 1 = 5
    masks = _sample_many("exact", scores, budget, 20_000, seed=1, mask_L=mask, max_budget=4)
    assert np.all(masks.sum(1) == 3) and not np.any(masks[:, 2])
    present = np.flatnonzero(mask)
    probs = _brute_subsets(scores[present], 3)
    counts = _frequencies(masks[:, present], len(present), 3)
    observed = np.array([counts[a] for a in probs])
    expected = np.array([probs[a] for a in probs]) * len(masks)
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_paper_gumbel_topb_sample_is_not_distributed_as_pi():
    """Weights {1, 1, 2}, B = 2: P({0, 1}) is 1/5 under π but 1/6 under Gumbel-top-2."""
    scores = np.log(np.array([1.0, 1.0, 2.0], np.float32))
    num = 100_000
    pi, gumbel = _brute_subsets(scores, 2), _gumbel_subsets(scores, 2)
    assert pi[(0, 1)] == pytest.approx(1 / 5) and gumbel[(0, 1)] == pytest.approx(1 / 6)
    se = math.sqrt(gumbel[(0, 1)] * (1 - gumbel[(0, 1)]) / num)  # 1.2e-3
    paper = _frequencies(_sample_many("paper", scores, 2, num), 3, 2)
    freq = paper[(0, 1)] / num
    assert abs(freq - 1 / 6) < 4 * se  # matches the ordered draw ...
    assert 1 / 5 - freq > 20 * se  # ... and is 28 standard errors away from π
    observed = np.array([paper[a] for a in pi])
    assert stats.chisquare(observed, np.array([pi[a] for a in pi]) * num).pvalue < 1e-20
    assert stats.chisquare(observed, np.array([gumbel[a] for a in pi]) * num).pvalue > 1e-3
    exact = _frequencies(_sample_many("exact", scores, 2, num, seed=1), 3, 2)
    assert abs(exact[(0, 1)] / num - 1 / 5) < 4 * math.sqrt(0.2 * 0.8 / num)


# ---------------------------------------------------------------------------- estimators


def test_ordered_log_prob_equals_brute_force():
    scores = np.random.default_rng(7).normal(0.0, 1.0, 5).astype(np.float32)
    draws = list(itertools.permutations(range(5), 3))
    orders = np.array([list(d) + [i for i in range(5) if i not in d] for d in draws])
    got = np.asarray(jax.vmap(lambda o: pl.ordered_log_prob(scores, o, 3))(orders))
    want = np.array([_ordered_log_prob(scores, d) for d in draws])
    np.testing.assert_allclose(got, want, atol=2e-6)
    assert np.exp(got).sum() == pytest.approx(1.0, abs=1e-5)
    # The estimator's log-prob is the ordered probability of one ordering of its sample.
    for seed in range(5):
        sel, logp = pl.sample_and_log_prob(
            scores, 3, key=jax.random.key(seed), estimator="ordered_pl"
        )
        items = tuple(np.flatnonzero(np.asarray(sel)))
        candidates = [_ordered_log_prob(scores, p) for p in itertools.permutations(items)]
        assert min(abs(float(logp) - c) for c in candidates) < 2e-6


def test_estimator_expectations_and_paper_bias():
    """E[R ∇ log p] per estimator, exactly (enumeration) and by Monte Carlo.

    ``exact`` gives ∇ E_π[R] and ``ordered_pl`` gives ∇ E_gumbel[R]; ``paper`` gives neither.
    """
    scores = jnp.asarray([0.3, -0.5, 1.0, 0.1], jnp.float32)
    subsets = list(itertools.combinations(range(4), 2))
    reward = dict(zip(subsets, np.random.default_rng(8).normal(size=len(subsets)), strict=True))
    reward_A = jnp.asarray([reward[a] for a in subsets], jnp.float32)
    masks_AL = jnp.asarray([[i in a for i in range(4)] for a in subsets])
    # Each size-2 subset in both orders, completed to a permutation.
    orders_2AL = jnp.asarray(
        [[[*p, *(i for i in range(4) if i not in p)] for p in (a, a[::-1])] for a in subsets]
    )
    log_pi_A = jax.vmap(lambda m, s: pl.subset_log_prob(s, m, 2), (0, None))
    log_ord_2A = jax.vmap(jax.vmap(lambda o, s: pl.ordered_log_prob(s, o, 2), (0, None)), (1, None))
    gumbel_A = lambda s: jnp.exp(log_ord_2A(orders_2AL, s)).sum(0)
    true_pi = jax.jit(jax.grad(lambda s: jnp.exp(log_pi_A(masks_AL, s)) @ reward_A))(scores)
    true_gumbel = jax.jit(jax.grad(lambda s: gumbel_A(s) @ reward_A))(scores)
    jac_log_pi_AL = jax.jit(jax.jacobian(lambda s: log_pi_A(masks_AL, s)))(scores)
    pi = np.array([_brute_subsets(scores, 2)[a] for a in subsets])
    gumbel = np.array([_gumbel_subsets(scores, 2)[a] for a in subsets])
    np.testing.assert_allclose(gumbel_A(scores), gumbel, atol=1e-6)
    expect = {
        "exact": (pi * reward_A) @ jac_log_pi_AL,
        "paper": (gumbel * reward_A) @ jac_log_pi_AL,
    }
    np.testing.assert_allclose(expect["exact"], true_pi, atol=1e-5)
    assert np.abs(expect["paper"] - true_pi).max() > 0.02
    assert np.abs(expect["paper"] - true_gumbel).max() > 0.02

    num, keys = 40_000, jax.random.split(jax.random.key(9), 40_000)
    codes = jnp.asarray([sum(1 << i for i in a) for a in subsets])

    def per_sample(key, estimator):
        def logp(s):
            sel, lp = pl.sample_and_log_prob(s, 2, key=key, estimator=estimator)
            return lp, sel

        g, sel = jax.grad(logp, has_aux=True)(scores)
        r = reward_A[jnp.argmax(codes == jnp.sum(sel * (1 << jnp.arange(4))))]
        return r * g

    targets = {"exact": true_pi, "ordered_pl": true_gumbel, "paper": expect["paper"]}
    for estimator, target in targets.items():
        g = np.asarray(jax.jit(jax.vmap(lambda k, e=estimator: per_sample(k, e)))(keys))
        assert np.all(np.isfinite(g))
        se = g.std(0) / math.sqrt(num)
        assert np.all(np.abs(g.mean(0) - target) < 5 * se + 1e-6), estimator


@pytest.mark.parametrize("estimator", pl.ESTIMATORS)
def test_sample_and_log_prob_gradients_finite_with_mask_and_traced_budget(estimator):
    rng = np.random.default_rng(10)
    scores = jnp.asarray(rng.normal(0.0, 30.0, 64), jnp.float32).at[5].set(-jnp.inf)
    mask = jnp.asarray(rng.random(64) > 0.2)

    @jax.jit
    def fn(s, budget, key):
        def logp(s):
            sel, lp = pl.sample_and_log_prob(
                s, budget, key=key, estimator=estimator, mask_L=mask, max_budget=32
            )
            return lp, sel

        return jax.value_and_grad(logp, has_aux=True)(s)

    for budget in (0, 1, 16, 32):
        (lp, sel), grad = fn(scores, budget, jax.random.key(budget))
        assert int(sel.sum()) == budget and not np.any(np.asarray(sel & ~mask)) and not sel[5]
        assert np.isfinite(float(lp)) and float(lp) <= 1e-6 and np.all(np.isfinite(grad))


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="paper, exact, ordered_pl"):
        pl.sample_and_log_prob(jnp.zeros(4), 2, key=jax.random.key(0), estimator="gumbel")
