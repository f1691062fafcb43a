"""``rerank:<policy>``: kvzip's allocation across rows, another policy's order within each row.

Under a pooled granularity (``adaptive``, ``global``) a policy decides two things at once: how
many tokens each (layer, KV head) row keeps, and which. kvzip's reconstruction scores
(``jaxkv.policies.kvzip``) are the strongest allocator measured here (uncapped, on held-out
BBH, within 2× of the oracle), while a ranker trained on future attention may order tokens
within a row better but allocates across rows worse (results/ranker_kvzip_residual_selection.md).
This combinator keeps kvzip's allocation and takes the inner policy's order:

    in every row, the slot the inner policy ranks k-th gets kvzip's k-th highest score.

Each row keeps its multiset of kvzip scores, so any selection that compares scores across rows
(a global top-B, with or without a per-row floor and cap) keeps exactly as many tokens per row
as kvzip, and within a row the inner policy's top ones (tested). Slots kvzip protects (its
sinks, scored in ``TIER``) stay protected: they rank first under the inner order too. At
``head`` granularity it keeps the inner policy's top B of each row, the sinks first.

``rerank@<w>:<policy>`` orders each row by a blend instead: ``w`` times the inner policy's
score plus ``1 - w`` times kvzip's log score, each standardized over the row's slots, so
``w = 1`` is ``rerank:<policy>`` and ``w = 0`` is kvzip (``blend``).

Like kvzip it compresses once (``prefill`` protocol) and only the fidelity evaluation computes
its state (``window_input="reconstruction"``); the inner policy may read the reconstruction
too (a ranker with kvzip's features).

``blend@<w>:<a>+<b>`` is the same idea for any two cache-scoring policies, in either protocol:
``a`` allocates (each row keeps its multiset of ``a``'s scores, so a pooled selection keeps
``a``'s count per row) and each row is ordered by the weighted mean of the two policies' ranks
within it, ``(1 - w)`` × ``a``'s + ``w`` × ``b``'s, ties going to ``a``'s order
(``rank_blend``). Ranks, not scores, because the two scales need not be comparable (a
heuristic's protected tier sits ``TIER`` above its other scores). ``w = 0`` is ``a``; ``w = 1``
is ``b``'s order in ``a``'s allocation. ``a``'s protected slots stay first.

``tier@<q>:<a>+<b>`` keeps ``a``'s allocation too, but orders each row by ``a`` alone after
putting first the row's top ``ceil(q × n)`` slots by ``b`` (n: the row's unprotected valid
slots), themselves in ``a``'s order (``rank_tier``): ``b`` decides only which few slots a row
keeps whatever ``a`` thinks of them, e.g. what TOVA's newest query attends to.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.policies import kvzip as kvzip_lib
from jaxkv.policies.base import TIER, Policy, per_row
from jaxkv.topn import argsort_desc, inverse_permutation, lex_argsort, order_key

PREFIX = "rerank:"
WEIGHTED = "rerank@"  # rerank@<w>:<policy>
MIX = "blend@"  # blend@<w>:<a>+<b>
TIER_MIX = "tier@"  # tier@<q>:<a>+<b>
MIXES = (MIX, TIER_MIX)


def transplant(alloc_LBKC: jnp.ndarray, order_LBKC: jnp.ndarray, valid_LBKC) -> jnp.ndarray:
    """Scores whose every row holds ``alloc``'s values in ``order``'s ranking: the slot with
    the k-th highest ``order`` score gets the k-th highest ``alloc`` score of its row. Slots
    ``alloc`` puts in the protected tier (>= TIER) rank first and keep their own scores;
    invalid slots get -inf."""
    alloc = jnp.where(valid_LBKC, alloc_LBKC.astype(jnp.float32), -jnp.inf)
    protected = alloc >= TIER
    within = jnp.where(protected, alloc, order_LBKC.astype(jnp.float32))
    within = jnp.where(valid_LBKC, within, -jnp.inf)
    slots = lex_argsort([~protected, ~order_key(within)], [1, 32])  # protected first
    rank = inverse_permutation(slots)  # 0 = best: protected first, then by ``order``
    values = jnp.take_along_axis(alloc, argsort_desc(alloc), axis=-1)  # descending
    return jnp.take_along_axis(values, rank, axis=-1)


def row_z(x_LBKC: jnp.ndarray, mask_LBKC) -> jnp.ndarray:
    """``x`` standardized over each row's ``mask``ed slots (0 elsewhere)."""
    n = jnp.maximum(jnp.sum(mask_LBKC, axis=-1, keepdims=True), 1)
    x = jnp.where(mask_LBKC, x_LBKC, 0.0)
    mean = jnp.sum(x, axis=-1, keepdims=True) / n
    var = jnp.sum(jnp.where(mask_LBKC, (x - mean) ** 2, 0.0), axis=-1, keepdims=True) / n
    return jnp.where(mask_LBKC, (x - mean) / jnp.sqrt(var + 1e-12), 0.0)


