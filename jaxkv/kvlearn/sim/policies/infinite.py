"""``infinite``: the infinite-pool ceiling: admit every miss into a pool of the largest size the
table can count (2047 GiB, whatever the run's capacity), so nothing is ever evicted and every
re-reference hits."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.sim.policies.base import (
    PolicySetup,
    PoolPolicy,
    RunInputs,
    SimRequest,
    event,
    init_pool,
)


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy; its state is the pool."""

    def init(inp: RunInputs) -> pool_lib.Pool:
        return init_pool(
            inp.replace(capacity_kib=jnp.int32(pool_lib.MAX_CAPACITY_KIB)), setup=setup
        )

    def step(pool: pool_lib.Pool, req: SimRequest):
        hit = pool_lib.lookup(pool, req.key) >= 0
        pool, admitted, victims = pool_lib.admit(
            pool, key=req.key, kib=req.kib, rank=0.0, value=0.0, allowed=~hit, rule="all"
        )
        return pool, event(hit, admitted, jnp.sum(victims.valid_E, dtype=jnp.int32))

    return PoolPolicy("infinite", init, step)
