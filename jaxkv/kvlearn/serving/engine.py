"""The serving simulator's engine: a discrete-event replay of a Mooncake trace through FCFS
prefill nodes, a block-level prefix cache (``prefix.PrefixCache``) and decode slots.

Requests (``MooncakeTrace``) arrive at their trace timestamps (divided by ``load_scale``) and are
served FCFS by ``prefill_nodes`` identical prefill nodes fed from one central queue (M/G/c: a
request starts on the first node to free up, in arrival order). For request i with n input
tokens, c of them in its cached prefix (``prefix.PrefixCache``, looked up when it *starts*):

    service_i = T(c) + R(n) − R(c)          fetch the cached KV from the pool, then prefill the
                                            suffix over the cached context (R is the envelope
                                            of ``cost.CostModel``; R(n) − R(c) is the suffix's
                                            share of the full prefill: its linear work plus its
                                            attention over the prefix)
    TTFT_i    = wait_i + service_i + T(n)   wait in the queue, prefill, ship all n tokens' KV to
                                            the decode node (decode queueing: ``decode_queue``)

The suffix's blocks are offered to the pool when the request *finishes*, so a request that
starts while an earlier one with the same prefix is still computing recomputes it (as a real
engine would). Transfer volume counts pool → prefill (c tokens), prefill → decode (n tokens)
and prefill → pool (admitted blocks). The pool holds ``pool_blocks`` blocks (one slot per block;
capacity from GiB is ⌊bytes / |512-token block|⌋). Which blocks it keeps is the block policy's
choice (``policies``); ``metrics`` summarises a run, ``rate`` searches the sustainable rate.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from jaxkv.kvlearn.cost import GIB, CostModel
from jaxkv.kvlearn.serving import policies as policies_lib
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.serving.prefix import ROOT, PrefixCache
from jaxkv.kvlearn.traces import BLOCK_TOKENS, MooncakeTrace, Progress

_PROGRESS_EVERY = 256  # requests between calls of a ``progress`` callback


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Deployment: prefill nodes, pool size in blocks, TTFT SLO; decode nodes of
    ``decode_slots`` concurrent sequences each, ``tpot_ms`` per generated token (an assumed
    LLaMA-3-8B/A100 batched decode step)."""

    pool_blocks: int
    prefill_nodes: int = 1
    slo_ms: float = 30_000.0
    decode_nodes: int = 8
    decode_slots: int = 32
    tpot_ms: float = 25.0

    def __post_init__(self):
        if self.pool_blocks < 0:
            raise ValueError(f"pool_blocks must be ≥ 0, got {self.pool_blocks}")
        if self.prefill_nodes <= 0:
            raise ValueError(f"prefill_nodes must be positive, got {self.prefill_nodes}")
        if not self.slo_ms > 0:
            raise ValueError(f"slo_ms must be positive, got {self.slo_ms}")
        if self.decode_nodes <= 0 or self.decode_slots <= 0 or not self.tpot_ms >= 0:
            raise ValueError("decode_nodes, decode_slots must be positive and tpot_ms ≥ 0")


