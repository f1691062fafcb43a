"""The KV pool's block table: a fixed-capacity, policy-agnostic pytree and pure operations on it.

Shape suffixes use the KVLearn glossary in ``jaxkv/config.py``: ``Z`` slots, ``Y`` slot groups,
``W`` slots per group (Z = Y·W), ``E`` victims of one admission, ``P`` prefix keys.

Sizes are accounted in KiB (``int32``, each block rounded *up*), which keeps sums exact and
allows pools up to ``MAX_CAPACITY_KIB`` (2047 GiB). A block's KiB (``block_kib``) is computed
without int32 overflow and saturates at ``MAX_KIB``: such a block is larger than any pool, so
it is never admitted, exactly as if its true size had been kept. A slot is empty iff ``key_Z``
is -1; ``slot_P`` is the inverse map, so ``lookup`` is O(1). Free slots sit on a stack
(``free_Z``): an insert takes the top, evicted slots are pushed in victim order.

Finding the lowest-rank blocks must not scan all Z slots (an XLA CPU argmin over 100k floats
costs ~0.5 ms): slots are split into Y groups of W ≈ √(Z / max_victims) and ``group_min_Y``
keeps each group's lowest resident rank. Each victim is found in O(Y + max_victims · W) (the
lowest group, then its lowest slot not yet taken), only as many as are needed; every rank change
refreshes one group in O(W).

Every policy (LRU, LFU, Belady, KVLearn, …) uses the same table and differs only in the
``rank`` it stores (lower rank = evicted first; ranks must be finite) and the admission ``rule``:

* ``"all"``: admit whenever the block can be made to fit (evicting by rank);
* ``"value"``: when victims are needed, admit only if the candidate's ``value`` exceeds their
  summed ``value`` (KVLearn: never destroy more value than is added); into free space the
  caller's ``allowed`` gate alone decides;
* ``"rank"``: admit only if the candidate outranks every victim (Belady-style).

Victims are the lowest-rank blocks in (rank, slot) order until enough KiB and a slot are free;
at most ``max_victims`` per admission (an admission needing more is refused).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

EMPTY = -1
RULES = ("all", "value", "rank")
MAX_KIB = 2**31 - 1
"""Largest KiB count the int32 accounting holds; ``block_kib`` saturates here."""
MAX_CAPACITY_KIB = 2047 * 2**20
"""Largest pool (2047 GiB): below ``MAX_KIB`` with room for float32 rounding of the capacity."""


@struct.dataclass
class Pool:
    """Block table.

    Attributes:
        key_Z: [Z] int32 key id held by each slot, -1 when empty.
        kib_Z: [Z] int32 size of each resident block (KiB, 0 when empty).
        rank_Z: [Z] float32 eviction rank (lowest first).
        value_Z: [Z] float32 value (ms) lost if the block is evicted.
        group_min_Y: [Y] float32 lowest rank of a resident block per group (+inf if none).
        free_Z: [Z] int32 stack of free slots, top at ``n_free - 1``.
        n_free: [] int32 free slots.
        free_top: [] int32 ``free_Z[n_free - 1]``, kept so that an insert never reads the
            stack it is about to update (XLA would copy it).
        slot_P: [P] int32 slot holding each key, -1 when not resident.
        used_kib: [] int32 sum of ``kib_Z``.
        capacity_kib: [] int32 pool capacity (an array, so runs can be vmapped over sizes).
        max_victims: static, victims one admission may evict.
    """

    key_Z: jax.Array
    kib_Z: jax.Array
    rank_Z: jax.Array
    value_Z: jax.Array
    group_min_Y: jax.Array
    free_Z: jax.Array
    n_free: jax.Array
    free_top: jax.Array
    slot_P: jax.Array
    used_kib: jax.Array
    capacity_kib: jax.Array
    max_victims: int = struct.field(pytree_node=False, default=128)

    @property
    def n_slots(self) -> int:
        return self.key_Z.shape[-1]

    @property
    def group_size(self) -> int:
        return self.n_slots // self.group_min_Y.shape[-1]

    @property
    def max_keys(self) -> int:
        return self.slot_P.shape[-1]


def bytes_to_kib(nbytes):
    """Block size in whole KiB, rounded up (accounting is conservative)."""
    return -(-nbytes // 1024)


def block_kib(tokens, *, bytes_per_token: int):
    """⌈tokens · bytes_per_token / 1024⌉ KiB, saturated at ``MAX_KIB``: int32 for JAX ``tokens``
    (int32), int64 for anything else; any shape.

    ``bytes_to_kib(tokens * bytes_per_token)`` overflows int32 from 16,384 tokens of
    LLaMA-3-8B (128 KiB/token). Here no intermediate exceeds the result (with tokens = 1024·a
    + b and bytes_per_token = 1024·q + r: tokens·q + a·r + ⌈b·r / 1024⌉). On the JAX path a
    result within 1024 KiB of ``MAX_KIB`` or beyond it saturates (detected in float32, which
    is far more accurate than that margin); such a block is larger than any pool
    (``MAX_CAPACITY_KIB``), so saturating it changes no decision.
    """
    q, r = divmod(int(bytes_per_token), 1024)
    if not isinstance(tokens, jax.Array):
        tokens = np.asarray(tokens, np.int64)
    exact = tokens * q + (tokens // 1024) * r + -(-(tokens % 1024) * r // 1024)
    if not isinstance(tokens, jax.Array):
        return np.minimum(exact, MAX_KIB)
    fits = tokens * (bytes_per_token / 1024) < MAX_KIB - 1024
    return jnp.where(fits, exact, MAX_KIB)


def check_capacity_kib(capacity_kib) -> None:
    """Raises ValueError unless 0 ≤ ``capacity_kib`` ≤ ``MAX_CAPACITY_KIB`` (concrete values;
    a traced capacity is not checked)."""
    if isinstance(capacity_kib, jax.core.Tracer):
        return
    cap = np.asarray(capacity_kib, np.float64)
    if np.any(cap < 0) or np.any(cap > MAX_CAPACITY_KIB) or not np.all(np.isfinite(cap)):
        raise ValueError(
            f"pool capacity must be between 0 and {MAX_CAPACITY_KIB} KiB (2047 GiB), got "
            f"{capacity_kib} KiB"
        )


def init_pool(*, max_blocks: int, max_keys: int, capacity_kib, max_victims: int = 128) -> Pool:
    """An empty pool of ``capacity_kib`` KiB with ``max_blocks`` slots for keys < ``max_keys``.

    The slot arrays are padded up to a multiple of the group size; padding slots are never
    on the free stack, so at most ``max_blocks`` blocks are resident.
    """
    if max_blocks <= 0 or max_keys <= 0 or max_victims <= 0:
        raise ValueError(
            f"max_blocks, max_keys, max_victims must be positive, got "
            f"{max_blocks}, {max_keys}, {max_victims}"
        )
    check_capacity_kib(capacity_kib)
    max_victims = min(max_victims, max_blocks)
    # victim search costs O(Y) + O(max_victims · W): balance the two with W ≈ √(Z / E)
    s = max(1, math.ceil(math.sqrt(max_blocks / max_victims)))
    g = -(-max_blocks // s)
    free = jnp.zeros((g * s,), jnp.int32).at[:max_blocks].set(jnp.arange(max_blocks - 1, -1, -1))
    return Pool(
        key_Z=jnp.full((g * s,), EMPTY, jnp.int32),
        kib_Z=jnp.zeros((g * s,), jnp.int32),
        rank_Z=jnp.zeros((g * s,), jnp.float32),
        value_Z=jnp.zeros((g * s,), jnp.float32),
        group_min_Y=jnp.full((g,), jnp.inf, jnp.float32),
        free_Z=free,
        n_free=jnp.asarray(max_blocks, jnp.int32),
        free_top=jnp.zeros((), jnp.int32),
        slot_P=jnp.full((max_keys,), EMPTY, jnp.int32),
        used_kib=jnp.zeros((), jnp.int32),
        capacity_kib=jnp.asarray(capacity_kib, jnp.int32),
        max_victims=max_victims,
    )


def resident(pool: Pool) -> jax.Array:
    """[Z] bool: slot holds a block."""
    return pool.key_Z >= 0


def lookup(pool: Pool, key) -> jax.Array:
    """Slot of ``key`` or -1."""
    return pool.slot_P[key]


def _group_rows(pool: Pool, groups_E, exclude_E=None):
    """[E, W] resident ranks of the given groups (+inf for empty or excluded slots)."""
    s = pool.group_size
    slots_EW = groups_E[:, None] * s + jnp.arange(s)
    idx_EW = jnp.minimum(slots_EW, pool.n_slots - 1)
    rank_EW = jnp.where(pool.key_Z[idx_EW] >= 0, pool.rank_Z[idx_EW], jnp.inf)
    if exclude_E is not None:
        hit_EW = jnp.any(slots_EW[:, :, None] == exclude_E[None, None, :], axis=-1)
        rank_EW = jnp.where(hit_EW, jnp.inf, rank_EW)
    return slots_EW, rank_EW


def _refresh_groups(pool: Pool, slots_E) -> Pool:
    """Recomputes ``group_min_Y`` for the groups of ``slots_E`` (entries ≥ Z are ignored)."""
    groups_E = slots_E // pool.group_size
    _, rank_EW = _group_rows(pool, jnp.minimum(groups_E, pool.group_min_Y.shape[0] - 1))
    gidx = jnp.where(slots_E < pool.n_slots, groups_E, pool.group_min_Y.shape[0])
    return pool.replace(group_min_Y=pool.group_min_Y.at[gidx].set(rank_EW.min(-1), mode="drop"))


def set_entry(pool: Pool, *, slot, rank, value) -> Pool:
    """Updates a resident slot's rank and value (no-op when ``slot`` is -1)."""
    idx = jnp.where(slot >= 0, slot, pool.n_slots)  # out of bounds → dropped
    pool = pool.replace(
        rank_Z=pool.rank_Z.at[idx].set(rank, mode="drop"),
        value_Z=pool.value_Z.at[idx].set(value, mode="drop"),
    )
    return _refresh_groups(pool, idx[None])


