"""``no_cache``: recompute every request, keep nothing."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kvlearn.sim.policies.base import PolicySetup, PoolPolicy, event


def make(setup: PolicySetup) -> PoolPolicy:
    """The policy (``setup`` is unused: there is no pool)."""
    del setup
    init = lambda inp: jnp.zeros((), jnp.int32)
    step = lambda s, r: (s, event(False, False, 0))
    return PoolPolicy("no_cache", init, step)
