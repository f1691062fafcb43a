"""``lfu``: evict the leaf with the fewest accesses so far (ties: least recently used)."""

from __future__ import annotations

import numpy as np

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.traces import MooncakeTrace


class LFU(BlockPolicy):
    """Exact per-block access counts (``count_P``)."""

    name = "lfu"

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        self.count_P = np.zeros(trace.n_blocks, np.int64)

    def on_access(self, blocks, hit, i, now):
        self.count_P[blocks] += 1

    def prio(self, b, i, j, now):
        self.clock += 1
        return (int(self.count_P[b]), self.clock)
