"""The block policy type of the serving simulator (``BlockPolicy``): what a policy decides and
when the engine asks it.

A block policy keeps no pool itself: ``prefix.PrefixCache`` holds the blocks and evicts the
lowest priority; the policy supplies the priorities and an admission gate, and hears about
every request and every eviction. The policies are one module each under
``serving/policies/``; ``serving/policies/__init__.py`` is their registry.
"""

from __future__ import annotations

from typing import ClassVar

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.prefix import PrefixCache
from jaxkv.kvlearn.traces import MooncakeTrace


class BlockPolicy:
    """A block-level policy: priorities for the cache's heap and an admission gate.

    ``prio(b, i, j, now)`` is the priority of block ``b`` (position j of request i) when it is
    touched at time ``now``; ``gate(b, i, j, now)`` returns ``(admit, min_victim)``. The
    defaults are LRU over leaves that admits everything (``mooncake``).

    Class attributes: ``name``; ``leaf_only`` (evict only leaves and admit only under a
    resident parent: a prefix cache; false = blocks as independent keys); ``uses_pool`` (false:
    the policy runs with an empty pool whatever the deployment's size).
    """

    name: ClassVar[str] = "base"
    leaf_only: ClassVar[bool] = True
    uses_pool: ClassVar[bool] = True

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int):
        self.capacity = pool_blocks if self.uses_pool else 0
        """Blocks of the pool this policy runs with."""
        self.clock = 0

    def prio(self, b: int, i: int, j: int, now: float) -> tuple:
        self.clock += 1
        return (self.clock,)

    def gate(self, b: int, i: int, j: int, now: float) -> tuple[bool, tuple | None]:
        return True, None

    def on_access(self, blocks, hit: int, i: int, now: float) -> None:
        """Called once per request at lookup with its blocks and hit count."""

    def on_evict(self, b: int) -> None:
        """Called by the cache after it evicts block ``b``."""

    def attach(self, cache: PrefixCache) -> None:
        """Called once with the pool the policy serves (read-only use)."""
