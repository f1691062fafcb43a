"""The serving simulator's block policies (``BlockPolicy``): one module each, and their registry.

    no_cache       recompute everything (an empty pool).
    lru            LRU-Pool: blocks as independent keys, LRU over all blocks, admit every
                   computed block; eviction may strand descendants. (The Zipf simulator's
                   ``lru`` is this rule on whole prefixes, where it is also Mooncake's.)
    mooncake       Mooncake-style prefix cache: LRU over leaves, admit every computed block.
    lfu            fewest accesses among leaves.
    oracle_static  knows every block's popularity in the whole trace; keeps the best static
                   prefix-closed set by value per byte.
    belady         future knowledge: evict the leaf used again last; admit a block only if it
                   is used again sooner than the victim.
    kvlearn        KVLearn's design at block granularity (``kvlearn.BlockKVLearn``).
    kvlearn_experts  KVLearn as expert learning (LeCaR/CACHEUS): ghost histories and regret
                   weights, or shadow pools, over the leaf orders lru / lfu / gd / gdsf; or
                   a guard: gd backs off to classical shadows (``kvlearn_experts.ExpertKVLearn``).

The classical bar (blocks as independent keys, like ``lru``, for the list- and queue-based
policies, which pick their victims themselves: ``BlockPolicy.selects_victims``; over leaves, like
``mooncake``, for the priority-based ones):

    arc            Adaptive Replacement Cache with vLLM's KV-offload semantics.
    s3fifo         S3-FIFO: small FIFO (10 %), main FIFO with 2-bit frequency reinsertion, ghost.
    wtinylfu       W-TinyLFU: window LRU (1 %), count-min-sketch admission, SLRU main (20/80).
    slru           segmented LRU: probation and protected (80 %) segments.
    gdsf           GreedyDual-Size-Frequency over leaves: H = L + F·C/S, inflation L.
    cost_aware     recompute saved per slot, decayed by age in requests, over leaves.
    infinite       the infinite-pool ceiling: holds every block, never evicts.

``make_policy(name, trace, cost, pool_blocks=..., **options)`` builds one (``kvlearn`` and
some classical policies take options); ``BLOCK_POLICIES`` is their order in every table.
"""

from __future__ import annotations

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.arc import ARC
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.serving.policies.belady import Belady
from jaxkv.kvlearn.serving.policies.cost_aware import CostAware
from jaxkv.kvlearn.serving.policies.gdsf import GDSF
from jaxkv.kvlearn.serving.policies.infinite import Infinite
from jaxkv.kvlearn.serving.policies.kvlearn import BlockKVLearn
from jaxkv.kvlearn.serving.policies.kvlearn_experts import ExpertKVLearn
from jaxkv.kvlearn.serving.policies.lfu import LFU
from jaxkv.kvlearn.serving.policies.lru import LRUPool
from jaxkv.kvlearn.serving.policies.mooncake import Mooncake
from jaxkv.kvlearn.serving.policies.no_cache import NoCache
from jaxkv.kvlearn.serving.policies.oracle_static import OracleStatic
from jaxkv.kvlearn.serving.policies.s3fifo import S3FIFO
from jaxkv.kvlearn.serving.policies.slru import SLRU
from jaxkv.kvlearn.serving.policies.wtinylfu import WTinyLFU
from jaxkv.kvlearn.traces import MooncakeTrace

_CLASSES = (NoCache, LRUPool, Mooncake, LFU, OracleStatic, Belady, BlockKVLearn, ExpertKVLearn)
_CLASSICAL = (ARC, S3FIFO, WTinyLFU, SLRU, GDSF, CostAware, Infinite)
REGISTRY: dict[str, type[BlockPolicy]] = {cls.name: cls for cls in _CLASSES + _CLASSICAL}
BLOCK_POLICIES = tuple(REGISTRY)
"""Names of the block policies, in table order."""


def make_policy(
    name: str, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int, **options
) -> BlockPolicy:
    """The block policy ``name`` (one of ``BLOCK_POLICIES``) for ``trace`` in a pool of
    ``pool_blocks`` blocks; ``options`` go to its constructor."""
    if name not in REGISTRY:
        raise ValueError(f"unknown policy {name!r}; choose from {BLOCK_POLICIES}")
    return REGISTRY[name](trace, cost, pool_blocks=pool_blocks, **options)
