"""The classical bar at block level (serving simulator): arc (vLLM's offload ARC), s3fifo,
wtinylfu, slru, gdsf, cost_aware, infinite.

Each policy runs through the real engine (``engine.simulate``) on sequential requests (1000 s
apart: every request's blocks are offered before the next lookup), with its evictions recorded
per request. Hand-worked traces check hits and eviction order written out from each algorithm's
definition; on random prefix-tree traces a plain-Python reference of the published algorithm
(written here, request by request, sharing no code with the policies) must agree with the
simulator on every request's hits and on every eviction, in order.
"""

import math

import numpy as np
import pytest

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine
from jaxkv.kvlearn.serving import policies as policies_lib
from jaxkv.kvlearn.serving.policies.base import block_saving_ms
from jaxkv.kvlearn.serving.policies.wtinylfu import FrequencySketch, sketch_width
from jaxkv.kvlearn.serving.prefix import ROOT, PrefixCache
from jaxkv.kvlearn.traces import MooncakeTrace

COST = CostModel.llama3_8b_a100()
BT = 512


def _trace(reqs) -> tuple[MooncakeTrace, list]:
    """Requests (lists of hashable block names) → a trace with dense ids, and the id → name map."""
    ids: dict = {}
    blocks = tuple(np.array([ids.setdefault(b, len(ids)) for b in r], np.int64) for r in reqs)
    n = len(reqs)
    tr = MooncakeTrace(
        time_s=np.arange(n) * 1000.0,
        input_len=np.array([BT * len(r) for r in reqs], np.int64),
        output_len=np.ones(n, np.int64),
        blocks=blocks,
        n_blocks=len(ids),
    )
    return tr, list(ids)


