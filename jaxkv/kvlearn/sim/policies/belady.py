"""``belady``: future knowledge, rank = −(next use); a miss is admitted only if it is reused
later and sooner than every victim it needs (Belady with bypass; a heuristic bound, not exactly
optimal for variable block sizes)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kvlearn.sim.policies.base import PolicySetup, PoolPolicy, ranked_pool_policy


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy (``SimRequest.next_use`` is ``setup.n_requests`` for a last use)."""
    rank = lambda r: -r.next_use.astype(jnp.float32)
    allowed = lambda r: r.next_use < setup.n_requests
    return ranked_pool_policy("belady", setup=setup, rank_fn=rank, allowed_fn=allowed, rule="rank")
