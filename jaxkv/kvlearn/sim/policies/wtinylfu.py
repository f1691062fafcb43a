"""``wtinylfu``: W-TinyLFU (Einziger, Friedman & Manes, ACM ToS 2017; Caffeine), segments sized
in KiB.

Segments (each least recently used first): a window LRU (1/100 of the pool's KiB) and a main
SLRU of the rest, probation and protected (4/5 of main). A count-min sketch (4 rows of 4-bit
counters, the serving simulator's hashing, ``sketch_width(P)`` counters per row, halved after
10·P increments, P the key table's size) counts every request.

A hit in the window or in protected moves the key to its segment's MRU end; a hit in probation
moves it to protected's MRU end, and protected's LRU keys are demoted to probation's MRU end
while protected is over its share. A miss enters the window's MRU end (a block larger than the
pool is never stored); while the window is over its share its LRU key becomes a candidate for
main: it enters probation's MRU end once it fits in main, and while it does not, it duels main's
victim (probation's LRU key, else protected's): the candidate wins iff its estimate is strictly
higher, and the loser is evicted (a candidate with no victim left is evicted). The missed key
itself is stored iff it is still in the window or won its way into probation.

Sequential duels for one large candidate follow Caffeine's ``evictFromMain``; the hill-climbing
window, the doorkeeper and the random admission of warm candidates are not modelled. Of a pool
of C KiB main gets ⌊0.99·C⌋ and the window the rest, as the serving simulator splits blocks; a
window smaller than a block makes every miss a candidate at once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.sim.policies.base import (
    PolicySetup,
    PoolPolicy,
    RunInputs,
    SimRequest,
    event,
    frac_of,
    init_pool,
    oldest,
    store,
)

ABSENT, WINDOW, PROBATION, PROTECTED = 0, 1, 2, 3
SKETCH_SEEDS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
"""The serving simulator's sketch multipliers (``serving.policies.wtinylfu``), repeated here so
that the two simulators do not import each other."""
SKETCH_MAX = 15


def sketch_width(n: int) -> int:
    """Counters per row: the next power of two ≥ max(n, 16)."""
    return 1 << max(4, (max(n, 1) - 1).bit_length())


def sketch_index_D(key, *, width: int) -> jax.Array:
    """[4] the key's counter in each row: top log2(width) bits of (key + 1)·seed mod 2^32."""
    h = (jnp.asarray(key, jnp.uint32) + jnp.uint32(1)) * jnp.asarray(SKETCH_SEEDS, jnp.uint32)
    return (h >> (32 - int(math.log2(width)))).astype(jnp.int32)


@struct.dataclass
class WTinyLFUState:
    """The pool, the segments and the sketch.

    Attributes:
        pool: the block table (holds all three segments).
        seg_P: [P] int32 segment of each key (``ABSENT``, ``WINDOW``, ``PROBATION``,
            ``PROTECTED``).
        stamp_P: [P] int32 recency within its segment (larger = more recent; distinct).
        kib_P: [P] int32 size of each key seen so far.
        size_G: [4] int32 KiB per segment (index = segment id; entry 0 unused).
        window_cap, main_cap, protected_cap: [] int32 segment limits (KiB).
        sketch_DW: [4, W] int32 counters; additions: [] int32 increments since the last aging.
        clock: [] int32 next stamp.
    """

    pool: pool_lib.Pool
    seg_P: jax.Array
    stamp_P: jax.Array
    kib_P: jax.Array
    size_G: jax.Array
    window_cap: jax.Array
    main_cap: jax.Array
    protected_cap: jax.Array
    sketch_DW: jax.Array
    additions: jax.Array
    clock: jax.Array


