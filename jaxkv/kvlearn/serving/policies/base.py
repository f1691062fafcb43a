"""The block policy type of the serving simulator (``BlockPolicy``): what a policy decides and
when the engine asks it.

A block policy keeps no pool itself: ``prefix.PrefixCache`` holds the blocks and evicts the
lowest priority; the policy supplies the priorities and an admission gate, and hears about
every request, every insertion and every eviction. A policy whose eviction order is not one
priority per block (``selects_victims``: ARC, S3-FIFO, W-TinyLFU, SLRU) picks each victim itself
instead (``victim``). The policies are one module each under ``serving/policies/``;
``serving/policies/__init__.py`` is their registry.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

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
    the policy runs with an empty pool whatever the deployment's size); ``selects_victims``
    (true: the cache asks ``victim`` for every victim and ignores the priorities).
    """

    name: ClassVar[str] = "base"
    leaf_only: ClassVar[bool] = True
    uses_pool: ClassVar[bool] = True
    selects_victims: ClassVar[bool] = False

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

    def on_offer(self, i: int) -> None:
        """Called once per request when it finishes, before its computed blocks are offered
        (a policy that mirrors the pool's timing in a shadow pool stores them then)."""

    def victim(self, incoming: int) -> int | None:
        """(``selects_victims`` only) The resident block to evict to make room for ``incoming``,
        or None to refuse ``incoming``; the cache then calls ``on_evict`` with it."""
        raise NotImplementedError

    def on_insert(self, b: int) -> None:
        """Called by the cache after block ``b`` becomes resident (after any evictions)."""

    def attach(self, cache: PrefixCache) -> None:
        """Called once with the pool the policy serves: binds ``on_insert`` and, when the policy
        ``selects_victims``, ``victim`` to it. (The policy reads the pool; only a policy whose
        priority depends on what room-making changed re-``touch``es a block it inserted.)"""
        victim = self.victim if self.selects_victims else None
        hears = type(self).on_insert is not BlockPolicy.on_insert  # the default does nothing
        cache.bind(select_victim=victim, on_insert=self.on_insert if hears else None)


def block_saving_ms(trace: MooncakeTrace, cost: CostModel) -> np.ndarray:
    """[P] what one hit on each block saves (ms): R(e) − R(s) − T(its tokens), floored at 0,
    where s, e are the block's first and last token offsets in its request (a hit on a deeper
    block skips its attention over a longer prefix). A block id names its whole prefix, so the
    offsets are the same in every request; if a trace disagrees the largest saving is kept."""
    out = np.zeros(trace.n_blocks)
    if not len(trace):
        return out
    bt = trace.block_tokens
    ids = np.concatenate(trace.blocks)
    n_B = np.array([len(b) for b in trace.blocks], np.int64)  # B: requests
    end_B = np.cumsum(n_B)
    depth = np.arange(len(ids)) - np.repeat(end_B - n_B, n_B)  # j of each block in its request
    start = (depth * bt).astype(np.float64)
    tok = np.full(len(ids), bt, np.int64)  # ``trace.block_tokens_of``, all requests at once
    tok[end_B[n_B > 0] - 1] = trace.input_len[n_B > 0] - (n_B[n_B > 0] - 1) * bt
    tok = tok.astype(np.float64)
    save = (
        np.asarray(cost.recompute_ms(start + tok), np.float64)
        - np.asarray(cost.recompute_ms(start), np.float64)
        - np.asarray(cost.transfer_ms(cost.footprint_bytes(tok)), np.float64)
    )
    np.maximum.at(out, ids, np.maximum(save, 0.0))
    return out
