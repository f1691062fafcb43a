"""Cache mechanics of compression: budgets, top-B selection, freeing slots, capacities.

Budget (paper Alg. 1 / App. D, our reading): ``B_t = max(floor(r * N_t), B_min)`` with N_t
the tokens a sequence has processed (prompt + generated). The paper writes ``L_t = |C_t|``;
read literally the cache would shrink geometrically to B_min. An absolute budget may be
given instead of a ratio.

Protocols (``Compression.protocol``):

* ``decode`` (the paper's): evict after prefill and after every ``evict_every``-th decode
  step, so each sequence holds B_t tokens at every step;
* ``prefill`` (compress once, kvpress's): evict once after prefill, down to
  ``B = max(floor(r * N_prompt), B_min)``; every later token is appended and nothing is
  evicted again, so the cache grows by one slot per generated token.

Eviction after prefill ranks every slot; during decoding at most ``evict_every`` tokens
arrive between evictions, so only that many lowest-scored slots are candidates: the engine
frees them (``kvcache.free_slots``) and the next tokens reuse them, without moving any key.

Granularities: ``shared`` (one token set for every layer and head), ``layer``, ``head``
(each (layer, KV head) row keeps its own B tokens) and ``adaptive`` (AdaKV, Feng et al.
2024: per layer and sequence the K heads' scores are pooled and the layer keeps its top
K * B over all heads; each head keeps what it got, at least ``floor(head_floor * B)`` — kvpress's
``alpha_safeguard`` — and at most ``floor(head_cap * B)``) and ``global`` (the same pool over
every layer and KV head of a sequence, L * K * B tokens: KVzip's default allocation). Scores
are pooled as the policy returns them: AdaKV assumes scores comparable across heads
(attention probabilities, TOVA, K-norm, Expected Attention); H2O and SnapKV scale their
heavy-hitter scores into [0, 1) per row, so for them the pool compares each head's tokens
relative to that head's best.

Capacity layout (``Compression.capacity``). The cache is one array ``[L, B, K, C, H]``, so
every (layer, sequence, KV head) row has the same C slots and free slots carry pos = -1:

* shared / layer / head: ``C = B_max + evict_every`` (decode) or ``B_prompt + n_new``
  (prefill), never more than the full cache; every row holds B tokens after an eviction.
* adaptive, global: ``C = floor(head_cap * B_max) + evict_every`` (decode) or
  ``floor(head_cap * B_prompt) + n_new`` (prefill). A layer holds exactly K * B tokens after
  an eviction (fewer only while fewer tokens were seen), spread unevenly over its K rows
  (global: a sequence holds L * K * B, spread over all of its rows);
  the slots a head does not use stay free. The cache so takes ``head_cap`` times the
  memory of ``head`` (2x by default: at r = 0.25 half the full cache instead of a quarter),
  the price of letting a head keep up to ``head_cap * B`` tokens in a fixed-shape array that
  attention reads per head without any mask beyond pos = -1.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from jaxkv import kvcache
from jaxkv.kvcache import KVCache
from jaxkv.model import cache_kernel
from jaxkv.policies import GRANULARITIES as POLICY_GRANULARITIES
from jaxkv.policies import Policy, get_policy
from jaxkv.policies.base import PROTOCOLS
from jaxkv.topn import sort_desc, top_n_mask

POOLED = ("adaptive", "global")  # granularities that pool rows' budgets (per layer, or all)
GRANULARITIES = (*POLICY_GRANULARITIES, *POOLED)


@dataclasses.dataclass(frozen=True)
class Compression:
    """How a run compresses its cache (hashable: a static argument of jitted loops).

    Attributes:
        policy: the scoring policy.
        ratio: r in (0, 1]; or None with ``budget``.
        budget: absolute budget (tokens per sequence) instead of a ratio.
        min_budget: B_min.
        granularity: ``shared`` (one token set for all layers and heads, the paper),
            ``layer`` (per layer), ``head`` (per layer and KV head), ``adaptive`` (AdaKV:
            a layer's K * B tokens pooled over its heads) or ``global`` (a sequence's
            L * K * B tokens pooled over all its rows); see the module docstring.
        evict_every: evict after every k-th decode step (and always after prefill).
        full_heads: fraction of (layer, KV head) pairs that keep every token (the paper's
            head-level hybrid, App. E.3; needs ``granularity="head"``).
        protocol: ``decode`` (evict during decoding, the paper) or ``prefill`` (compress
            once after prefill, kvpress); see the module docstring.
        head_floor: ``adaptive`` and ``global`` only: each head keeps at least
            ``floor(head_floor * B)`` tokens (AdaKV's safeguard; kvpress's
            ``alpha_safeguard`` = 0.2).
        head_cap: ``adaptive`` and ``global`` only: each head keeps at most
            ``floor(head_cap * B)`` tokens; the cache has that many slots per head (module
            docstring: capacity layout).
    """

    policy: Policy
    ratio: float | None = None
    budget: int | None = None
    min_budget: int = 32
    granularity: str = "shared"
    evict_every: int = 1
    full_heads: float = 0.0
    protocol: str = "decode"
    head_floor: float = 0.2
    head_cap: float = 2.0

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
        if row_granularity(self.granularity) not in self.policy.granularities:
            raise ValueError(
                f"policy {self.policy.name!r} does not support granularity "
                f"{self.granularity!r}; it supports {self.policy.granularities}"
                + (
                    f" ({self.granularity!r} needs per-head scores)"
                    if self.granularity in POOLED
                    else ""
                )
            )
        if not 0 <= self.full_heads < 1:
            raise ValueError(f"full_heads must be in [0, 1), got {self.full_heads}")
        if self.full_heads and self.granularity != "head":
            raise ValueError("full_heads (head-level hybrid) needs granularity='head'")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}; choose one of {PROTOCOLS}")
        if self.protocol not in self.policy.protocols:
            raise ValueError(
                f"policy {self.policy.name!r} needs protocol {' or '.join(self.policy.protocols)}"
                f" (--protocol), not {self.protocol!r}"
            )
        if not (_is_real(self.head_floor) and 0 <= self.head_floor <= 1):
            raise ValueError(f"head_floor must be in [0, 1], got {self.head_floor}")
        if not (_is_real(self.head_cap) and self.head_cap >= 1):
            raise ValueError(f"head_cap must be >= 1, got {self.head_cap}")

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

    @property
    def evicts_in_decode(self) -> bool:
        """Whether decode steps evict (the ``decode`` protocol with an evicting policy)."""
        return self.policy.evicts and self.protocol == "decode"

    def max_budget(self, n_max: int) -> int:
        """The largest budget of a run that ends at ``n_max`` tokens (static)."""
        if self.budget is not None:
            return self.budget
        return max(math.floor(self.ratio * n_max), self.min_budget)

    def max_row_tokens(self, budget):
        """Most tokens one (layer, sequence, KV head) row keeps at budget B (int or array):
        B, or ``floor(head_cap * B)`` under ``adaptive`` and ``global``."""
        if self.granularity not in POOLED:
            return budget
        if isinstance(budget, numbers.Integral):
            return math.floor(self.head_cap * budget)
        return jnp.floor(self.head_cap * budget.astype(jnp.float32)).astype(jnp.int32)

    def capacity(self, n_max: int, *, prompt_len: int | None = None) -> int:
        """Slots of the compressed cache (per row), never more than the full cache.

        ``decode``: the largest row after an eviction plus one eviction period of slack.
        ``prefill``: the largest row after the one eviction plus every later token
        (needs ``prompt_len``, the prompt tokens prefilled). See the module docstring.
        """
        if not self.policy.evicts or self.full_heads:
            return n_max  # hybrid: some heads keep everything, and rows share one capacity
        if self.protocol == "decode":
            return min(self.max_row_tokens(self.max_budget(n_max)) + self.evict_every, n_max)
        if prompt_len is None or not 0 < prompt_len <= n_max:
            raise ValueError(f"the prefill protocol needs prompt_len in [1, {n_max}]")
        kept = self.max_row_tokens(self.max_budget(prompt_len))
        return min(kept + n_max - prompt_len, n_max)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_int(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def row_granularity(granularity: str) -> str:
    """The policy granularity a selection granularity needs: ``adaptive`` and ``global`` pool
    per-head scores, so they need a policy that supports ``head``."""
    return "head" if granularity in POOLED else granularity


def aggregate(scores, granularity: str, shape_LBKC) -> jax.Array:
    """Averages scores over the axes a granularity shares; returns [L, B, K, C] (broadcast).
    ``head``, ``adaptive`` and ``global`` keep per-head scores as they are."""
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


# Up to this many drop candidates per row, ``drop_mask`` takes them with ``lax.top_k``; more
# (after prefill, pooled granularities, long eviction periods) with ``top_n_mask``'s
# bisection: top_k sorts its candidates, 64 ms per eviction for a whole 1072-slot row of the
# 720 of a batch-8 x 4K ``global`` cache, against a few ms (session 29).
_TOP_K_DROPS = 64


def drop_mask(scores_LBKC, pos_LBKC, budget_B, *, max_drop: int, keep_rows=None):
    """Slots to free so that each row keeps its ``budget`` highest-scored tokens.

    ``budget_B`` is one budget per sequence ([B]) or per row ([L, B, K], ``adaptive``).
    Only the ``max_drop`` lowest-scored occupied slots of a row are candidates (static).
    Ties break towards dropping the lower slot index (``-0.0`` ties ``0.0``). ``keep_rows``
    ([L, B, K] bool) marks rows that keep everything (head-level hybrid).
    """
    valid = pos_LBKC >= 0
    keep = budget_B[None, :, None] if budget_B.ndim == 1 else budget_B
    n_drop = jnp.maximum(jnp.sum(valid, axis=-1) - keep, 0)
    if keep_rows is not None:
        n_drop = jnp.where(keep_rows, 0, n_drop)
    s = scores_LBKC.astype(jnp.float32)
    s = jnp.where(valid, jnp.where(s == 0, 0.0, s), jnp.inf)  # -0.0 ties 0.0 in top_k too
    m = min(max_drop, s.shape[-1])
    if m > _TOP_K_DROPS:  # the same slots without top_k's sort of m candidates per row
        return top_n_mask(-s, jnp.minimum(n_drop, m)[..., None])
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
    kernel: bool = False,
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
        kernel: select with the compiled kernel (``cache_kernel.drop_lowest``: the same
            slots, one pass per row on XLA's threads) instead of ``drop_mask``; the callers
            pass ``config.attention == "kernel"`` (the kernels are opt-in).

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
    keep = budget_B
    if compression.granularity in POOLED:
        over_layers = compression.granularity == "global"
        keep = adaptive_budgets(
            scores,
            pos,
            budget_B,
            floor_B=jnp.floor(compression.head_floor * budget_B).astype(jnp.int32),
            cap_B=compression.max_row_tokens(budget_B),
            over_layers=over_layers,
        )
        # one head may give up the slots of all pooled heads' new tokens
        pooled = pos.shape[2] * (pos.shape[0] if over_layers else 1)
        max_drop = min(max_drop * pooled, cache.capacity)
    if kernel:
        return _drop_lowest(cache, scores, pos, keep, max_drop=max_drop, keep_rows=keep_rows)
    drop = drop_mask(scores, pos, keep, max_drop=max_drop, keep_rows=keep_rows)
    return kvcache.free_slots(cache, drop)


def _drop_lowest(cache: KVCache, scores, pos, keep, *, max_drop: int, keep_rows) -> KVCache:
    """``free_slots(cache, drop_mask(...))`` through ``cache_kernel.drop_lowest``: ``pos`` is
    the cache's own (updated in place) or one row per token set (whose freed slots are then
    freed in every row of the set)."""
    keep_LBK = keep[None, :, None] if keep.ndim == 1 else keep
    keep_LBK = jnp.broadcast_to(keep_LBK, pos.shape[:3])
    if keep_rows is not None:
        keep_LBK = jnp.where(keep_rows, jnp.iinfo(jnp.int32).max, keep_LBK)
    new = cache_kernel.drop_lowest(scores, pos, keep_LBK, max_drop=min(max_drop, pos.shape[-1]))
    if pos.shape == cache.pos.shape:
        return cache.replace(pos=new)
    return kvcache.free_slots(cache, new < 0)


def adaptive_budgets(
    scores_LBKC, pos_LBKC, budget_B, *, floor_B, cap_B, over_layers: bool = False
) -> jax.Array:
    """AdaKV's allocation: how many tokens each (layer, sequence, KV head) row keeps.

    Per layer and sequence the heads' occupied slots are pooled and the K * B best kept:
    each head's ``floor`` best first (the safeguard), then the rest by score, a head taking
    at most ``cap`` (ties: lower head first, then higher-ranked slot). With fewer than
    K * B occupied slots every row keeps all of its own. ``over_layers`` pools the rows of
    every layer of a sequence instead (``global``: L * K * B tokens; ties: lower layer first).

    Args:
        scores_LBKC: keep-scores per slot (comparable across the pooled heads).
        pos_LBKC: slot positions (-1: free).
        budget_B: B per sequence; floor_B, cap_B: per-head bounds ([B] int32).
        over_layers: pool all layers' rows (``global``) rather than each layer's.

    Returns:
        [L, B, K] int32 tokens per row; each pool's rows sum to min(rows * B, occupied).
    """
    if over_layers:
        L, B, K, C = scores_LBKC.shape
        fold = lambda x: x.transpose(1, 0, 2, 3).reshape(1, B, L * K, C)  # noqa: E731
        kept = adaptive_budgets(
            fold(scores_LBKC), fold(pos_LBKC), budget_B, floor_B=floor_B, cap_B=cap_B
        )
        return kept.reshape(B, L, K).transpose(1, 0, 2)
    L, B, K, C = scores_LBKC.shape
    s = jnp.where(pos_LBKC >= 0, scores_LBKC.astype(jnp.float32), -jnp.inf)
    occupied = s > -jnp.inf
    # a head's floor best are taken first, and its cap best are its candidates (its rows are
    # not sorted: each row's counts, all this returns, do not depend on where its ties sit)
    first = occupied & top_n_mask(s, floor_B[None, :, None, None])
    cap = cap_B[None, :, None, None]
    # A row holding at most its cap has every occupied slot within it (what the mask would
    # add beyond them is free, -inf, and changes nothing below): skip the mask, as during
    # decoding, where a row exceeds its cap only by the tokens that arrived since eviction.
    within = jax.lax.cond(
        jnp.all(jnp.sum(occupied, axis=-1, keepdims=True) <= cap),
        lambda: occupied,
        lambda: top_n_mask(s, cap),
    )
    cand = jnp.where(first, jnp.inf, jnp.where(within, s, -jnp.inf))
    best = top_n_mask(cand.reshape(L, B, K * C), (K * budget_B)[None, :, None])
    taken = occupied & (first | within) & best.reshape(L, B, K, C)
    return jnp.sum(taken, axis=-1).astype(jnp.int32)


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
    top = sort_desc(mass)  # each row's masses, largest first
    kept = jnp.sum(jnp.where(jnp.arange(C) < budget[None, :, None, None], top, 0.0), axis=-1)
    lost = 1.0 - kept / jnp.maximum(jnp.sum(mass, axis=-1), 1e-30)  # [L, B, K]
    n_full = max(1, round(compression.full_heads * L * K))
    flat = jnp.moveaxis(lost, 1, 0).reshape(B, L * K)
    thresh = jax.lax.top_k(flat, n_full)[0][:, -1]
    return lost >= thresh[None, :, None]