def set_ranks(pool: Pool, *, rank_Z, value_Z) -> Pool:
    """Replaces every slot's rank and value (e.g. after re-scoring all resident blocks)."""
    live = resident(pool)
    rank_Z = jnp.where(live, rank_Z, 0.0).astype(jnp.float32)
    g = pool.group_min_Y.shape[0]
    gmin = jnp.where(live, rank_Z, jnp.inf).reshape(g, -1).min(-1)
    return pool.replace(
        rank_Z=rank_Z, value_Z=jnp.where(live, value_Z, 0.0).astype(jnp.float32), group_min_Y=gmin
    )


@struct.dataclass
class Victims:
    """Chosen victims in eviction order ([E] arrays, padded: slot Z, key -1, kib 0)."""

    slot_E: jax.Array
    key_E: jax.Array
    kib_E: jax.Array
    rank_E: jax.Array
    value_E: jax.Array

    @property
    def valid_E(self):
        return self.key_E >= 0


def select_victims(pool: Pool, *, need_kib, active=True) -> tuple[Victims, jax.Array]:
    """Lowest-rank resident blocks, in (rank, slot) order, until ``need_kib`` KiB and a free slot
    are available. With ``active`` false nothing is selected.

    A ``lax.while_loop`` that takes one victim per iteration: the lowest group minimum
    (``argmin`` over Y), then the lowest slot of that group not yet taken (W), then that group's
    next minimum. Ties go to the lowest group and slot, which is (rank, slot) order because
    groups are contiguous slot ranges. It runs as many iterations as victims are needed (none
    for most requests), and has no sort: a sort or ``top_k`` over all candidates cost more
    than the rest of a simulator step, and under ``vmap`` every run paid it at every request.

    Returns:
        (victims, ok): ``ok`` is false if the need cannot be met within ``max_victims``.
    """
    v, c = pool.max_victims, pool.n_slots
    need_slot = pool.n_free == 0
    want = lambda freed, count: (freed < need_kib) | (need_slot & (count == 0))

    def cond(carry):
        _, _, count, freed, exhausted = carry
        return active & ~exhausted & (count < v) & want(freed, count)

    def body(carry):
        gmin_Y, slots_E, count, freed, _ = carry
        g = jnp.argmin(gmin_Y)
        live = jnp.isfinite(gmin_Y[g])
        slots_1W, rank_1W = _group_rows(pool, g[None], exclude_E=slots_E)
        j = jnp.argmin(rank_1W[0])
        slot = jnp.where(live, slots_1W[0, j], c)
        rest = jnp.where(jnp.arange(rank_1W.shape[1]) == j, jnp.inf, rank_1W[0]).min()
        return (
            gmin_Y.at[g].set(jnp.where(live, rest, gmin_Y[g])),
            slots_E.at[count].set(slot),
            count + live.astype(jnp.int32),
            freed + jnp.where(live, pool.kib_Z[jnp.minimum(slot, c - 1)], 0),
            ~live,
        )

    init = (pool.group_min_Y, jnp.full((v,), c, jnp.int32), jnp.int32(0), jnp.int32(0), False)
    _, slot_E, count, freed, _ = jax.lax.while_loop(cond, body, init)
    take = slot_E < c
    safe = jnp.minimum(slot_E, c - 1)
    ok = ~active | (~want(freed, count))
    victims = Victims(
        slot_E=slot_E,
        key_E=jnp.where(take, pool.key_Z[safe], EMPTY),
        kib_E=jnp.where(take, pool.kib_Z[safe], 0),
        rank_E=jnp.where(take, pool.rank_Z[safe], jnp.inf),
        value_E=jnp.where(take, pool.value_Z[safe], 0.0),
    )
    return victims, ok


