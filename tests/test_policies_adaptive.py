"""``adaptive`` granularity (AdaKV): a layer's K * B tokens pooled over its KV heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import eviction, kvcache, topn
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import teacher_forced
from jaxkv.model import decoder
from jaxkv.model.params import init_params
from jaxkv.policies import Policy

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)


def _reference_allocation(scores_KC, valid_KC, budget, floor, cap):
    """AdaKV's allocation written out: the safeguard first, then the pool by score."""
    K = scores_KC.shape[0]
    ranked = [sorted(scores_KC[k][valid_KC[k]], reverse=True) for k in range(K)]
    counts = [min(floor, len(r)) for r in ranked]
    pool = [(s, k) for k in range(K) for s in ranked[k][counts[k] : min(cap, len(ranked[k]))]]
    pool.sort(key=lambda t: -t[0])
    for _, k in pool[: max(K * budget - sum(counts), 0)]:
        counts[k] += 1
    return counts


def _allocate(scores, pos, budget, floor, cap, **kw):
    """``eviction.adaptive_budgets`` on numpy inputs, as numpy."""
    arrays = (jnp.asarray(a) for a in (scores, pos, budget))
    return np.asarray(
        eviction.adaptive_budgets(*arrays, floor_B=jnp.asarray(floor), cap_B=jnp.asarray(cap), **kw)
    )


@pytest.mark.parametrize("caps", [(10, 6), (15, 16)])
def test_allocation_equals_the_written_out_reference(caps):
    """Caps that bind, and caps no row exceeds (the allocation skips the cap's mask)."""
    rng = np.random.default_rng(0)
    L, B, K, C = 3, 2, 4, 16
    scores = rng.normal(size=(L, B, K, C)).astype(np.float32) * rng.uniform(0.1, 3, (L, B, K, 1))
    pos = np.where(rng.uniform(size=(L, B, K, C)) < 0.2, -1, 1).astype(np.int32)
    budget = np.array([5, 3], np.int32)
    floor, cap = np.array([1, 0], np.int32), np.array(caps, np.int32)
    assert ((pos >= 0).sum(-1) <= cap[None, :, None]).all() == (caps == (15, 16))
    got = _allocate(scores, pos, budget, floor, cap)
    for l in range(L):
        for b in range(B):
            want = _reference_allocation(scores[l, b], pos[l, b] >= 0, budget[b], floor[b], cap[b])
            assert list(got[l, b]) == want, (l, b)
            assert got[l, b].sum() == min(K * budget[b], (pos[l, b] >= 0).sum())
    assert len(set(map(tuple, got.reshape(-1, K)))) > 1  # the heads' shares differ


def test_allocation_breaks_ties_as_the_reference_does():
    """Scores from three values (ties everywhere, +-0.0 among them), rows full, empty and in
    between, budgets from 0 to more than the occupied slots."""
    rng = np.random.default_rng(2)
    L, B, K, C = 2, 4, 3, 10
    scores = rng.choice(np.float32([-0.0, 0.0, 1.5]), size=(L, B, K, C))
    pos = np.where(rng.uniform(size=(L, B, K, C)) < 0.3, -1, 1).astype(np.int32)
    pos[0, 1, 0] = -1  # an empty row
    budget = np.array([0, 2, 5, 40], np.int32)
    floor, cap = np.array([0, 1, 2, 0], np.int32), np.array([0, 4, 10, 10], np.int32)
    for over_layers in (False, True):
        got = _allocate(scores, pos, budget, floor, cap, over_layers=over_layers)
        for b in range(B):
            rows = [(l, k) for l in range(L) for k in range(K)] if over_layers else None
            for group in [rows] if over_layers else [[(l, k) for k in range(K)] for l in range(L)]:
                s = np.stack([scores[l, b, k] for l, k in group])
                v = np.stack([pos[l, b, k] >= 0 for l, k in group])
                want = _reference_allocation(s, v, budget[b], floor[b], cap[b])
                assert [got[l, b, k] for l, k in group] == want, (over_layers, b)


