"""Future knowledge of a Mooncake trace, for the oracle block policies: each block's next use
(``belady``) and the best static prefix-closed set (``oracle_static``).

With chained block ids the blocks form a forest (a block's parent is the block before it in any
request that holds it); ``block_tree`` recovers it, ``static_values`` prices keeping a block
for the whole trace, and ``static_oracle_set`` picks the most valuable prefix-closed set that
fits the pool.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.prefix import ROOT
from jaxkv.kvlearn.traces import MooncakeTrace

INF = math.inf


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
