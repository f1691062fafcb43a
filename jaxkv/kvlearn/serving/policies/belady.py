"""``belady``: future knowledge, evict the leaf used again last; admit a block only if it is
used again sooner than the victim (a heuristic bound: not optimal for TTFT with queueing)."""

from __future__ import annotations

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.oracle import INF, next_use
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.traces import MooncakeTrace


class Belady(BlockPolicy):
    """Priority −(next use); the gate refuses a block never used again (bypass)."""

    name = "belady"

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        self.nu = next_use(trace)

    def prio(self, b, i, j, now):
        return (-self.nu[i][j],)

    def gate(self, b, i, j, now):
        nu = self.nu[i][j]
        return nu < INF, (-nu,)
