"""Attention statistics, computed from the probabilities the forward pass already has.

For every key slot, per layer and KV head, a pass of T queries contributes (means over the G
query heads of a KV group; ``a_q(i)`` is query q's attention probability on key i):

* ``attn``: a_final(i), the mass from the pass's final (real) query;
* ``attn_sq``: a_final(i)^2, whose mean against ``attn`` gives the variance across heads;
* ``attn_cum``: sum over the pass's real queries of a_q(i) (accumulated across passes);
* ``recent``: sum_q lam^(age q) a_q(i), lam = exp(-1/window), age 0 for the final query;
* ``recent_ent``: sum_q lam^(age q) a_q(i) H(a_q), with H(a_q) = -sum_j a_q(j) log a_q(j).

``recent``/``recent_ent`` are exponentially decayed versions of the paper's "last w queries"
sums: an exact window would need every query's attention row for w steps (w times the
memory of the keys); the decay keeps one number per slot and weights the last w queries
most. See ``jaxkv.kvcache.STAT_NAMES``.

Query moments (``jaxkv.kvcache.QUERIES``) are computed from the pre-RoPE queries: the sums
``sum_q q`` and ``sum_q q q^T`` per (layer, query head) over every query so far (after the
first ``QUERY_SINKS`` positions), as kvpress computes mean and covariance over the prompt.
They are not decayed: a decay would need its own time constant (``window`` belongs to the
per-slot statistics, and policies that share a cache must agree on it).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxkv.kvcache import QUERY_SINKS, STAT_NAMES

# Order of the query-weight channels; channel 3 is the recent weight times the entropy.
_FINAL, _VALID, _RECENT, _RECENT_ENT = 0, 1, 2, 3
_CHANNEL = {
    "attn": _FINAL,
    "attn_sq": _FINAL,
    "attn_cum": _VALID,
    "recent": _RECENT,
    "recent_ent": _RECENT_ENT,
}


def decay(window: int) -> float:
    return math.exp(-1.0 / window)


def query_weights(pos_BT: jax.Array, window: int) -> jax.Array:
    """[B, T, 3] weights of each query: final-query indicator, real-query indicator, and the
    decay ``lam^(age)`` (0 for padding queries, whose position is -1)."""
    valid = pos_BT >= 0
    last = jnp.max(pos_BT, axis=1, keepdims=True)
    age = (last - pos_BT).astype(jnp.float32)
    recent = jnp.where(valid, decay(window) ** age, 0.0)
    final = (pos_BT == last) & valid
    return jnp.stack([final.astype(jnp.float32), valid.astype(jnp.float32), recent], axis=-1)


def entropy(p_BKGTS: jax.Array) -> jax.Array:
    """H(a_q) = -sum_j a_q(j) log a_q(j) of every query's attention row, [B, K, G, T]."""
    return -jnp.sum(
        jnp.where(p_BKGTS > 0, p_BKGTS * jnp.log(jnp.where(p_BKGTS > 0, p_BKGTS, 1.0)), 0.0),
        axis=-1,
    )


def _mean_over_heads(x_BKGS: jax.Array) -> jax.Array:
    """Mean over the G query heads of a KV group, as G-1 elementwise adds: XLA fuses them
    with their producers, where a reduction over that short middle axis ran as a separate
    (slow) kernel on CPU."""
    G = x_BKGS.shape[2]
    return functools.reduce(jnp.add, [x_BKGS[:, :, g] for g in range(G)]) / G


def contributions(
    p_parts, w_BT3: jax.Array, names=STAT_NAMES, *, entropy_BKGT=None
) -> tuple[dict, ...]:
    """The contribution ([B, K, S] for each part) of one pass's attention probabilities to
    each statistic in ``names`` (``vnorm`` and ``wo_vnorm`` are not attention statistics and
    are skipped).

    Args:
        p_parts: the probabilities [B, K, G, T, S] of the key parts of one softmax (e.g. the
            cache slots and the new tokens); a row's entropy sums over all parts.
        w_BT3: the query weights (``query_weights``).
        names: the statistics to compute (nothing else is; the rows' entropies only for
            ``recent_ent``).
        entropy_BKGT: the rows' entropies over every key of the pass, where ``p_parts`` are
            not all of them (``cache_kernel.cache_attention_stats`` computes the cache's
            part and returns them); None: computed from ``p_parts``.

    Returns:
        One dict {name: [B, K, S]} per part.

    Everything is computed from ``p`` after the softmax, never inside it: a softmax that
    also produced statistics would be fused differently by XLA, and the logits of a cache
    with statistics would no longer equal the full cache's bit for bit.
    """
    names = [n for n in names if n in _CHANNEL]
    p_parts = [p.astype(jnp.float32) for p in p_parts]
    if "recent_ent" in names and entropy_BKGT is None:
        entropy_BKGT = functools.reduce(jnp.add, [entropy(p) for p in p_parts])
    slabs = _slab_parts(p_parts, names)
    return tuple(
        _part_contributions(p, w_BT3, entropy_BKGT, names, slab)
        for p, slab in zip(p_parts, slabs, strict=True)
    )


