"""``slru``: segmented LRU (Karedla, Love & Wherry 1994) over blocks as independent keys (like
``lru``).

Two LRU segments (each least recently used first): probationary and protected (at most
``protected_frac`` = 80 % of the pool's blocks). A stored block enters probation's MRU end; an
access to a block in probation moves it to protected's MRU end, and while protected is over its
share its LRU block is demoted to probation's MRU end; an access in protected moves the block to
its MRU end. The victim is probation's LRU block (protected's when probation is empty).

A request accesses its blocks deepest first (as vLLM's offload managers touch them), so its
first block ends up the most recent.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.traces import MooncakeTrace


class SLRU(BlockPolicy):
    """Segments ``probation`` and ``protected`` (ordered dicts, LRU first)."""

    name = "slru"
    leaf_only = False
    selects_victims = True

    def __init__(
        self,
        trace: MooncakeTrace,
        cost: CostModel,
        *,
        pool_blocks: int,
        protected_frac: float = 0.8,
    ):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        if not 0 <= protected_frac < 1:
            raise ValueError(f"slru: protected_frac must be in [0, 1), got {protected_frac}")
        self.protected_cap = int(protected_frac * self.capacity)
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()

    def on_access(self, blocks, hit, i, now):
        for b in reversed(blocks.tolist()):
            touch_segments(self.probation, self.protected, b, protected_cap=self.protected_cap)

    def prio(self, b, i, j, now):
        return ()

    def victim(self, incoming):
        return next(iter(self.probation), next(iter(self.protected), None))

    def on_evict(self, b):
        if b in self.probation:
            del self.probation[b]
        else:
            del self.protected[b]

    def on_insert(self, b):
        self.probation[b] = None


def touch_segments(probation: OrderedDict, protected: OrderedDict, b: int, *, protected_cap: int):
    """An access to ``b`` in an SLRU main (probation -> protected, demoting protected's LRU
    blocks while it is over ``protected_cap``; protected -> its MRU end). Returns whether ``b``
    was in either segment."""
    if b in probation:
        del probation[b]
        protected[b] = None
        while len(protected) > protected_cap:
            probation[protected.popitem(last=False)[0]] = None
        return True
    if b in protected:
        protected.move_to_end(b)
        return True
    return False
