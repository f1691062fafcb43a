"""``gdsf``: GreedyDual-Size-Frequency (Cherkasova, HP Labs 1998) on the pool's rank.

Each resident block has rank H = L + F·ν: F its requests since it was stored (the storing
request counts 1), ν = (R − T)/(κ·|b|) its recompute saving per byte normalised by the
bandwidth-regime κ (the core's value density, ≥ 1 for bandwidth-bound blocks; C/S of GDSF). L,
the inflation, is the H of the last victim. A miss is always admitted: the pool evicts the
lowest H until it fits (``pool.admit``), L becomes the last victim's H, and the new block gets
H = L + ν with that L. Exact up to float32 ranks (ties go to the lowest pool slot).
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
class GDSFState:
    """The pool (rank = H), [P] int32 ``freq_P`` (F of resident keys), [] float32 ``inflation``
    (L)."""

    pool: pool_lib.Pool
    freq_P: jax.Array
    inflation: jax.Array


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy (ν from ``setup.kvlearn.cost``)."""
    cost = setup.kvlearn.cost if setup.kvlearn is not None else CostModel.llama3_8b_a100()

    def init(inp: RunInputs) -> GDSFState:
        zeros = jnp.zeros((setup.max_keys,), jnp.int32)
        return GDSFState(init_pool(inp, setup=setup), zeros, jnp.float32(0.0))

    def step(st: GDSFState, req: SimRequest):
        k = req.key
        nu = value_density(cost, req.tokens)
        slot = pool_lib.lookup(st.pool, k)
        hit = slot >= 0
        freq = jnp.where(hit, st.freq_P[k] + 1, 1)
        pool = pool_lib.set_entry(st.pool, slot=slot, rank=st.inflation + freq * nu, value=0.0)
        pool, admitted, victims = pool_lib.admit(
            pool, key=k, kib=req.kib, rank=0.0, value=0.0, allowed=~hit, rule="all"
        )
        last = jnp.max(jnp.where(victims.valid_E, victims.rank_E, -jnp.inf))
        inflation = jnp.maximum(st.inflation, last)
        new_slot = jnp.where(admitted, pool_lib.lookup(pool, k), -1)
        pool = pool_lib.set_entry(pool, slot=new_slot, rank=inflation + nu, value=0.0)
        gone = jnp.where(victims.valid_E, victims.key_E, setup.max_keys)
        freq_P = st.freq_P.at[gone].set(0, mode="drop")
        freq_P = freq_P.at[k].set(jnp.where(hit | admitted, freq, freq_P[k]))
        n_evicted = jnp.sum(victims.valid_E, dtype=jnp.int32)
        return GDSFState(pool, freq_P, inflation), event(hit, admitted, n_evicted)

    return PoolPolicy("gdsf", init, step)