def _slab_fits(p_BKGTS, names) -> bool:
    """Whether one key part could go through ``_decode_slab``: a single query, more than one
    statistic, at most ``MAX_SLAB`` elements per statistic."""
    B, K, _, T, S = p_BKGTS.shape
    return len(names) > 1 and T == 1 and B * K * S <= MAX_SLAB


def _slab_parts(p_parts, names) -> list[bool]:
    """Which key parts of one pass go through ``_decode_slab``: every part or none (a slab for
    the new token beside a cache part above ``MAX_SLAB`` cost ~10 ms per decode step at batch
    8 x 2145 slots)."""
    ok = all(_slab_fits(p, names) for p in p_parts)
    return [ok] * len(p_parts)


def _part_contributions(p_BKGTS, w_BT3, entropy_BKGT, names, slab: bool) -> dict:
    T = p_BKGTS.shape[3]
    if slab:
        return _decode_slab(p_BKGTS[:, :, :, 0], w_BT3[:, 0], entropy_BKGT, names)
    per_head = {}  # channel -> [B, K, G, S]: sum over queries of weight * probability

    def summed(c):
        if c not in per_head:
            w_BT = w_BT3[..., min(c, _RECENT)]
            w_BKGT = jnp.broadcast_to(w_BT[:, None, None], p_BKGTS.shape[:4])
            if c == _RECENT_ENT:
                w_BKGT = w_BKGT * entropy_BKGT
            if T == 1:  # decode: a broadcast product, much cheaper on CPU
                per_head[c] = p_BKGTS[:, :, :, 0] * w_BKGT[..., 0, None]
            else:
                per_head[c] = jnp.einsum("bkgts,bkgt->bkgs", p_BKGTS, w_BKGT)
        return per_head[c]

    out = {}
    for n in names:
        m = summed(_CHANNEL[n])
        out[n] = _mean_over_heads(m**2 if n == "attn_sq" else m)
    return out


# Up to this many [B, K, S] elements per statistic, a decode step's statistics are one slab
# (``_decode_slab``); above it they are left to XLA's fusion.
MAX_SLAB = 32768


def _decode_slab(p_BKGS, w_B3, entropy_BKGT, names) -> dict:
    """``_part_contributions`` of one query (decode) for more than one statistic. Its final,
    real and recent weights are all its validity (1, or 0 for padding; ``lam^0`` = 1), so
    ``attn``, ``attn_cum`` and ``recent`` share one contribution: with ``attn_sq`` and
    ``recent_ent`` at most three distinct [B, K, S] arrays, computed as one slab behind an
    optimization barrier. XLA:CPU otherwise fuses the products into every statistic's update
    and reads ``p`` once per statistic. Measured with all six statistics in fused decode
    loops, paired in turns (``scripts/profile_decode.py stats``): batch 8 x 1105 slots
    0.33-0.71x the statistics' time (five runs); 8 x 552 and 1 x 4160 no difference; 8 x 2145
    (above ``MAX_SLAB``) 1.3-1.5x, so larger rows keep one product per weight channel, and
    so does their new token's part (``contributions``: until session 34 that part alone was a
    slab, which cost +19-23 ms a step at 8 x 2145 against +9-15 ms without it).
    The values are the same either way, bit for bit."""
    kind = {"attn_sq": "sq", "recent_ent": "ent"}
    products = {
        "p": lambda: p_BKGS,
        "sq": lambda: p_BKGS**2,
        "ent": lambda: p_BKGS * entropy_BKGT[..., 0, None],
    }
    used = list(dict.fromkeys(kind.get(n, "p") for n in names))
    w_B11 = w_B3[:, _VALID, None, None]
    slab = jnp.stack([_mean_over_heads(products[u]()) * w_B11 for u in used])
    slab = jax.lax.optimization_barrier(slab)
    return {n: slab[used.index(kind.get(n, "p"))] for n in names}


# The statistics computed from attention probabilities (``contributions``); ``vnorm`` and
# ``wo_vnorm`` are written once with their token.
ATTENTION_STATS = tuple(_CHANNEL)

# Statistics that add a pass's contribution to their old value (the others are replaced).
ACCUMULATING = ("attn_cum", "recent", "recent_ent")


def merge(cached: dict, new: dict, *, n_queries_B: jax.Array, window: int) -> dict:
    """Statistics of cached slots after a pass of ``n_queries_B`` real queries.

    ``new`` maps each computed statistic to the pass's contribution ([..., B, K, C]);
    ``cached`` holds the old values of (at least) the ``ACCUMULATING`` ones among them.
    ``attn`` and ``attn_sq`` are replaced, ``attn_cum`` adds up, ``recent``/``recent_ent``
    decay by lam^n_queries first. Returns the merged values of the names in ``new``.
    """
    lam = decay(window) ** n_queries_B.astype(jnp.float32)
    lam = lam[:, None, None]
    merged = {}
    for n, x in new.items():
        if n == "attn_cum":
            merged[n] = cached[n] + x
        elif n in ("recent", "recent_ent"):
            merged[n] = lam * cached[n] + x
        else:
            merged[n] = x
    return merged


