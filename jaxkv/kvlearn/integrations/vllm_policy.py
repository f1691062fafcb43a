"""jaxkv's block policies as vLLM KV-offload cache policies (vLLM's ``CachePolicy`` ABC).

vLLM's CPU offload tier (``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``) keeps KV
chunks in a host pool and asks a pluggable ``CachePolicy`` which chunks to evict. The classes
here are such policies; vLLM loads them by name and module path, with no change to vLLM::

    kv_transfer_config = {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 8 << 30,
            "eviction_policy": "KVLearnGuardCachePolicy",  # or any class below
            "cache_policy_module_path": "jaxkv.kvlearn.integrations.vllm_policy",
        },
    }

    JaxkvLRU            jaxkv's block ``lru`` (``serving.policies.lru.LRUPool``): every use gets
                        the policy's next priority, the lowest is evicted.
    JaxkvARC            jaxkv's block ``arc`` (``serving.policies.arc.ARC``): its ``on_access``,
                        ``victim``, ``on_evict`` and ``on_insert`` decide; the adapter only
                        steps over chunks vLLM may not evict (pinned or protected).
    JaxkvCostAware      the protocol's ``cost_aware`` and ``gdsf`` in vLLM's flat key space
    JaxkvGDSF           (values from the chunk's depth and uses, a head priced at least as its
                        tail: see the classes).
    KVLearnCachePolicy  KVLearn at block level (``serving.policies.kvlearn.BlockKVLearn``, the
                        very object the serving simulator runs): the core's PRP MLP on 16 block
                        features, GreedyDual CARS retention (L + P̂·s_j); by default the
                        protocol's ``gd`` setting (``PROTOCOL_SETTING``: no write-cost
                        admission; with it, as an eviction order, see the class).
    KVLearnGuardCachePolicy
                        KVLearn's vLLM policy: the learner (``KVLearnCachePolicy``) and the
                        baselines (lru, arc, cost_aware, gdsf) each in a shadow pool of the same
                        capacity fed vLLM's calls; the real pool is the best baseline's (call
                        for call while it holds what that shadow holds) and follows the learner
                        only while the learner's shadow saves strictly more (issue 15's guard);
                        a change of leader needs a lead above 0.1 % (design, setting and its
                        rule in the class docstring).

What vLLM asks of a policy (its ``CachePolicy`` docstrings) and how these keep it: ``touch``
receives keys head to tail and the head ends most recent (vLLM's ``lru`` and ``arc`` both walk
``reversed(keys)``); ``evict(n, protected)`` evicts exactly n chunks whose ``ref_cnt`` is 0 and
that are not in ``protected``, or returns None and changes nothing; ``clear`` resets every chunk
and all adaptive state; ``mark_evictable`` / ``mark_non_evictable`` follow ``ref_cnt``.

Host-side fast path: the per-call work is dictionary and heap operations in Python on the
scheduler's thread (no device round trip); KVLearn's PRP forward pass runs in numpy once per
request (``predictors.HostPRP``), and only its training rounds touch JAX:
``predictors.DeferredPRP`` holds the labels on the host and pushes them in the one jitted call
that runs a round (one per 100 labels, not one per request; the same decisions).

vLLM is imported when this module is imported (its ``CachePolicy`` is the base class here).
Nothing in jaxkv imports this module (``tests/test_vllm_policy.py`` checks that no jaxkv module
outside ``jaxkv/kvlearn/integrations/`` names vLLM), so jaxkv never needs vLLM.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
from collections.abc import Iterable, Sequence

import numpy as np
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.arc import ARC
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.serving.policies.kvlearn import BlockKVLearn, BlockKVLearnState, DepthCosts
from jaxkv.kvlearn.serving.policies.lru import LRUPool
from jaxkv.kvlearn.serving.predictors import DeferredPRP, HostPRP
from jaxkv.kvlearn.traces import BLOCK_TOKENS, MooncakeTrace

_Entry = tuple  # (*priority, stamp, key): one heap entry, flat (cheaper to compare than a
# nested priority tuple; a policy's priorities all have one length, so the order is the same)
_NO_BLOCKS = np.zeros(0, np.int64)

PROTOCOL_SETTING = {"retention": "gd", "write_cost": False}
"""KVLearn's hyper-parameters (``BlockKVLearnConfig`` fields) that every fold of issue 15's
leave-one-workload-out protocol chose (``gd``: GreedyDual retention on P̂·s_j, no write-cost
admission; ``scripts/bench_kvlearn_serving.py --protocol``). ``KVLearnCachePolicy``'s default:
vLLM writes every offered chunk anyway, so the write cost could only reorder evictions."""


def key_depths(
    keys: Sequence[OffloadKey], req_context: ReqContext, *, block_tokens: int
) -> list[int]:
    """Each key's depth j in its request (chunk index, 0 = the head) from vLLM's key positions
    (end tokens, ``block_tokens`` per chunk); a key without a position gets its index."""
    out = []
    for idx, key in enumerate(keys):
        end = req_context.get_offload_key_position(key)
        out.append(idx if end is None else max(math.ceil(end / block_tokens) - 1, 0))
    return out


def shape_trace(*, n_blocks: int, max_depth: int, block_tokens: int) -> MooncakeTrace:
    """A one-request placeholder ``MooncakeTrace`` that only carries the shapes a block policy
    is built for (``n_blocks`` block ids, requests of up to ``max_depth`` blocks); vLLM gives a
    policy no trace, and ``BlockPolicy`` constructors read only these from it."""
    return MooncakeTrace(
        time_s=np.zeros(1),
        input_len=np.array([max_depth * block_tokens], np.int64),
        output_len=np.zeros(1, np.int64),
        blocks=(np.arange(max_depth, dtype=np.int64),),
        n_blocks=n_blocks,
        block_tokens=block_tokens,
    )


class _HeapCachePolicy(CachePolicy):
    """A vLLM ``CachePolicy`` over priorities: evict the lowest priority among the evictable,
    unprotected chunks (a lazy min-heap, stale entries skipped). Subclasses say what priority a
    chunk gets when it is inserted (``_insert_prio``) and when a request uses it (``_use``,
    with ``_set``).

    Attributes: ``chunks`` (key → ``ChunkStatus``), ``evictions`` (chunks evicted so far) and
    ``capacity`` (vLLM's ``cache_capacity``; the two are what a jaxkv policy reads of its pool).
    """

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.evictions = 0
        self._entry: dict[OffloadKey, _Entry] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[_Entry] = []
        self._stamp = 0

    @property
    def capacity(self) -> int:
        return self.cache_capacity

    # ---- what subclasses decide -------------------------------------------------------------
    def _insert_prio(self, key: OffloadKey) -> tuple:
        raise NotImplementedError

    def _use(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """Re-prioritises the resident ``keys`` (head to tail) one request used; the head ends
        most recent, as in vLLM's lru and arc."""
        raise NotImplementedError

    def _on_evict(self, key: OffloadKey, prio: tuple) -> None:
        """Called after ``key`` (of priority ``prio``) is evicted, in eviction order."""

    def _reset(self) -> None:
        """Resets the subclass's own state (``clear``)."""

    # ---- the heap ---------------------------------------------------------------------------
    def _set(self, key: OffloadKey, prio: tuple) -> None:
        self._stamp += 1
        entry = (*prio, self._stamp, key)
        self._entry[key] = entry
        if key in self._evictable:
            heapq.heappush(self._heap, entry)
            if len(self._heap) > 64 and len(self._heap) > 2 * len(self._evictable):
                self._maybe_compact()

    def _maybe_compact(self) -> None:
        if len(self._heap) > max(64, 2 * len(self._evictable)):
            self._heap = [self._entry[k] for k in self._evictable]
            heapq.heapify(self._heap)

    def priority(self, key: OffloadKey) -> tuple | None:
        """The priority ``key`` holds now (lower is evicted first; None if not resident)."""
        entry = self._entry.get(key)
        return None if entry is None else entry[:-2]

    # ---- vLLM's CachePolicy -----------------------------------------------------------------
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self.chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
        self._set(key, self._insert_prio(key))

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._entry.pop(key, None)
        self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._use(list(keys), req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        # Every key the request stored or reused is one use, in one head-to-tail order (vLLM's
        # lru does the same; its base class would touch group by group).
        self._use(order_request_keys(key_groups, req_context), req_context)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        chosen: list[_Entry] = []
        deferred: list[_Entry] = []
        seen: set[OffloadKey] = set()
        while self._heap and len(chosen) < n:
            entry = heapq.heappop(self._heap)
            key = entry[-1]
            if key in seen or key not in self._evictable or self._entry.get(key) is not entry:
                continue  # stale, or a duplicate left by a re-pin without a new priority
            seen.add(key)
            (deferred if key in protected else chosen).append(entry)
        for entry in deferred if len(chosen) == n else deferred + chosen:
            heapq.heappush(self._heap, entry)
        if len(chosen) < n:
            return None  # atomic: every popped live entry is back, nothing else changed
        out = []
        for entry in chosen:
            key = entry[-1]
            self._evictable.remove(key)
            del self._entry[key]
            out.append((key, self.chunks.pop(key)))
            self.evictions += 1
            self._on_evict(key, entry[:-2])
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self._entry.clear()
        self._evictable.clear()
        self._heap.clear()
        self._stamp = 0
        self.evictions = 0
        self._reset()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        entry = self._entry.get(key)
        if entry is not None:
            heapq.heappush(self._heap, entry)
            self._maybe_compact()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)


class _BlockPolicyCache(_HeapCachePolicy):
    """A heap policy whose priorities come from a jaxkv ``BlockPolicy`` (``prio(b, i, j, now)``):
    keys get dense block ids in first-seen order, ``i`` counts finished requests and ``j`` is
    the key's depth (its end-token position from the request context, else its index)."""

    block_tokens: int = BLOCK_TOKENS
    """Tokens per offloaded chunk: converts vLLM's key positions into depths."""

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.ids: dict[OffloadKey, int] = {}
        self.n_req = 0
        self._depth: dict[OffloadKey, int] = {}  # of keys seen in a store miss, until used
        self.block_policy: BlockPolicy = self._make_block_policy()

    def _make_block_policy(self) -> BlockPolicy:
        raise NotImplementedError

    def _reset(self) -> None:
        self.ids.clear()
        self._depth.clear()
        self.n_req = 0
        self.block_policy = self._make_block_policy()

    def _id(self, key: OffloadKey) -> int:
        b = self.ids.get(key)
        if b is None:
            b = self.ids[key] = len(self.ids)
        return b

    def _depths(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> list[int]:
        return key_depths(keys, req_context, block_tokens=self.block_tokens)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        self._depth.update(zip(keys, self._depths(keys, req_context), strict=True))

    def _insert_prio(self, key: OffloadKey) -> tuple:
        j = self._depth.get(key, 0)
        return tuple(self.block_policy.prio(self._id(key), self.n_req, j, 0.0))

    def _use(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        depths = self._depths(keys, req_context)
        for key, j in zip(reversed(keys), reversed(depths), strict=True):
            if key in self.chunks:
                self._set(key, tuple(self.block_policy.prio(self._id(key), self.n_req, j, 0.0)))

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        self._finish(key_groups)

    def _finish(self, key_groups) -> None:
        for keys in key_groups:
            for key in keys:
                self._depth.pop(key, None)
        self.n_req += 1

    def _on_evict(self, key: OffloadKey, prio: tuple) -> None:
        self.block_policy.on_evict(self.ids[key])


class JaxkvLRU(_BlockPolicyCache):
    """jaxkv's block ``lru`` (``LRUPool``, blocks as independent keys) as a vLLM policy: each
    insert and each use takes the policy's next clock value; the oldest is evicted."""

    def _make_block_policy(self) -> BlockPolicy:
        shape = shape_trace(n_blocks=0, max_depth=1, block_tokens=self.block_tokens)
        return LRUPool(shape, CostModel.llama3_8b_a100(), pool_blocks=self.cache_capacity)


class KVLearnCachePolicy(_BlockPolicyCache):
    """KVLearn at block level (``BlockKVLearn``, the serving simulator's ``kvlearn`` object) as
    a vLLM policy.

    What it keeps of KVLearn's decisions: per finished request, ``BlockKVLearn.on_access``
    with the request's keys head to tail and its hit count (the leading keys it reused) —
    label windows, the adaptive horizon, features, the PRP's training and P̂; then the
    GreedyDual CARS priority L + P̂·s_j of every resident key of the request (``prio``), the
    admission rule of the keys the request stored (``gate``: with ``write_cost``, the default
    ``PROTOCOL_SETTING`` has none), and L raised to each victim's priority (``on_evict``).

    What differs from the simulator: (1) vLLM's manager writes every offered chunk (a policy
    cannot refuse an ``insert``), so (with ``write_cost``) a chunk KVLearn would not admit is
    kept in a lower tier that is evicted before every admitted chunk (the bytes are moved all
    the same); (2) vLLM's
    pool has no prefix tree, so a key's priority is raised to the largest of the keys behind it
    in its request (``_price``: the simulator evicts only leaves); (3) the per-request step runs
    when the request finishes, after its stores, where the simulator runs it at lookup; until
    then a stored chunk holds L + s_j (P̂ = 1, KVLearn's untrained rule); (4) a key's depth
    comes from vLLM's key positions (``block_tokens`` per chunk).

    Configuration (vLLM builds a policy from ``cache_capacity`` alone): the class attributes
    ``cost_preset``, ``block_tokens``, ``max_depth``, ``hparams`` (``BlockKVLearnConfig``
    fields; ``PROTOCOL_SETTING`` unless a subclass says otherwise), or the environment
    variables ``JAXKV_KVLEARN_COST`` and ``JAXKV_KVLEARN_BLOCK_TOKENS``; a subclass in the
    user's module changes the rest.
    """

    cost_preset: str = "llama3-8b-a100"
    max_depth: int = 1 << 14
    """Deepest block priced (``s_j``); deeper keys are priced as this depth, and a request
    longer than this many blocks is seen by the PRP as its first ``max_depth`` blocks."""
    hparams: dict = PROTOCOL_SETTING
    """``BlockKVLearnConfig`` fields (copied at construction)."""
    initial_ids: int = 1 << 12
    """Block ids the state is first sized for; it doubles when they run out."""
    defer_labels: bool = True
    """Push the PRP's labels once per training round (``predictors.DeferredPRP``, as the
    simulator does; same decisions); False: one push per request (``HostPRP``)."""

    def __init__(self, cache_capacity: int):
        self.block_tokens = int(os.environ.get("JAXKV_KVLEARN_BLOCK_TOKENS", self.block_tokens))
        self.cost = CostModel.preset(os.environ.get("JAXKV_KVLEARN_COST", self.cost_preset))
        super().__init__(cache_capacity)

    def _make_block_policy(self) -> BlockKVLearn:
        shape = shape_trace(
            n_blocks=self.initial_ids, max_depth=self.max_depth, block_tokens=self.block_tokens
        )
        pol = BlockKVLearn(shape, self.cost, pool_blocks=self.cache_capacity, **self.hparams)
        if not self.defer_labels and isinstance(pol.pred, DeferredPRP):
            pol.pred = HostPRP(seed=pol.cfg.seed)
        pol.attach(self)  # reads ``capacity`` and ``evictions``, as of its PrefixCache
        return pol

    def _id(self, key: OffloadKey) -> int:
        b = super()._id(key)
        st = self.block_policy.state
        if b >= len(st.count_P):
            _grow(st, 2 * len(st.count_P))
        return b

    def _insert_prio(self, key: OffloadKey) -> tuple:
        j = min(self._depth.get(key, 0), self.max_depth)
        b = self._id(key)  # first: it may grow the state's arrays
        st = self.block_policy.state
        v = st.prio_P[b] = st.inflation + float(self.block_policy.costs.save_ms[j])
        return (1, v)

    def _use(self, keys, req_context) -> None:
        """A bare ``touch`` (vLLM 0.32's connector sends none; requests end in
        ``on_request_finished``): the keys are re-priced with their current P̂, as hits."""
        pol = self.block_policy
        ids = np.fromiter((self._id(k) for k in keys), np.int64, len(keys))
        depths = (min(j, self.max_depth) for j in self._depths(keys, req_context))
        prios = [
            (1, *pol.prio(b, self.n_req, j, 0.0)) for b, j in zip(ids.tolist(), depths, strict=True)
        ]
        self._price(keys, ids, prios)

    def _on_evict(self, key: OffloadKey, prio: tuple) -> None:
        if prio[0]:  # a chunk KVLearn did not admit leaves no trace (L, turnover), as there
            self.block_policy.on_evict(self.ids[key])

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        keys = order_request_keys(key_groups, req_context)[: self.max_depth]
        if keys:
            self._access(keys, insertion_only_keys, reused_keys, req_context)
        self._finish(key_groups)

    def _access(self, keys, inserted, reused, req_context) -> None:
        pol, i = self.block_policy, self.n_req
        ids = np.fromiter((self._id(k) for k in keys), np.int64, len(keys))
        hit = next((n for n, k in enumerate(keys) if k not in reused), len(keys))
        pol.on_access(ids, hit, i, 0.0)
        prios = []
        for key, b, j in zip(keys, ids.tolist(), self._depths(keys, req_context), strict=True):
            j = min(j, self.max_depth)
            if key in inserted:
                admit, pr = pol.gate(b, i, j, 0.0)
                prios.append((int(admit), *pr))
            else:
                prios.append((1, *pol.prio(b, i, j, 0.0)))
        self._price(keys, ids, prios)

    def _price(self, keys, ids, prios) -> None:
        """Sets the resident keys' priorities, each raised to the largest of the keys behind it
        (tail to head). The simulator's KVLearn evicts only leaves of the prefix tree; vLLM's
        pool has no tree, so a block must not go before the deeper blocks that need it (its
        GreedyDual value P̂·s_j grows with depth, and would strand them)."""
        st, run = self.block_policy.state, None
        for key, b, prio in zip(reversed(keys), ids[::-1].tolist(), reversed(prios), strict=True):
            run = prio if run is None or prio > run else run
            if key in self.chunks:
                st.prio_P[b] = run[1]  # what L rises to if it is evicted
                self._set(key, run)


class JaxkvARC(CachePolicy):
    """jaxkv's block ``arc`` (``ARC``, the serving simulator's object) as a vLLM policy.

    vLLM's calls map onto ``ARC``'s hooks as the serving simulator makes them: ``insert`` →
    ``on_insert`` (into T1, out of the ghosts when the store batch closes: at the next access
    or eviction); ``on_store_miss`` (the request's new keys,
    before they are inserted) → ``on_access`` of those keys (they are not resident, so only a
    ghost hit adapts p, as the simulator's lookup does for missed blocks);
    ``on_request_finished`` / ``touch`` → ``on_access`` of the keys the request reused (T1 →
    T2, T2 → MRU); ``evict`` → ``victim`` then ``on_evict`` per chunk. Where ``victim`` names a
    chunk vLLM may not evict (ref_cnt ≠ 0 or protected), the adapter takes the next evictable
    chunk of the list ``ARC``'s rule picks (T1 if |T1| ≥ int(p), else T2; then the other list), as
    vLLM's ``arc`` does. ``evict`` first checks that n evictable, unprotected chunks exist, so a
    refusal changes nothing.
    """

    block_tokens: int = BLOCK_TOKENS

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.ids: dict[OffloadKey, int] = {}
        self.keys: list[OffloadKey] = []
        self.n_req = 0
        self.evictions = 0
        self._evictable: set[OffloadKey] = set()
        self.arc = self._make_arc()

    def _make_arc(self) -> ARC:
        shape = shape_trace(n_blocks=0, max_depth=1, block_tokens=self.block_tokens)
        return ARC(shape, CostModel.llama3_8b_a100(), pool_blocks=self.cache_capacity)

    def _id(self, key: OffloadKey) -> int:
        b = self.ids.get(key)
        if b is None:
            b = self.ids[key] = len(self.keys)
            self.keys.append(key)
        return b

    def _access(self, keys: Sequence[OffloadKey]) -> None:
        if keys:
            ids = np.fromiter((self._id(k) for k in keys), np.int64, len(keys))
            self.arc.on_access(ids, len(keys), self.n_req, 0.0)

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self.chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
        self.arc.on_insert(self._id(key))

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._evictable.discard(key)
        b = self.ids[key]
        self.arc.t1.pop(b, None)  # a failed store: ``ARC`` has no hook, its lists are public
        self.arc.t2.pop(b, None)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._access(list(keys))

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._access(list(keys))

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        keys = order_request_keys(key_groups, req_context)
        # Only resident keys: the simulator touches hits at lookup, when they are resident, so a
        # reused key evicted since (by another request's store) must not count as a ghost hit.
        self._access([k for k in keys if k in reused_keys and k in self.chunks])
        self.n_req += 1

    def _usable(self, b: int | None, protected: set[OffloadKey]) -> bool:
        return b is not None and self.keys[b] in self._evictable and self.keys[b] not in protected

    def _fallback(self, named: int | None, protected: set[OffloadKey]) -> int:
        """The oldest usable chunk of the list ``ARC``'s victim ``named`` came from, else of the
        other list (``named`` None: ``ARC`` chose T2, which is empty)."""
        arc = self.arc
        first, second = (
            (arc.t1, arc.t2) if named is not None and named in arc.t1 else (arc.t2, arc.t1)
        )
        for lst in (first, second):
            b = next((b for b in lst if self._usable(b, protected)), None)
            if b is not None:
                return b
        raise AssertionError("no evictable chunk although the count said there was one")

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        blocked = sum(1 for k in protected if k in self._evictable)
        if len(self._evictable) - blocked < n:
            return None
        # vLLM evicts for a whole store before inserting any of it: close ``ARC``'s store
        # batch (an empty access does only that), so T1 and the ghosts are counted in full.
        self.arc.on_access(_NO_BLOCKS, 0, self.n_req, 0.0)
        out = []
        for _ in range(n):
            b = self.arc.victim(None)
            if not self._usable(b, protected):
                b = self._fallback(b, protected)
            self.arc.on_evict(b)
            key = self.keys[b]
            self._evictable.remove(key)
            out.append((key, self.chunks.pop(key)))
        self.evictions += n
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self.ids.clear()
        self.keys.clear()
        self._evictable.clear()
        self.n_req = 0
        self.evictions = 0
        self.arc = self._make_arc()

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)


# ---- flat forms of the protocol's cost-aware baselines ----------------------------------------
class _FlatValueCache(_HeapCachePolicy):
    """A heap policy whose priority is a value per chunk computed from the chunk's depth
    (``key_depths``) and its history, re-priced at every request that uses it, then raised to
    the largest value of the keys behind it in the request (``_price``, as
    ``KVLearnCachePolicy`` does): the flat pool's stand-in for the simulator's leaf-only
    eviction, so a head never goes before the deeper chunks that need it. Subclasses say what
    a stored (``_stored``), a reused (``_reused``) and, at its request's finish, a just-stored
    (``_inserted``) chunk is worth."""

    block_tokens: int = BLOCK_TOKENS
    cost_preset: str = "llama3-8b-a100"
    max_depth: int = 1 << 14

    def __init__(self, cache_capacity: int):
        self.block_tokens = int(os.environ.get("JAXKV_KVLEARN_BLOCK_TOKENS", self.block_tokens))
        self.cost = CostModel.preset(os.environ.get("JAXKV_KVLEARN_COST", self.cost_preset))
        shape = shape_trace(n_blocks=0, max_depth=self.max_depth, block_tokens=self.block_tokens)
        self.save_ms = DepthCosts.of(shape, self.cost, write_cost=False).save_ms  # s_j
        super().__init__(cache_capacity)
        self.n_req = 0
        self._depth: dict[OffloadKey, int] = {}  # of keys seen in a store miss, until used
        self._reset_values()

    def _reset_values(self) -> None:
        raise NotImplementedError

    def _stored(self, key: OffloadKey, j: int) -> float:
        raise NotImplementedError

    def _reused(self, key: OffloadKey, j: int) -> float:
        raise NotImplementedError

    def _inserted(self, key: OffloadKey, j: int) -> float:
        return self._stored(key, j)

    def _finished(self, keys: list) -> None:
        self.n_req += 1

    def _reset(self) -> None:
        self.n_req = 0
        self._depth.clear()
        self._reset_values()

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        depths = key_depths(keys, req_context, block_tokens=self.block_tokens)
        self._depth.update((k, min(j, self.max_depth)) for k, j in zip(keys, depths, strict=True))

    def _insert_prio(self, key: OffloadKey) -> tuple:
        return (self._stored(key, self._depth.get(key, 0)),)

    def _use(self, keys, req_context) -> None:
        """A bare ``touch``: every resident key is one reuse."""
        self._price(keys, req_context, ())

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        keys = order_request_keys(key_groups, req_context)
        self._price(keys, req_context, insertion_only_keys)
        for key in keys:
            self._depth.pop(key, None)
        self._finished(keys)

    def _price(self, keys, req_context, inserted) -> None:
        depths = key_depths(keys, req_context, block_tokens=self.block_tokens)
        run = None
        for key, j in zip(reversed(keys), reversed(depths), strict=True):
            if key not in self.chunks:
                continue
            j = min(j, self.max_depth)
            v = self._inserted(key, j) if key in inserted else self._reused(key, j)
            run = v if run is None or v > run else run
            self._set(key, (run,))


class JaxkvGDSF(_FlatValueCache):
    """The protocol's ``gdsf`` (GreedyDual-Size-Frequency, ``serving.policies.gdsf``) in vLLM's
    flat key space: H = L + F·s_j, F the chunk's uses since it was stored (the store counts 1),
    s_j its saving at depth j (``DepthCosts.save_ms``), L the priority of the last victim (never
    decreasing); a chunk stored by a request is priced again when the request finishes (L may
    have risen while room was made, as the simulator's ``on_insert`` does)."""

    def _reset_values(self) -> None:
        self.freq: dict[OffloadKey, int] = {}
        self.inflation = 0.0

    def _stored(self, key, j):
        self.freq[key] = 1
        return self.inflation + float(self.save_ms[j])

    def _reused(self, key, j):
        f = self.freq[key] = self.freq.get(key, 0) + 1
        return self.inflation + f * float(self.save_ms[j])

    def _on_evict(self, key, prio):
        self.freq.pop(key, None)
        self.inflation = max(self.inflation, prio[0])


class JaxkvCostAware(_FlatValueCache):
    """The protocol's ``cost_aware`` (``serving.policies.cost_aware``) in vLLM's flat key
    space: value log s_j + log Σ_k exp(n_k/τ) over the chunk's uses n_k (finished-request
    indices; kept across evictions), τ the pool's turnover, capacity / mean chunks per finished
    request so far (the simulator takes the trace's mean, which a vLLM policy never sees)."""

    def _reset_values(self) -> None:
        self.log_mass: dict[OffloadKey, float] = {}
        self.n_keys = 0

    def _tau(self) -> float:
        per_req = self.n_keys / self.n_req if self.n_req else 1.0
        return max(1.0, self.cache_capacity / max(per_req, 1.0))

    def _stored(self, key, j):
        return self._reused(key, j)

    def _reused(self, key, j):
        m = _log_add_exp(self.log_mass.get(key, -math.inf), self.n_req / self._tau())
        self.log_mass[key] = m
        return math.log(max(float(self.save_ms[j]), 1e-12)) + m

    def _inserted(self, key, j):  # its use was counted at its insert
        return math.log(max(float(self.save_ms[j]), 1e-12)) + self.log_mass[key]

    def _finished(self, keys):
        self.n_keys += len(keys)
        super()._finished(keys)


def _log_add_exp(a: float, x: float) -> float:
    """log(e^a + e^x) for a possibly −inf."""
    if a == -math.inf:
        return x
    m = max(a, x)
    return m + math.log(math.exp(a - m) + math.exp(x - m))


# ---- the guard ----------------------------------------------------------------------------------
GUARD_BASELINES = ("lru", "arc", "cost_aware", "gdsf")
"""The guard's classical baselines, in tie-break order (see ``KVLearnGuardCachePolicy``)."""


def guard_leader(
    scores: Sequence[float],
    incumbent: int,
    *,
    slack: float = 0.0,
    hysteresis: float = 0.0,
    floor: float = 0.0,
) -> int:
    """The guard's leader after a request: ``scores`` are the shadows' cumulative hit savings,
    the baselines' in tie-break order (``scores[0]``: the anchor, ``lru``) then the learner's
    (last); ``incumbent`` is the leader until now (an index into ``scores``).

    The candidate is the learner if its score is strictly above (1 + ``slack``) × every
    baseline's, else the best baseline (ties: the first). With ``hysteresis`` h = 0 that is the
    new leader. With h > 0 the incumbent keeps the lead unless the candidate's score is above
    (1 + h) × the incumbent's (a lead worth a change of contents), or the incumbent has fallen
    below the anchor, which then leads (backing off to lru is never delayed). ``floor`` (same
    units as the scores, ≥ 0) is an absolute lower bound on that margin: the candidate's score
    must also be above the incumbent's + ``floor``."""
    b = len(scores) - 1
    best = max(range(b), key=lambda k: (scores[k], -k))
    cand = b if scores[b] > (1.0 + slack) * scores[best] else best
    if hysteresis == 0.0 and floor == 0.0:
        return cand
    inc = scores[incumbent]
    bar = (1.0 + hysteresis) * inc  # the shipped comparison, bit for bit, when floor is 0
    if scores[cand] > (max(bar, inc + floor) if floor > 0.0 else bar):
        return cand
    return 0 if inc < scores[0] else incumbent


def guard_floor(units: float, anchor_score: float, requests: int) -> float:
    """The guard's absolute margin (ms): ``units`` × the anchor's (``lru``'s shadow's) mean hit
    saving per request over the ``requests`` finished so far (0 before any, or when lru has
    saved nothing yet)."""
    return units * max(anchor_score, 0.0) / requests if requests > 0 else 0.0


class _Shadow:
    """One policy in a pool of its own of the same capacity, driven as vLLM's
    ``CPUOffloadingManager`` drives a policy, at the moments the guard's real pool is driven
    (``KVLearnGuardCachePolicy`` says which). ``saved``: its cumulative hit saving (ms)."""

    def __init__(self, name: str, policy: CachePolicy, on_evict):
        self.name = name
        self.policy = policy
        self.used = 0
        self.saved = 0.0
        self.pending: dict[OffloadKey, ChunkStatus] = {}  # stored, not yet ready
        self.pinned: set[OffloadKey] = set()  # pinned because the real pool's chunk is
        self.inserted: dict[str, set[OffloadKey]] = {}  # request → keys it stored here
        self.evicted: dict[str, set[OffloadKey]] = {}  # request → keys its stores evicted
        self._on_evict = on_evict

    def holds(self, key: OffloadKey) -> bool:
        return self.policy.get(key) is not None

    def store(self, keys: list, protected: set, req_context: ReqContext) -> None:
        """The manager's ``prepare_store`` of ``keys`` (those it lacks, head to tail): the store
        miss, the pre-check, ``evict`` of what the pool lacks (protected: ``protected``), the
        inserts (not ready until ``ready``). A refused store stores nothing."""
        pol, rid = self.policy, req_context.req_id
        keys = [k for k in keys if pol.get(k) is None]
        if not keys:
            return
        pol.on_store_miss(keys, req_context)
        n = len(keys) - (pol.cache_capacity - self.used)
        if n > 0:
            if n > len(pol._evictable):
                return
            out = pol.evict(n, protected)
            if out is None:
                return
            self.used -= n
            gone = self.evicted.setdefault(rid, set())
            for key, _ in out:
                gone.add(key)
                self._on_evict(self, key)
        mine = self.inserted.setdefault(rid, set())
        for key in keys:
            chunk = ChunkStatus(0)  # ref_cnt −1: being written
            pol.insert(key, chunk)
            self.pending[key] = chunk
            mine.add(key)
        self.used += len(keys)

    def ready(self, key: OffloadKey) -> None:
        chunk = self.pending.pop(key)
        chunk.ref_cnt = 0
        self.policy.mark_evictable(key)

    def pin(self, key: OffloadKey) -> None:
        chunk = self.policy.get(key)
        if chunk is not None and chunk.ref_cnt == 0:
            chunk.ref_cnt = 1
            self.policy.mark_non_evictable(key)
            self.pinned.add(key)

    def unpin_or_ready(self, key: OffloadKey) -> None:
        if key in self.pinned:
            self.pinned.remove(key)
            self.policy.get(key).ref_cnt = 0
            self.policy.mark_evictable(key)
        elif key in self.pending:
            self.ready(key)

    def remove(self, key: OffloadKey) -> None:
        if key in self.pending:  # a failed store: the manager removes the written chunk
            del self.pending[key]
            self.policy.remove(key)
            self.used -= 1


class KVLearnGuardCachePolicy(_HeapCachePolicy):
    """KVLearn guarded by vLLM's own policies (issue 15's ``guard`` in vLLM's flat key space).

    Shadows: each baseline of ``baselines`` (``GUARD_BASELINES``: vLLM's ``lru`` and ``arc``,
    as ``JaxkvLRU`` / ``JaxkvARC``, which decide as vLLM's do on every evict call, and the
    protocol's cost-aware ``cost_aware`` and ``gdsf`` in flat form, ``JaxkvCostAware`` /
    ``JaxkvGDSF``) and the learner (``KVLearnCachePolicy``, ``PROTOCOL_SETTING``) each run in a
    pool of their own of the real pool's capacity (``_Shadow``), fed what vLLM's manager would
    feed that policy alone:

    * store: the chunks the real pool stores, when it stores them (inside the real ``evict``,
      before the real pool chooses its victims, or at the store's first ``insert`` when it
      needs no eviction), less those the shadow holds; the shadow's own pre-check, ``evict``
      (protected: the real call's protected keys and the store's keys) and inserts. At the
      request's ``on_request_finished``: also the request's keys the shadow lacks and the real
      pool holds (a shadow that missed where the real pool hit); a store vLLM refused only
      reaches the shadows as its store miss.
    * readiness and pins: a shadow's chunk is written (ready) when the real pool's is, else
      when its request finishes; it is pinned while the real pool's chunk of the same key is
      (``mark_non_evictable`` / ``mark_evictable``).
    * the request: ``on_request_finished`` with the real call's key groups, insertion-only =
      the keys the shadow stored for the request, reused = the others.

    Score: each pool's cumulative hit saving, R(c) − T(c) per request (c: the end token of the
    request's leading chunks that the pool held when the request stored, i.e. before its
    store, counting chunks its own store evicted), the replay's "hit saving". vLLM tells a
    policy nothing at lookup (the connector sends no ``touch``), so hits are scored at the
    store, the same way for every pool, the real one included (``saved_real``).

    The real pool: an LRU order (vLLM's ``lru`` exactly, ``_HeapCachePolicy``) and, per shadow,
    its *orphans*: the real pool's chunks the shadow does not hold, in the order the shadow let
    them go (its eviction, or the real pool's storing a chunk it lacks). ``evict(n)`` takes the
    leader's orphans first, then the LRU order. The leader (updated when a request finishes,
    ``guard_leader``): the candidate is the learner while its shadow's score is strictly above
    every baseline's (× (1 + ``slack``), slack 0), else the baseline with the highest score
    (ties: ``baselines`` order, so ``lru`` until another is ahead); the candidate takes the lead
    only when its score is above (1 + ``hysteresis``) × the incumbent's (0.1 %), and ``lru``
    takes it back at once when the incumbent's score falls below ``lru``'s. Why the margin: a
    change of leader costs hits (the real pool takes on the new shadow's contents, and a loss it
    then shares with that shadow cannot be won back), so a lead of one request's hits, noise,
    must not move it (the two losses to ``lru`` of the rule without it,
    ``results/kvlearn/vllm_guard_rule_s10.md``). While the real pool holds what the leader's
    shadow holds, the only orphans at a store are the chunks the shadow has just evicted for
    that same store, so the real pool evicts exactly them: it *is* that policy's pool, call for
    call (tested against vLLM's ``lru`` and ``arc``: ``force_leader``). After a change of
    leader it evicts first what the new leader's shadow does not hold, until the two agree.

    Not exact (vLLM's interface gives a policy no request at lookup): a shadow that disagrees
    with the real pool is told of a request's keys only as the real pool stores them, so its
    hits are scored at the store and a miss the real pool did not have is stored when the
    request finishes; its pins are the real pool's. None of this touches a shadow that holds
    what the real pool holds.

    Setting (fixed before any replay of this class; ``results/kvlearn/vllm_replay.md``):
    issue 15's protocol chose ``guard:moon+ca+gdsf,0%`` in every fold (baselines ``mooncake``,
    ``cost_aware``, ``gdsf``; slack 0; learner ``gd`` without the write cost); in vLLM's flat
    pool ``mooncake`` (LRU over the prefix tree's leaves) is vLLM's ``lru``, and vLLM ships
    ``arc`` too, so the baselines are ``lru``, ``arc``, ``cost_aware``, ``gdsf``, slack 0,
    the learner ``KVLearnCachePolicy`` with ``PROTOCOL_SETTING``. One change from issue 15's
    rule, made so that a cell where a baseline leads throughout is that baseline's exactly:
    the learner is scored in a shadow of its own and followed only while strictly ahead;
    issue 15's real pool started with the learner and compared its own saving. Session 10
    added the hysteresis (0.1 %), chosen among {none, baselines lru + arc only, 0.1 %, 0.5 %}
    by a rule committed before any candidate ran (``vllm_guard_rule_s10.md``) on issue 15's
    cells and seeds 7 and 8, which are therefore design data for it; seeds 10 and 11 were
    replayed once afterwards.

    Configuration: the class attributes ``baselines``, ``slack``, ``hysteresis``,
    ``learner_hparams`` and the
    environment variables of ``KVLearnCachePolicy`` (``JAXKV_KVLEARN_COST``,
    ``JAXKV_KVLEARN_BLOCK_TOKENS``); ``force_leader`` (a baseline name or ``"kvlearn"``) pins
    the leader (tests). Diagnostics: ``saved_real``, each shadow's ``saved``,
    ``leader_changes``, ``learner_requests`` (requests finished with the learner leading),
    ``orphan_evictions``.
    """

    baselines: tuple[str, ...] = GUARD_BASELINES
    slack: float = 0.0
    hysteresis: float = 0.001
    floor: float = 0.0
    min_requests: int = 0
    learner_hparams: dict = PROTOCOL_SETTING
    force_leader: str | None = None
    block_tokens: int = BLOCK_TOKENS
    cost_preset: str = "llama3-8b-a100"

    def __init__(self, cache_capacity: int):
        self.block_tokens = int(os.environ.get("JAXKV_KVLEARN_BLOCK_TOKENS", self.block_tokens))
        self.cost = CostModel.preset(os.environ.get("JAXKV_KVLEARN_COST", self.cost_preset))
        bad = [b for b in self.baselines if b not in GUARD_BASELINES]
        if not self.baselines or bad or len(set(self.baselines)) != len(self.baselines):
            raise ValueError(f"baselines must be distinct names from {GUARD_BASELINES}")
        names = (*self.baselines, "kvlearn")
        if self.force_leader is not None and self.force_leader not in names:
            raise ValueError(f"force_leader must be one of {names}, got {self.force_leader!r}")
        super().__init__(cache_capacity)
        self._new_shadows()

    def _make(self, name: str) -> CachePolicy:
        if name == "kvlearn":
            hp = self.learner_hparams
            learner = type("GuardLearner", (KVLearnCachePolicy,), {"hparams": hp})
            return learner(self.cache_capacity)
        cls = {"lru": JaxkvLRU, "arc": JaxkvARC, "cost_aware": JaxkvCostAware}.get(name, JaxkvGDSF)
        return cls(self.cache_capacity)

    def _new_shadows(self) -> None:
        names = (*self.baselines, "kvlearn")
        self.shadows = [_Shadow(n, self._make(n), self._shadow_evicted) for n in names]
        self._index = {sh: k for k, sh in enumerate(self.shadows)}
        self._orphans: list[list[tuple[int, OffloadKey]]] = [[] for _ in names]
        self._seq = 0
        self.leader = names.index(self.force_leader) if self.force_leader else 0
        self.saved_real = 0.0
        self.leader_changes = 0
        self.requests = 0
        self.learner_requests = 0
        self.orphan_evictions = 0
        self._store_ctx: ReqContext | None = None  # a store miss not yet shown to the shadows
        self._store_req: str | None = None  # the request whose store is in progress
        self._store_new: list[OffloadKey] = []
        self._triggered: set[str] = set()  # requests whose store reached the shadows
        self._missed: dict[str, list[OffloadKey]] = {}  # request → its store-miss keys
        self._real_evicted: dict[str, set[OffloadKey]] = {}

    def _reset(self) -> None:
        self._new_shadows()

    # ---- the real pool's LRU order (vLLM's lru) ---------------------------------------------
    def _insert_prio(self, key: OffloadKey) -> tuple:
        self._seq += 1
        return (self._seq,)

    def _use(self, keys, req_context) -> None:
        for key in reversed(keys):
            if key in self.chunks:
                self._seq += 1
                self._set(key, (self._seq,))

    # ---- orphans ----------------------------------------------------------------------------
    def _push_orphan(self, k: int, key: OffloadKey) -> None:
        self._seq += 1
        heap = self._orphans[k]
        heapq.heappush(heap, (self._seq, key))
        if len(heap) > 2 * len(self.chunks) + 64:
            sh = self.shadows[k]
            heap[:] = [e for e in heap if e[1] in self.chunks and not sh.holds(e[1])]
            heapq.heapify(heap)

    def _shadow_evicted(self, sh: _Shadow, key: OffloadKey) -> None:
        if key in self.chunks:
            self._push_orphan(self._index[sh], key)

    # ---- what vLLM calls --------------------------------------------------------------------
    def on_store_miss(self, keys, req_context) -> None:
        self._store_ctx, self._store_new = req_context, list(keys)
        self._store_req = req_context.req_id
        self._missed.setdefault(req_context.req_id, []).extend(self._store_new)

    def _trigger(self, protected: set[OffloadKey]) -> None:
        """The store in progress reaches the shadows (once per store miss)."""
        ctx = self._store_ctx
        if ctx is None:
            return
        self._store_ctx = None
        self._triggered.add(ctx.req_id)
        new = set(self._store_new)
        keys = self._store_new + [k for k in protected if k not in new]
        pos = {k: ctx.get_offload_key_position(k) for k in keys}
        keys.sort(key=lambda k: (pos[k] is None, pos[k] or 0))
        guard = set(protected) | new
        for sh in self.shadows:
            sh.store(keys, guard, ctx)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self._trigger(set())
        super().insert(key, chunk)
        for k, sh in enumerate(self.shadows):
            if not sh.holds(key):
                self._push_orphan(k, key)

    def remove(self, key: OffloadKey) -> None:
        super().remove(key)
        for sh in self.shadows:
            sh.remove(key)

    def touch(self, keys, req_context) -> None:
        keys = list(keys)
        super().touch(keys, req_context)
        for sh in self.shadows:
            sh.policy.touch(keys, req_context)

    def mark_evictable(self, key: OffloadKey) -> None:
        super().mark_evictable(key)
        for sh in self.shadows:
            sh.unpin_or_ready(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        super().mark_non_evictable(key)
        for sh in self.shadows:
            sh.pin(key)

    def evict(self, n, protected):
        if n == 0:
            return []
        blocked = sum(1 for k in protected if k in self._evictable)
        if len(self._evictable) - blocked < n:
            return None  # atomic: nothing has changed, the shadows included
        self._trigger(protected)
        chosen = self._take_orphans(n, protected)
        self.orphan_evictions += len(chosen)
        seen, deferred = set(chosen), []
        while len(chosen) < n:  # the count above guarantees enough evictable chunks
            entry = heapq.heappop(self._heap)
            key = entry[-1]
            if key in seen or key not in self._evictable or self._entry.get(key) is not entry:
                continue
            seen.add(key)
            if key in protected:
                deferred.append(entry)
            else:
                chosen.append(key)
        for entry in deferred:
            heapq.heappush(self._heap, entry)
        gone = self._real_evicted.setdefault(self._store_req, set()) if self._store_req else None
        out = []
        for key in chosen:
            self._evictable.remove(key)
            del self._entry[key]
            out.append((key, self.chunks.pop(key)))
            if gone is not None:
                gone.add(key)
        self.evictions += n
        return out

    def _take_orphans(self, n: int, protected: set[OffloadKey]) -> list[OffloadKey]:
        """Up to n evictable, unprotected chunks the leader's shadow does not hold, first
        orphaned first."""
        heap, sh = self._orphans[self.leader], self.shadows[self.leader]
        chosen: list[OffloadKey] = []
        seen: set[OffloadKey] = set()
        deferred = []
        while heap and len(chosen) < n:
            entry = heapq.heappop(heap)
            key = entry[1]
            if key in seen or key not in self.chunks or sh.holds(key):
                continue  # stale: evicted since, or the shadow holds it again
            seen.add(key)
            if key not in self._evictable or key in protected:
                deferred.append(entry)
            else:
                chosen.append(key)
        for entry in deferred:
            heapq.heappush(heap, entry)
        return chosen

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        keys = order_request_keys(key_groups, req_context)
        rid = req_context.req_id
        if self._store_ctx is not None and self._store_ctx.req_id == rid:
            self._store_ctx = None  # a store vLLM refused before it reached evict or insert
        if self._store_req == rid:
            self._store_req = None
        triggered = rid in self._triggered
        self._triggered.discard(rid)
        missed = self._missed.pop(rid, [])
        gone = self._real_evicted.pop(rid, set())
        self.saved_real += self._hit_saving(
            keys,
            req_context,
            lambda k: (k in self.chunks and k not in insertion_only_keys) or k in gone,
        )
        for sh in self.shadows:
            self._finish_shadow(sh, key_groups, keys, missed, triggered, req_context)
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        self._choose_leader()

    def _finish_shadow(self, sh, key_groups, keys, missed, triggered, req_context) -> None:
        rid = req_context.req_id
        late = [k for k in keys if k in self.chunks and not sh.holds(k)]
        if late:  # the shadow missed where the real pool hit (or stored): store them now
            sh.store(late, set(keys), req_context)
        if not triggered:
            refused = [k for k in missed if k not in self.chunks and not sh.holds(k)]
            if refused:  # vLLM refused the store: its policy saw only the store miss
                sh.policy.on_store_miss(refused, req_context)
        mine = sh.inserted.pop(rid, set())
        evicted = sh.evicted.pop(rid, set())
        for key in mine:
            if key in sh.pending:
                sh.ready(key)
        sh.saved += self._hit_saving(
            keys, req_context, lambda k: (sh.holds(k) and k not in mine) or k in evicted
        )
        reused = {k for k in keys if k not in mine}
        sh.policy.on_request_finished(key_groups, mine, reused, req_context)

    def _hit_saving(self, keys, req_context, held) -> float:
        """R(c) − T(c) (ms) for c the end token of the leading ``keys`` that ``held``."""
        h = 0
        for key in keys:
            if not held(key):
                break
            h += 1
        if not h:
            return 0.0
        end = req_context.get_offload_key_position(keys[h - 1])
        c = float(h * self.block_tokens if end is None else end)
        cost = self.cost
        return float(cost.recompute_ms(c) - cost.transfer_ms(cost.footprint_bytes(c)))

    def _choose_leader(self) -> None:
        b = len(self.baselines)
        self.requests += 1
        scores = [sh.saved for sh in self.shadows]
        if self.force_leader is not None:
            new = self.leader
        elif self.requests < self.min_requests:
            new = 0
        else:
            new = guard_leader(
                scores,
                self.leader,
                slack=self.slack,
                hysteresis=self.hysteresis,
                floor=guard_floor(self.floor, scores[0], self.requests),
            )
        self.leader_changes += new != self.leader
        self.leader = new
        self.learner_requests += new == b

    def clear(self) -> None:
        super().clear()  # ``_reset``: new shadows, scores, orphans and leader


class KVLearnGuardFloorCachePolicy(KVLearnGuardCachePolicy):
    """Session 11's candidate for short traces (``results/kvlearn/vllm_guard_rule_s11.md``):
    the guard over vLLM's ``lru`` and ``arc`` alone, whose candidate must lead the incumbent by
    more than max(0.1 % of the incumbent's score, 20 × ``lru``'s mean hit saving per request
    so far) (``guard_floor``) to take the lead; backing off to ``lru`` is still immediate.

    Why: on short MM-Session traces (about 300 requests) the shipped guard followed leads of 1
    to 10 requests' hits (0.5–6 s of cumulative saving, 2 % of it early on, above the 0.1 %
    margin) and paid a change of contents at each of 17 changes (seed 111, 25 % pool: the real
    pool 22.9 s below lru's shadow at the end, while the shadow it followed last led lru by
    1.0 s). Chosen among 14 settings on seeds 100–111 (design data, the rule file has every
    result). Held out, run once (``results/kvlearn/vllm_guard_short_s11.md``,
    ``vllm_replay_seed12.md``): never below lru on short seeds 200–211 but below arc in 2 of 24
    cells; on full-size seed 12 below lru in 1 of 12 (chat 10 %, −0.084 ms per request), where
    the shipped guard is below lru in another (MM-Session 25 %, −1.948). Not the default."""

    baselines = ("lru", "arc")
    floor = 20.0


def _grow(st: BlockKVLearnState, n: int) -> None:
    """Grows a ``BlockKVLearnState``'s [P] arrays to ``n`` block ids in place (new ids start
    empty; the (parent, child) pairs are re-encoded for the new P)."""
    p = len(st.count_P)
    fresh = BlockKVLearnState.empty(n - p, horizon=st.horizon)
    for f in dataclasses.fields(st):
        v = getattr(st, f.name)
        if isinstance(v, np.ndarray) and v.shape[:1] == (p,):
            setattr(st, f.name, np.concatenate([v, getattr(fresh, f.name)]))
    st.seen_child = {k // p * n + k % p for k in st.seen_child}
