"""``lfu``: admit every miss, evict the block with the fewest requests so far (perfect per-key
counts, ties to the lowest slot)."""

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
    """The policy; its state is (pool, [P] request counts)."""

    def init(inp: RunInputs):
        return init_pool(inp, setup=setup), jnp.zeros((setup.max_keys,), jnp.int32)

    def step(state, req: SimRequest):
        pool, count_P = state
        count_P = count_P.at[req.key].add(1)
        rank = count_P[req.key].astype(jnp.float32)
        slot = pool_lib.lookup(pool, req.key)
        pool = pool_lib.set_entry(pool, slot=slot, rank=rank, value=0.0)
        pool, admitted, victims = pool_lib.admit(
            pool, key=req.key, kib=req.kib, rank=rank, value=0.0, allowed=slot < 0, rule="all"
        )
        return (pool, count_P), event(slot >= 0, admitted, jnp.sum(victims.valid_E))

    return PoolPolicy("lfu", init, step)
