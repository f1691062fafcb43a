"""Serving-scale simulation of Mooncake traces: block-level prefix caching + disaggregated timing.

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
capacity from GiB is ⌊bytes / |512-token block|⌋).

Policies (``POLICIES``): ``no_cache``; ``lru`` (LRU-Pool: blocks as independent keys, LRU over
all blocks, admit every computed block; eviction may strand descendants); ``mooncake``
(Mooncake-style prefix cache: LRU over leaves, admit every computed block); ``lfu`` (fewest
accesses among leaves); ``oracle_static`` (knows every block's popularity in the whole trace,
keeps the best static prefix-closed set by value per byte, ``static_oracle_set``); ``belady``
(future knowledge: evict the leaf used again last; admit a block only if it is used again
sooner than the victim; a heuristic bound: not optimal for TTFT with queueing); ``kvlearn``
(see ``block_kvlearn``).

``goodput_rps`` is requests whose TTFT met the SLO divided by the arrival span;
``throughput_rps`` is the maximum sustainable rate (``max_sustainable_rate``: the highest
arrival rate at which a target fraction of requests meets the TTFT SLO, found by searching the
load scale). Decode: ``decode_queue`` (slots on decode nodes, FCFS; TTFT excludes it, completion
times include it).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time

import numpy as np

from jaxkv.kvlearn.cost import GIB, CostModel
from jaxkv.kvlearn.prefix import ROOT, PrefixCache
from jaxkv.kvlearn.traces import BLOCK_TOKENS, MooncakeTrace, Progress

# The Mooncake format has one loader, in ``traces``; these names stay importable from here.
from jaxkv.kvlearn.traces import is_mooncake_file as is_mooncake_file
from jaxkv.kvlearn.traces import load_mooncake_trace as load_mooncake_trace

POLICIES = ("no_cache", "lru", "mooncake", "lfu", "oracle_static", "belady", "kvlearn")
INF = math.inf
_PROGRESS_EVERY = 256  # requests between calls of a ``progress`` callback


def next_use(trace: MooncakeTrace) -> list[np.ndarray]:
    """Per request, per block: index of the next request that contains the block (inf if none)."""
    last: dict[int, int] = {}
    out: list[np.ndarray] = [np.empty(0)] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        blk = trace.blocks[i]
        out[i] = np.array([last.get(int(b), INF) for b in blk], np.float64)
        for b in blk:
            last[int(b)] = i
    return out


# ---- policies -------------------------------------------------------------------------------
class BlockPolicy:
    """A block-level policy: priorities for the cache's heap and an admission gate.

    ``prio(b, i, j, now)`` is the priority of block ``b`` (position j of request i) when it is
    touched at time ``now``; ``gate(b, i, j, now)`` returns ``(admit, min_victim)``.
    """

    name = "base"
    leaf_only = True

    def __init__(self, trace: MooncakeTrace, cost: CostModel):
        self.clock = 0

    def prio(self, b: int, i: int, j: int, now: float) -> tuple:
        self.clock += 1
        return (self.clock,)

    def gate(self, b: int, i: int, j: int, now: float) -> tuple[bool, tuple | None]:
        return True, None

    def on_access(self, blocks, hit: int, i: int, now: float) -> None:
        """Called once per request at lookup with its blocks and hit count."""

    def attach(self, cache: PrefixCache) -> None:
        """Called once with the pool the policy serves (read-only use)."""


class LRUPool(BlockPolicy):
    name, leaf_only = "lru", False


class Mooncake(BlockPolicy):
    name = "mooncake"


class LFU(BlockPolicy):
    name = "lfu"

    def __init__(self, trace, cost):
        super().__init__(trace, cost)
        self.count = np.zeros(trace.n_blocks, np.int64)

    def on_access(self, blocks, hit, i, now):
        self.count[blocks] += 1

    def prio(self, b, i, j, now):
        self.clock += 1
        return (int(self.count[b]), self.clock)


class Belady(BlockPolicy):
    name = "belady"

    def __init__(self, trace, cost):
        super().__init__(trace, cost)
        self.nu = next_use(trace)

    def prio(self, b, i, j, now):
        return (-self.nu[i][j],)

    def gate(self, b, i, j, now):
        nu = self.nu[i][j]
        return nu < INF, (-nu,)


def block_tree(trace: MooncakeTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per block: parent (ROOT for a first block), depth, tokens and number of requests holding
    it, from the block's first occurrence (with chained ids every occurrence agrees)."""
    k = trace.n_blocks
    parent = np.full(k, ROOT - 1, np.int64)  # ROOT − 1: not seen yet
    depth = np.zeros(k, np.int64)
    tokens = np.zeros(k, np.int64)
    count = np.zeros(k, np.int64)
    for i, blk in enumerate(trace.blocks):
        count[blk] += 1
        new = parent[blk] == ROOT - 1
        if new.any():
            j = np.nonzero(new)[0]
            parent[blk[j]] = np.where(j > 0, blk[np.maximum(j - 1, 0)], ROOT)
            depth[blk[j]] = j
            tokens[blk[j]] = trace.block_tokens_of(i)[j]
    return parent, depth, tokens, count


