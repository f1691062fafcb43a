"""Baseline eviction policies. Each docstring names the published variant it follows.

All score per layer and KV head (``[L, B, K, C]``), so every granularity works; the engine
averages scores over the axes a granularity shares.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.kvcache import KVCache
from jaxkv.policies.base import TIER, Policy
from jaxkv.topn import inverse_permutation, lex_argsort, top_n_mask


def protect_recent(scores_LBKC, cache: KVCache, n_recent_B: jax.Array) -> jax.Array:
    """Puts the ``n_recent`` most recent tokens of each sequence in the protected tier,
    ranked among themselves by recency (should the budget not hold them all, the newest
    stay); other slots keep their [0, 1) scores."""
    cutoff = cache.length - n_recent_B  # [B]
    recent = cache.pos >= cutoff[None, :, None, None]
    recency = unit_scale(cache.pos.astype(jnp.float32), cache.pos)
    return jnp.where(recent, TIER + recency, scores_LBKC)


def protect_attended(scores_LBKC, cache: KVCache, n_top_B: jax.Array) -> jax.Array:
    """Puts each row's ``n_top`` slots that the latest query attends to most (TOVA's score,
    ``stats["attn"]``) in the protected tier, ranked among themselves by that attention;
    exactly ``min(n_top, occupied)`` per row (ties: the lower slot first). Other slots keep
    their [0, 1) scores."""
    attn, valid = cache.stats["attn"], cache.valid
    top = top_n_mask(jnp.where(valid, attn, -jnp.inf), n_top_B[None, :, None, None])
    return jnp.where(top & valid, TIER + unit_scale(attn, cache.pos), scores_LBKC)


def unit_scale(x_LBKC: jax.Array, pos_LBKC: jax.Array) -> jax.Array:
    """Non-negative scores scaled into [0, 1) per row (ranking unchanged), so that a
    protection tier (``TIER``) added on top never swamps them in float32 (1e9 + votes would
    erase the votes)."""
    top = jnp.max(jnp.where(pos_LBKC >= 0, x_LBKC, 0.0), axis=-1, keepdims=True)
    return x_LBKC / (1.0000001 * top + 1e-30)


def full() -> Policy:
    """No eviction: the full cache (the reference every other policy is compared with)."""
    return Policy("full", score=lambda state, cache, **_: jnp.zeros(cache.pos.shape), evicts=False)


def random() -> Policy:
    """Uniformly random token selection (seeded by the engine's per-step key)."""

    def score(state, cache, *, key, **_):
        return jax.random.uniform(key, cache.pos.shape)

    return Policy("random", score=score)


def streaming_llm(sinks: int = 4) -> Policy:
    """StreamingLLM (Xiao et al., 2024): the first ``sinks`` tokens (attention sinks) plus
    the most recent tokens; the recent window is whatever budget the sinks leave."""

    def score(state, cache, **_):
        recency = unit_scale(cache.pos.astype(jnp.float32), cache.pos)
        return jnp.where((cache.pos >= 0) & (cache.pos < sinks), TIER, 0.0) + recency

    return Policy("streaming_llm", score=score, spec=(("sinks", sinks),))


def h2o(recent_fraction: float = 0.5) -> Policy:
    """H2O (Zhang et al., 2023), as in its reference code and KVCache-Factory: the budget
    splits into a recent window (``recent_fraction`` of it) and heavy hitters ranked by
    attention accumulated over every query so far (per KV head, mean over its query heads).
    Heavy-hitter scores are scaled into [0, 1) per row (ranking unchanged)."""
    if not 0 <= recent_fraction <= 1:
        raise ValueError(f"recent_fraction must be in [0, 1], got {recent_fraction}")

    def score(state, cache, *, budget_B, **_):
        n_recent = jnp.floor(recent_fraction * budget_B).astype(jnp.int32)
        return protect_recent(unit_scale(cache.stats["attn_cum"], cache.pos), cache, n_recent)

    return Policy(
        "h2o", score=score, stats=("attn_cum",), spec=(("recent_fraction", recent_fraction),)
    )


def snapkv(window: int = 64, kernel: int = 5) -> Policy:
    """SnapKV (Li et al., 2024) as in kvpress's SnapKVPress: votes are the attention that an
    observation window of recent queries gives each key (mean over the KV group's query
    heads), smoothed by average pooling (``kernel``) over neighbouring positions; the
    window's own tokens are always kept (at most half the budget, so that a budget smaller
    than the window still keeps voted tokens such as the attention sink). jaxkv re-scores at
    every eviction, so the observation window is the exponentially decayed ``recent``
    statistic with time constant ``window``; pooling runs over the surviving tokens in
    position order.
    """
    if window < 1 or kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"snapkv needs window >= 1 and an odd kernel >= 1, got {window}, {kernel}")

    def score(state, cache, *, budget_B, **_):
        votes = unit_scale(_pool_by_position(cache.stats["recent"], cache.pos, kernel), cache.pos)
        return protect_recent(votes, cache, jnp.minimum(window, budget_B // 2))

    return Policy(
        "snapkv",
        score=score,
        window=window,
        stats=("recent",),
        spec=(("window", window), ("kernel", kernel)),
    )


def _pool_by_position(x_LBKC, pos_LBKC, kernel: int):
    """Average of each slot's value with its ``kernel // 2`` neighbours on either side, in
    position order (free slots sort last and contribute zeros)."""
    C = pos_LBKC.shape[-1]
    key = jnp.where(pos_LBKC >= 0, pos_LBKC, jnp.iinfo(jnp.int32).max).astype(jnp.uint32)
    order = lex_argsort([key], [31])
    xs = jnp.take_along_axis(jnp.where(pos_LBKC >= 0, x_LBKC, 0.0), order, axis=-1)
    half = kernel // 2
    padded = jnp.pad(xs, [(0, 0)] * 3 + [(half, half)])
    pooled = sum(padded[..., i : i + C] for i in range(kernel)) / kernel
    inverse = inverse_permutation(order)
    return jnp.take_along_axis(pooled, inverse, axis=-1)


def tova() -> Policy:
    """TOVA (Oren et al., 2024): keep the tokens the current (final) query attends to most,
    attention averaged over the query heads (here per KV group; ``granularity="layer"``
    averages over all heads of a layer as TOVA does)."""
    return Policy("tova", score=lambda state, cache, **_: cache.stats["attn"], stats=("attn",))


def keydiff() -> Policy:
    """KeyDiff (Park et al., 2025) as in kvpress's KeyDiffPress: keep keys least similar
    (cosine) to the mean direction of the row's normalized keys."""

    def score(state, cache, **_):
        k = cache.keys()
        unit = k / jnp.maximum(jnp.linalg.norm(k, axis=-1, keepdims=True), 1e-6)
        valid = (cache.pos >= 0)[..., None]
        anchor = jnp.sum(jnp.where(valid, unit, 0.0), axis=3, keepdims=True)
        anchor = anchor / jnp.maximum(jnp.linalg.norm(anchor, axis=-1, keepdims=True), 1e-6)
        return -jnp.sum(unit * anchor, axis=-1)

    return Policy("keydiff", score=score)


def knorm() -> Policy:
    """K-norm (Devoto et al., 2024) as in kvpress's KnormPress: keep the keys with the
    smallest L2 norm (low key norm correlates with high attention)."""

    def score(state, cache, **_):
        return -jnp.linalg.norm(cache.keys(), axis=-1)

    return Policy("knorm", score=score)