def _run(monkeypatch, name, reqs, pool_blocks, **options):
    """(hit blocks per request, evicted block names per request's offer, the policy)."""
    tr, names = _trace(reqs)
    log: list[list] = []
    made = []
    cls = policies_lib.REGISTRY[name]

    class Recording(cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

        def on_access(self, blocks, hit, i, now):
            log.append([])
            super().on_access(blocks, hit, i, now)

        def on_evict(self, b):
            log[-1].append(names[b])
            super().on_evict(b)

    monkeypatch.setitem(policies_lib.REGISTRY, name, Recording)
    cfg = engine.ServingConfig(pool_blocks=pool_blocks, prefill_nodes=1)
    rec = engine.simulate(tr, name, cfg=cfg, cost=COST, **options)
    return rec["hit_blocks"].tolist(), log, made[0], rec


def _single(seq: str) -> list[list[str]]:
    return [[c] for c in seq]


def _prefix_hits(blocks, resident) -> int:
    n = 0
    while n < len(blocks) and blocks[n] in resident:
        n += 1
    return n


def random_requests(seed: int, n_req: int = 300, n_paths: int = 14) -> list[list[int]]:
    """Paths of a random prefix tree (chained ids: a block always has the same parent), chosen
    with a skew, cut at a random depth, sometimes with a one-off tail."""
    rng = np.random.default_rng(seed)
    paths: list[list[int]] = []
    nxt = 0
    for _ in range(n_paths):
        base = []
        if paths and rng.random() < 0.6:
            src = paths[int(rng.integers(len(paths)))]
            base = src[: int(rng.integers(1, len(src) + 1))]
        ext = list(range(nxt, nxt + int(rng.integers(1, 5))))
        nxt += len(ext)
        paths.append(base + ext)
    w = 1.0 / np.arange(1, len(paths) + 1) ** 0.9
    reqs = []
    for _ in range(n_req):
        path = paths[int(rng.choice(len(paths), p=w / w.sum()))]
        req = path[: int(rng.integers(1, len(path) + 1))]
        if rng.random() < 0.25:
            tail = list(range(nxt, nxt + int(rng.integers(1, 3))))
            nxt += len(tail)
            req = req + tail
        reqs.append(req)
    return reqs


# ---- references (request by request, from the published definitions) ------------------------
class RefVllmARC:
    """vLLM 0.32 ``ARCCachePolicy`` under ``CPUOffloadingManager``: touch all blocks (reversed;
    a ghost hit adapts p by max(1, ratio) as a float and moves the id to its ghost list's MRU
    end), lookup, then store the request's new blocks as one batch (evict what the batch needs:
    T1 if |T1| ≥ int(p), else T2, else T1; trim ghosts; insert into T1), then finish the
    request (its stored blocks move to T1's MRU end, deepest first). Where vLLM runs out of
    victims (T1 and T2 empty) it stores nothing; the policy then keeps the blocks stored one per
    slot freed so far (its documented difference)."""

    def __init__(self, c):
        self.c, self.p = c, 0.0
        self.t1, self.t2, self.b1, self.b2 = [], [], [], []
        self.short = 0  # batches where vLLM would have stored nothing

    def request(self, blocks):
        for b in reversed(blocks):
            if b in self.t1:
                self.t1.remove(b)
                self.t2.append(b)
            elif b in self.t2:
                self.t2.remove(b)
                self.t2.append(b)
            elif b in self.b1:
                self.p = min(self.p + max(1, len(self.b2) / len(self.b1)), self.c)
                self.b1.remove(b)
                self.b1.append(b)
            elif b in self.b2:
                self.p = max(self.p - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2.remove(b)
                self.b2.append(b)
        hit = _prefix_hits(blocks, set(self.t1) | set(self.t2))
        new = [b for b in blocks[hit:] if b not in self.t1 and b not in self.t2]
        free = self.c - len(self.t1) - len(self.t2)
        evicted = []
        for _ in range(len(new) - free):
            if self.t1 and (len(self.t1) >= int(self.p) or not self.t2):
                v = self.t1.pop(0)
                self.b1.append(v)
            elif self.t2:
                v = self.t2.pop(0)
                self.b2.append(v)
            else:
                self.short += 1
                new = new[: free + len(evicted)]
                break
            evicted.append(v)
        for g in (self.b1, self.b2):
            del g[: max(0, len(g) - self.c)]
        for b in new:
            self.t1.append(b)
            for g in (self.b1, self.b2):
                if b in g:
                    g.remove(b)
        for b in reversed(new):  # request finished: its stored blocks, deepest first, to MRU
            self.t1.remove(b)
            self.t1.append(b)
        return hit, evicted


class RefS3FIFO:
    """S3-FIFO (libCacheSim's one-victim-per-round structure): S 10 %, M, ghost G of |M| ids."""

    def __init__(self, c, move_to_main=1):
        self.c, self.thr = c, move_to_main
        self.s_cap = max(1, int(0.1 * c))
        self.m_cap = c - self.s_cap
        self.S, self.M, self.G = [], [], []
        self.freq, self.to_main = {}, set()

    def request(self, blocks):
        hit = _prefix_hits(blocks, set(self.S) | set(self.M))
        for b in blocks:
            if b in self.S or b in self.M:
                self.freq[b] = min(self.freq[b] + 1, 3)
            elif b in self.G:
                self.G.remove(b)
                self.to_main.add(b)
        evicted = []
        for b in blocks[hit:]:
            if b in self.S or b in self.M:
                continue
            if len(self.S) + len(self.M) >= self.c:
                evicted.append(self._evict())
            (self.M if b in self.to_main else self.S).append(b)
            self.to_main.discard(b)
            self.freq[b] = 0
        return hit, evicted

    def _evict(self):
        if len(self.M) <= self.m_cap and self.S:
            while self.S:
                t = self.S.pop(0)
                if self.freq[t] >= self.thr:
                    self.M.append(t)
                    self.freq[t] = 0
                else:
                    self.G.append(t)
                    del self.G[: max(0, len(self.G) - self.m_cap)]
                    return t
        while True:
            t = self.M.pop(0)
            if self.freq[t] == 0:
                return t
            self.freq[t] -= 1
            self.M.append(t)


class RefSLRU:
    """Segmented LRU: probation, protected (80 %); a request touches its blocks deepest first."""

    def __init__(self, c):
        self.c, self.cap = c, int(0.8 * c)
        self.prob, self.prot = [], []

    def touch(self, b):
        if b in self.prob:
            self.prob.remove(b)
            self.prot.append(b)
            while len(self.prot) > self.cap:
                self.prob.append(self.prot.pop(0))
        elif b in self.prot:
            self.prot.remove(b)
            self.prot.append(b)

    def request(self, blocks):
        hit = _prefix_hits(blocks, set(self.prob) | set(self.prot))
        for b in reversed(blocks):
            self.touch(b)
        evicted = []
        for b in blocks[hit:]:
            if b in self.prob or b in self.prot:
                continue
            if len(self.prob) + len(self.prot) >= self.c:
                evicted.append((self.prob or self.prot).pop(0))
            self.prob.append(b)
        return hit, evicted


class RefSketch:
    """Count-min sketch from its definition: 4 rows, counter = top log2(w) bits of
    (key + 1)·seed mod 2^32, 4-bit saturating, all halved after ``sample`` increments."""

    SEEDS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)

    def __init__(self, width, sample):
        self.width, self.sample, self.adds = width, sample, 0
        self.rows = [[0] * width for _ in self.SEEDS]

    def _idx(self, key, r):
        return ((key + 1) * self.SEEDS[r] % 2**32) >> (32 - int(math.log2(self.width)))

    def add(self, key):
        changed = False
        for r, row in enumerate(self.rows):
            if row[self._idx(key, r)] < 15:
                row[self._idx(key, r)] += 1
                changed = True
        if changed:
            self.adds += 1
            if self.adds >= self.sample:
                self.rows = [[v // 2 for v in row] for row in self.rows]
                self.adds //= 2

    def est(self, key):
        return min(row[self._idx(key, r)] for r, row in enumerate(self.rows))


class RefWTinyLFU:
    """W-TinyLFU: window LRU 1 %, TinyLFU duel (candidate strictly more frequent than main's
    victim), SLRU main (protected 80 %)."""

    def __init__(self, c):
        self.c = c
        main = int(0.99 * c)
        self.w_cap, self.p_cap = c - main, int(0.8 * main)
        self.win, self.prob, self.prot = [], [], []
        self.sk = RefSketch(max(16, 1 << (c - 1).bit_length()), 10 * c)

    def request(self, blocks):
        hit = _prefix_hits(blocks, set(self.win) | set(self.prob) | set(self.prot))
        for b in reversed(blocks):
            self.sk.add(b)
            if b in self.win:
                self.win.remove(b)
                self.win.append(b)
            elif b in self.prob:
                self.prob.remove(b)
                self.prot.append(b)
                while len(self.prot) > self.p_cap:
                    self.prob.append(self.prot.pop(0))
            elif b in self.prot:
                self.prot.remove(b)
                self.prot.append(b)
        evicted = []
        for b in blocks[hit:]:
            if b in self.win or b in self.prob or b in self.prot:
                continue
            if len(self.win) + len(self.prob) + len(self.prot) >= self.c:
                cand = self.win.pop(0)
                seg = self.prob or self.prot
                if seg and self.sk.est(cand) > self.sk.est(seg[0]):
                    evicted.append(seg.pop(0))
                    self.prob.append(cand)
                else:
                    evicted.append(cand)
            self.win.append(b)
            if len(self.win) > self.w_cap:
                self.prob.append(self.win.pop(0))
        return hit, evicted


class RefLeafPriority:
    """A prefix cache by brute force: the victim is the resident leaf (no resident child; the
    parent of the block being stored is not eligible) of lowest (value, last touch); ``value``
    is GDSF's H or cost_aware's decayed saving."""

    def __init__(self, c, saving, *, kind, tau=None):
        self.c, self.saving, self.kind, self.tau = c, saving, kind, tau
        self.parent, self.val, self.stamp = {}, {}, {}
        self.freq, self.mass = {}, {}
        self.L, self.clock = 0.0, 0

    def _value(self, b, i):
        if self.kind == "gdsf":
            return self.L + self.freq[b] * self.saving[b]
        self.mass[b] = float(np.logaddexp(self.mass.get(b, -np.inf), i / self.tau))
        return math.log(self.saving[b]) + self.mass[b]

    def _touch(self, b, value):
        self.clock += 1
        self.val[b], self.stamp[b] = value, self.clock

    def request(self, blocks, i):
        hit = _prefix_hits(blocks, self.parent)
        for b in blocks[:hit]:
            self.freq[b] = self.freq[b] + 1
            self._touch(b, self._value(b, i))
        evicted = []
        for j in range(hit, len(blocks)):
            b, par = blocks[j], blocks[j - 1] if j else ROOT
            self.freq[b] = 1
            value = self._value(b, i)
            if len(self.parent) >= self.c:
                kids = {p for p in self.parent.values()}
                leaves = [x for x in self.parent if x not in kids and x != par]
                if not leaves:
                    break
                v = min(leaves, key=lambda x: (self.val[x], self.stamp[x]))
                evicted.append(v)
                self.L = max(self.L, self.val[v])
                del self.parent[v]
            self.parent[b] = par
            self._touch(b, self._value(b, i) if self.kind == "gdsf" else value)
        return hit, evicted


def _reference_run(ref, reqs, *, with_index=False):
    hits, evs = [], []
    for i, r in enumerate(reqs):
        h, e = ref.request(r, i) if with_index else ref.request(r)
        hits.append(h)
        evs.append(e)
    return hits, evs


# ---- hand-worked traces ---------------------------------------------------------------------
def test_arc_hand_worked_vllm_semantics(monkeypatch):
    # c = 2, one block per request. p starts at 0.0; T1, T2, B1, B2 listed LRU first. Evict from
    # T1 if |T1| ≥ int(p); a ghost hit adds/subtracts max(1, ratio), the ratio a float.
    #  1 a  miss            T1=[a]
    #  2 b  miss            T1=[a,b]
    #  3 a  hit: T1→T2      T1=[b] T2=[a]
    #  4 c  miss, full, |T1|=1 ≥ 0: evict b → B1=[b]; T1=[c]
    #  5 b  B1 hit: p=0+max(1,0/1)=1; miss, |T1|=1 ≥ 1: evict c → B1=[b,c]; b stored in T1
    #       (the paper would put it in T2), leaves B1: T1=[b] B1=[c]
    #  6 c  B1 hit: p=2; |T1|=1 < 2: evict T2's a → B2=[a]; T1=[b,c] B1=[]
    #  7 a  B2 hit: p=max(2−max(1,0/1),0)=1; |T1|=2 ≥ 1: evict b → B1=[b]; T1=[c,a] B2=[]
    #  8 c  hit: T1→T2      T1=[a] T2=[c]
    #  9 d  miss, |T1|=1 ≥ 1: evict a → B1=[b,a]; T1=[d]
    hits, ev, pol, _ = _run(monkeypatch, "arc", _single("abacbcacd"), 2)
    assert hits == [0, 0, 1, 0, 0, 0, 0, 1, 0]
    assert ev == [[], [], [], ["b"], ["c"], ["a"], ["b"], [], ["a"]]
    names = lambda d: [_trace(_single("abacbcacd"))[1][b] for b in d]
    assert (pol.p, names(pol.t1), names(pol.t2), names(pol.b1), names(pol.b2)) == (
        1.0,
        ["d"],
        ["c"],
        ["b", "a"],
        [],
    )


def test_arc_ghost_hit_moves_the_id_to_its_ghost_lists_mru_end(monkeypatch):
    # c = 2, one block per request (vLLM 0.32's ``_adapt_to_ghost_hit``).
    #  1-4 a b c d   a, b evicted from T1 in turn: B1=[a,b]; T1=[c,d]
    #  5 a  B1 hit: p=0+max(1,0/2)=1 and a moves to B1's MRU end: B1=[b,a]; |T1|=2 ≥ 1: evict
    #       c → B1=[b,a,c], trimmed to c=2 → [a,c] (b, now the LRU, is forgotten); a stored,
    #       leaves B1: T1=[d,a] B1=[c]
    #  6 b  no ghost hit (without the move b would still be in B1 and p would become 2);
    #       |T1|=2 ≥ 1: evict d → B1=[c,d]; T1=[a,b]
    #  7 a  hit: T1=[b] T2=[a]
    #  8 e  |T1|=1 ≥ int(1): evict T1's b (with p=2 it would be T2's a) → B1=[c,d,b] → [d,b]
    hits, ev, pol, _ = _run(monkeypatch, "arc", _single("abcdabae"), 2)
    assert hits == [0, 0, 0, 0, 0, 0, 1, 0]
    assert ev == [[], [], ["a"], ["b"], ["c"], ["d"], [], ["b"]]
    names = lambda d: [_trace(_single("abcdabae"))[1][b] for b in d]
    assert (pol.p, names(pol.t1), names(pol.t2), names(pol.b1), names(pol.b2)) == (
        1.0,
        ["e"],
        ["a"],
        ["d", "b"],
        [],
    )


def test_arc_adapts_p_by_a_float_ratio_and_a_finished_request_ends_head_first(monkeypatch):
    # c = 3. A finished request's stored blocks move to T1's MRU end deepest first, so its
    # first block ends most recent (vLLM 0.32's ``on_request_finished``).
    #  1 [a,b,c]  stored T1=[a,b,c]; finish: T1=[c,b,a]
    #  2 [a,b,c]  3 hits, touched c, b, a: T2=[c,b,a] T1=[]
    #  3 [d,e,f]  evict 3, T1 empty: T2's c, b, a → B2=[c,b,a]; T1=[d,e,f] → finish [f,e,d]
    #  4 [g,h]    evict 2, |T1| ≥ 0: f, e (without the finish order: d, e) → B1=[f,e];
    #             T1=[d,g,h] → finish [d,h,g]
    #  5 [f]      B1 hit: p=0+max(1,3/2)=1.5 (⌊3/2⌋ would give 1); B1=[e,f]; |T1|=3 ≥ int(1.5):
    #             evict d → B1=[e,f,d]; f stored: T1=[h,g,f] B1=[e,d]
    #  6 [e]      B1 hit: p=1.5+max(1,3/2)=3 (integer steps: 2); B1=[d,e]; |T1|=3 ≥ 3: evict
    #             h → B1=[d,e,h]; e stored: T1=[g,f,e] B1=[d,h]
    #  7 [g]      hit: T1=[f,e] T2=[g]
    #  8 [i]      |T1|=2 < int(3): evict T2's g (with p=2: T1's f) → B2=[c,b,a,g] → [b,a,g];
    #             T1=[f,e,i]
    reqs = [["a", "b", "c"], ["a", "b", "c"], ["d", "e", "f"], ["g", "h"]]
    reqs += [["f"], ["e"], ["g"], ["i"]]
    hits, ev, pol, _ = _run(monkeypatch, "arc", reqs, 3)
    assert hits == [0, 3, 0, 0, 0, 0, 1, 0]
    assert ev == [[], [], ["c", "b", "a"], ["f", "e"], ["d"], ["h"], [], ["g"]]
    names = lambda d: [_trace(reqs)[1][b] for b in d]
    assert (pol.p, names(pol.t1), names(pol.t2), names(pol.b1), names(pol.b2)) == (
        3.0,
        ["f", "e", "i"],
        [],
        ["d", "h"],
        ["b", "a", "g"],
    )


def test_arc_evicts_from_t1_below_p_when_t2_is_empty(monkeypatch):
    # c = 2. vLLM's ``evict`` falls back to T1 when T1 is below int(p) and T2 has nothing.
    #  1-5 a b c d a   as in the ghost-hit test: p=1, T1=[d,a] B1=[c]
    #  6 c        B1 hit: p=1+max(1,0/1)=2; |T1|=2 ≥ 2: evict d → B1=[c,d]; c stored:
    #             T1=[a,c] B1=[d]
    #  7 [x,y]    evict 2: |T1|=2 ≥ 2: a; then |T1|=1 < 2 and T2 empty: c (not a refused store)
    #             → B1=[d,a,c] → [a,c]; T1=[x,y] → finish [y,x]
    #  8 z        |T1|=2 ≥ 2: evict y, the batch's deepest block → B1=[a,c,y] → [c,y]; T1=[x,z]
    reqs = _single("abcdac") + [["x", "y"], ["z"]]
    hits, ev, pol, rec = _run(monkeypatch, "arc", reqs, 2)
    assert hits == [0] * 8 and rec["discards"] == 0
    assert ev == [[], [], ["a"], ["b"], ["c"], ["d"], ["a", "c"], ["y"]]
    names = lambda d: [_trace(reqs)[1][b] for b in d]
    assert (pol.p, names(pol.t1), names(pol.t2), names(pol.b1), names(pol.b2)) == (
        2.0,
        ["x", "z"],
        [],
        ["c", "y"],
        [],
    )


def test_arc_touches_deepest_first_and_stores_a_batch_like_vllm(monkeypatch):
    # c = 3. [x,y] stored in T1 (x first). [x,y] again: touched y then x, so T2=[y,x].
    # [z,w]: two new blocks, one free slot. vLLM evicts for the whole batch first: |T1|=0 ≥ p=0
    # but T1 is empty, so T2's LRU y goes (not z, which one-at-a-time storing would evict).
    hits, ev, pol, _ = _run(monkeypatch, "arc", [["x", "y"], ["x", "y"], ["z", "w"]], 3)
    assert hits == [0, 2, 0] and ev == [[], [], ["y"]]
    assert [len(pol.t1), len(pol.t2), len(pol.b2)] == [2, 1, 1]


def test_s3fifo_hand_worked(monkeypatch):
    # c = 10: S holds 1 (10 %), M 9, ghost 9. One block per request.
    #  a b: a in S; b's store needs no room (2 ≤ 10) ... fill with a..j (10 blocks), then:
    #  a is hit once (freq 1) before k arrives.
    #  k: full; |M|=0 ≤ 9 and S non-empty → S round: a (freq 1) moves to M (freq 0), b (freq 0)
    #     is evicted into G.
    #  b: G hit → marked; full; S round: c (freq 0) evicted into G; b stored into M.
    #  a: hit in M (freq 1).  l: full; |M|=2 ≤ 9: S round: d evicted.
    reqs = _single("abcdefghij") + _single("akbal")
    hits, ev, pol, _ = _run(monkeypatch, "s3fifo", reqs, 10)
    assert hits == [0] * 10 + [1, 0, 0, 1, 0]
    assert [e for e in ev if e] == [["b"], ["c"], ["d"]]
    names = _trace(reqs)[1]
    assert [names[b] for b in pol.main] == ["a", "b"] and pol.freq_P[0] == 1
    assert [names[b] for b in pol.ghost] == ["c", "d"]


def test_s3fifo_ghost_hit_enters_main_and_main_reinserts(monkeypatch):
    # c = 2: S holds 1, M 1, G 1.
    #  x x y   S=[x,y] (x freq 1); no room needed
    #  z       full, |M|=0 ≤ 1: S round: x (freq 1) → M (freq 0); y (freq 0) evicted → G=[y]
    #  y       G hit (y leaves G); full: S round: z evicted → G=[z]; y stored into M=[x,y]
    #  x x     hits: x freq 2
    #  q       full, |M|=2 > 1: M round: x (freq 2) reinserted with freq 1, y (freq 0) evicted
    #  r       |M|=1 ≤ 1: S round: q evicted → G=[z,q], trimmed to 1 id: G=[q]
    hits, ev, pol, _ = _run(monkeypatch, "s3fifo", _single("xxyzyxxqr"), 2)
    assert hits == [0, 1, 0, 0, 0, 1, 1, 0, 0]
    assert ev == [[], [], [], ["y"], ["z"], [], [], ["y"], ["q"]]
    names = _trace(_single("xxyzyxxqr"))[1]
    assert [names[b] for b in pol.main] == ["x"] and pol.freq_P[0] == 1
    assert [names[b] for b in pol.small] == ["r"] and [names[b] for b in pol.ghost] == ["q"]


def test_slru_hand_worked(monkeypatch):
    # c = 5: protected holds 4. a b c stored in probation; a, b hit → protected=[a,b];
    # d e fill (prob=[c,d,e]); f: evict probation's LRU c; c: miss, evict d;
    # a b d? d was evicted: miss, evicts e. Protected blocks survive the churn.
    hits, ev, pol, _ = _run(monkeypatch, "slru", _single("abcabdefcabd"), 5)
    assert hits == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0]
    assert [e for e in ev if e] == [["c"], ["d"], ["e"]]
    names = _trace(_single("abcabdefcabd"))[1]
    assert [names[b] for b in pol.protected] == ["a", "b"]
    assert [names[b] for b in pol.probation] == ["f", "c", "d"]


def test_slru_demotes_protected_overflow(monkeypatch):
    # c = 2: protected holds 1. a, b; a hit → protected=[a]; b hit → protected=[a,b] is over
    # its share: a is demoted to probation's MRU end; c then evicts probation's LRU, a.
    hits, ev, _, _ = _run(monkeypatch, "slru", _single("ababc"), 2)
    assert hits == [0, 0, 1, 1, 0] and ev[4] == ["a"]


def test_wtinylfu_hand_worked(monkeypatch):
    # c = 3: window 1, main 2 (protected 1). a, b, c fill it: a, b pushed from the window into
    # probation while there is room. d: full; candidate c (window LRU, estimate 1) against
    # probation's LRU a (estimate 1): not strictly more frequent, so c is evicted; window=[d].
    # d again (estimate 2), then e: candidate d (2) beats a (1): a evicted, d enters probation.
    hits, ev, pol, _ = _run(monkeypatch, "wtinylfu", _single("abcdde"), 3)
    assert hits == [0, 0, 0, 0, 1, 0]
    assert [e for e in ev if e] == [["c"], ["a"]]
    names = _trace(_single("abcdde"))[1]
    assert [names[b] for b in pol.window] == ["e"]
    assert [names[b] for b in pol.probation] == ["b", "d"] and not pol.protected


def test_frequency_sketch_against_exact_counts():
    sk = FrequencySketch(width=sketch_width(64), sample_size=10**9)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 40, size=500)
    for k in keys:
        sk.increment(int(k))
    counts = np.bincount(keys, minlength=40)
    est = np.array([sk.estimate(k) for k in range(40)])
    assert np.all(est >= np.minimum(counts, 15))  # count-min never underestimates (below 15)
    assert np.all(est <= 15)
    # aging: after sample_size increments every counter is halved
    sk = FrequencySketch(width=16, sample_size=4)
    for _ in range(3):
        sk.increment(7)
    assert sk.estimate(7) == 3 and sk.additions == 3
    sk.increment(7)
    assert sk.estimate(7) == 2 and sk.additions == 2
    with pytest.raises(ValueError):
        FrequencySketch(width=24, sample_size=1)


def test_gdsf_hand_worked(monkeypatch):
    # Single-block requests: every block is at depth 0 and saves C = s_0. c = 2, L = 0.
    #  a b    stored with H = L + 1·C = C
    #  a a    hits: F_a = 2, 3 → H_a = 3C
    #  c      full: the lowest leaf is b (C): evicted, L = C; c stored with H = L + C = 2C
    #         (L after the eviction, as in GreedyDual)
    #  d      leaves a (3C), c (2C): c evicted, L = 2C; d: H = 3C
    #  e      a (3C, touched at request 3) and d (3C, request 5) tie: the older, a, goes
    hits, ev, pol, _ = _run(monkeypatch, "gdsf", _single("abaacde"), 2)
    c0 = float(block_saving_ms(_trace(_single("abaacde"))[0], COST)[0])
    assert hits == [0, 0, 1, 1, 0, 0, 0]
    assert [e for e in ev if e] == [["b"], ["c"], ["a"]]
    assert pol.inflation == pytest.approx(3 * c0)
    assert pol.h_P[3] == pytest.approx(3 * c0) and pol.h_P[4] == pytest.approx(4 * c0)


def test_gdsf_keeps_deep_blocks_and_evicts_leaves_only(monkeypatch):
    # [p,q] then [r]: c = 2, full. A deeper block saves more (attention over a longer prefix),
    # but only leaves may go: q (a leaf) is evicted, never p under it.
    hits, ev, _, _ = _run(monkeypatch, "gdsf", [["p", "q"], ["r"], ["p", "q"]], 2)
    assert ev[1] == ["q"] and hits == [0, 0, 1]


def test_block_saving_is_the_recompute_over_the_prefix_minus_the_fetch():
    tr, _ = _trace([["a", "b", "c"]])
    s = block_saving_ms(tr, COST)
    for j in range(3):
        want = COST.recompute_ms((j + 1) * BT) - COST.recompute_ms(j * BT)
        want -= COST.transfer_ms(COST.footprint_bytes(BT))
        assert s[j] == pytest.approx(want)
    assert s[0] < s[1] < s[2] or s[0] == pytest.approx(s[1])


def test_cost_aware_hand_worked(monkeypatch):
    # τ = 1 request, c = 2, single blocks (the same C): a block's value at request n is
    # C·Σ_k e^−(n − n_k) over its requests n_k (history kept across evictions).
    #  0 a, 1 b    stored
    #  2 c         a (e^−2) < b (e^−1): a evicted
    #  3 a         b (e^−2) < c (e^−1): b evicted (a's mass now e^−3 + 1)
    #  4 b         c (e^−2) < a (e^−4 + e^−1): c evicted (b's mass e^−3 + 1)
    #  5 b, 6 a    hits
    #  7 d         b: e^−6 + e^−3 + e^−2, a: e^−7 + e^−4 + e^−1: b evicted
    hits, ev, _, _ = _run(monkeypatch, "cost_aware", _single("abcabbad"), 2, tau_requests=1.0)
    assert hits == [0, 0, 0, 0, 0, 1, 1, 0]
    assert [e for e in ev if e] == [["a"], ["b"], ["c"], ["b"]]


def test_cost_aware_tau_scale_multiplies_the_turnover(monkeypatch):
    reqs = random_requests(1)
    _, _, base, _ = _run(monkeypatch, "cost_aware", reqs, 12)
    hits, ev, pol, rec = _run(monkeypatch, "cost_aware", reqs, 12, tau_scale=3.0)
    assert pol.tau == pytest.approx(3.0 * base.tau)
    tr, names = _trace(reqs)
    ref = RefLeafPriority(12, block_saving_ms(tr, COST), kind="cost_aware", tau=pol.tau)
    r_hits, r_ev = _reference_run(ref, [list(map(int, b)) for b in tr.blocks], with_index=True)
    assert hits == r_hits and ev == [[names[b] for b in e] for e in r_ev]
    with pytest.raises(ValueError, match="tau_scale"):
        _run(monkeypatch, "cost_aware", reqs, 12, tau_scale=0.0)


def test_infinite_every_rereference_hits(monkeypatch):
    reqs = random_requests(3, 200)
    hits, ev, pol, rec = _run(monkeypatch, "infinite", reqs, 1)
    seen: set = set()
    for h, r in zip(hits, reqs, strict=True):
        assert h == _prefix_hits(r, seen)
        seen |= set(r)
    assert rec["evictions"] == 0 and rec["admits"] == len(seen) and pol.capacity == len(seen)


# ---- random traces against the references ---------------------------------------------------
REFS = {
    "arc": RefVllmARC,
    "s3fifo": RefS3FIFO,
    "slru": RefSLRU,
    "wtinylfu": RefWTinyLFU,
}


@pytest.mark.parametrize("name", list(REFS))
@pytest.mark.parametrize("seed,pool", [(0, 6), (1, 12), (2, 25)])
def test_queue_policies_equal_their_references(monkeypatch, name, seed, pool):
    reqs = random_requests(seed)
    hits, ev, _, rec = _run(monkeypatch, name, reqs, pool)
    tr, names = _trace(reqs)
    r_hits, r_ev = _reference_run(REFS[name](pool), [list(map(int, b)) for b in tr.blocks])
    assert hits == r_hits
    assert ev == [[names[b] for b in e] for e in r_ev]
    assert rec["evictions"] > 20  # the pool binds


@pytest.mark.parametrize("name", ["gdsf", "cost_aware"])
@pytest.mark.parametrize("seed,pool", [(0, 6), (1, 12), (2, 25)])
def test_leaf_policies_equal_a_brute_force_prefix_cache(monkeypatch, name, seed, pool):
    reqs = random_requests(seed)
    hits, ev, pol, rec = _run(monkeypatch, name, reqs, pool)
    tr, names = _trace(reqs)
    saving = block_saving_ms(tr, COST)
    ref = RefLeafPriority(pool, saving, kind=name, tau=getattr(pol, "tau", None))
    r_hits, r_ev = _reference_run(ref, [list(map(int, b)) for b in tr.blocks], with_index=True)
    assert hits == r_hits
    assert ev == [[names[b] for b in e] for e in r_ev]
    assert rec["evictions"] > 20


# ---- the cache's victim hook ----------------------------------------------------------------
def test_victim_hook_is_checked_and_excludes_the_heap():
    c = PrefixCache(1, n_blocks=4, leaf_only=False)
    c.bind(select_victim=lambda incoming: 3)  # 3 is not resident
    assert c.insert(0, ROOT, ())
    with pytest.raises(RuntimeError, match="not evictable"):
        c.insert(1, ROOT, ())
    with pytest.raises(ValueError, match="heap"):
        c.insert(2, ROOT, (), min_victim=(0,))
    with pytest.raises(ValueError, match="priority"):
        c.peek_victim_prio()
    with pytest.raises(ValueError, match="before the first insertion"):
        c.bind()
    refused = PrefixCache(1, n_blocks=4, leaf_only=False)
    refused.bind(select_victim=lambda incoming: None)
    assert refused.insert(0, ROOT, ()) and not refused.insert(1, ROOT, ())
    assert refused.size == 1 and not refused._heap
