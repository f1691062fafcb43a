"""``random_lru``: admit a miss with probability ``p_admit`` (default 0.1), evict LRU."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kvlearn.sim.policies.base import PolicySetup, PoolPolicy, ranked_pool_policy


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy: LRU ranks, a miss admitted iff its uniform draw is below ``setup.p_admit``."""
    rank = lambda r: r.index.astype(jnp.float32)
    allowed = lambda r: r.u < setup.p_admit
    return ranked_pool_policy(
        "random_lru", setup=setup, rank_fn=rank, allowed_fn=allowed, rule="all"
    )
