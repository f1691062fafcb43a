"""``arc``: Adaptive Replacement Cache with the semantics of vLLM 0.32's KV-offload ARC
(``vllm/v1/kv_offload/cpu/policies/arc.py``, ``ARCCachePolicy``), over blocks as independent
keys (like ``lru``).

Lists (each least recently used first): T1 (blocks stored and not touched since), T2 (touched
again), ghosts B1, B2 (evicted from T1, T2; ids only). p is the adaptive target size of T1, a
float.

* **Touch** (``on_access``): every block of a request, deepest first (so a prefix's first block
  ends up most recent): in T1 → moved to T2's MRU end; in T2 → MRU; in B1 → p += max(1,
  |B2| / |B1|) (true division), at most the capacity c, and the id moves to B1's MRU end; in B2
  → p −= max(1, |B1| / |B2|), at least 0, and the id moves to B2's MRU end.
* **Store** (a request's computed blocks, one batch): vLLM evicts as many blocks as the batch
  needs, then stores the whole batch into T1 (in prefix order) and removes it from B1/B2. Each
  eviction takes T1's LRU block if |T1| ≥ int(p) (and T1 is not empty), else T2's, else (T2
  empty) T1's; it joins B1 or B2 at the MRU end, and each ghost list keeps its c most recent
  ids.
* **Finish**: when the request finishes, the blocks it stored move to the MRU end of the list
  they are in, deepest first, so the prefix's first stored block ends up most recent.

The engine offers a batch one block at a time (``gate``, ``victim``, ``on_insert``), so the batch
is reconstructed: at request i's first offered block the batch is fixed as its remaining blocks
not resident then (a block evicted by the batch's own evictions is not stored again, as in
vLLM); while it is being stored, its blocks already in T1 are neither counted in |T1| nor
eligible as victims, and the finish (the reordering, then the removal from the ghost lists)
waits until the batch ends (the next request's blocks or the next touch). This gives vLLM's
victims and ghost lists exactly, except when vLLM runs out of victims for a batch (T1 without
the batch and T2 both empty; e.g. a batch larger than the pool): vLLM then stores none of the
batch (keeping the evictions made so far), here the batch's first blocks stay stored, one per
slot that was free or freed.

Where vLLM differs from the paper (Megiddo & Modha, FAST'03), vLLM is followed: a ghost hit
adapts p when the request arrives, but the block is stored into T1 (not T2); the eviction test
is |T1| ≥ int(p), without the paper's "x ∈ B2 and |T1| = p" case; each ghost list is capped at
c on its own (not |T1| + |B1| ≤ c and |L1| + |L2| ≤ 2c); a stored block is reordered when its
request finishes; and all of a request's blocks are touched, hits or not.
"""

from __future__ import annotations

from collections import OrderedDict

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.serving.prefix import PrefixCache
from jaxkv.kvlearn.traces import MooncakeTrace


class ARC(BlockPolicy):
    """Lists ``t1``, ``t2``, ``b1``, ``b2`` (ordered dicts, LRU first), the target ``p`` and the
    batch being stored (``to_store``: its blocks; ``batch``: those stored so far, at T1's MRU
    end; ``batch_req``: its request)."""

    name = "arc"
    leaf_only = False
    selects_victims = True

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0.0
        self.blocks = trace.blocks
        self.to_store: set[int] = set()
        self.batch: list[int] = []
        self.batch_req = -1
        self.cache: PrefixCache | None = None

    def attach(self, cache):
        super().attach(cache)
        self.cache = cache

    def on_access(self, blocks, hit, i, now):
        self._end_batch()
        c = self.capacity
        for b in reversed(blocks.tolist()):
            if b in self.t1:
                del self.t1[b]
                self.t2[b] = None
            elif b in self.t2:
                self.t2.move_to_end(b)
            elif b in self.b1:
                self.p = min(self.p + max(1, len(self.b2) / len(self.b1)), c)
                self.b1.move_to_end(b)
            elif b in self.b2:
                self.p = max(self.p - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.move_to_end(b)

    def prio(self, b, i, j, now):
        return ()

    def gate(self, b, i, j, now):
        if i != self.batch_req:
            self._end_batch()
            self.batch_req = i
            rest = self.blocks[i][j:].tolist()
            self.to_store = {x for x in rest if not self.cache.resident[x]}
        return b in self.to_store, None

    def victim(self, incoming):
        n_old = len(self.t1) - len(self.batch)  # T1 without the batch (its MRU end)
        if n_old > 0 and (n_old >= int(self.p) or not self.t2):
            return next(iter(self.t1))
        return next(iter(self.t2), None)

    def on_evict(self, b):
        if b in self.t1:
            del self.t1[b]
            ghost = self.b1
        else:
            del self.t2[b]
            ghost = self.b2
        ghost[b] = None
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)

    def on_insert(self, b):
        self.t1[b] = None
        self.batch.append(b)

    def _end_batch(self) -> None:
        """The batch's request finishes: its stored blocks move to their list's MRU end, deepest
        first (vLLM's ``on_request_finished`` for keys it only inserted), and leave the ghosts."""
        for b in reversed(self.batch):
            for lst in (self.t1, self.t2):
                if b in lst:
                    lst.move_to_end(b)
                    break
            self.b1.pop(b, None)
            self.b2.pop(b, None)
        self.batch.clear()
