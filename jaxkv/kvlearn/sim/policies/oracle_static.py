"""``oracle_static``: knows the true popularity p_k; keeps the best set by p_k·(R−T)/|b| (greedy
knapsack, ``static_oracle_set``) that fits; admits a miss iff it is in that set; never evicts.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.sim.policies.base import (
    PolicySetup,
    PoolPolicy,
    RunInputs,
    SimRequest,
    event,
    init_pool,
)


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy; the set arrives per run as ``RunInputs.keep_P``."""

    def init(inp: RunInputs):
        return init_pool(inp, setup=setup), inp.keep_P

    def step(state, req: SimRequest):
        pool, keep_P = state
        slot = pool_lib.lookup(pool, req.key)
        pool, admitted, victims = pool_lib.admit(
            pool,
            key=req.key,
            kib=req.kib,
            rank=0.0,
            value=0.0,
            allowed=(slot < 0) & keep_P[req.key],
            rule="all",
        )
        return (pool, keep_P), event(slot >= 0, admitted, jnp.sum(victims.valid_E))

    return PoolPolicy("oracle_static", init, step)


def static_oracle_set(
    *, popularity_P, tokens_P, cost: CostModel, capacity_bytes: float, max_blocks: int
) -> np.ndarray:
    """[P] bool: the greedy value-per-byte set p_k·(R−T)/|b| that fits in the pool."""
    tokens = np.asarray(tokens_P, np.float64)
    kib = pool_lib.bytes_to_kib(cost.footprint_bytes(np.asarray(tokens_P, np.int64)))
    density = np.asarray(popularity_P) * cost.net_benefit_ms(tokens) / cost.footprint_bytes(tokens)
    keep = np.zeros(tokens.shape, bool)
    used, cap = 0, int(pool_lib.bytes_to_kib(int(capacity_bytes)))
    for k in np.argsort(-density, kind="stable"):
        if density[k] <= 0 or keep.sum() >= max_blocks:
            break
        if used + kib[k] <= cap:
            keep[k], used = True, used + kib[k]
    return keep