def pool_blocks_for(pool_gib: float, cost: CostModel, block_tokens: int = BLOCK_TOKENS) -> int:
    """Blocks of ``block_tokens`` tokens that fit in ``pool_gib`` GiB."""
    return int(pool_gib * GIB // cost.footprint_bytes(block_tokens))


def simulate(
    trace: MooncakeTrace,
    policy: str,
    *,
    cfg: ServingConfig,
    cost: CostModel,
    progress: Progress | None = None,
    **policy_kw,
) -> dict[str, np.ndarray]:
    """Per-request records of one run of the block policy ``policy`` (``policies.BLOCK_POLICIES``,
    built with ``policy_kw``): arrival_s, start_s, wait_ms, service_ms, ttft_ms, hit_blocks,
    n_blocks, hit_tokens, input_tokens, admitted_tokens, decode_wait_ms, done_s, e2e_ms, plus
    scalars admits, evictions, discards (computed blocks not admitted). ``progress``
    (optional) is told the number of requests replayed, every few hundred."""
    pol = policies_lib.make_policy(policy, trace, cost, pool_blocks=cfg.pool_blocks, **policy_kw)
    cap = pol.capacity
    hears = type(pol).on_evict is not BlockPolicy.on_evict  # the default does nothing
    cache = PrefixCache(
        cap,
        n_blocks=trace.n_blocks,
        leaf_only=pol.leaf_only,
        on_evict=pol.on_evict if hears else None,
    )
    pol.attach(cache)
    n = len(trace)
    rec = {k: np.zeros(n) for k in ("start_s", "wait_ms", "service_ms", "ttft_ms")}
    rec |= {k: np.zeros(n, np.int64) for k in ("hit_blocks", "hit_tokens", "admitted_tokens")}
    nodes = [0.0] * cfg.prefill_nodes  # heap of free times (s)
    pending: list[tuple[float, int]] = []  # (finish time, request) whose suffix awaits the pool
    counts = {"admits": 0, "discards": 0}
    touch, prio = cache.touch, pol.prio
    for i in range(n):
        if progress is not None and i and i % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
        arrival = float(trace.time_s[i])
        start = max(arrival, nodes[0])
        while pending and pending[0][0] <= start:
            _, k = heapq.heappop(pending)
            offer(cache, pol, trace, k, int(rec["hit_blocks"][k]), rec, counts)
        blk = trace.blocks[i]
        ids = np.asarray(blk).tolist()  # Python ints: faster to index with, block by block
        hit = cache.match(ids) if cap else 0
        pol.on_access(blk, hit, i, start)
        for j in range(hit):
            b = ids[j]
            touch(b, prio(b, i, j, start))
        n_tok = int(trace.input_len[i])
        c_tok = _hit_tokens(trace, i, hit, len(ids))
        service = _service_ms(cost, n_tok, c_tok)
        finish = start + service / 1e3
        heapq.heapreplace(nodes, finish)
        heapq.heappush(pending, (finish, i))
        rec["start_s"][i], rec["service_ms"][i] = start, service
        rec["wait_ms"][i] = (start - arrival) * 1e3
        rec["ttft_ms"][i] = (
            rec["wait_ms"][i] + service + cost.transfer_ms(cost.footprint_bytes(n_tok))
        )
        rec["hit_blocks"][i], rec["hit_tokens"][i] = hit, c_tok
    while pending:
        _, k = heapq.heappop(pending)
        offer(cache, pol, trace, k, int(rec["hit_blocks"][k]), rec, counts)
    if progress is not None and n:
        progress(n - (n - 1) // _PROGRESS_EVERY * _PROGRESS_EVERY)
    return finish_record(rec, trace, cfg) | counts | {"evictions": cache.evictions}


def finish_record(rec: dict, trace: MooncakeTrace, cfg: ServingConfig) -> dict:
    """``rec`` (with ``ttft_ms``) completed by the columns every replay ends with: arrival
    time, block and input-token counts, decode queueing (``decode_queue``) and end-to-end
    latency."""
    rec["arrival_s"] = trace.time_s.copy()
    rec["n_blocks"] = np.array([len(b) for b in trace.blocks], np.int64)
    rec["input_tokens"] = trace.input_len.astype(np.int64)
    rec |= decode_queue(
        rec["arrival_s"] + rec["ttft_ms"] / 1e3,
        trace.output_len,
        slots=cfg.decode_nodes * cfg.decode_slots,
        tpot_ms=cfg.tpot_ms,
    )
    rec["e2e_ms"] = (rec["done_s"] - rec["arrival_s"]) * 1e3
    return rec


def decode_queue(ready_s, output_len, *, slots: int, tpot_ms: float) -> dict[str, np.ndarray]:
    """Decode stage: ``slots`` sequence slots (all decode nodes together), FCFS in the order
    the KV arrives (``ready_s``, s); a sequence holds a slot for output_len × tpot_ms.

    The first token comes from the prefill node, so TTFT does not include this wait; it shows
    in ``decode_wait_ms`` and the completion time ``done_s``.
    """
    order = np.argsort(ready_s, kind="stable")
    free = [0.0] * slots
    wait = np.zeros(len(ready_s))
    done = np.zeros(len(ready_s))
    for i in order:
        start = max(float(ready_s[i]), free[0])
        done[i] = start + float(output_len[i]) * tpot_ms / 1e3
        heapq.heapreplace(free, done[i])
        wait[i] = (start - ready_s[i]) * 1e3
    return {"decode_wait_ms": wait, "done_s": done}


def _hit_tokens(trace: MooncakeTrace, i: int, hit: int, m: int) -> int:
    """Tokens in request i's first ``hit`` blocks (of its m): ``block_tokens_of(i)[:hit].sum()``
    without the array (every block is full but the last)."""
    return hit * trace.block_tokens if hit < m else int(trace.input_len[i])


def _service_ms(cost: CostModel, n_tok: int, c_tok: int) -> float:
    fetch = cost.transfer_ms(cost.footprint_bytes(c_tok))
    return float(fetch + cost.recompute_ms(float(n_tok)) - cost.recompute_ms(float(c_tok)))


def offer(cache: PrefixCache, pol: BlockPolicy, trace: MooncakeTrace, i, hit, rec, counts) -> None:
    """Offers request i's computed blocks (positions ``hit``..) to the pool, in prefix order:
    each is admitted if the policy's gate and the cache agree (``counts`` and
    ``rec["admitted_tokens"]`` record the outcome)."""
    pol.on_offer(i)
    blk = np.asarray(trace.blocks[i]).tolist()
    m, bt = len(blk), trace.block_tokens
    now = float(rec["start_s"][i] + rec["service_ms"][i] / 1e3)
    parent = blk[hit - 1] if hit else ROOT
    resident, leaf_only, prio, gate = cache.res_view, cache.leaf_only, pol.prio, pol.gate
    room, admits, tokens = cache.capacity > 0, 0, 0
    for j in range(hit, m):
        b = blk[j]
        ok = room and not (leaf_only and parent != ROOT and not resident[parent])
        if ok and not resident[b]:
            admit, min_victim = gate(b, i, j, now)
            ok = admit and cache.insert(b, parent, prio(b, i, j, now), min_victim=min_victim)
            if ok:
                admits += 1
                tokens += bt if j < m - 1 else int(trace.input_len[i]) - (m - 1) * bt
        elif ok:
            cache.touch(b, prio(b, i, j, now))
        if not ok:
            counts["discards"] += m - j if leaf_only else 1
            if leaf_only:
                break
        parent = b
    counts["admits"] += admits
    rec["admitted_tokens"][i] += tokens
