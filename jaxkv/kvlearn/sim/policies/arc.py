"""``arc``: Adaptive Replacement Cache (Megiddo & Modha, FAST'03), generalised to blocks of
different sizes by counting every list, the capacity c and the target p in KiB.

Lists (each least recently used first): T1, T2 (resident), ghosts B1, B2 (keys only). Request
for key x of s KiB:

* x in T1 ∪ T2 (hit): x moves to T2's MRU end.
* x in B1: p = min(c, p + s·max(1, ⌊|B2| / |B1|⌋)); REPLACE until x fits; x moves to T2.
* x in B2: p = max(0, p − s·max(1, ⌊|B1| / |B2|⌋)); REPLACE until x fits; x moves to T2.
* otherwise (case IV): if |T1| + |B1| + s > c, drop B1's LRU keys while that holds and B1 is
  not empty, then evict T1's LRU blocks without a ghost while |T1| + s > c; else drop B2's LRU
  keys while |T1| + |T2| + |B1| + |B2| + s > 2c. REPLACE until x fits; x enters T1's MRU end.

REPLACE evicts T1's LRU block into B1's MRU end if T1 is not empty and (|T1| > p, or x was in B2
and |T1| = p, or T2 is empty), else T2's LRU block into B2. A block larger than the pool is
never stored and changes nothing. With blocks of one size (s = 1) this is the paper's ARC, except
that δ rounds the ratio of the ghost lists down (the paper keeps p real).
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
    init_pool,
    oldest,
    store,
)

ABSENT, T1, T2, B1, B2 = 0, 1, 2, 3, 4


@struct.dataclass
class ARCState:
    """The pool, the four lists and the target.

    Attributes:
        pool: the block table (holds T1 and T2).
        list_P: [P] int32 list of each key (``ABSENT``, ``T1``, ``T2``, ``B1``, ``B2``).
        stamp_P: [P] int32 recency within its list (larger = more recent; distinct).
        kib_P: [P] int32 size of each key seen so far.
        size_L: [5] int32 KiB per list (index = list id; entry 0 unused).
        p: [] int32 target KiB of T1.
        clock: [] int32 next stamp.
    """

    pool: pool_lib.Pool
    list_P: jax.Array
    stamp_P: jax.Array
    kib_P: jax.Array
    size_L: jax.Array
    p: jax.Array
    clock: jax.Array


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy."""

    def init(inp: RunInputs) -> ARCState:
        zeros = jnp.zeros((setup.max_keys,), jnp.int32)
        return ARCState(
            pool=init_pool(inp, setup=setup),
            list_P=zeros,
            stamp_P=zeros,
            kib_P=zeros,
            size_L=jnp.zeros((5,), jnp.int32),
            p=jnp.int32(0),
            clock=jnp.int32(0),
        )

    def step(st: ARCState, req: SimRequest):
        k, s = req.key, req.kib
        c = st.pool.capacity_kib
        where = st.list_P[k]
        fits = s <= c
        hit = (where == T1) | (where == T2)
        in_b1, in_b2 = fits & (where == B1), fits & (where == B2)
        new = fits & (where == ABSENT)
        size = st.size_L
        b1, b2 = jnp.maximum(size[B1], 1), jnp.maximum(size[B2], 1)
        p = jnp.where(in_b1, jnp.minimum(c, st.p + s * jnp.maximum(1, size[B2] // b1)), st.p)
        p = jnp.where(in_b2, jnp.maximum(0, p - s * jnp.maximum(1, size[B1] // b2)), p)
        st = st.replace(kib_P=st.kib_P.at[k].set(s), p=p)
        # case IV: keep the directory within c (L1) and 2c (L1 + L2)
        l1_full = new & (size[T1] + size[B1] + s > c)
        drop = lambda lst, cond: jax.lax.while_loop(cond, lambda st: _drop(st, lst), st)
        st = drop(
            B1, lambda st: l1_full & (st.size_L[T1] + st.size_L[B1] + s > c) & (st.size_L[B1] > 0)
        )
        n0 = jnp.int32(0)
        st, n_direct = jax.lax.while_loop(
            lambda cr: l1_full & (cr[0].size_L[T1] + s > c), _evict_t1, (st, n0)
        )
        st = drop(
            B2, lambda st: new & ~l1_full & (jnp.sum(st.size_L) + s > 2 * c) & (st.size_L[B2] > 0)
        )
        # REPLACE until x fits, then store it (or move it within T1 ∪ T2 on a hit)
        want = in_b1 | in_b2 | new
        room = lambda cr: want & (cr[0].pool.used_kib + s > c)
        st, n_replaced = jax.lax.while_loop(room, lambda cr: _replace(cr, x_in_b2=in_b2), (st, n0))
        pool, admitted = store(st.pool, req, want)
        to = jnp.where(new, T1, T2)
        moved = hit | admitted
        size = st.size_L.at[where].add(jnp.where(moved & (where != ABSENT), -s, 0))
        size = size.at[to].add(jnp.where(moved, s, 0))
        st = st.replace(
            pool=pool,
            list_P=st.list_P.at[k].set(jnp.where(moved, to, st.list_P[k])),
            stamp_P=st.stamp_P.at[k].set(jnp.where(moved, st.clock, st.stamp_P[k])),
            size_L=size,
            clock=st.clock + 1,
        )
        return st, event(hit, admitted, n_direct + n_replaced)

    return PoolPolicy("arc", init, step)


def _drop(st: ARCState, lst: int) -> ARCState:
    """Forgets the LRU key of ghost list ``lst``."""
    j = oldest(st.list_P == lst, st.stamp_P)
    return st.replace(
        list_P=st.list_P.at[j].set(ABSENT), size_L=st.size_L.at[lst].add(-st.kib_P[j])
    )


def _evict_t1(carry):
    """Evicts T1's LRU block without remembering it (case IV, L1 full and B1 empty)."""
    st, n = carry
    j = oldest(st.list_P == T1, st.stamp_P)
    st = st.replace(
        pool=pool_lib.remove(st.pool, j),
        list_P=st.list_P.at[j].set(ABSENT),
        size_L=st.size_L.at[T1].add(-st.kib_P[j]),
    )
    return st, n + 1


def _replace(carry, *, x_in_b2):
    """REPLACE: evicts T1's or T2's LRU block into the matching ghost list's MRU end."""
    st, n = carry
    t1, t2 = st.size_L[T1], st.size_L[T2]
    from_t1 = (t1 > 0) & ((t1 > st.p) | (x_in_b2 & (t1 == st.p)) | (t2 == 0))
    src = jnp.where(from_t1, T1, T2)
    j = oldest(st.list_P == src, st.stamp_P)
    kj = st.kib_P[j]
    st = st.replace(
        pool=pool_lib.remove(st.pool, j),
        list_P=st.list_P.at[j].set(src + 2),
        stamp_P=st.stamp_P.at[j].set(st.clock),
        size_L=st.size_L.at[src].add(-kj).at[src + 2].add(kj),
        clock=st.clock + 1,
    )
    return st, n + 1