def blend(order_LBKC, recon_LBKC, valid_LBKC, weight: float) -> jnp.ndarray:
    """``weight`` × ``order`` + (1 − ``weight``) × log ``recon``, each ``row_z``-standardized
    over the row's valid slots (an inner policy's protected tier is standardized with the rest;
    kvzip's own protected slots are ``transplant``'s); invalid slots get -inf."""
    log_recon = jnp.log(jnp.maximum(recon_LBKC.astype(jnp.float32), 1e-30))
    z = lambda x: row_z(x.astype(jnp.float32), valid_LBKC)  # noqa: E731
    mixed = weight * z(order_LBKC) + (1.0 - weight) * z(log_recon)
    return jnp.where(valid_LBKC, mixed, -jnp.inf)


def row_ranks(score_LBKC: jnp.ndarray, mask_LBKC) -> jnp.ndarray:
    """Each ``mask``ed slot's rank among its row's ``mask``ed slots by ``score`` (0 = highest;
    ties: the lower slot first); the other slots get the row's length."""
    s = jnp.where(mask_LBKC, score_LBKC.astype(jnp.float32), -jnp.inf)
    rank = inverse_permutation(argsort_desc(s))
    return jnp.where(mask_LBKC, rank, s.shape[-1])


def rank_blend(alloc_LBKC, other_LBKC, valid_LBKC, weight: float) -> jnp.ndarray:
    """``alloc``'s scores, each row's multiset kept, reordered within the row: ``alloc``'s
    protected slots (>= TIER) first, then the other valid slots by ``(1 - weight)`` × their rank
    by ``alloc`` + ``weight`` × their rank by ``other`` (both among those slots), ties by
    ``alloc``'s rank. Invalid slots get -inf. Valid slots' ``alloc`` scores are finite.

    ``transplant(alloc, -position, valid)`` of the mixed order, in three row sorts instead of
    six: one sort by ``alloc`` gives the protected slots' places (they outrank every other
    slot, so they keep their own scores), the free slots' ranks (their places after the
    protected ones) and the row's scores in descending order; the free slot at place k of the
    mixed order takes the k-th highest free score (tested against that composition)."""

    def mixed(own, free):
        return (1.0 - weight) * own + weight * row_ranks(other_LBKC, free)

    return _reorder(alloc_LBKC, valid_LBKC, mixed)


def rank_tier(alloc_LBKC, other_LBKC, valid_LBKC, fraction: float) -> jnp.ndarray:
    """``alloc``'s scores, each row's multiset kept, reordered within the row: ``alloc``'s
    protected slots (>= TIER) first, then the row's top ``ceil(fraction × n)`` other valid
    slots by ``other`` (n of them; ties: the lower slot), then the rest; within each group by
    ``alloc``'s rank. Invalid slots get -inf (the same three row sorts as ``rank_blend``)."""

    def mixed(own, free):
        n_tier = jnp.ceil(fraction * jnp.sum(free, axis=-1, keepdims=True))
        return jnp.where(row_ranks(other_LBKC, free) < n_tier, 0.0, 1.0)

    return _reorder(alloc_LBKC, valid_LBKC, mixed)


def _reorder(alloc_LBKC, valid_LBKC, mixed_fn) -> jnp.ndarray:
    """``rank_blend``'s placement for any order of the free slots: ``mixed_fn(own, free)`` gives
    each slot a key (lower first; ties by ``own``, its rank by ``alloc`` among the free slots,
    the row's length for the others)."""
    alloc = jnp.where(valid_LBKC, alloc_LBKC.astype(jnp.float32), -jnp.inf)
    protected = alloc >= TIER
    free = valid_LBKC & ~protected
    C = alloc.shape[-1]
    by_alloc = argsort_desc(alloc)  # protected, free, invalid
    n_protected = jnp.sum(protected, axis=-1, keepdims=True)
    own = jnp.where(free, inverse_permutation(by_alloc) - n_protected, C)
    key = order_key(mixed_fn(own, free))
    slots = lex_argsort([key, own.astype(jnp.uint32)], [32, C.bit_length()])  # by key, own
    descending = jnp.take_along_axis(alloc, by_alloc, axis=-1)
    place = n_protected + inverse_permutation(slots)  # a free slot's place among the row's
    moved = jnp.take_along_axis(descending, jnp.minimum(place, C - 1), axis=-1)
    return jnp.where(free, moved, alloc)


_REORDERS = {MIX: (rank_blend, "weight"), TIER_MIX: (rank_tier, "tier")}
"""Each mix's row reordering and the name of its number in the policy's spec."""


