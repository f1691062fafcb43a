"""A Mooncake trace replayed through vLLM's own KV-offload manager, and the call-by-call
cross-check of jaxkv's block ``lru`` / ``arc`` against vLLM's.

Every policy, vLLM's (``lru``, ``arc``, by their registered names) and jaxkv's (``JaxkvLRU``,
``JaxkvARC``, ``KVLearnCachePolicy``, loaded by vLLM's factory from ``VLLM_POLICY_MODULE``), runs
inside the same real ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager``, which makes the
calls the offloading connector's scheduler side makes (vLLM 0.32's
``offloading/scheduler.py``, one KV group, one block per chunk, no GPU prefix cache in front):

    request i starts    on_new_request; lookup(key) head to tail until the first MISS (the hit
                        prefix); prepare_load(hit keys) (pins them: ref_cnt > 0)
    its load ends       complete_load(hit keys) (unpins), T(hit tokens) after the start
    request i finishes  prepare_store(the keys after the hit prefix): on_store_miss, then
                        evict(n, protected = the offered keys) when the pool lacks n free chunks
                        (None: the whole store is dropped), insert; complete_store (the chunks
                        become ready and evictable); on_request_finished (the policy's
                        request-scoped touch of every key stored or reused, head to tail)

Timing and costs are the serving simulator's (``serving.engine``): arrivals at the trace's
timestamps, ``prefill_nodes`` FCFS nodes, service T(c) + R(n) − R(c), TTFT = wait + service +
T(n), stores when the request finishes; ``metrics.summarize`` reports hit rate, bytes moved
(transfer GiB) and TTFT. A Mooncake hash id is one chunk, the last (partial) one included, as
in the simulator (vLLM itself offloads only full blocks).

``cross_check`` replays a trace with a vLLM policy and its jaxkv peer and compares every
``evict`` call: n, the number of protected keys, and the evicted keys in order (None for a
refusal). Imports vLLM when imported (``integrations`` explains why nothing else does).
"""

from __future__ import annotations

import dataclasses
import heapq
import time

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.integrations import JAXKV_POLICIES, VLLM_POLICY_MODULE
from jaxkv.kvlearn.serving.engine import ServingConfig, finish_record
from jaxkv.kvlearn.serving.metrics import summarize
from jaxkv.kvlearn.traces import MooncakeTrace

VLLM_POLICIES = ("lru", "arc")
"""vLLM's own cache policies, by their registered names."""
PEERS = {"lru": "JaxkvLRU", "arc": "JaxkvARC"}
"""Each vLLM policy and the jaxkv policy that must decide exactly as it does."""

_LOAD, _FINISH = 0, 1  # event kinds; a load that ends with a finish is handled first


@dataclasses.dataclass(frozen=True)
class EvictCall:
    """One ``evict(n, protected)`` call: what was asked and what came back."""

    n: int
    n_protected: int
    evicted: tuple[OffloadKey, ...] | None


def make_manager(policy, *, pool_blocks: int) -> CPUOffloadingManager:
    """vLLM's CPU offload manager over ``pool_blocks`` chunks with the cache policy ``policy``
    (one of ``VLLM_POLICIES`` or ``JAXKV_POLICIES``), resolved by vLLM's own factory. A
    ``CachePolicy`` subclass instead (a test's variant) replaces the policy the factory built
    (the manager holds it as ``_policy`` and nothing else refers to it)."""
    if isinstance(policy, type):
        mgr = CPUOffloadingManager(num_chunks=pool_blocks, cache_policy="lru")
        mgr._policy = policy(cache_capacity=pool_blocks)
        return mgr
    if policy not in VLLM_POLICIES + JAXKV_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {VLLM_POLICIES + JAXKV_POLICIES}")
    module = None if policy in VLLM_POLICIES else VLLM_POLICY_MODULE
    return CPUOffloadingManager(
        num_chunks=pool_blocks, cache_policy=policy, cache_policy_module_path=module
    )


def record_evictions(manager: CPUOffloadingManager, log: list[EvictCall]) -> None:
    """Wraps the manager's policy's ``evict`` so every call is appended to ``log``. (vLLM
    exposes the policy only as the manager's ``_policy``.)"""
    policy = manager._policy
    inner = policy.evict

    def evict(n, protected):
        out = inner(n, protected)
        keys = None if out is None else tuple(k for k, _ in out)
        log.append(EvictCall(n=n, n_protected=len(protected), evicted=keys))
        return out

    policy.evict = evict


