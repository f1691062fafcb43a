"""``s3fifo``: S3-FIFO (Yang et al., SOSP'23) with queues sized in KiB (libCacheSim's byte mode).

Queues (each oldest first): S, the small FIFO (1/10 of the pool's KiB), M, the main FIFO (the
rest), and G, a ghost FIFO of keys evicted from S (as many KiB of keys as M may hold). Each
resident key has a 2-bit frequency (0–3).

A hit sets freq = min(freq + 1, 3). A miss leaves G if it was there; it is stored (freq 0) into
M if it was in G, else into S, after evictions until it fits (a block larger than the pool is
never stored). One eviction round (libCacheSim's ``S3FIFO_evict``): from M if M holds more than
its share or S is empty, else from S. From S: the oldest key moves to M (freq 0) if it was hit
at least once, and the round continues with S; the first key that was not is evicted into G
(G then drops its oldest keys beyond its size); a round that empties S ends without evicting.
From M: the oldest key with freq > 0 is reinserted at the head with freq − 1, until the oldest
has freq 0: it is evicted. With blocks of one size and an S of whole blocks this is the
serving simulator's ``s3fifo``.
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

ABSENT, SMALL, MAIN, GHOST = 0, 1, 2, 3
_IDLE = 0  # eviction round: none in progress (else SMALL or MAIN)


@struct.dataclass
class S3FIFOState:
    """The pool and the three queues.

    Attributes:
        pool: the block table (holds S and M).
        queue_P: [P] int32 queue of each key (``ABSENT``, ``SMALL``, ``MAIN``, ``GHOST``).
        stamp_P: [P] int32 order within its queue (larger = newer; distinct).
        freq_P: [P] int32 frequency of resident keys (0–3).
        kib_P: [P] int32 size of each key seen so far.
        small_kib, main_kib, ghost_kib: [] int32 KiB per queue.
        small_cap, main_cap: [] int32 S's share and M's (= G's) size.
        clock: [] int32 next stamp.
    """

    pool: pool_lib.Pool
    queue_P: jax.Array
    stamp_P: jax.Array
    freq_P: jax.Array
    kib_P: jax.Array
    small_kib: jax.Array
    main_kib: jax.Array
    ghost_kib: jax.Array
    small_cap: jax.Array
    main_cap: jax.Array
    clock: jax.Array


def make(setup: PolicySetup, *, small: tuple[int, int] = (1, 10)) -> PoolPolicy:
    """The policy; ``small`` is S's share of the pool as a fraction (num, den)."""

    def init(inp: RunInputs) -> S3FIFOState:
        zeros = jnp.zeros((setup.max_keys,), jnp.int32)
        small_cap = frac_of(inp.capacity_kib, *small)
        return S3FIFOState(
            pool=init_pool(inp, setup=setup),
            queue_P=zeros,
            stamp_P=zeros,
            freq_P=zeros,
            kib_P=zeros,
            small_kib=jnp.int32(0),
            main_kib=jnp.int32(0),
            ghost_kib=jnp.int32(0),
            small_cap=small_cap,
            main_cap=jnp.asarray(inp.capacity_kib, jnp.int32) - small_cap,
            clock=jnp.int32(0),
        )

    def step(st: S3FIFOState, req: SimRequest):
        k, s = req.key, req.kib
        q = st.queue_P[k]
        hit = (q == SMALL) | (q == MAIN)
        was_ghost = q == GHOST
        st = st.replace(
            kib_P=st.kib_P.at[k].set(s),
            freq_P=st.freq_P.at[k].set(jnp.where(hit, jnp.minimum(st.freq_P[k] + 1, 3), 0)),
            queue_P=st.queue_P.at[k].set(jnp.where(was_ghost, ABSENT, q)),
            ghost_kib=st.ghost_kib - jnp.where(was_ghost, s, 0),
        )
        want = ~hit & (s <= st.pool.capacity_kib)
        room = lambda c: want & (c[0].pool.used_kib + s > c[0].pool.capacity_kib)
        st, _, n_evicted = jax.lax.while_loop(
            room, _evict_once, (st, jnp.int32(_IDLE), jnp.int32(0))
        )
        st = jax.lax.while_loop(lambda st: st.ghost_kib > st.main_cap, _drop_ghost, st)
        pool, admitted = store(st.pool, req, want)
        to = jnp.where(was_ghost, MAIN, SMALL)
        st = st.replace(
            pool=pool,
            queue_P=st.queue_P.at[k].set(jnp.where(admitted, to, st.queue_P[k])),
            stamp_P=st.stamp_P.at[k].set(jnp.where(admitted, st.clock, st.stamp_P[k])),
            small_kib=st.small_kib + jnp.where(admitted & ~was_ghost, s, 0),
            main_kib=st.main_kib + jnp.where(admitted & was_ghost, s, 0),
            clock=st.clock + 1,
        )
        return st, event(hit, admitted, n_evicted)

    return PoolPolicy("s3fifo", init, step)


def _evict_once(carry):
    """One look at the tail of S or M: a move S → M, a reinsertion in M, or an eviction."""
    st, mode, n = carry
    mode = jnp.where(
        mode == _IDLE,
        jnp.where((st.main_kib > st.main_cap) | (st.small_kib == 0), MAIN, SMALL),
        mode,
    )
    j = oldest(st.queue_P == mode, st.stamp_P)
    kj, fj = st.kib_P[j], st.freq_P[j]
    keep = fj >= 1  # S: move to M; M: reinsert with freq − 1
    from_small = mode == SMALL
    new_q = jnp.where(keep, MAIN, jnp.where(from_small, GHOST, ABSENT))
    st = st.replace(
        pool=jax.tree.map(lambda a, b: jnp.where(keep, a, b), st.pool, pool_lib.remove(st.pool, j)),
        queue_P=st.queue_P.at[j].set(new_q),
        stamp_P=st.stamp_P.at[j].set(st.clock),
        freq_P=st.freq_P.at[j].set(jnp.where(keep & ~from_small, fj - 1, 0)),
        small_kib=st.small_kib - jnp.where(from_small, kj, 0),
        main_kib=st.main_kib
        + jnp.where(from_small & keep, kj, 0)
        - jnp.where(~from_small & ~keep, kj, 0),
        ghost_kib=st.ghost_kib + jnp.where(from_small & ~keep, kj, 0),
        clock=st.clock + 1,
    )
    done = ~keep | (from_small & (st.small_kib == 0))
    return st, jnp.where(done, _IDLE, mode), n + (~keep).astype(jnp.int32)


def _drop_ghost(st: S3FIFOState) -> S3FIFOState:
    j = oldest(st.queue_P == GHOST, st.stamp_P)
    return st.replace(queue_P=st.queue_P.at[j].set(ABSENT), ghost_kib=st.ghost_kib - st.kib_P[j])