def make(
    setup: PolicySetup, *, window: tuple[int, int] = (1, 100), protected: tuple[int, int] = (4, 5)
) -> PoolPolicy:
    """The policy; ``window`` (of the pool) and ``protected`` (of main) are fractions."""
    width = sketch_width(setup.max_keys)
    sample = 10 * setup.max_keys

    def init(inp: RunInputs) -> WTinyLFUState:
        zeros = jnp.zeros((setup.max_keys,), jnp.int32)
        cap = jnp.asarray(inp.capacity_kib, jnp.int32)
        main_cap = frac_of(cap, window[1] - window[0], window[1])  # the window gets the rest
        return WTinyLFUState(
            pool=init_pool(inp, setup=setup),
            seg_P=zeros,
            stamp_P=zeros,
            kib_P=zeros,
            size_G=jnp.zeros((4,), jnp.int32),
            window_cap=cap - main_cap,
            main_cap=main_cap,
            protected_cap=frac_of(main_cap, *protected),
            sketch_DW=jnp.zeros((len(SKETCH_SEEDS), width), jnp.int32),
            additions=jnp.int32(0),
            clock=jnp.int32(0),
        )

    def increment(st: WTinyLFUState, key) -> WTinyLFUState:
        rows = jnp.arange(len(SKETCH_SEEDS))
        idx_D = sketch_index_D(key, width=width)
        c_D = st.sketch_DW[rows, idx_D]
        added = jnp.any(c_D < SKETCH_MAX)
        sketch = st.sketch_DW.at[rows, idx_D].set(jnp.minimum(c_D + 1, SKETCH_MAX))
        additions = st.additions + added.astype(jnp.int32)
        age = additions >= sample
        return st.replace(
            sketch_DW=jnp.where(age, sketch >> 1, sketch),
            additions=jnp.where(age, additions // 2, additions),
        )

    def estimate(st: WTinyLFUState, key) -> jax.Array:
        rows = jnp.arange(len(SKETCH_SEEDS))
        return jnp.min(st.sketch_DW[rows, sketch_index_D(key, width=width)])

    def duel(carry):
        """One step of moving the window's overflow into main: take a candidate (the window's
        LRU key), or let it enter probation if it fits, or let it fight main's victim."""
        st, cand, n = carry
        idle = cand < 0
        none = setup.max_keys  # an out-of-range index: updates to it are dropped
        take = jnp.where(idle, oldest(st.seg_P == WINDOW, st.stamp_P), none)
        cand = jnp.where(idle, take, cand)
        kc = st.kib_P[cand]
        size = st.size_G.at[WINDOW].add(jnp.where(idle, -kc, 0))
        seg_P = st.seg_P.at[take].set(ABSENT, mode="drop")
        enter = ~idle & (size[PROBATION] + size[PROTECTED] + kc <= st.main_cap)
        prob = seg_P == PROBATION
        main_P = jnp.where(jnp.any(prob), prob, seg_P == PROTECTED)
        victim = oldest(main_P, st.stamp_P)
        fight = ~idle & ~enter
        wins = fight & jnp.any(main_P) & (estimate(st, cand) > estimate(st, victim))
        loses = fight & ~wins
        gone = jnp.where(wins, victim, jnp.where(loses, cand, none))
        evicted = wins | (loses & (st.pool.slot_P[cand] >= 0))  # the missed key is not in it
        size = size.at[seg_P[victim]].add(jnp.where(wins, -st.kib_P[victim], 0))
        size = size.at[PROBATION].add(jnp.where(enter, kc, 0))
        seg_P = seg_P.at[jnp.where(enter, cand, none)].set(PROBATION, mode="drop")
        seg_P = seg_P.at[gone].set(ABSENT, mode="drop")
        st = st.replace(
            pool=_remove_if(st.pool, gone, gone < none),
            seg_P=seg_P,
            stamp_P=st.stamp_P.at[jnp.where(enter, cand, none)].set(st.clock, mode="drop"),
            size_G=size,
            clock=st.clock + 1,
        )
        return st, jnp.where(idle | wins, cand, -1), n + evicted.astype(jnp.int32)

    def step(st: WTinyLFUState, req: SimRequest):
        k, s = req.key, req.kib
        st = increment(st.replace(kib_P=st.kib_P.at[k].set(s)), k)
        seg = st.seg_P[k]
        hit = seg != ABSENT
        promote = seg == PROBATION
        new_seg = jnp.where(promote, PROTECTED, jnp.where(hit, seg, WINDOW))
        want = ~hit & (s <= st.pool.capacity_kib)
        moved = hit | want
        size = st.size_G.at[seg].add(jnp.where(promote, -s, 0))
        size = size.at[new_seg].add(jnp.where(promote | want, s, 0))
        st = st.replace(
            seg_P=st.seg_P.at[k].set(jnp.where(moved, new_seg, seg)),
            stamp_P=st.stamp_P.at[k].set(jnp.where(moved, st.clock, st.stamp_P[k])),
            size_G=size,
            clock=st.clock + 1,
        )
        st = jax.lax.while_loop(lambda st: st.size_G[PROTECTED] > st.protected_cap, _demote, st)
        pending = lambda cr: (cr[1] >= 0) | (cr[0].size_G[WINDOW] > cr[0].window_cap)
        st, _, n_evicted = jax.lax.while_loop(pending, duel, (st, jnp.int32(-1), jnp.int32(0)))
        pool, admitted = store(st.pool, req, want & (st.seg_P[k] != ABSENT))
        return st.replace(pool=pool), event(hit, admitted, n_evicted)

    return PoolPolicy("wtinylfu", init, step)


def _remove_if(pool: pool_lib.Pool, key, do) -> pool_lib.Pool:
    """``pool.remove(pool, key)`` when ``do`` (``key`` may then be out of range)."""
    removed = pool_lib.remove(pool, jnp.minimum(key, pool.max_keys - 1))
    return jax.tree.map(lambda a, b: jnp.where(do, a, b), removed, pool)


def _demote(st: WTinyLFUState) -> WTinyLFUState:
    j = oldest(st.seg_P == PROTECTED, st.stamp_P)
    kj = st.kib_P[j]
    return st.replace(
        seg_P=st.seg_P.at[j].set(PROBATION),
        stamp_P=st.stamp_P.at[j].set(st.clock),
        size_G=st.size_G.at[PROTECTED].add(-kj).at[PROBATION].add(kj),
        clock=st.clock + 1,
    )