def parse_mix(name: str) -> tuple[str, float, str, str]:
    """``(prefix, weight, a, b)`` of ``blend@<w>:<a>+<b>`` or ``tier@<q>:<a>+<b>``.

    Raises:
        ValueError: a weight that is not a number in [0, 1], or not two policy names.
    """
    prefix = next(m for m in MIXES if name.startswith(m))
    head, _, pair = name.removeprefix(prefix).partition(":")
    a, _, b = pair.partition("+")
    try:
        weight = float(head)
    except ValueError:
        weight = float("nan")
    if not 0.0 <= weight <= 1.0 or not a or not b:
        raise ValueError(f"{name!r}: write {prefix}<w>:<a>+<b> with w in [0, 1] and two policies")
    return prefix, weight, a, b


def mix(alloc: Policy, other: Policy, *, weight: float, prefix: str = MIX) -> Policy:
    """``alloc``'s allocation across rows, each row ordered by the ``rank_blend`` of ``alloc``'s
    and ``other``'s ranks at ``weight`` on ``other``'s, or (``prefix`` ``tier@``) by
    ``rank_tier`` with ``weight`` the tier's fraction (module docstring). Runs where both run
    (protocols, granularities); its state is the two states, its statistics both sets.

    Raises:
        ValueError: a policy that does not evict, needs a window's future or reconstruction,
            or reads ``recent`` statistics over a window of another length.
    """
    reorder, setting = _REORDERS[prefix]
    for p in (alloc, other):
        if not p.evicts or p.window_input is not None or p.name.startswith(MIXES):
            raise ValueError(f"{prefix[:-1]}: needs two cache-scoring policies, got {p.name!r}")
    if alloc.window != other.window:
        raise ValueError(
            f"{prefix[:-1]}: {alloc.name!r} and {other.name!r} read recent statistics over windows "
            f"of {alloc.window} and {other.window} tokens"
        )

    def init():
        return tuple(p.init() for p in pair)

    def score(state, cache, **kw):
        a, b = (per_row(p.score(st, cache, **kw), cache) for p, st in zip(pair, state, strict=True))
        return reorder(a, b, cache.valid, weight)

    pair = (alloc, other)
    both = lambda field: tuple(x for x in getattr(alloc, field) if x in getattr(other, field))  # noqa: E731
    return Policy(
        f"{prefix}{weight:g}:{alloc.name}+{other.name}",
        score=score,
        init=init,
        granularities=both("granularities"),
        protocols=both("protocols"),
        window=alloc.window,
        stats=tuple(dict.fromkeys(alloc.stats + other.stats)),
        spec=(
            ("alloc", (alloc.name, alloc.spec)),
            ("other", (other.name, other.spec)),
            (setting, weight),
        ),
    )


def parse(name: str) -> tuple[float, str]:
    """``(weight, inner name)`` of ``rerank:<inner>`` (weight 1) or ``rerank@<w>:<inner>``.

    Raises:
        ValueError: a weight that is not a number in [0, 1].
    """
    if name.startswith(PREFIX):
        return 1.0, name.removeprefix(PREFIX)
    head, _, inner = name.removeprefix(WEIGHTED).partition(":")
    try:
        weight = float(head)
    except ValueError:
        weight = float("nan")
    if not 0.0 <= weight <= 1.0 or not inner:
        raise ValueError(f"{name!r}: write rerank@<w>:<policy> with w in [0, 1]")
    return weight, inner


def rerank(inner: Policy, *, weight: float = 1.0) -> Policy:
    """kvzip's per-row allocation with ``inner``'s order within each row, or with the
    ``blend`` of ``inner``'s and kvzip's at ``weight`` < 1 (module docstring)."""
    if not inner.evicts or inner.window_input not in (None, "reconstruction"):
        raise ValueError(f"rerank: needs an evicting cache-scoring policy, got {inner.name!r}")
    if inner.name == kvzip_lib.NAME or inner.name.startswith((PREFIX, WEIGHTED)):
        raise ValueError(f"rerank: cannot wrap {inner.name!r}")
    if "prefill" not in inner.protocols:
        raise ValueError(f"rerank: {inner.name!r} does not run in the prefill protocol")
    alloc = kvzip_lib.kvzip()
    reads_recon = inner.window_input == "reconstruction"

    def init(reconstruction=None):
        state = alloc.init(reconstruction=reconstruction)  # raises, naming the fidelity evaluation
        return state, inner.init(reconstruction=reconstruction) if reads_recon else inner.init()

    def score(state, cache, **kw):
        alloc_state, inner_state = state
        order = per_row(inner.score(inner_state, cache, **kw), cache)
        if weight != 1.0:
            order = blend(order, alloc_state.at(cache.pos), cache.valid, weight)
        return transplant(alloc.score(alloc_state, cache, **kw), order, cache.valid)

    name = PREFIX + inner.name if weight == 1.0 else f"{WEIGHTED}{weight:g}:{inner.name}"
    return Policy(
        name,
        score=score,
        init=init,
        protocols=("prefill",),
        window=inner.window,
        stats=inner.stats,
        window_input="reconstruction",
        spec=(("inner", (inner.name, inner.spec)), ("weight", weight)),
    )