def _evict(pool: Pool, victims: Victims) -> Pool:
    valid_E = victims.valid_E
    push_E = jnp.where(valid_E, pool.n_free + jnp.cumsum(valid_E) - 1, pool.n_slots)
    pool = pool.replace(
        key_Z=pool.key_Z.at[victims.slot_E].set(EMPTY, mode="drop"),
        kib_Z=pool.kib_Z.at[victims.slot_E].set(0, mode="drop"),
        slot_P=pool.slot_P.at[jnp.where(valid_E, victims.key_E, pool.max_keys)].set(
            EMPTY, mode="drop"
        ),
        used_kib=pool.used_kib - jnp.sum(victims.kib_E),
        free_Z=pool.free_Z.at[push_E].set(victims.slot_E, mode="drop"),
        n_free=pool.n_free + jnp.sum(valid_E, dtype=jnp.int32),
    )
    return _refresh_groups(_sync_free_top(pool), victims.slot_E)


def remove(pool: Pool, key) -> Pool:
    """Evicts ``key`` if it is resident."""
    slot = pool.slot_P[key]
    live = slot >= 0
    safe = jnp.maximum(slot, 0)
    victims = Victims(
        slot_E=jnp.where(live, slot, pool.n_slots)[None],
        key_E=jnp.where(live, key, EMPTY)[None],
        kib_E=jnp.where(live, pool.kib_Z[safe], 0)[None],
        rank_E=pool.rank_Z[safe][None],
        value_E=pool.value_Z[safe][None],
    )
    return _evict(pool, victims)


