"""``expected_attention``: Expected Attention's scores against a numpy brute force over the raw
queries, keys and values of the tiny model, its limiting cases, and both protocols."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_reference import rms, rope

from jaxkv import eviction, kvcache
from jaxkv.config import ModelConfig
from jaxkv.eviction import GRANULARITIES, PROTOCOLS, Compression
from jaxkv.generate import teacher_forced
from jaxkv.model import decoder, layers
from jaxkv.model.params import init_params
from jaxkv.policies import expected
from jaxkv.policies.expected import expected_attention

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
PROMPT = 20


def _np_forward(tokens):
    """Pre-RoPE queries [L, T, N, H], post-RoPE keys and values [L, T, K, H] of a full
    causal pass, in float64 with loops."""
    c = CFG
    P = jax.tree.map(lambda a: np.asarray(a, np.float64), PARAMS)
    L, K, G, H, T = c.n_layers, c.n_kv_heads, c.q_per_kv, c.head_dim, len(tokens)
    x = P["embed"][np.asarray(tokens)]
    qs, ks, vs = [], [], []
    for l in range(L):
        lp = {n: a[l] for n, a in P["layers"].items()}
        h = rms(x, lp["attn_norm"], c.norm_eps)
        q = np.einsum("td,dnh->tnh", h, lp["wq"])
        k = np.einsum("td,dkh->tkh", h, lp["wk"])
        v = np.einsum("td,dkh->tkh", h, lp["wv"])
        k = np.array([[rope(k[t, j], t, c.rope_theta) for j in range(K)] for t in range(T)])
        out = np.zeros((T, K * G, H))
        for n in range(K * G):
            for t in range(T):
                s = np.array([rope(q[t, n], t, c.rope_theta) @ k[u, n // G] for u in range(t + 1)])
                a = np.exp((s - s.max()) / math.sqrt(H))
                out[t, n] = (a / a.sum()) @ v[: t + 1, n // G]
        qs.append(q)
        ks.append(k)
        vs.append(v)
        x = x + np.einsum("tnh,nhd->td", out, lp["wo"])
        h = rms(x, lp["mlp_norm"], c.norm_eps)
        gate = h @ lp["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ lp["w_up"])) @ lp["w_down"]
    return np.stack(qs), np.stack(ks), np.stack(vs)


def _rotation(pos):
    """RoPE's matrix at ``pos``: R @ x == rope(x, pos)."""
    H = CFG.head_dim
    return np.stack([rope(e, pos, CFG.rope_theta) for e in np.eye(H)], axis=1)


def _reference_scores(tokens, *, n_future=16, n_sink=4, cov=True, vnorm=True, eps=0.0):
    """[L, K, T] scores of every key after ``len(tokens)`` tokens, from the written formula:
    mean and covariance of the pre-RoPE queries at positions >= 4, the mean rotation
    matrix over the next positions, softmax over non-sink keys, mean over G, value norms,
    sinks at the layer's max + 1."""
    q, k, v = _np_forward(tokens)
    L, T, N, H = q.shape
    K, G = CFG.n_kv_heads, CFG.q_per_kv
    w = (np.arange(T) >= kvcache.QUERY_SINKS).astype(np.float64)
    R = np.mean([_rotation(p) for p in range(T, T + n_future)], axis=0)
    out = np.zeros((L, K, T))
    for l in range(L):
        for kh in range(K):
            probs = []
            for g in range(G):
                qn = q[l, :, kh * G + g]
                mu = w @ qn / w.sum()
                sigma = sum(w[t] * np.outer(qn[t] - mu, qn[t] - mu) for t in range(T)) / w.sum()
                mu_r, sigma_r = R @ mu, R @ sigma @ R.T
                z = np.array(
                    [
                        mu_r @ k[l, t, kh] / math.sqrt(H)
                        + (k[l, t, kh] @ sigma_r @ k[l, t, kh] / (2 * H) if cov else 0.0)
                        for t in range(n_sink, T)
                    ]
                )
                probs.append(np.exp(z - z.max()) / np.exp(z - z.max()).sum())
            s = np.mean(probs, axis=0)
            if vnorm:
                s = (s + eps) * np.linalg.norm(v[l, n_sink:, kh], axis=-1)
            out[l, kh, n_sink:] = s
        out[l, :, :n_sink] = out[l, :, n_sink:].max() + 1
    return out


def _filled(n_prefill, n_decode):
    """A cache carrying query statistics after prefilling ``n_prefill`` tokens of both
    sequences and decoding ``n_decode`` more one at a time (nothing evicted)."""
    cache = kvcache.init_cache(
        CFG, batch_size=2, capacity=n_prefill + n_decode, stats=(kvcache.QUERIES,)
    )
    _, cache = decoder.prefill(PARAMS, TOKENS[:, :n_prefill], cache, config=CFG)
    for i in range(n_decode):
        _, cache = decoder.decode_step(PARAMS, TOKENS[:, n_prefill + i], cache, config=CFG)
    return cache


@pytest.mark.parametrize(
    "n_prefill, n_decode, settings",
    [
        (16, 0, {}),
        (12, 4, {}),  # moments merged across passes
        (16, 0, dict(n_sink=0, cov=False, eps=0.05)),
        (16, 0, dict(n_sink=2, vnorm=False)),
    ],
)
def test_scores_equal_the_numpy_brute_force(n_prefill, n_decode, settings):
    cache = _filled(n_prefill, n_decode)
    keys = dict(cov="use_covariance", vnorm="use_vnorm", eps="epsilon")
    policy = expected_attention(
        n_future_positions=16, **{keys.get(n, n): x for n, x in settings.items()}
    )
    got = np.asarray(policy.score(None, cache, budget_B=None, key=None))
    T = n_prefill + n_decode
    for b in range(2):
        want = _reference_scores(np.asarray(TOKENS[b, :T]), n_future=16, **settings)
        np.testing.assert_allclose(got[:, b], want, rtol=2e-4, atol=1e-6)


