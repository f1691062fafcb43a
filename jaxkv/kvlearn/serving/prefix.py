"""Block-granular prefix cache for Mooncake traces (plain Python, host side).

A Mooncake request names its prompt as ``hash_ids``: one id per 512-token block, chained, so an
id names a whole prefix. A request's cached prefix is the **longest run of leading blocks present
in the pool**; a block whose predecessor is missing is useless (attention needs every earlier
key) and is not a hit, even if it is resident.

``PrefixCache`` holds at most ``capacity`` blocks (one slot per block, whatever its length) and
evicts the lowest-priority eligible block. With ``leaf_only=True`` only leaves are eligible (a
block none of whose resident successors depend on it), and a block is admitted only under a
resident predecessor, so the resident set stays prefix-closed (a radix forest). With
``leaf_only=False`` (the block-keyed LRU-Pool) any block may be evicted, which can strand its
resident descendants.

Priorities are tuples compared lexicographically (lower = evicted first), computed by the
policy when a block is touched and kept in a lazy heap (stale entries are skipped by version).
A heap entry is the priority's items followed by (version, block), one flat tuple (it compares
like the nested ``(prio, version, block)`` when every priority has the same length, at about
half the cost of a heap operation); a cache given priorities of another length switches to
nested entries once, for good. Stale entries never become current again (versions only grow),
so the heap is rebuilt without them when they exceed half the resident blocks (``_compact``):
the same victims from a smaller heap. An inner block (resident children, ``leaf_only``) is
never a victim, so touching it pushes no entry: it is pushed when it becomes a leaf (the
entries it would have had are dropped unread or stale by then). For the same reason the entry
of a block just stored (``leaf_only``) is held back until the heap is next read
(``_peek_victim``) or another block is stored: a prefix stored block by block makes each of its
blocks but the last inner at once, and those never enter the heap. A hook's re-touch of the
stored block (``on_insert``) updates the held entry; the heap, when read, holds the same
current entries as if every touch had pushed.
A policy whose order is not one priority per block (ARC's lists, S3-FIFO's queues, W-TinyLFU's
window and admission duel) selects victims itself instead: ``bind(select_victim=...)`` replaces
the heap (no entries are pushed then), and the cache calls ``select_victim(incoming)`` each time
it needs room for ``incoming`` (a resident block to evict, or None to refuse ``incoming``) and
``on_insert(b)`` (bound for any policy) after a block becomes resident. Without a
``select_victim`` the heap decides, as it always has.
This is a plain-Python simulator, not jitted: the heap and the variable-length prefix walks do
not map onto a fixed-shape ``lax.scan`` without padding every request to its longest prefix.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

ROOT = -1
_COMPACT_SHIFT = 1  # compact the heap when its stale entries exceed 2^-shift of the live ones
_COMPACT_SLACK = 1024  # (plus this many)


class PrefixCache:
    """A capacity-bounded set of blocks with prefix structure and a lazy eviction heap.

    Args:
        capacity: blocks the pool holds (≥ 0).
        n_blocks: size of the dense block-id space (ids are ``0..n_blocks-1``).
        leaf_only: evict only leaves and admit only under a resident parent (prefix cache).
        on_evict: called with each evicted block, after its eviction (the block policy's hook).

    ``select_victim`` and ``on_insert`` are the policy's hooks (None until it ``bind``s them).

    Attributes (over block ids): ``resident`` ([P] bool array) and ``res_view`` (the same
    memory as a memoryview: Python bools, about twice as fast to read and write block by block
    as the array); ``parent`` (ROOT for a first block), ``n_children`` (resident children) and
    ``version`` (heap entries older than it are stale), [P] lists (read and written block by
    block); ``prio`` (block → priority of its newest heap entry), ``size`` (resident blocks)
    and ``evictions`` (so far).
    """

    def __init__(
        self,
        capacity: int,
        *,
        n_blocks: int,
        leaf_only: bool = True,
        on_evict: Callable[[int], None] | None = None,
    ):
        if capacity < 0:
            raise ValueError(f"capacity must be ≥ 0 blocks, got {capacity}")
        self.capacity = int(capacity)
        self.leaf_only = leaf_only
        self.resident = np.zeros(n_blocks, bool)
        self.res_view = memoryview(self.resident)
        self.parent = [ROOT] * n_blocks
        self.n_children = [0] * n_blocks  # resident children (leaf_only)
        self.version = [0] * n_blocks  # a list: bumped at every touch, read at every pop
        self.prio: dict[int, tuple] = {}
        self.size = 0
        self.evictions = 0
        self.on_evict = on_evict
        self.select_victim: Callable[[int], int | None] | None = None
        self.on_insert: Callable[[int], None] | None = None
        self._heap: list[tuple] = []
        self._prio_len: int | None = None  # of every priority so far (None: none yet; -1: mixed)
        self._held = ROOT  # the stored leaf whose entry is not pushed yet (``insert``)

    def bind(
        self,
        *,
        select_victim: Callable[[int], int | None] | None = None,
        on_insert: Callable[[int], None] | None = None,
    ) -> None:
        """Registers a policy's hooks (before the first insertion): ``select_victim(incoming)``
        chooses every victim (the priority heap is then unused), ``on_insert(b)`` hears of every
        block made resident."""
        if self.size:
            raise ValueError("bind the policy's hooks before the first insertion")
        self.select_victim = select_victim
        self.on_insert = on_insert

    # ---- queries --------------------------------------------------------------------------
    def match(self, blocks) -> int:
        """Length of the longest run of leading ``blocks`` that are resident."""
        n = 0
        res = self.res_view
        for b in blocks:
            if not res[b]:
                break
            n += 1
        return n

    def is_leaf(self, b: int) -> bool:
        return self.n_children[b] == 0

    # ---- updates --------------------------------------------------------------------------
    def touch(self, b: int, prio: tuple) -> None:
        """Sets a resident block's priority (an inner block's entry waits until it is a leaf:
        every path that makes it one, ``_evict`` and a refused ``insert``, re-touches it)."""
        ver = self.version[b] + 1
        self.version[b] = ver
        self.prio[b] = prio
        if self.select_victim is None and not self.n_children[b] and b != self._held:
            self._push(prio, ver, int(b))

    def _push(self, prio: tuple, ver: int, b: int) -> None:
        if len(prio) == self._prio_len:
            heapq.heappush(self._heap, (*prio, ver, b))
        else:
            self._push_odd(prio, ver, b)
        if len(self._heap) > self.size + (self.size >> _COMPACT_SHIFT) + _COMPACT_SLACK:
            self._compact()

    def _push_odd(self, prio: tuple, ver: int, b: int) -> None:
        """Pushes an entry whose priority is the first, or of a new length: from then on the
        heap holds nested ``(prio, version, block)`` entries (see the module docstring)."""
        h = self._heap
        if self._prio_len is None:
            self._prio_len = len(prio)
            heapq.heappush(h, (*prio, ver, b))
            return
        if self._prio_len != -1:  # a second length: nest what is there, once
            n = self._prio_len
            self._heap = h = [(e[:n], e[n], e[n + 1]) for e in h]
            heapq.heapify(h)
            self._prio_len = -1
        heapq.heappush(h, (prio, ver, b))

    def _compact(self) -> None:
        """Drops the stale entries (never current again) and re-heapifies: every pop that
        returns a block returns the same one, on a heap of the live entries only."""
        res, ver = self.res_view, self.version
        self._heap = h = [e for e in self._heap if res[e[-1]] and e[-2] == ver[e[-1]]]
        heapq.heapify(h)

    def insert(self, b: int, parent: int, prio: tuple, *, min_victim: tuple | None = None) -> bool:
        """Admits block ``b`` under ``parent`` (ROOT for a first block), evicting as needed.

        With ``min_victim`` set, refuses (without evicting) if the first victim's priority is
        not below ``min_victim`` (a bypass rule: never evict something worth more; heap order
        only). Returns whether ``b`` is resident afterwards.
        """
        if min_victim is not None and self.select_victim is not None:
            raise ValueError("min_victim needs the priority heap; this cache selects by hook")
        res = self.res_view
        if res[b]:
            self.touch(b, prio)
            return True
        if self.capacity == 0:
            return False
        has_parent = parent != ROOT and res[parent]
        pin = self.leaf_only and has_parent
        if self.leaf_only and parent != ROOT and not has_parent:
            return False
        kids = self.n_children
        if pin:
            kids[parent] += 1  # pins the parent while making room
        while self.size >= self.capacity:
            victim = self._peek_victim() if self.select_victim is None else self._next_victim(b)
            if victim is None or (min_victim is not None and self.prio[victim] >= min_victim):
                if pin:
                    kids[parent] -= 1
                    if kids[parent] == 0:
                        self.touch(parent, self.prio[parent])  # its heap entry may be gone
                return False
            self._evict(victim)
        res[b] = True
        self.parent[b] = int(parent) if has_parent else ROOT
        kids[b] = 0
        self.size += 1
        if pin and parent == self._held:
            self._held = ROOT  # an inner block now: its entry would never be read
        ver = self.version[b] + 1  # ``touch``, without the push:
        self.version[b] = ver
        self.prio[b] = prio
        hook = self.on_insert
        if self.leaf_only and self.select_victim is None:
            if self._held != ROOT:
                self._flush_held()
            self._held = int(b)  # b's entry waits: a prefix's next block makes b inner at once
            if hook is not None:
                hook(b)  # (a re-touch of b keeps it held)
            return True
        if hook is not None:
            hook(b)
        if self.select_victim is None and self.version[b] == ver:  # not re-touched by the hook
            self._push(prio, ver, int(b))
        return True

    def _flush_held(self) -> None:
        """Pushes the held block's entry (its current priority and version) if it is a leaf."""
        b, self._held = self._held, ROOT
        if self.res_view[b] and not self.n_children[b]:
            self._push(self.prio[b], self.version[b], b)

    def peek_victim_prio(self) -> tuple | None:
        """Priority of the block that would be evicted next (None if none is eligible)."""
        if self.select_victim is not None:
            raise ValueError("a cache that selects victims by hook has no victim priority")
        v = self._peek_victim()
        return None if v is None else self.prio[v]

    def _next_victim(self, incoming: int) -> int | None:
        if self.select_victim is None:
            return self._peek_victim()
        v = self.select_victim(incoming)
        if v is not None and not (
            self.res_view[v] and (not self.leaf_only or self.n_children[v] == 0)
        ):
            raise RuntimeError(f"select_victim returned block {v}, which is not evictable")
        return v

    def _peek_victim(self) -> int | None:
        held = self._held
        if held != ROOT and not self.n_children[held]:  # (a pinned parent stays held)
            self._flush_held()
        h, res, ver, kids = self._heap, self.res_view, self.version, self.n_children
        while h:
            e = h[0]
            b = e[-1]
            if res[b] and e[-2] == ver[b]:
                if not self.leaf_only or kids[b] == 0:
                    return b
                # an inner node: dropped now, re-pushed when its last child leaves
            heapq.heappop(h)
        return None

    def _evict(self, b: int) -> None:
        if self.select_victim is None:
            heapq.heappop(self._heap)  # b is the heap's top (``_peek_victim``)
        res = self.res_view
        res[b] = False
        self.version[b] += 1
        self.size -= 1
        self.evictions += 1
        p = self.parent[b]
        if self.leaf_only and p != ROOT and res[p]:
            kids = self.n_children
            kids[p] -= 1
            if kids[p] == 0:
                self.touch(p, self.prio[p])  # became a leaf: eligible again
        if self.on_evict is not None:
            self.on_evict(b)
