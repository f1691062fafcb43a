"""``wtinylfu``: W-TinyLFU (Einziger, Friedman & Manes, ACM ToS 2017; Caffeine's eviction) over
blocks as independent keys (like ``lru``).

Segments (each least recently used first): a window LRU (1 % of the pool's blocks, at least one)
and a main SLRU of the rest, probation and protected (80 % of main). A count-min sketch
(``FrequencySketch``) estimates how often each block was accessed recently.

* **Access** (``on_access``, every block of a request, deepest first): the sketch counts it; in
  the window → MRU; in probation → protected's MRU (protected's LRU blocks beyond its share
  are demoted to probation's MRU); in protected → MRU.
* **Store** (``on_insert``): into the window's MRU end. While the pool has room, a block pushed
  out of the window enters probation's MRU end.
* **Evict** (``victim``, when the pool is full): the window's LRU block is the candidate and
  main's victim is probation's LRU block (protected's if probation is empty); the candidate
  enters probation iff the sketch estimates it strictly more frequent than the victim, which is
  then evicted; otherwise the candidate is evicted.

Not modelled from Caffeine: the hill-climbing window size (fixed at 1 % here), the doorkeeper
(Caffeine has none either) and the random admission of a warm candidate that guards against
hash flooding.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.serving.policies.slru import touch_segments
from jaxkv.kvlearn.traces import MooncakeTrace

SKETCH_SEEDS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
"""Odd 32-bit multipliers of the sketch's four rows (multiplicative hashing)."""
SKETCH_MAX = 15
"""Counters are 4 bits, as Caffeine's."""


def sketch_width(n: int) -> int:
    """Counters per row: the next power of two ≥ max(n, 16)."""
    return 1 << max(4, (max(n, 1) - 1).bit_length())


def sketch_index(key: int, row: int, width: int) -> int:
    """Row ``row``'s counter for ``key``: the top log2(width) bits of (key + 1)·seed mod 2^32."""
    bits = width.bit_length() - 1
    return (((key + 1) * SKETCH_SEEDS[row]) & 0xFFFFFFFF) >> (32 - bits)


class FrequencySketch:
    """A count-min sketch of 4 rows × ``width`` 4-bit counters with periodic aging.

    ``increment`` adds one to the key's counter in every row (saturating at 15); once
    ``sample_size`` increments have changed some counter, every counter is halved (integer
    shift) and so is the count of increments (Caffeine's reset, without its correction for odd
    counters). ``estimate`` is the smallest of the key's four counters.
    """

    def __init__(self, *, width: int, sample_size: int):
        if width < 16 or width & (width - 1):
            raise ValueError(f"sketch width must be a power of two ≥ 16, got {width}")
        self.width = width
        self.sample_size = max(1, sample_size)
        self.rows = [bytearray(width) for _ in SKETCH_SEEDS]
        self.additions = 0

    def increment(self, key: int) -> None:
        added = False
        for r, row in enumerate(self.rows):
            j = sketch_index(key, r, self.width)
            if row[j] < SKETCH_MAX:
                row[j] += 1
                added = True
        if added:
            self.additions += 1
            if self.additions >= self.sample_size:
                self.rows = [bytearray(v >> 1 for v in row) for row in self.rows]
                self.additions //= 2

    def estimate(self, key: int) -> int:
        return min(row[sketch_index(key, r, self.width)] for r, row in enumerate(self.rows))


class WTinyLFU(BlockPolicy):
    """Segments ``window``, ``probation``, ``protected`` (ordered dicts, LRU first) and the
    ``sketch`` (sample size 10 × the pool's blocks, as Caffeine)."""

    name = "wtinylfu"
    leaf_only = False
    selects_victims = True

    def __init__(
        self,
        trace: MooncakeTrace,
        cost: CostModel,
        *,
        pool_blocks: int,
        window_frac: float = 0.01,
        protected_frac: float = 0.8,
    ):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        if not 0 < window_frac < 1 or not 0 <= protected_frac < 1:
            raise ValueError("wtinylfu: window_frac must be in (0, 1), protected_frac in [0, 1)")
        c = self.capacity
        self.main_cap = int((1 - window_frac) * c)
        self.window_cap = c - self.main_cap
        self.protected_cap = int(protected_frac * self.main_cap)
        self.window: OrderedDict[int, None] = OrderedDict()
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.sketch = FrequencySketch(width=sketch_width(c), sample_size=10 * c)

    def on_access(self, blocks, hit, i, now):
        for b in reversed(blocks.tolist()):
            self.sketch.increment(b)
            if b in self.window:
                self.window.move_to_end(b)
            else:
                touch_segments(self.probation, self.protected, b, protected_cap=self.protected_cap)

    def prio(self, b, i, j, now):
        return ()

    def victim(self, incoming):
        cand = next(iter(self.window), None)
        main_victim = next(iter(self.probation), next(iter(self.protected), None))
        if cand is None:
            return main_victim
        del self.window[cand]
        if main_victim is not None and (
            self.sketch.estimate(cand) > self.sketch.estimate(main_victim)
        ):
            self.probation[cand] = None
            return main_victim
        return cand

    def on_evict(self, b):
        for seg in (self.probation, self.protected):
            if b in seg:
                del seg[b]
                return

    def on_insert(self, b):
        self.window[b] = None
        if len(self.window) > self.window_cap:
            self.probation[self.window.popitem(last=False)[0]] = None