def test_without_covariance_and_one_future_position_it_is_the_next_querys_attention():
    """With the covariance term dropped, one future position and the query mean in place of
    a query, the score is the softmax attention that a query at the next position gives the
    cached keys (RoPE applied as the decoder applies it), times the value norms."""
    cache = _filled(16, 0)
    mean, _ = expected.query_mean_cov(cache.query_stats)  # [L, B, K, G, H]
    L, B, K, G, H = mean.shape
    pos_BT = cache.length[:, None]
    q_LBKGH = jnp.stack(
        [layers.rope(mean[l].reshape(B, 1, K * G, H), pos_BT, 1e4) for l in range(L)]
    ).reshape(L, B, K, G, H)
    logits = jnp.einsum("lbkgh,lbkch->lbkgc", q_LBKGH, cache.k) / jnp.sqrt(H)
    attn = jnp.mean(jax.nn.softmax(logits, axis=-1), axis=3)
    want = attn * jnp.linalg.norm(cache.v, axis=-1)
    got = expected.expected_scores(
        cache, n_future=1, n_sink=0, use_covariance=False, use_vnorm=True, epsilon=0.0
    )
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_the_averaged_rotation_is_the_mean_rotation_matrix():
    cos, sin = expected.averaged_rotation(jnp.array([3, 30]), n_future=7, head_dim=16, theta=1e4)
    x = np.asarray(jax.random.normal(jax.random.key(2), (1, 2, 1, 16)))
    got = np.asarray(expected._rotate(jnp.asarray(x), cos, sin))
    back = np.asarray(expected._rotate(jnp.asarray(x), cos, -sin))
    for b, start in enumerate((3, 30)):
        R = np.mean([_rotation(p) for p in range(start, start + 7)], axis=0)
        np.testing.assert_allclose(got[0, b, 0], R @ x[0, b, 0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(back[0, b, 0], R.T @ x[0, b, 0], rtol=1e-5, atol=1e-6)


def test_only_a_policy_that_asks_carries_query_statistics():
    assert expected_attention().stats == (kvcache.QUERIES,)
    comp = Compression(policy=expected_attention(), ratio=0.5)
    assert comp.stats == (kvcache.QUERIES,)
    lean = kvcache.init_cache(CFG, batch_size=1, capacity=4, stats=("attn",))
    assert lean.query_stats == {} and set(lean.stats) == {"attn"}
    assert set(kvcache.init_cache(CFG, batch_size=1, capacity=4, stats=True).stats) == set(
        kvcache.STAT_NAMES
    )
    carried = kvcache.init_cache(CFG, batch_size=1, capacity=4, stats=comp.stats)
    assert carried.stats == {} and carried.query_stats["q_outer"].shape == (2, 1, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="query statistics"):
        expected.expected_scores(
            lean, n_future=1, n_sink=0, use_covariance=True, use_vnorm=True, epsilon=0.0
        )
    with pytest.raises(ValueError, match="n_future_positions"):
        expected_attention(n_future_positions=0)


def test_gather_keeps_the_query_statistics():
    cache = _filled(16, 0)
    small = kvcache.compact(
        kvcache.free_slots(cache, jnp.arange(16) % 2 == 0), capacity=8
    )  # evict even slots
    for n, a in cache.query_stats.items():
        np.testing.assert_array_equal(np.asarray(small.query_stats[n]), np.asarray(a))


@pytest.fixture(scope="module")
def full_stream():
    return teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG)[0]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_ratio_one_equals_the_full_cache_bit_for_bit(protocol, full_stream):
    comp = Compression(policy=expected_attention(), ratio=1.0, protocol=protocol)
    logits, cache = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG, compression=comp)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(full_stream))
    assert float(cache.query_stats["weight"][0]) > 0


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_every_granularity_keeps_the_budget_and_the_sinks(granularity, protocol, full_stream):
    comp = Compression(
        policy=expected_attention(),
        ratio=0.25,
        min_budget=6,
        granularity=granularity,
        protocol=protocol,
    )
    logits, cache = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG, compression=comp)
    assert np.all(np.isfinite(np.asarray(logits)))
    assert not np.array_equal(np.asarray(logits), np.asarray(full_stream))
    held = np.asarray(cache.pos)
    L, B, K = held.shape[:3]
    n_held = (held >= 0).sum(-1)
    if protocol == "decode":  # B = floor(0.25 * 39) = 9 per row, pooled by adaptive / global
        pooled = {"adaptive": (-1,), "global": (0, 2)}.get(granularity, ())
        rows = int(np.prod([n_held.shape[a] for a in pooled]))
        np.testing.assert_array_equal(n_held.sum(axis=pooled) if pooled else n_held, rows * 9)
    for l in range(L):
        for b in range(B):
            for k in range(K):
                assert set(range(4)) <= set(held[l, b, k].tolist())  # the sinks stay


def test_eviction_keeps_the_best_scored_tokens():
    cache = _filled(16, 0)
    comp = Compression(policy=expected_attention(), budget=8, granularity="head")
    scores = np.asarray(comp.policy.score(None, cache, budget_B=None, key=None))
    out = eviction.evict(cache, comp, None, key=jax.random.key(0))
    for l in range(CFG.n_layers):
        for b in range(2):
            for k in range(CFG.n_kv_heads):
                kept = set(np.flatnonzero(np.asarray(out.pos[l, b, k]) >= 0))
                assert kept == set(np.argsort(-scores[l, b, k], kind="stable")[:8])
