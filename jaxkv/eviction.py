"""Cache mechanics of compression: budgets, top-B selection, freeing slots, capacities.

Budget (paper Alg. 1 / App. D, our reading): ``B_t = max(floor(r * N_t), B_min)`` with N_t
the tokens a sequence has processed (prompt + generated). The paper writes ``L_t = |C_t|``;
read literally the cache would shrink geometrically to B_min. An absolute budget may be
given instead of a ratio.

Eviction after prefill ranks every slot; during decoding at most ``evict_every`` tokens
arrive between evictions, so only that many lowest-scored slots are candidates: the engine
frees them (``kvcache.free_slots``) and the next tokens reuse them, without moving any key.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from jaxkv import kvcache
from jaxkv.kvcache import KVCache
from jaxkv.policies import GRANULARITIES, Policy, get_policy


@dataclasses.dataclass(frozen=True)
class Compression:
    """How a run compresses its cache (hashable: a static argument of jitted loops).

    Attributes:
        policy: the scoring policy.
        ratio: r in (0, 1]; or None with ``budget``.
        budget: absolute budget (tokens per sequence) instead of a ratio.
        min_budget: B_min.
        granularity: ``shared`` (one token set for all layers and heads, the paper),
            ``layer`` (per layer) or ``head`` (per layer and KV head).
        evict_every: evict after every k-th decode step (and always after prefill).
        full_heads: fraction of (layer, KV head) pairs that keep every token (the paper's
            head-level hybrid, App. E.3; needs ``granularity="head"``).
    """

    policy: Policy
    ratio: float | None = None
    budget: int | None = None
    min_budget: int = 32
    granularity: str = "shared"
    evict_every: int = 1
    full_heads: float = 0.0

    def __post_init__(self):
        # Check each given value first, so that a bad value is named even when both are given.
        if self.budget is not None:
            _check_int("budget", self.budget)
        if self.ratio is not None and not (_is_real(self.ratio) and 0 < self.ratio <= 1):
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio}")
        if self.ratio is None and self.budget is None:
            raise ValueError("give exactly one of ratio and budget (got neither)")
        if self.ratio is not None and self.budget is not None:
            raise ValueError(
                f"give exactly one of ratio and budget, not both "
                f"(got ratio={self.ratio}, budget={self.budget})"
            )
        _check_int("min_budget", self.min_budget)
        _check_int("evict_every", self.evict_every)
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"unknown granularity {self.granularity!r}; choose one of {GRANULARITIES}"
            )
        if self.granularity not in self.policy.granularities:
            raise ValueError(
                f"policy {self.policy.name!r} does not support granularity "
                f"{self.granularity!r}; it supports {self.policy.granularities}"
            )
        if not 0 <= self.full_heads < 1:
            raise ValueError(f"full_heads must be in [0, 1), got {self.full_heads}")
        if self.full_heads and self.granularity != "head":
            raise ValueError("full_heads (head-level hybrid) needs granularity='head'")

    @classmethod
    def make(cls, policy: str | Policy, **kwargs) -> Compression:
        """Builds from a policy name (``get_policy``) or a Policy."""
        return cls(policy=get_policy(policy) if isinstance(policy, str) else policy, **kwargs)

    @property
    def stats(self) -> tuple[str, ...]:
        """The cache statistics this compression reads (the cache carries only these)."""
        if not self.policy.evicts:
            return ()
        extra = ("attn_cum",) if self.full_heads else ()  # ``hybrid_full_rows``
        return kvcache.stat_names(self.policy.stats + extra)

    def budget_for(self, n_tokens):
        """B_t for N_t tokens seen (int or array)."""
        if self.budget is not None:
            return jnp.full(jnp.shape(n_tokens), self.budget, jnp.int32)
        b = jnp.floor(self.ratio * jnp.asarray(n_tokens, jnp.float32)).astype(jnp.int32)
        return jnp.maximum(b, self.min_budget)

    def max_budget(self, n_max: int) -> int:
        """The largest budget of a run that ends at ``n_max`` tokens (static)."""
        if self.budget is not None:
            return self.budget
        return max(math.floor(self.ratio * n_max), self.min_budget)

    def capacity(self, n_max: int) -> int:
        """Slots of the compressed cache: max budget plus one eviction period of slack,
        never more than the full cache (``n_max``)."""
        if not self.policy.evicts or self.full_heads:
            return n_max  # hybrid: some heads keep everything, and rows share one capacity
        return min(self.max_budget(n_max) + self.evict_every, n_max)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_int(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def aggregate(scores, granularity: str, shape_LBKC) -> jax.Array:
    """Averages scores over the axes a granularity shares; returns [L, B, K, C] (broadcast)."""
    if scores.ndim == 2:  # [B, C]: one score per token
        if granularity != "shared":
            raise ValueError("per-token scores only support granularity 'shared'")
        s = scores[None, :, None, :]
    elif granularity == "shared":
        s = jnp.mean(scores, axis=(0, 2), keepdims=True)
    elif granularity == "layer":
        s = jnp.mean(scores, axis=2, keepdims=True)
    else:
        s = scores
    return jnp.broadcast_to(s, shape_LBKC)


def drop_mask(scores_LBKC, pos_LBKC, budget_B, *, max_drop: int, keep_rows=None):
    """Slots to free so that each row keeps its ``budget`` highest-scored tokens.

    Only the ``max_drop`` lowest-scored occupied slots of a row are candidates (static).
    Ties break towards dropping the lower slot index. ``keep_rows`` ([L, B, K] bool) marks
    rows that keep everything (head-level hybrid).
    """
    valid = pos_LBKC >= 0
    n_drop = jnp.maximum(jnp.sum(valid, axis=-1) - budget_B[None, :, None], 0)
    if keep_rows is not None:
        n_drop = jnp.where(keep_rows, 0, n_drop)
    s = jnp.where(valid, scores_LBKC.astype(jnp.float32), jnp.inf)
    m = min(max_drop, s.shape[-1])
    _, lowest = jax.lax.top_k(-s, m)  # ascending score
    rank_ok = jnp.arange(m) < n_drop[..., None]
    drop = jnp.zeros(s.shape, bool)
    L, B, K = s.shape[:3]
    li, bi, ki = jnp.ix_(jnp.arange(L), jnp.arange(B), jnp.arange(K))
    return drop.at[li[..., None], bi[..., None], ki[..., None], lowest].set(rank_ok)


def evict(
    cache: KVCache,
    compression: Compression,
    policy_state,
    *,
    key: jax.Array,
    max_drop: int | None = None,
    keep_rows=None,
) -> KVCache:
    """Scores the cache with the policy and frees slots down to each sequence's budget.

    Args:
        cache: the cache to compress.
        compression: the policy, budget and granularity.
        policy_state: the policy's state (None for the heuristics).
        key: randomness of the policy (the random policy).
        max_drop: at most this many lowest-scored slots per row are freed (static). The
            default, None, frees as many as the budget needs (every slot is a candidate), as
            after prefill. The decode loop passes ``compression.evict_every``: at most that many
            tokens arrived since the last eviction, and fewer candidates cost less.
        keep_rows: [L, B, K] rows that keep every token (``hybrid_full_rows``), or None.

    Returns:
        The cache with the evicted slots freed (``pos == -1``); no key moves.
    """
    budget_B = compression.budget_for(cache.length)
    raw = compression.policy.score(policy_state, cache, budget_B=budget_B, key=key)
    scores = aggregate(raw, compression.granularity, cache.pos.shape)
    pos = cache.pos
    if keep_rows is None and compression.granularity in _SET_ROWS:
        # Every row of a token set (all rows of a sequence, or of a layer) holds the same
        # tokens: select on one row per set and broadcast the decision (L * K times less work).
        one = _SET_ROWS[compression.granularity]
        scores, pos = scores[one], pos[one]
    if max_drop is None:
        max_drop = cache.capacity
    drop = drop_mask(scores, pos, budget_B, max_drop=max_drop, keep_rows=keep_rows)
    return kvcache.free_slots(cache, drop)


# One row per token set, as an index into [L, B, K, C] that keeps the axes.
_SET_ROWS = {
    "shared": (slice(0, 1), slice(None), slice(0, 1)),
    "layer": (slice(None), slice(None), slice(0, 1)),
}


def hybrid_full_rows(cache: KVCache, compression: Compression) -> jax.Array | None:
    """[L, B, K] rows that keep every token: the ``full_heads`` fraction of (layer, KV head)
    pairs whose attention is least concentrated — the heads that would lose the most
    cumulative attention mass to eviction at the current budget (App. E.3 names "attention
    statistics" without details; this is our choice). None without the hybrid."""
    if not compression.full_heads:
        return None
    L, B, K, C = cache.pos.shape
    budget = compression.budget_for(cache.length)
    mass = jnp.where(cache.pos >= 0, cache.stats["attn_cum"], 0.0)
    top = jax.lax.top_k(mass, C)[0]
    kept = jnp.sum(jnp.where(jnp.arange(C) < budget[None, :, None, None], top, 0.0), axis=-1)
    lost = 1.0 - kept / jnp.maximum(jnp.sum(mass, axis=-1), 1e-30)  # [L, B, K]
    n_full = max(1, round(compression.full_heads * L * K))
    flat = jnp.moveaxis(lost, 1, 0).reshape(B, L * K)
    thresh = jax.lax.top_k(flat, n_full)[0][:, -1]
    return lost >= thresh[None, :, None]