def static_values(trace: MooncakeTrace, cost: CostModel) -> np.ndarray:
    """[n_blocks] static value (ms) of keeping a block from its first request to the end: its
    later requests (count − 1) × the time one hit saves at its depth (marginal R − T)."""
    parent, depth, tokens, count = block_tree(trace)
    bt = trace.block_tokens
    lo = depth.astype(np.float64) * bt
    save = (
        np.asarray(cost.recompute_ms(lo + tokens), np.float64)
        - np.asarray(cost.recompute_ms(lo), np.float64)
        - np.asarray(cost.transfer_ms(cost.footprint_bytes(tokens.astype(np.float64))))
    )
    return (count - 1) * np.maximum(save, 0.0)


def static_oracle_set(
    parent: np.ndarray, depth: np.ndarray, value: np.ndarray, capacity: int
) -> tuple[np.ndarray, bool]:
    """The best prefix-closed set of at most ``capacity`` blocks by total static value.

    Every block takes one slot, so value per slot is value per byte of pool. Lagrangian
    relaxation: for a price λ per slot, the prefix-closed set maximising Σ(value − λ) is exact
    by one bottom-up pass (a block's gain is its own plus its children's positive gains); λ is
    bisected to the smallest price whose set fits, then the leftover slots are filled greedily
    from the frontier by value. Returns (mask, exact): ``exact`` iff no greedy fill was needed
    or the fill had nothing to add (then the set is optimal among prefix-closed sets of its
    size).
    """
    k = len(value)
    if capacity <= 0 or k == 0:
        return np.zeros(k, bool), True
    order = np.argsort(-depth, kind="stable")  # children before parents
    levels = np.split(order, np.nonzero(np.diff(depth[order]))[0] + 1)
    has_parent = parent >= 0

    def select(lam: float) -> np.ndarray:
        g = value - lam
        for lvl in levels:  # deepest first: push positive gains to the parents
            c = lvl[has_parent[lvl]]
            np.add.at(g, parent[c], np.maximum(g[c], 0.0))
        sel = np.zeros(k, bool)
        for lvl in levels[::-1]:  # shallowest first: take a positive gain under a taken parent
            ok = g[lvl] > 0
            ok &= np.where(has_parent[lvl], sel[np.maximum(parent[lvl], 0)], True)
            sel[lvl] = ok
        return sel

    lo, hi = 0.0, float(value.max()) + 1.0  # select(hi) is empty
    best = select(lo)
    if best.sum() <= capacity:
        return best, True
    best = select(hi)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        sel = select(mid)
        if sel.sum() <= capacity:
            hi, best = mid, sel
        else:
            lo = mid
    return _fill_frontier(best, parent, value, capacity)


def _fill_frontier(sel, parent, value, capacity) -> tuple[np.ndarray, bool]:
    sel = sel.copy()
    children: dict[int, list[int]] = {}
    for b in np.nonzero(parent >= 0)[0]:
        children.setdefault(int(parent[b]), []).append(int(b))
    frontier = [(-value[b], int(b)) for b in np.nonzero(~sel)[0] if parent[b] < 0 or sel[parent[b]]]
    heapq.heapify(frontier)
    added = 0
    while frontier and sel.sum() < capacity:
        v, b = heapq.heappop(frontier)
        if v >= 0:  # nothing of value left
            break
        sel[b] = True
        added += 1
        for c in children.get(b, ()):
            heapq.heappush(frontier, (-value[c], c))
    return sel, added == 0


class OracleStatic(BlockPolicy):
    """Knows every block's true popularity (the whole trace): keeps the static best
    value-per-byte prefix-closed set (``static_oracle_set``), admits a block iff it is in the
    set, never evicts, pays compulsory misses."""

    name = "oracle_static"

    def __init__(self, trace, cost, *, capacity: int):
        super().__init__(trace, cost)
        parent, depth, _, _ = block_tree(trace)
        self.keep, self.exact = static_oracle_set(
            parent, depth, static_values(trace, cost), capacity
        )

    def gate(self, b, i, j, now):
        return bool(self.keep[b]), None