def admit(pool: Pool, *, key, kib, rank, value, allowed=True, rule: str = "all", margin=0.0):
    """Tries to insert a non-resident block, evicting lowest-rank blocks if needed.

    Args:
        pool: the table.
        key, kib, rank, value: the candidate.
        allowed: [] bool pre-decision (admission gate); when false nothing changes.
        rule: ``"all"``, ``"value"`` or ``"rank"`` (static; see the module docstring).
        margin: with ``"value"``, the candidate must exceed the victims' value by this fraction.

    Returns:
        (pool, admitted, victims): the evicted blocks (``Victims``, padded).
    """
    if rule not in RULES:
        raise ValueError(f"unknown admission rule {rule!r}; choose from {RULES}")
    eligible = allowed & (kib <= pool.capacity_kib) & (pool.slot_P[key] < 0)
    need = pool.used_kib + kib - pool.capacity_kib
    victims, ok = select_victims(pool, need_kib=need, active=eligible)
    any_victim = jnp.any(victims.valid_E)
    if rule == "value":
        beats = ~any_victim | (value > (1.0 + margin) * jnp.sum(victims.value_E))
    elif rule == "rank":
        beats = ~any_victim | (rank > jnp.max(jnp.where(victims.valid_E, victims.rank_E, -jnp.inf)))
    else:
        beats = jnp.asarray(True)
    do = eligible & ok & beats
    victims = jax.tree.map(lambda a, pad: jnp.where(do, a, pad), victims, _no_victims(pool))
    return (
        _evict_and_insert(pool, victims, key=key, kib=kib, rank=rank, value=value, do=do),
        do,
        victims,
    )


