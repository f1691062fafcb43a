"""``gdsf``: GreedyDual-Size-Frequency (Cherkasova, HP Labs 1998) over the leaves of the prefix
tree (like ``mooncake``: the resident set stays prefix-closed).

Each resident block has H = L + F·C/S: F its accesses since it was stored (the storing access
counts 1), C what one hit on it saves (``block_saving_ms``: its recompute over its prefix minus
fetching it, from the run's ``CostModel``), S its size, one slot of the pool for every block (so
C/S = C). L, the inflation, is the H of the last victim: blocks not accessed again age out
against newer ones. Every computed block is admitted; the victim is the leaf with the lowest H
(ties: least recently touched), and a stored block's H uses L after the eviction that made its
room (``on_insert`` re-touches it), as in GreedyDual. Because only leaves are eligible, a
victim's H can lie below L (an inner block waited behind its children); L never decreases
(L = max(L, H_victim)).
"""

from __future__ import annotations

import numpy as np

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy, block_saving_ms
from jaxkv.kvlearn.serving.prefix import PrefixCache
from jaxkv.kvlearn.traces import MooncakeTrace


class GDSF(BlockPolicy):
    """[P] ``saving_P`` (C), ``freq_P`` (F), ``h_P`` (H at the last touch); ``inflation`` (L)."""

    name = "gdsf"

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        self.saving_P = block_saving_ms(trace, cost)
        self.freq_P = np.zeros(trace.n_blocks, np.int64)
        self.h_P = np.zeros(trace.n_blocks)
        self.inflation = 0.0
        self.cache: PrefixCache | None = None
        # the arrays as memoryviews (Python numbers, faster block by block) and C as a list
        self._freq_v, self._h_v = memoryview(self.freq_P), memoryview(self.h_P)
        self._saving = self.saving_P.tolist()

    def attach(self, cache):
        super().attach(cache)
        self.cache = cache

    def prio(self, b, i, j, now):
        freq = self._freq_v
        freq[b] = freq[b] + 1 if self.cache.res_view[b] else 1
        return self._h(b)

    def on_insert(self, b):
        self.cache.touch(b, self._h(b))  # L may have risen while room was made

    def _h(self, b: int) -> tuple:
        h = self.inflation + self._freq_v[b] * self._saving[b]
        self._h_v[b] = h
        self.clock += 1
        return (h, self.clock)

    def on_evict(self, b):
        self.inflation = max(self.inflation, self._h_v[b])