def test_top_n_mask_is_a_stable_sorts_first_n():
    rng = np.random.default_rng(3)
    x = rng.choice(np.float32([-np.inf, -1.0, -0.0, 0.0, 2.0, np.inf]), size=(5, 64))
    x[0] = rng.normal(size=64)
    n = np.array([0, 1, 17, 63, 64])[:, None]
    got = np.asarray(topn.top_n_mask(jnp.asarray(x), jnp.asarray(n)))
    for i in range(5):
        order = np.argsort(-(x[i] + np.float32(0.0)), kind="stable")
        want = np.zeros(64, bool)
        want[order[: n[i, 0]]] = True
        np.testing.assert_array_equal(got[i], want)


def test_argsort_desc_is_a_stable_descending_argsort():
    rng = np.random.default_rng(5)
    x = rng.choice(np.float32([-np.inf, -1.0, -0.0, 0.0, 2.0, np.inf, np.nan]), size=(4, 3, 300))
    x[0, 0] = rng.normal(size=300)
    x[1, 1] = -np.abs(rng.normal(size=300))  # negative values only
    got = np.asarray(jax.jit(topn.argsort_desc)(jnp.asarray(x)))
    for idx in np.ndindex(4, 3):
        nan = np.isnan(x[idx])
        want = np.lexsort((-(x[idx] + np.float32(0.0)), nan))  # descending, NaN last
        np.testing.assert_array_equal(got[idx], want)
    np.testing.assert_array_equal(got, np.asarray(jnp.argsort(-jnp.asarray(x), stable=True)))


def test_sort_desc_is_a_descending_sort_of_the_values():
    rng = np.random.default_rng(7)
    x = rng.choice(np.float32([-np.inf, -1.5, -0.0, 0.0, 3.0, np.inf, np.nan]), size=(3, 500))
    x[0] = rng.normal(size=500) * 1e3
    got = np.asarray(jax.jit(topn.sort_desc)(jnp.asarray(x)))
    for i in range(3):
        nan = np.isnan(x[i])
        want = np.concatenate([np.sort(x[i][~nan])[::-1], x[i][nan]])  # NaN last
        np.testing.assert_array_equal(got[i], want)  # -0.0 == 0.0, NaN == NaN here


def _mass_above(logits: np.ndarray) -> np.ndarray:
    """Each entry's S: the softmax mass (float64) of the entries strictly greater than it."""
    z = logits.astype(np.float64)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-z, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]  # mass above each, in sorted order
    first = np.searchsorted(-z[order], -z[order], side="left")  # first of each tie group
    out = np.empty_like(before)
    out[order] = before[first]
    return out


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_mask_keeps_the_sorted_nucleus(p):
    """Top-p as a sort states it (keep each entry whose sorted predecessors hold less than p,
    with its ties): the same entries, except where S is p to within float32 summation."""
    rng = np.random.default_rng(int(p * 1000))
    x = (rng.normal(size=(24, 2000)) * rng.uniform(0.3, 8, size=(24, 1))).astype(np.float32)
    x[::3] = np.round(x[::3] * 2) / 2  # many ties at the cutoff
    x[1, :1000] = -np.inf  # masked vocabulary
    x[2, :] = x[2, 0]  # all equal: everything is the nucleus
    x[4, 0] = -0.0
    x[4, 1] = 0.0
    got = np.asarray(jax.jit(topn.top_p_mask, static_argnums=1)(jnp.asarray(x), p))
    exact = 0
    for i in range(len(x)):
        s = _mass_above(x[i])
        want = s < p
        near = np.abs(s - p) < 1e-5
        np.testing.assert_array_equal(got[i] & ~near, want & ~near)
        exact += not near.any()
        kept = x[i][got[i]]  # a nucleus: the largest entries, ties together
        assert kept.size and (~got[i]).sum() == (x[i] < kept.min()).sum()
    assert exact >= len(x) // 4