def _evict_and_insert(pool: Pool, victims: Victims, *, key, kib, rank, value, do) -> Pool:
    """Evicts ``victims`` and inserts the candidate with one scatter per array.

    Equivalent to evicting (pushing the victims' slots on the free stack in order) and then
    inserting into the stack's top slot; written as a single update so that every read of
    the old table happens before it (XLA would otherwise copy the slot arrays).
    """
    valid_E = victims.valid_E
    n_v = jnp.sum(valid_E, dtype=jnp.int32)
    last = victims.slot_E[jnp.maximum(n_v - 1, 0)]
    new_slot = jnp.where(n_v > 0, last, pool.free_top)
    c = pool.n_slots
    # victims other than the reused one are cleared; the candidate lands in new_slot
    clear_E = jnp.where(valid_E & ~(do & (victims.slot_E == new_slot)), victims.slot_E, c)
    ins = jnp.where(do, new_slot, c)
    idx = jnp.concatenate([clear_E, ins[None]])
    upd = lambda a, cleared, new: a.at[idx].set(
        jnp.concatenate(
            [jnp.full(clear_E.shape, cleared, a.dtype), jnp.asarray(new, a.dtype)[None]]
        ),
        mode="drop",
    )
    keys = jnp.concatenate(
        [jnp.where(valid_E, victims.key_E, pool.max_keys), jnp.where(do, key, pool.max_keys)[None]]
    )
    slot_vals = jnp.concatenate([jnp.full(valid_E.shape, EMPTY, jnp.int32), new_slot[None]])
    # free stack: push all victims, then pop the top (the last victim) for the candidate
    push_E = jnp.where(valid_E, pool.n_free + jnp.cumsum(valid_E) - 1, c)
    n_free = pool.n_free + n_v - do.astype(jnp.int32)
    pool = pool.replace(
        key_Z=upd(pool.key_Z, EMPTY, key),
        kib_Z=upd(pool.kib_Z, 0, kib),
        rank_Z=upd(pool.rank_Z, 0.0, rank),
        value_Z=upd(pool.value_Z, 0.0, value),
        slot_P=pool.slot_P.at[keys].set(slot_vals, mode="drop"),
        used_kib=pool.used_kib - jnp.sum(victims.kib_E) + jnp.where(do, kib, 0),
        free_Z=pool.free_Z.at[push_E].set(victims.slot_E, mode="drop"),
        n_free=n_free,
    )
    return _refresh_groups(_sync_free_top(pool), idx)


def _sync_free_top(pool: Pool) -> Pool:
    return pool.replace(free_top=pool.free_Z[jnp.maximum(pool.n_free - 1, 0)])


def _no_victims(pool: Pool) -> Victims:
    v = pool.max_victims
    return Victims(
        slot_E=jnp.full((v,), pool.n_slots, jnp.int32),
        key_E=jnp.full((v,), EMPTY, jnp.int32),
        kib_E=jnp.zeros((v,), jnp.int32),
        rank_E=jnp.full((v,), jnp.inf, jnp.float32),
        value_E=jnp.zeros((v,), jnp.float32),
    )
