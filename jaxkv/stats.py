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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Order of the query-weight channels.
_FINAL, _VALID, _RECENT = 0, 1, 2


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


def contributions(p_BKGTS: jax.Array, w_BT3: jax.Array) -> dict:
    """Each statistic's contribution ([B, K, S]) from one pass's attention probabilities."""
    p = p_BKGTS.astype(jnp.float32)
    ent_BKGT = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    w = jnp.broadcast_to(w_BT3[:, None, None], (*p.shape[:4], 3))
    w_BKGT4 = jnp.concatenate([w, w[..., _RECENT:] * ent_BKGT[..., None]], axis=-1)
    if p.shape[3] == 1:  # decode: a broadcast product, much cheaper on CPU than a tiny dot
        m_BKGS4 = p[:, :, :, 0, :, None] * w_BKGT4[:, :, :, 0, None, :]
    else:
        m_BKGS4 = jnp.einsum("bkgts,bkgtj->bkgsj", p, w_BKGT4)
    return {
        "attn": jnp.mean(m_BKGS4[..., _FINAL], axis=2),
        "attn_sq": jnp.mean(m_BKGS4[..., _FINAL] ** 2, axis=2),
        "attn_cum": jnp.mean(m_BKGS4[..., _VALID], axis=2),
        "recent": jnp.mean(m_BKGS4[..., _RECENT], axis=2),
        "recent_ent": jnp.mean(m_BKGS4[..., 3], axis=2),
    }


def merge(old: dict, new: dict, *, n_queries_B: jax.Array, window: int) -> dict:
    """Statistics of cached slots after a pass of ``n_queries_B`` real queries.

    ``old`` and ``new`` map names to [..., B, K, C] arrays (``vnorm`` is carried over).
    """
    lam = decay(window) ** n_queries_B.astype(jnp.float32)
    lam = lam[:, None, None]
    return {
        "attn": new["attn"],
        "attn_sq": new["attn_sq"],
        "attn_cum": old["attn_cum"] + new["attn_cum"],
        "recent": lam * old["recent"] + new["recent"],
        "recent_ent": lam * old["recent_ent"] + new["recent_ent"],
        "vnorm": old["vnorm"],
    }


def value_norms(v_BKTH: jax.Array) -> jax.Array:
    return jnp.linalg.norm(v_BKTH.astype(jnp.float32), axis=-1)


def stack_layers(per_layer: list[dict]) -> dict:
    """[{name: [B, K, S]}] * L -> {name: [L, B, K, S]}."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


FEATURE_NAMES = ("alpha", "vnorm", "sigma", "entropy", "pos")


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
