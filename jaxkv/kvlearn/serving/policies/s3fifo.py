"""``s3fifo``: S3-FIFO (Yang et al., SOSP'23) over blocks as independent keys (like ``lru``).

Three FIFO queues (each oldest first): S, the small queue (10 % of the pool's blocks, at least
one), M, the main queue (the rest), and G, a ghost queue of ids evicted from S (as many as M
holds). Every resident block has a 2-bit frequency (0–3).

* **Access** (``on_access``): each resident block of the request gets freq = min(freq + 1, 3);
  a missing block found in G leaves G and is marked to enter M when it is stored.
* **Store** (``on_insert``): into M if marked, else into S; freq = 0.
* **Evict** (``victim``, one block per call): from M if M holds more than its share or S is
  empty, else from S. From S: the oldest block moves to M (freq reset to 0) if it was accessed
  at least ``move_to_main`` times (default 1: "accessed at least once", the paper's text) and
  the next oldest is examined; the first one that was not is evicted into G (G drops its oldest
  ids beyond its size). If S empties this way the victim comes from M. From M: the oldest block
  with freq > 0 is reinserted at the head with freq − 1, until the oldest has freq 0: it is
  evicted.

The one-victim-per-call structure is libCacheSim's (``S3FIFO_evict``: an S-round continues
with S until one block leaves the cache, even if moves overfill M; the next round then takes
M). libCacheSim's default ``move-to-main-threshold`` is 2; the paper's prose promotes a block
accessed once in S, which is the default here.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.traces import MooncakeTrace

_NONE, _SMALL, _MAIN = 0, 1, 2


class S3FIFO(BlockPolicy):
    """Queues ``small``, ``main``, ``ghost`` (ordered dicts, oldest first), [P] ``queue_P`` and
    ``freq_P``; ``to_main`` holds the ghost hits waiting to be stored."""

    name = "s3fifo"
    leaf_only = False
    selects_victims = True

    def __init__(
        self,
        trace: MooncakeTrace,
        cost: CostModel,
        *,
        pool_blocks: int,
        small_frac: float = 0.1,
        move_to_main: int = 1,
    ):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        if not 0 < small_frac < 1 or move_to_main < 1:
            raise ValueError("s3fifo: small_frac must be in (0, 1) and move_to_main ≥ 1")
        c = self.capacity
        self.small_cap = max(1, int(small_frac * c)) if c else 0
        self.main_cap = c - self.small_cap
        self.ghost_cap = self.main_cap
        self.move_to_main = move_to_main
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.to_main: set[int] = set()
        self.queue_P = np.zeros(trace.n_blocks, np.int8)
        self.freq_P = np.zeros(trace.n_blocks, np.int8)

    def on_access(self, blocks, hit, i, now):
        live = self.queue_P[blocks] != _NONE
        res = blocks[live]
        self.freq_P[res] = np.minimum(self.freq_P[res] + 1, 3)
        for b in blocks[~live].tolist():
            if b in self.ghost:
                del self.ghost[b]
                self.to_main.add(b)

    def prio(self, b, i, j, now):
        return ()

    def victim(self, incoming):
        if len(self.main) > self.main_cap or not self.small:
            return self._evict_main()
        b = self._evict_small()
        return b if b is not None else self._evict_main()

    def _evict_small(self) -> int | None:
        while self.small:
            b = next(iter(self.small))
            if self.freq_P[b] < self.move_to_main:
                return b
            del self.small[b]
            self.main[b] = None
            self.queue_P[b], self.freq_P[b] = _MAIN, 0
        return None

    def _evict_main(self) -> int | None:
        while self.main:
            b = next(iter(self.main))
            if self.freq_P[b] == 0:
                return b
            self.main.move_to_end(b)
            self.freq_P[b] -= 1
        return None

    def on_evict(self, b):
        if self.queue_P[b] == _SMALL:
            del self.small[b]
            self.ghost[b] = None
            while len(self.ghost) > self.ghost_cap:
                self.ghost.popitem(last=False)
        else:
            del self.main[b]
        self.queue_P[b], self.freq_P[b] = _NONE, 0

    def on_insert(self, b):
        if b in self.to_main:
            self.to_main.discard(b)
            self.main[b] = None
            self.queue_P[b] = _MAIN
        else:
            self.small[b] = None
            self.queue_P[b] = _SMALL
        self.freq_P[b] = 0