def test_top_p_mask_small_vocabulary_by_hand():
    logits = jnp.log(jnp.array([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]]))
    got = lambda p: np.asarray(topn.top_p_mask(logits, p)).tolist()
    assert got(0.45) == [[False, True, False, False], [True, True, True, True]]
    assert got(0.7) == [[False, True, False, True], [True, True, True, True]]
    assert got(0.9) == [[False, True, True, True], [True, True, True, True]]


def test_lex_argsort_is_numpys_lexsort():
    rng = np.random.default_rng(6)
    a = rng.integers(0, 2, size=(5, 1000)).astype(np.uint32)  # 1 bit, many ties
    b = rng.integers(0, 40, size=(5, 1000)).astype(np.uint32)
    c = rng.integers(0, 2**20, size=(5, 1000)).astype(np.uint32)
    c[:, ::3] = 7  # ties on every key, broken by the index
    got = np.asarray(topn.lex_argsort([jnp.asarray(k) for k in (a, b, c)], [1, 6, 20]))
    for i in range(5):
        np.testing.assert_array_equal(got[i], np.lexsort((c[i], b[i], a[i])))
    with pytest.raises(ValueError, match="exceed 64 bits"):
        topn.lex_argsort([jnp.asarray(c), jnp.asarray(c)], [32, 32])


def test_inverse_permutation_is_the_ranks_of_an_argsort():
    rng = np.random.default_rng(4)
    perm = np.stack([rng.permutation(50) for _ in range(6)]).reshape(2, 3, 50)
    got = np.asarray(topn.inverse_permutation(jnp.asarray(perm, jnp.int32)))
    for idx in np.ndindex(2, 3):
        want = np.empty(50, int)
        want[perm[idx]] = np.arange(50)  # slot perm[i] has rank i
        np.testing.assert_array_equal(got[idx], want)
        np.testing.assert_array_equal(got[idx], np.argsort(perm[idx]))


def test_each_layer_keeps_k_times_b_tokens_split_by_the_pooled_scores():
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=24, stats=("attn",))
    _, cache = decoder.prefill(PARAMS, TOKENS[:, :24], cache, config=CFG)
    comp = Compression.make("tova", budget=6, granularity="adaptive")
    out = eviction.evict(cache, comp, None, key=jax.random.key(0))
    counts = np.asarray(jnp.sum(out.pos >= 0, axis=-1))  # [L, B, K]
    K = CFG.n_kv_heads
    np.testing.assert_array_equal(counts.sum(axis=-1), K * 6)
    assert counts.min() >= 1 and counts.max() <= 12  # floor(0.2 * 6), floor(2 * 6)
    assert (counts != 6).any()  # the heads got different shares
    attn = np.asarray(cache.stats["attn"])
    for l in range(CFG.n_layers):
        for b in range(2):
            want = _reference_allocation(attn[l, b], np.ones((K, 24), bool), 6, 1, 12)
            assert list(counts[l, b]) == want
            for k in range(K):  # each head keeps its own best
                kept = set(np.flatnonzero(np.asarray(out.pos[l, b, k]) >= 0))
                assert kept == set(np.argsort(-attn[l, b, k])[: counts[l, b, k]])


def _by_position():
    """Scores that depend on the position only: equal across heads holding the same tokens."""
    return Policy("by_position", score=lambda state, cache, **_: jnp.sin(1.7 * cache.pos))


def test_head_and_adaptive_agree_when_scores_are_equal_across_heads():
    runs = {}
    for granularity in ("head", "adaptive"):
        comp = Compression(_by_position(), ratio=0.25, min_budget=4, granularity=granularity)
        runs[granularity] = teacher_forced(
            PARAMS, TOKENS, prompt_len=20, config=CFG, compression=comp
        )
    (head_logits, head), (ada_logits, ada) = runs["head"], runs["adaptive"]
    assert ada.capacity == 2 * 10 + 1 and head.capacity == 10 + 1  # B_max = floor(0.25 * 40)
    sets = lambda c: [  # noqa: E731
        sorted(int(p) for p in c.pos[l, b, k] if p >= 0)
        for l in range(CFG.n_layers)
        for b in range(2)
        for k in range(CFG.n_kv_heads)
    ]
    assert sets(head) == sets(ada)
    np.testing.assert_allclose(np.asarray(ada_logits), np.asarray(head_logits), atol=1e-5, rtol=0)