def block_key(b: int) -> OffloadKey:
    """The offload key of the trace's dense block id ``b`` (KV group 0)."""
    return make_offload_key(int(b).to_bytes(8, "big"), 0)


@dataclasses.dataclass
class _Request:
    ctx: ReqContext
    keys: list[OffloadKey]
    hit: int


def replay(
    trace: MooncakeTrace,
    policy: str,
    *,
    cfg: ServingConfig,
    cost: CostModel,
    log: list[EvictCall] | None = None,
) -> dict[str, np.ndarray]:
    """Per-request records (``serving.engine.simulate``'s keys) of ``trace`` replayed through
    vLLM's manager with ``policy`` and a pool of ``cfg.pool_blocks`` chunks; with ``log``, every
    ``evict`` call is appended to it."""
    mgr = make_manager(policy, pool_blocks=cfg.pool_blocks)
    log = [] if log is None else log
    record_evictions(mgr, log)
    n = len(trace)
    rec = {k: np.zeros(n) for k in ("start_s", "wait_ms", "service_ms", "ttft_ms")}
    rec |= {k: np.zeros(n, np.int64) for k in ("hit_blocks", "hit_tokens", "admitted_tokens")}
    counts = {"admits": 0, "discards": 0, "failed_stores": 0}
    nodes = [0.0] * cfg.prefill_nodes
    events: list[tuple[float, int, int]] = []
    live: dict[int, _Request] = {}
    for i in range(n):
        start = max(float(trace.time_s[i]), nodes[0])
        while events and events[0][0] <= start:
            _handle(mgr, trace, live, heapq.heappop(events), rec, counts)
        req = _start(mgr, trace, i)
        live[i] = req
        tok = trace.block_tokens_of(i)
        c_tok, n_tok = int(tok[: req.hit].sum()), int(trace.input_len[i])
        fetch = float(cost.transfer_ms(cost.footprint_bytes(c_tok)))
        service = fetch + float(cost.recompute_ms(float(n_tok)) - cost.recompute_ms(float(c_tok)))
        finish = start + service / 1e3
        heapq.heapreplace(nodes, finish)
        if req.hit:
            heapq.heappush(events, (start + fetch / 1e3, _LOAD, i))
        heapq.heappush(events, (finish, _FINISH, i))
        rec["start_s"][i], rec["service_ms"][i] = start, service
        rec["wait_ms"][i] = (start - float(trace.time_s[i])) * 1e3
        rec["ttft_ms"][i] = (
            rec["wait_ms"][i] + service + float(cost.transfer_ms(cost.footprint_bytes(n_tok)))
        )
        rec["hit_blocks"][i], rec["hit_tokens"][i] = req.hit, c_tok
    while events:
        _handle(mgr, trace, live, heapq.heappop(events), rec, counts)
    rec = finish_record(rec, trace, cfg)
    evictions = sum(len(c.evicted) for c in log if c.evicted is not None)
    return rec | counts | {"evictions": evictions, "evict_calls": len(log)} | _guard_stats(mgr)


def _guard_stats(mgr: CPUOffloadingManager) -> dict:
    """A guard's diagnostics (``KVLearnGuardCachePolicy``): the scores (cumulative hit saving
    at the store, ms) of the real pool and of each shadow, leader changes, requests finished
    with the learner leading, chunks evicted as orphans; {} for another policy."""
    pol = mgr._policy
    if not hasattr(pol, "shadows"):
        return {}
    return {
        "guard": {
            "saved_real": pol.saved_real,
            "saved": {sh.name: sh.saved for sh in pol.shadows},
            "leader_changes": pol.leader_changes,
            "learner_requests": pol.learner_requests,
            "orphan_evictions": pol.orphan_evictions,
            "final_leader": pol.shadows[pol.leader].name,
        }
    }