def make_policy(name: str, trace: MooncakeTrace, cost: CostModel, **kw) -> BlockPolicy:
    """Block policy by name (one of ``POLICIES``; ``no_cache`` is a zero-capacity Mooncake).
    ``oracle_static`` needs ``capacity`` (blocks)."""
    if name == "oracle_static":
        return OracleStatic(trace, cost, **kw)
    if name in ("no_cache", "mooncake"):
        return Mooncake(trace, cost)
    if name == "lru":
        return LRUPool(trace, cost)
    if name == "lfu":
        return LFU(trace, cost)
    if name == "belady":
        return Belady(trace, cost)
    if name == "kvlearn":
        from jaxkv.kvlearn.block_kvlearn import BlockKVLearn

        return BlockKVLearn(trace, cost, **kw)
    raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")


# ---- simulation -----------------------------------------------------------------------------
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
    """Per-request records of one run: arrival_s, start_s, wait_ms, service_ms, ttft_ms,
    hit_blocks, n_blocks, hit_tokens, input_tokens, admitted_tokens, plus scalars admits,
    evictions, discards (computed blocks not admitted). ``progress`` (optional) is told the
    number of requests replayed, every few hundred."""
    cap = 0 if policy == "no_cache" else cfg.pool_blocks
    if policy == "oracle_static":
        policy_kw = {"capacity": cap} | policy_kw
    pol = make_policy(policy, trace, cost, **policy_kw)
    cache = PrefixCache(cap, n_blocks=trace.n_blocks, leaf_only=pol.leaf_only)
    cache.on_evict = getattr(pol, "on_evict", None)
    pol.attach(cache)
    n = len(trace)
    rec = {k: np.zeros(n) for k in ("start_s", "wait_ms", "service_ms", "ttft_ms")}
    rec |= {k: np.zeros(n, np.int64) for k in ("hit_blocks", "hit_tokens", "admitted_tokens")}
    nodes = [0.0] * cfg.prefill_nodes  # heap of free times (s)
    pending: list[tuple[float, int]] = []  # (finish time, request) whose suffix awaits the pool
    counts = {"admits": 0, "discards": 0}
    for i in range(n):
        if progress is not None and i and i % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
        arrival = float(trace.time_s[i])
        start = max(arrival, nodes[0])
        while pending and pending[0][0] <= start:
            _, k = heapq.heappop(pending)
            _offer(cache, pol, trace, k, int(rec["hit_blocks"][k]), rec, counts)
        blk = trace.blocks[i]
        hit = cache.match(blk) if cap else 0
        pol.on_access(blk, hit, i, start)
        for j in range(hit):
            cache.touch(int(blk[j]), pol.prio(int(blk[j]), i, j, start))
        n_tok = int(trace.input_len[i])
        c_tok = int(trace.block_tokens_of(i)[:hit].sum())
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
        _offer(cache, pol, trace, k, int(rec["hit_blocks"][k]), rec, counts)
    if progress is not None and n:
        progress(n - (n - 1) // _PROGRESS_EVERY * _PROGRESS_EVERY)
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
    return rec | counts | {"evictions": cache.evictions}


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


def _service_ms(cost: CostModel, n_tok: int, c_tok: int) -> float:
    fetch = cost.transfer_ms(cost.footprint_bytes(c_tok))
    return float(fetch + cost.recompute_ms(float(n_tok)) - cost.recompute_ms(float(c_tok)))


def _offer(cache, pol, trace, i, hit, rec, counts) -> None:
    """Offers request i's computed blocks (positions hit..) to the pool, in prefix order."""
    blk, tok = trace.blocks[i], trace.block_tokens_of(i)
    now = float(rec["start_s"][i] + rec["service_ms"][i] / 1e3)
    parent = int(blk[hit - 1]) if hit else ROOT
    for j in range(hit, len(blk)):
        b = int(blk[j])
        ok = cache.capacity > 0 and not (
            cache.leaf_only and parent != ROOT and not cache.resident[parent]
        )
        if ok and not cache.resident[b]:
            admit, min_victim = pol.gate(b, i, j, now)
            ok = admit and cache.insert(b, parent, pol.prio(b, i, j, now), min_victim=min_victim)
            if ok:
                counts["admits"] += 1
                rec["admitted_tokens"][i] += int(tok[j])
        elif ok:
            cache.touch(b, pol.prio(b, i, j, now))
        if not ok:
            counts["discards"] += len(blk) - j if cache.leaf_only else 1
            if cache.leaf_only:
                return
        parent = b


def summarize(policy: str, rec: dict, *, cost: CostModel, cfg: ServingConfig) -> dict:
    """The core's metric schema (``simulate.metrics``) plus serving fields."""
    ttft = rec["ttft_ms"]
    n_tok = rec["input_tokens"].sum()
    moved = rec["hit_tokens"].sum() + n_tok + rec["admitted_tokens"].sum()
    span = float(rec["arrival_s"][-1] - rec["arrival_s"][0]) if len(ttft) > 1 else 0.0
    good = int((ttft <= cfg.slo_ms).sum())
    return {
        "policy": policy,
        "ttft_ms_mean": float(ttft.mean()),
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "hit_rate": float(rec["hit_blocks"].sum() / rec["n_blocks"].sum()),
        "byte_hit_rate": float(rec["hit_tokens"].sum() / n_tok),
        "token_hit_rate": float(rec["hit_tokens"].sum() / n_tok),
        "transfer_gib": float(cost.footprint_bytes(float(moved)) / GIB),
        "admits": int(rec["admits"]),
        "evictions": int(rec["evictions"]),
        "discards": int(rec["discards"]),
        "wait_ms_mean": float(rec["wait_ms"].mean()),
        "decode_wait_ms_mean": float(rec["decode_wait_ms"].mean()),
        "e2e_ms_mean": float(rec["e2e_ms"].mean()),
        "e2e_ms_p99": float(np.percentile(rec["e2e_ms"], 99)),
        "slo_attainment": good / len(ttft),
        "goodput_rps": good / span if span > 0 else float("nan"),
        "throughput_rps": None,  # filled by ``max_sustainable_rate`` (compare(rate_search=True))
        "max_load_scale": None,
    }


def max_sustainable_rate(
    trace: MooncakeTrace,
    policy: str,
    *,
    cfg: ServingConfig,
    cost: CostModel,
    attainment: float = 0.9,
    rel_tol: float = 0.02,
    scale_range: tuple[float, float] = (1 / 64, 64.0),
    **policy_kw,
) -> dict:
    """Highest arrival rate at which ≥ ``attainment`` of requests meet the TTFT SLO.

    Searches the load scale S (arrivals compressed S×): doubles or halves from S = 1 to bracket
    the boundary, then bisects geometrically until hi/lo ≤ 1 + ``rel_tol``. Assumes attainment
    falls with load (it does for a fixed cache; with an adaptive cache the search finds a
    boundary). Returns ``max_load_scale`` (the largest S that passed; the range's end if none
    failed or none passed), ``throughput_rps`` = S·N / arrival span of the unscaled trace, and
    ``runs``.
    """
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")
    n = len(trace)
    span = float(trace.time_s[-1] - trace.time_s[0])
    if n < 2 or span <= 0:
        raise ValueError("rate search needs at least two requests spread over time")
    runs = 0

    def ok(scale: float) -> bool:
        nonlocal runs
        runs += 1
        rec = simulate(trace.scaled(scale), policy, cfg=cfg, cost=cost, **policy_kw)
        return float(np.mean(rec["ttft_ms"] <= cfg.slo_ms)) >= attainment

    s_min, s_max = scale_range
    lo = hi = 1.0
    if ok(1.0):
        while hi < s_max:
            hi = min(2 * hi, s_max)
            if not ok(hi):
                break
            lo = hi
        else:
            return {"max_load_scale": lo, "throughput_rps": lo * n / span, "runs": runs}
    else:
        while lo > s_min:
            lo = max(lo / 2, s_min)
            if ok(lo):
                break
            hi = lo
        else:
            return {"max_load_scale": s_min, "throughput_rps": s_min * n / span, "runs": runs}
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return {"max_load_scale": lo, "throughput_rps": lo * n / span, "runs": runs}


def compare(
    trace: MooncakeTrace,
    *,
    cfg: ServingConfig,
    cost: CostModel,
    policies=POLICIES,
    rate_search: bool = False,
    attainment: float = 0.9,
    progress: Progress | None = None,
) -> list[dict]:
    """Summary (plus ``wall_s``, the time of the one simulation) of every policy on one trace;
    with ``rate_search`` also ``throughput_rps`` / ``max_load_scale`` (``max_sustainable_rate``
    at ``attainment``; ``rate_search_s``: its time). ``progress`` (optional) is told the
    requests replayed by each policy's simulation (len(policies) × len(trace) in all)."""
    out = []
    for p in policies:
        t0 = time.perf_counter()
        rec = simulate(trace, p, cfg=cfg, cost=cost, progress=progress)
        row = summarize(p, rec, cost=cost, cfg=cfg) | {"wall_s": time.perf_counter() - t0}
        if rate_search:
            t0 = time.perf_counter()
            r = max_sustainable_rate(trace, p, cfg=cfg, cost=cost, attainment=attainment)
            row |= {k: r[k] for k in ("throughput_rps", "max_load_scale")}
            row |= {"rate_search_s": time.perf_counter() - t0, "attainment_target": attainment}
        out.append(row)
    return out
