"""``expected_attention``: Expected Attention (Devoto et al., 2025), as in kvpress's
``ExpectedAttentionPress``.

Each key is scored by the attention the queries to come are expected to give it. The future
pre-RoPE queries of query head n are modelled as Gaussian, ``q ~ N(mu_n, Sigma_n)``, with the
mean and covariance of the queries seen so far; for a post-RoPE key k (as the cache stores
it) and a query rotated by R, ``E[exp(k^T R q / sqrt(d))] = exp(k^T R mu / sqrt(d) +
k^T R Sigma R^T k / (2d))`` (the Gaussian moment-generating function). As in kvpress:

* the rotation is averaged over the next ``n_future_positions`` positions: R-bar, the mean of
  R(p) for p = N_t .. N_t + n_future - 1 (N_t = ``cache.length``, the next position, per
  sequence), is applied to the moments: mu' = R-bar mu, Sigma' = R-bar Sigma R-bar^T. In the
  half-split layout R-bar is ``[[C, -S], [S, C]]`` with C, S the mean cosines and sines per
  frequency, so it is applied like RoPE (``_rotate``); the score uses ``R-bar^T k``;
* per query head the exponents are normalised over the row's keys (a softmax), averaged over
  the KV group's G query heads, then ``(s + epsilon) * ||v||_2`` (``use_vnorm``);
* the first ``n_sink`` positions are left out of the softmax and always kept: they score the
  layer's highest score plus 1 (max over its KV heads and slots, so that any granularity's
  average still ranks them first and ``adaptive`` pools keep them).

Query statistics (``jaxkv.kvcache.QUERIES``). kvpress computes mean and covariance once, over
the prompt's pre-RoPE queries after the first ``n_sink``. jaxkv re-scores at every eviction
(``decode`` protocol), so the decoder keeps running sums in the cache: per (layer, query head)
the sums of q and q q^T in float32 over every query so far, those at positions <
``kvcache.QUERY_SINKS`` (4, kvpress's default ``n_sink``) left out; under the ``prefill``
protocol these are exactly kvpress's statistics. They are not decayed (a decay would need a
time constant of its own: the cache's ``window`` belongs to the per-slot statistics, and every
policy of a ``switch_policy`` must agree on it). The covariance is ``E[q q^T] - mu mu^T``
(biased, as kvpress's), from raw moments in float32. Only a cache whose policy lists
``QUERIES`` carries them (``L * N * H * (H + 1)`` floats per sequence, 4.4 MB for
SmolLM2-135M, 67 MB for Mistral-7B); any other cache pays nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.kvcache import QUERIES, KVCache
from jaxkv.policies.base import Policy

NAME = "expected_attention"


def averaged_rotation(start_B: jax.Array, *, n_future: int, head_dim: int, theta: float):
    """Mean cosine and sine of RoPE's angles over positions ``start .. start + n_future - 1``.

    Returns:
        cos, sin [B, H/2] float32 (one per frequency of the half-split layout).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    pos_BF = start_B.astype(jnp.float32)[:, None] + jnp.arange(n_future, dtype=jnp.float32)
    angle_BFJ = pos_BF[..., None] * inv_freq
    return jnp.mean(jnp.cos(angle_BFJ), axis=1), jnp.mean(jnp.sin(angle_BFJ), axis=1)


