"""``infinite``: the infinite-pool ceiling, a prefix cache that holds every block and never evicts.

Its pool has a slot for every distinct block of the trace, whatever the deployment's size, so
each block is computed once (and again only when a request starts before the one computing it
has finished); the policy bounds what any pool could gain on a trace.
"""

from __future__ import annotations

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.traces import MooncakeTrace


class Infinite(BlockPolicy):
    """The base policy (admit everything) with ``capacity`` = the trace's distinct blocks."""

    name = "infinite"

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        self.capacity = trace.n_blocks