def _start(mgr: CPUOffloadingManager, trace: MooncakeTrace, i: int) -> _Request:
    """Request i's lookups (head to tail until the first miss) and the load of its hits."""
    ctx = ReqContext(req_id=str(i))
    mgr.on_new_request(ctx)
    keys = [block_key(b) for b in trace.blocks[i].tolist()]
    for key, end in zip(keys, np.cumsum(trace.block_tokens_of(i)).tolist(), strict=True):
        ctx.set_offload_key_position(key, end)
    hit = 0
    for key in keys:
        if mgr.lookup(key, ctx) is not LookupResult.HIT:
            break  # a chunk still being written counts as a miss: no wait modelled
        hit += 1
    if hit:
        mgr.prepare_load(keys[:hit], ctx)
    return _Request(ctx=ctx, keys=keys, hit=hit)


def _handle(mgr, trace, live, event, rec, counts) -> None:
    """A load ends (unpin the hits) or a request finishes (store the rest, then finish)."""
    _, kind, i = event
    req = live[i]
    if kind == _LOAD:
        mgr.complete_load(req.keys[: req.hit], req.ctx)
        return
    del live[i]
    offered = req.keys[req.hit :]
    if offered:
        out = mgr.prepare_store(offered, req.ctx)
        if out is None:
            counts["failed_stores"] += 1
            counts["discards"] += len(offered)
        else:
            mgr.complete_store(out.keys_to_store, req.ctx)
            stored = set(out.keys_to_store)
            tok = trace.block_tokens_of(i)[req.hit :]
            counts["admits"] += len(stored)
            counts["discards"] += len(offered) - len(stored)
            rec["admitted_tokens"][i] = int(
                sum(t for k, t in zip(offered, tok, strict=True) if k in stored)
            )
    mgr.on_request_finished(req.ctx)


def hit_saving_ms(rec: dict[str, np.ndarray], *, cost: CostModel) -> np.ndarray:
    """[R] what each request's hits saved by the cost model, queueing aside: R(c) − T(c) for c
    hit tokens (the recompute the hits replace, less loading them), in ms."""
    c = rec["hit_tokens"].astype(np.float64)
    return np.asarray(cost.recompute_ms(c) - cost.transfer_ms(cost.footprint_bytes(c)))


def run(
    trace: MooncakeTrace,
    policies,
    *,
    cfg: ServingConfig,
    cost: CostModel,
) -> list[dict]:
    """One ``metrics.summarize`` row per policy (plus ``evict_calls``, ``failed_stores``,
    ``hit_saving_ms_mean`` (``hit_saving_ms``) and ``wall_s``) for ``trace`` replayed through
    vLLM's manager."""
    rows = []
    for name in policies:
        t0 = time.perf_counter()
        rec = replay(trace, name, cfg=cfg, cost=cost)
        row = summarize(getattr(name, "__name__", name), rec, cost=cost, cfg=cfg)
        row |= {k: int(rec[k]) for k in ("evict_calls", "failed_stores")}
        row |= {"guard": rec["guard"]} if "guard" in rec else {}
        row["hit_saving_ms_mean"] = float(hit_saving_ms(rec, cost=cost).mean())
        rows.append(row | {"wall_s": time.perf_counter() - t0})
    return rows


def cross_check(
    trace: MooncakeTrace,
    *,
    cfg: ServingConfig,
    cost: CostModel,
    pairs=None,
) -> list[dict]:
    """For each (vLLM policy, jaxkv policy) pair, replays ``trace`` with both and compares
    their ``evict`` calls one by one. A row: ``vllm``, ``jaxkv``, ``calls`` (the vLLM side's),
    ``jaxkv_calls``, ``matches`` (equal calls at equal index), ``first_mismatch`` (index or
    None; after it the two runs see different call sequences), ``evicted`` (chunks),
    ``refused`` (calls answered None). ``pairs`` defaults to ``PEERS``."""
    rows = []
    for ref, peer in tuple(PEERS.items()) if pairs is None else pairs:
        logs = {}
        for name in (ref, peer):
            logs[name] = []
            replay(trace, name, cfg=cfg, cost=cost, log=logs[name])
        a, b = logs[ref], logs[peer]
        same = [x == y for x, y in zip(a, b, strict=False)]  # lengths may differ
        first = next((k for k, ok in enumerate(same) if not ok), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append(
            {
                "vllm": ref,
                "jaxkv": getattr(peer, "__name__", peer),
                "calls": len(a),
                "jaxkv_calls": len(b),
                "matches": sum(same),
                "first_mismatch": first,
                "evicted": sum(len(c.evicted) for c in a if c.evicted is not None),
                "refused": sum(c.evicted is None for c in a),
            }
        )
    return rows