def _rotate(x_LBKXH: jax.Array, cos_BJ: jax.Array, sin_BJ: jax.Array) -> jax.Array:
    """``R x`` for R = ``[[C, -S], [S, C]]`` per sequence (x's axis 1 is B); with ``-sin``
    it is ``R^T x``."""
    J = cos_BJ.shape[-1]
    shape = (1, -1) + (1,) * (x_LBKXH.ndim - 3) + (J,)
    c, s = cos_BJ.reshape(shape), sin_BJ.reshape(shape)
    x1, x2 = x_LBKXH[..., :J], x_LBKXH[..., J:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def query_mean_cov(query_stats: dict) -> tuple[jax.Array, jax.Array]:
    """Mean [L, B, K, G, H] and covariance [L, B, K, G, H, H] of the weighted queries (zero
    before any query was counted)."""
    w = jnp.maximum(query_stats["weight"], 1e-30)[None, :, None, None, None]
    mean = query_stats["q_sum"] / w
    second = query_stats["q_outer"] / w[..., None]
    return mean, second - mean[..., :, None] * mean[..., None, :]


def expected_logits(mean_LBKGH, cov_LBKGH2, keys_LBKCH) -> jax.Array:
    """``mu^T k / sqrt(d) + k^T Sigma k / (2d)`` of every query head and slot: [L, B, K, G, C].
    ``cov`` None drops the second term. Layers are mapped one at a time, so only one layer's
    [B, K, G, C, H] product exists at once."""
    H = keys_LBKCH.shape[-1]

    def layer(args):
        mean, cov, k = args
        lin = jnp.einsum("bkgh,bkch->bkgc", mean, k) / jnp.sqrt(H)
        if cov is None:
            return lin
        quad = jnp.einsum("bkch,bkghi,bkci->bkgc", k, cov, k)
        return lin + quad / (2 * H)

    return jax.lax.map(layer, (mean_LBKGH, cov_LBKGH2, keys_LBKCH))


def group_softmax(logits_LBKGC, mask_LBKC) -> jax.Array:
    """Softmax over each query head's visible slots, mean over the G heads: [L, B, K, C]
    (zeros for a row with no visible slot)."""
    mask = mask_LBKC[:, :, :, None]
    top = jnp.max(jnp.where(mask, logits_LBKGC, -jnp.inf), axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    e = jnp.where(mask, jnp.exp(logits_LBKGC - top), 0.0)
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    return jnp.mean(p, axis=3)


def expected_scores(
    cache: KVCache,
    *,
    n_future: int,
    n_sink: int,
    use_covariance: bool,
    use_vnorm: bool,
    epsilon: float,
) -> jax.Array:
    """Expected Attention's keep-scores [L, B, K, C] (module docstring); free slots 0."""
    if not cache.query_stats:
        raise ValueError(f"{NAME} needs a cache that carries the query statistics ({QUERIES!r})")
    H = cache.k.shape[-1]
    cos, sin = averaged_rotation(
        cache.length, n_future=n_future, head_dim=H, theta=cache.rope_theta
    )
    mean, cov = query_mean_cov(cache.query_stats)
    keys = _rotate(cache.keys(), cos, -sin)  # R-bar^T k
    logits = expected_logits(mean, cov if use_covariance else None, keys)
    valid = cache.pos >= 0
    sink = valid & (cache.pos < n_sink)
    s = group_softmax(logits, valid & ~sink)
    if use_vnorm:
        s = (s + epsilon) * jnp.linalg.norm(cache.values(), axis=-1)
    s = jnp.where(valid & ~sink, s, 0.0)
    top = jnp.max(s, axis=(2, 3), keepdims=True)
    return jnp.where(sink, top + 1.0, s)


def expected_attention(
    *,
    n_future_positions: int = 512,
    n_sink: int = 4,
    use_covariance: bool = True,
    use_vnorm: bool = True,
    epsilon: float = 0.0,
) -> Policy:
    """Expected Attention (module docstring); the defaults are kvpress's.

    Args:
        n_future_positions: future positions the RoPE rotation is averaged over.
        n_sink: the first positions, left out of the softmax and always kept.
        use_covariance: include the covariance term (else the softmax of ``mu^T k``).
        use_vnorm: weight by the value norm, ``(s + epsilon) * ||v||``.
        epsilon: added to the expected attention before the value-norm weighting.
    """
    if n_future_positions < 1:
        raise ValueError(f"n_future_positions must be >= 1, got {n_future_positions}")
    if n_sink < 0 or epsilon < 0:
        raise ValueError(f"need n_sink >= 0 and epsilon >= 0, got {n_sink}, {epsilon}")
    settings = dict(
        n_future=n_future_positions,
        n_sink=n_sink,
        use_covariance=use_covariance,
        use_vnorm=use_vnorm,
        epsilon=epsilon,
    )

    def score(state, cache, **_):
        return expected_scores(cache, **settings)

    return Policy(
        NAME,
        score=score,
        stats=(QUERIES,),
        spec=(
            ("n_future_positions", n_future_positions),
            ("n_sink", n_sink),
            ("use_covariance", use_covariance),
            ("use_vnorm", use_vnorm),
            ("epsilon", epsilon),
        ),
    )