def test_capacity_layout_and_settings():
    comp = Compression.make("h2o", ratio=0.25, granularity="adaptive")
    assert comp.capacity(4096 + 64) == 2 * 1040 + 1  # floor(head_cap * B_max) + evict_every
    prefill = Compression.make("h2o", ratio=0.25, granularity="adaptive", protocol="prefill")
    assert prefill.capacity(1024 + 64, prompt_len=1024) == 2 * 256 + 64
    assert Compression.make("h2o", ratio=0.5, granularity="adaptive").capacity(100) == 100
    with pytest.raises(ValueError, match="head_cap must be >= 1"):
        Compression.make("h2o", ratio=0.5, granularity="adaptive", head_cap=0.5)
    with pytest.raises(ValueError, match="head_floor must be in"):
        Compression.make("h2o", ratio=0.5, granularity="adaptive", head_floor=1.5)
    with pytest.raises(ValueError, match="does not support granularity 'adaptive'"):
        Compression(
            Policy("tok", score=None, granularities=("shared",)), ratio=0.5, granularity="adaptive"
        )


def test_global_pools_every_layer_and_head_of_a_sequence():
    """``global``: the allocation of one pool over all L * K rows (the written-out reference on
    the rows of every layer together), and the layers' shares differ."""
    rng = np.random.default_rng(1)
    L, B, K, C = 3, 2, 2, 12
    scores = rng.normal(size=(L, B, K, C)).astype(np.float32) * rng.uniform(0.1, 3, (L, 1, 1, 1))
    pos = np.where(rng.uniform(size=(L, B, K, C)) < 0.2, -1, 1).astype(np.int32)
    budget = np.array([4, 3], np.int32)
    floor, cap = np.array([1, 0], np.int32), np.array([8, 6], np.int32)
    got = _allocate(scores, pos, budget, floor, cap, over_layers=True)
    for b in range(B):
        rows_KC = scores[:, b].reshape(L * K, C)
        valid = pos[:, b].reshape(L * K, C) >= 0
        want = _reference_allocation(rows_KC, valid, budget[b], floor[b], cap[b])
        assert list(got[:, b].reshape(-1)) == want, b
    assert len(set(got.sum(axis=-1).reshape(-1).tolist())) > 1  # layers got different shares


def test_global_eviction_keeps_l_k_b_tokens_and_each_rows_best():
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=24, stats=("attn",))
    _, cache = decoder.prefill(PARAMS, TOKENS[:, :24], cache, config=CFG)
    comp = Compression.make("tova", budget=6, granularity="global")
    assert comp.capacity(40) == 12 + 1
    out = eviction.evict(cache, comp, None, key=jax.random.key(0))
    counts = np.asarray(jnp.sum(out.pos >= 0, axis=-1))  # [L, B, K]
    L, K = CFG.n_layers, CFG.n_kv_heads
    np.testing.assert_array_equal(counts.sum(axis=(0, 2)), L * K * 6)
    attn = np.asarray(cache.stats["attn"])
    for b in range(2):
        want = _reference_allocation(
            attn[:, b].reshape(L * K, 24), np.ones((L * K, 24), bool), 6, 1, 12
        )
        assert list(counts[:, b].reshape(-1)) == want
        for l in range(L):
            for k in range(K):
                kept = set(np.flatnonzero(np.asarray(out.pos[l, b, k]) >= 0))
                assert kept == set(np.argsort(-attn[l, b, k])[: counts[l, b, k]])
