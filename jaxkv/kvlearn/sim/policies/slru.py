"""``slru``: segmented LRU (Karedla, Love & Wherry 1994), segments sized in KiB.

A miss is stored at probation's MRU end (after evicting probation's LRU blocks, then
protected's, until it fits); a hit in probation moves the block to protected's MRU end and
protected's LRU blocks are demoted to probation's MRU end while protected holds more than
``protected`` (4/5) of the pool's KiB; a hit in protected moves it to the MRU end. A block
larger than the pool is never stored. With blocks of one size this is the textbook SLRU.
"""

from __future__ import annotations

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

ABSENT, PROBATION, PROTECTED = 0, 1, 2


@struct.dataclass
class SLRUState:
    """The pool and the segments.

    Attributes:
        pool: the block table (holds both segments).
        seg_P: [P] int32 segment of each key (``ABSENT``, ``PROBATION``, ``PROTECTED``).
        stamp_P: [P] int32 recency within its segment (larger = more recent; distinct).
        kib_P: [P] int32 size of each key seen so far.
        protected_kib, protected_cap: [] int32 KiB in protected, its limit.
        clock: [] int32 next stamp.
    """

    pool: pool_lib.Pool
    seg_P: jax.Array
    stamp_P: jax.Array
    kib_P: jax.Array
    protected_kib: jax.Array
    protected_cap: jax.Array
    clock: jax.Array


def make(setup: PolicySetup, *, protected: tuple[int, int] = (4, 5)) -> PoolPolicy:
    """The policy; ``protected`` is protected's share of the pool as a fraction (num, den)."""

    def init(inp: RunInputs) -> SLRUState:
        zeros = jnp.zeros((setup.max_keys,), jnp.int32)
        return SLRUState(
            pool=init_pool(inp, setup=setup),
            seg_P=zeros,
            stamp_P=zeros,
            kib_P=zeros,
            protected_kib=jnp.int32(0),
            protected_cap=frac_of(inp.capacity_kib, *protected),
            clock=jnp.int32(0),
        )

    def step(st: SLRUState, req: SimRequest):
        k, s = req.key, req.kib
        kib_P = st.kib_P.at[k].set(s)
        hit = st.pool.slot_P[k] >= 0
        promote = hit & (st.seg_P[k] == PROBATION)
        st = st.replace(
            kib_P=kib_P,
            seg_P=st.seg_P.at[k].set(jnp.where(hit, PROTECTED, st.seg_P[k])),
            stamp_P=st.stamp_P.at[k].set(jnp.where(hit, st.clock, st.stamp_P[k])),
            protected_kib=st.protected_kib + jnp.where(promote, s, 0),
            clock=st.clock + 1,
        )
        st = jax.lax.while_loop(lambda st: st.protected_kib > st.protected_cap, _demote, st)
        want = ~hit & (s <= st.pool.capacity_kib)
        room = lambda c: want & (c[0].pool.used_kib + s > c[0].pool.capacity_kib)
        st, n_evicted = jax.lax.while_loop(room, _evict, (st, jnp.int32(0)))
        pool, admitted = store(st.pool, req, want)
        st = st.replace(
            pool=pool,
            seg_P=st.seg_P.at[k].set(jnp.where(admitted, PROBATION, st.seg_P[k])),
            stamp_P=st.stamp_P.at[k].set(jnp.where(admitted, st.clock, st.stamp_P[k])),
            clock=st.clock + 1,
        )
        return st, event(hit, admitted, n_evicted)

    return PoolPolicy("slru", init, step)


def _demote(st: SLRUState) -> SLRUState:
    j = oldest(st.seg_P == PROTECTED, st.stamp_P)
    return st.replace(
        seg_P=st.seg_P.at[j].set(PROBATION),
        stamp_P=st.stamp_P.at[j].set(st.clock),
        protected_kib=st.protected_kib - st.kib_P[j],
        clock=st.clock + 1,
    )


def _evict(carry):
    st, n = carry
    prob = st.seg_P == PROBATION
    j = oldest(jnp.where(jnp.any(prob), prob, st.seg_P == PROTECTED), st.stamp_P)
    st = st.replace(
        pool=pool_lib.remove(st.pool, j),
        seg_P=st.seg_P.at[j].set(ABSENT),
        protected_kib=st.protected_kib - jnp.where(st.seg_P[j] == PROTECTED, st.kib_P[j], 0),
    )
    return st, n + 1
