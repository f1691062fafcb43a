"""``lru``: LRU-Pool, admit every miss, evict the least recently used block.

In this simulator a request names one whole prefix (one key, one block), so LRU over keys is
also the Mooncake-style pool; the serving simulator's ``lru`` is LRU over the *blocks* of a
prefix, and its ``mooncake`` LRU over leaves (``serving/policies/``).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kvlearn.sim.policies.base import PolicySetup, PoolPolicy, ranked_pool_policy


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy: rank = request index (the oldest access goes first)."""
    rank = lambda r: r.index.astype(jnp.float32)
    return ranked_pool_policy(
        "lru", setup=setup, rank_fn=rank, allowed_fn=lambda r: True, rule="all"
    )
