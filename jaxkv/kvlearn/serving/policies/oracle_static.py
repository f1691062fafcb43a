"""``oracle_static``: knows every block's popularity in the whole trace and keeps the best static
prefix-closed set by value per byte (``oracle.static_oracle_set``); admits a block iff it is in
the set, never evicts, pays compulsory misses."""

from __future__ import annotations

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.oracle import block_tree, static_oracle_set, static_values
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.traces import MooncakeTrace


class OracleStatic(BlockPolicy):
    """The set is chosen once for the pool's size (``keep_P``; ``exact``: provably optimal)."""

    name = "oracle_static"

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        parent, depth, _, _ = block_tree(trace)
        self.keep_P, self.exact = static_oracle_set(
            parent, depth, static_values(trace, cost), self.capacity
        )

    def gate(self, b, i, j, now):
        return bool(self.keep_P[b]), None
