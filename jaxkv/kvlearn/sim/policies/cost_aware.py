"""``cost_aware``: keep the blocks that save the most recompute per byte, decayed by age (in the
style of Marconi and LMCache's cost-aware eviction proposal), on the pool's rank.

A block's value at request n is ν · Σ_k exp(−(n − n_k)/τ): ν = (R − T)/(κ·|b|) its recompute
saving per byte (``base.value_density``) and n_k the indices of its requests, decayed with a
time constant of τ requests. Ranking by it is the same at every n, so the rank is the
time-invariant log ν + log Σ_k exp(n_k/τ) (float32), updated at every request; every miss is
admitted and the pool evicts the lowest rank. History is kept across evictions. τ = 1000
requests by default (an untuned choice; the serving simulator's ``cost_aware`` derives τ from
the pool's turnover, which the jitted run, vmapped over pool sizes, does not know statically).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.sim.policies.base import (
    PolicySetup,
    PoolPolicy,
    RunInputs,
    SimRequest,
    event,
    init_pool,
    value_density,
)


@struct.dataclass
class CostAwareState:
    """The pool (rank = value) and [P] float32 ``log_mass_P`` (log Σ_k exp(n_k/τ))."""

    pool: pool_lib.Pool
    log_mass_P: jax.Array


def make(setup: PolicySetup, *, tau_requests: float = 1000.0) -> PoolPolicy:
    """The policy (ν from ``setup.kvlearn.cost``)."""
    if not tau_requests > 0:
        raise ValueError(f"cost_aware: tau_requests must be positive, got {tau_requests}")
    cost = setup.kvlearn.cost if setup.kvlearn is not None else CostModel.llama3_8b_a100()

    def init(inp: RunInputs) -> CostAwareState:
        mass = jnp.full((setup.max_keys,), -jnp.inf, jnp.float32)
        return CostAwareState(init_pool(inp, setup=setup), mass)

    def step(st: CostAwareState, req: SimRequest):
        k = req.key
        mass = jnp.logaddexp(st.log_mass_P[k], req.index.astype(jnp.float32) / tau_requests)
        rank = jnp.log(value_density(cost, req.tokens)) + mass
        slot = pool_lib.lookup(st.pool, k)
        pool = pool_lib.set_entry(st.pool, slot=slot, rank=rank, value=0.0)
        pool, admitted, victims = pool_lib.admit(
            pool, key=k, kib=req.kib, rank=rank, value=0.0, allowed=slot < 0, rule="all"
        )
        n_evicted = jnp.sum(victims.valid_E, dtype=jnp.int32)
        state = CostAwareState(pool, st.log_mass_P.at[k].set(mass))
        return state, event(slot >= 0, admitted, n_evicted)

    return PoolPolicy("cost_aware", init, step)
