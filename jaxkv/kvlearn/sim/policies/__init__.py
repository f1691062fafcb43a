"""The Zipf simulator's pool policies (``PoolPolicy``): one module each, and their registry.

    no_cache       recompute every request, keep nothing.
    lru            LRU-Pool: admit every miss, evict least recently used. A request here names
                   one whole prefix (one block), so this is also the Mooncake-style pool; the
                   serving simulator's block policies (``serving.policies``) tell the two apart.
    random_lru     admit a miss with probability ``p_admit`` (default 0.1), evict LRU.
    lfu            admit every miss, evict the block with the fewest requests so far.
    oracle_static  knows the true popularity; keeps the best static set by value per byte.
    belady         future knowledge: evict the block used again last, with bypass.
    kvlearn        KVLearn's control plane (``core.control``).

The classical bar (the serving simulator's policies of the same names on whole prefixes, with
every list, queue and segment sized in KiB; they keep their own per-key lists and pick victims
in a ``lax.while_loop``, or rank the pool):

    arc            Adaptive Replacement Cache (the paper's, sizes in KiB).
    s3fifo         S3-FIFO: small FIFO (1/10), main FIFO with 2-bit reinsertion, ghost FIFO.
    wtinylfu       W-TinyLFU: window LRU (1/100), count-min-sketch duels, SLRU main (1/5, 4/5).
    slru           segmented LRU: probation and protected (4/5) segments.
    gdsf           GreedyDual-Size-Frequency: rank L + F·ν, inflation L.
    cost_aware     recompute saved per byte ν, decayed by age in requests (τ = 1000).
    infinite       a pool that never fills: every re-reference hits.

``make_policy(name, setup)`` builds one; ``POOL_POLICIES`` is their order in every table.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxkv.kvlearn.sim.policies import (
    arc,
    belady,
    cost_aware,
    gdsf,
    infinite,
    kvlearn,
    lfu,
    lru,
    no_cache,
    oracle_static,
    random_lru,
    s3fifo,
    slru,
    wtinylfu,
)
from jaxkv.kvlearn.sim.policies.base import PolicySetup, PoolPolicy

REGISTRY: dict[str, Callable[[PolicySetup], PoolPolicy]] = {
    "no_cache": no_cache.make,
    "lru": lru.make,
    "random_lru": random_lru.make,
    "lfu": lfu.make,
    "oracle_static": oracle_static.make,
    "belady": belady.make,
    "kvlearn": kvlearn.make,
    "arc": arc.make,
    "s3fifo": s3fifo.make,
    "wtinylfu": wtinylfu.make,
    "slru": slru.make,
    "gdsf": gdsf.make,
    "cost_aware": cost_aware.make,
    "infinite": infinite.make,
}
POOL_POLICIES = tuple(REGISTRY)
"""Names of the pool policies, in table order."""


def make_policy(name: str, setup: PolicySetup) -> PoolPolicy:
    """The pool policy ``name`` (one of ``POOL_POLICIES``) built for ``setup``."""
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; choose from {POOL_POLICIES}")
    return REGISTRY[name](setup)