def value_norms(v_BKTH: jax.Array) -> jax.Array:
    return jnp.linalg.norm(v_BKTH.astype(jnp.float32), axis=-1)


def projected_value_norms(v_BKTH: jax.Array, wo_NHD: jax.Array, *, chunk: int = 512) -> jax.Array:
    """``||v W_o^(n)||_1`` of every value, mean over its KV head's G query heads
    (n = k * G + g): [B, K, T] float32 (the ``wo_vnorm`` statistic, CriticalKV's norm).

    ``wo_NHD`` is one layer's output projection as a float array. The projected values
    [B, K, t, G, D] exist ``chunk`` tokens at a time (a prompt of 8 x 4K at once: 680 MB)."""
    K, H = v_BKTH.shape[1], v_BKTH.shape[3]
    wo_KGHD = wo_NHD.reshape(K, -1, H, wo_NHD.shape[-1]).astype(jnp.float32)

    def norms(v_BKH):
        out = jnp.einsum("bkh,kghd->bkgd", v_BKH.astype(jnp.float32), wo_KGHD)
        return jnp.mean(jnp.sum(jnp.abs(out), axis=-1), axis=-1)

    out_TBK = jax.lax.map(norms, jnp.moveaxis(v_BKTH, 2, 0), batch_size=chunk)
    return jnp.moveaxis(out_TBK, 0, 2)


FEATURE_NAMES = ("alpha", "vnorm", "sigma", "entropy", "pos")
# The cache statistics ``features`` reads.
FEATURE_STATS = ("attn", "attn_sq", "recent", "recent_ent", "vnorm")


def features(cache) -> jax.Array:
    """DistillCache's five features per cached token, [B, C, 5] (paper §3.1.1).

    Aggregations (the cache must have one token set shared by all layers and heads):

    * alpha: attention mass from the latest pass's final query, averaged over all L layers
      and N query heads (``attn`` averaged over L and K; ``attn`` is already a mean over G);
    * vnorm: ||v_i||_2 averaged over layers and KV heads;
    * sigma: variance of that mass across all L*N (layer, query head) pairs,
      E[a^2] - E[a]^2 from ``attn_sq`` and ``attn``;
    * entropy: H_i = sum_q a_q(i) H(a_q) / sum_q a_q(i) over recent queries, numerator and
      denominator each summed over layers and heads before the division (decayed window,
      see the module docstring); 0 for a token no recent query attended to;
    * pos: the token's position divided by the number of tokens seen, in [0, 1).

    Free slots get zeros.
    """
    st = cache.stats
    mean_lk = lambda x: jnp.mean(x, axis=(0, 2))  # noqa: E731  [L, B, K, C] -> [B, C]
    alpha = mean_lk(st["attn"])
    sigma = jnp.maximum(mean_lk(st["attn_sq"]) - alpha**2, 0.0)
    den = jnp.sum(st["recent"], axis=(0, 2))
    num = jnp.sum(st["recent_ent"], axis=(0, 2))
    entropy = jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0)
    pos_BC = cache.pos[0, :, 0]
    pos = pos_BC / jnp.maximum(cache.length[:, None], 1).astype(jnp.float32)
    feats = jnp.stack([alpha, mean_lk(st["vnorm"]), sigma, entropy, pos], axis=-1)
    return jnp.where((pos_BC >= 0)[..., None], feats, 0.0)


# ---- query moments (``jaxkv.kvcache.QUERIES``) ----------------------------------------------


def query_moment_weights(pos_BT: jax.Array) -> jax.Array:
    """[B, T] weight of each query in the query moments: 1, or 0 for padding and for
    positions below ``QUERY_SINKS``."""
    return (pos_BT >= QUERY_SINKS).astype(jnp.float32)


def query_moments(q_BTNH: jax.Array, w_BT: jax.Array, n_kv_heads: int) -> dict:
    """One pass's weighted sums of pre-RoPE queries and of their outer products.

    Returns:
        {"q_sum": [B, K, G, H], "q_outer": [B, K, G, H, H]} in float32 (query head
        n = k * G + g).
    """
    B, T, N, H = q_BTNH.shape
    q = q_BTNH.astype(jnp.float32).reshape(B, T, n_kv_heads, N // n_kv_heads, H)
    wq = q * w_BT[:, :, None, None, None]
    return {
        "q_sum": jnp.sum(wq, axis=1),
        "q_outer": jnp.einsum("btkgh,btkgi->bkghi", wq, q),
    }


def merge_query_moments(old: dict, new: dict) -> dict:
    """Moments after a pass: the old sums plus the pass's (``query_moments``)."""
    return {n: old[n] + x for n, x in new.items()}
