"""The classical bar at key level (the jitted Zipf simulator): arc (the paper's, sizes in KiB),
s3fifo, wtinylfu, slru, gdsf, cost_aware, infinite.

Each policy's ``step`` is scanned over a trace returning, per request, its event and the set of
resident keys, so every request's hit, admission and evicted keys are compared. Hand-worked
traces use blocks of one size (1 MiB each: the paper's unit-size setting); on Zipf multimodal
traces (variable sizes) a plain-Python reference written here from each algorithm's definition,
with every list sized in KiB, must agree request by request. One step keeps every state's
shapes and dtypes; batched runs equal single runs.
"""

import math
from collections import OrderedDict

import jax
import numpy as np
import pytest

from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.cost import GIB, MIB, CostModel
from jaxkv.kvlearn.sim import policies as policies_lib
from jaxkv.kvlearn.sim import simulate as simulate_lib
from jaxkv.kvlearn.sim.policies.base import PolicySetup, RunInputs, value_density
from jaxkv.kvlearn.traces import Trace

COST = CostModel.llama3_8b_a100()
UNIT_TOKENS = 8  # 8 tokens × 128 KiB = 1 MiB = 1024 KiB per block
CLASSICAL = ("arc", "s3fifo", "wtinylfu", "slru", "gdsf", "cost_aware", "infinite")


def _unit_trace(seq: str) -> Trace:
    names = sorted(set(seq))
    key = np.array([names.index(c) for c in seq], np.int32)
    n = len(seq)
    return Trace(
        key=key,
        tokens=np.full(n, UNIT_TOKENS, np.int32),
        modality=np.zeros(n, np.int32),
        time_s=np.arange(n, dtype=np.float64),
        names=tuple(names),
    )


def _steps(name, trace: Trace, capacity_kib: int):
    """Per request: hit, admitted, n_evicted and the keys evicted (sets), from one jitted scan."""
    setup = PolicySetup(
        max_keys=trace.n_keys, n_requests=len(trace), kvlearn=simulate_lib.SimConfig().kvlearn
    )
    policy = policies_lib.make_policy(name, setup)
    inputs = RunInputs(
        capacity_kib=np.int32(capacity_kib),
        keep_P=np.zeros(trace.n_keys, bool),
        key=jax.random.key(0),
    )
    reqs = simulate_lib.sim_requests(trace, cost=COST, seed=0)

    def run(reqs, inputs):
        def f(st, r):
            st, ev = policy.step(st, r)
            pool = st if isinstance(st, pool_lib.Pool) else st.pool
            return st, (ev, pool.slot_P >= 0)

        return jax.lax.scan(f, policy.init(inputs), reqs)[1]

    ev, res_RP = jax.jit(run)(reqs, inputs)
    res_RP = np.asarray(res_RP)
    before = np.vstack([np.zeros((1, trace.n_keys), bool), res_RP[:-1]])
    gone = [set(np.flatnonzero(b & ~a).tolist()) for b, a in zip(before, res_RP, strict=True)]
    hit, adm, n_ev = (np.asarray(a) for a in (ev.hit, ev.admitted, ev.n_evicted))
    np.testing.assert_array_equal(n_ev, [len(g) for g in gone])  # events count every eviction
    return hit.tolist(), adm.tolist(), gone


def _names(trace, gone):
    return ["".join(trace.names[k] for k in sorted(g)) for g in gone]


# ---- hand-worked (blocks of one size) ---------------------------------------------------------
def test_arc_hand_worked_paper_semantics():
    # c = 2 blocks; p = 0; lists LRU first.
    #  1 a  miss: T1=[a]        2 b  miss: T1=[a,b]        3 a  hit: T1=[b] T2=[a]
    #  4 c  miss (case IV, L1 = 2 ≤ c): REPLACE: |T1|=1 > p: b → B1; T1=[c]
    #  5 b  B1 hit: p = 1; REPLACE: |T1|=1 is not > 1, b not in B2: T2's a → B2; b → T2=[b]
    #       (vLLM would store b into T1 and evict c)
    #  6 c  hit (T1 → T2=[b,c])
    #  7 a  B2 hit: p = 0; REPLACE: T1 empty: T2's b → B2=[a,b]; a → T2=[c,a], B2=[b]
    #  8 c  hit: T2=[a,c]
    #  9 d  miss (case IV, L1 = 0): REPLACE: T1 empty: a → B2=[b,a]; T1=[d]
    tr = _unit_trace("abacbcacd")
    hit, adm, gone = _steps("arc", tr, 2 * 1024)
    assert hit == [False, False, True, False, False, True, False, True, False]
    assert adm == [True, True, False, True, True, False, True, False, True]
    assert _names(tr, gone) == ["", "", "", "b", "a", "", "b", "", "a"]


def test_arc_case_a_forgets_t1_without_a_ghost():
    # c = 2: a, b fill T1. c: L1 = |T1| + |B1| = 2 = c and B1 is empty: T1's LRU a is dropped
    # with no ghost (case A), so a's return is a plain miss (no adaptation), dropping b.
    tr = _unit_trace("abcab")
    hit, adm, gone = _steps("arc", tr, 2 * 1024)
    assert hit == [False] * 5 and all(adm)
    assert _names(tr, gone) == ["", "", "a", "b", "c"]


def test_s3fifo_hand_worked():
    # Same trace as the serving test: S is 1/10 of 10 blocks = 1 block, M 9.
    tr = _unit_trace("abcdefghijakbal")
    hit, _, gone = _steps("s3fifo", tr, 10 * 1024)
    assert hit == [False] * 10 + [True, False, False, True, False]
    assert [g for g in _names(tr, gone) if g] == ["b", "c", "d"]


def test_slru_hand_worked():
    # Same trace as the serving test: c = 5 blocks, protected 4.
    tr = _unit_trace("abcabdefcabd")
    hit, _, gone = _steps("slru", tr, 5 * 1024)
    assert hit == [bool(x) for x in [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0]]
    assert [g for g in _names(tr, gone) if g] == ["c", "d", "e"]


def test_wtinylfu_hand_worked_admission_duels():
    # 2 blocks of KiB: the window (2048 − ⌊0.99·2048⌋ = 21 KiB) holds no block, so every miss
    # is a candidate at once; main (2027 KiB) holds one block.
    #  a  enters main (room)          b  estimate 1 vs a's 1: b refused (not stored)
    #  b  estimate 2 > 1: a evicted, b stored      a  2 vs b's 2: refused
    #  a  3 > 2: b evicted, a stored
    tr = _unit_trace("abbaa")
    hit, adm, gone = _steps("wtinylfu", tr, 2048)
    assert hit == [False] * 5
    assert adm == [True, False, True, False, True]
    assert _names(tr, gone) == ["", "", "a", "", "b"]


def test_gdsf_hand_worked():
    # Blocks of one size: ν is the same for all. Same trace as the serving test (c = 2):
    # b, then c, then a (the older of two equal H = 3ν) are evicted.
    tr = _unit_trace("abaacde")
    hit, _, gone = _steps("gdsf", tr, 2 * 1024)
    assert hit == [False, False, True, True, False, False, False]
    assert [g for g in _names(tr, gone) if g][:2] == ["b", "c"]


def test_cost_aware_decays_by_age():
    # τ = 1000 requests, c = 2 blocks of one ν. a at requests 0–2, b at 3: a's decayed count
    # e^0 + e^0.001 + e^0.002 ≈ 3 beats b's e^0.003 ≈ 1 (both in units of e^(n/τ)), so c evicts
    # b: three requests outweigh a recency of one request.
    tr = _unit_trace("aaabc")
    hit, _, gone = _steps("cost_aware", tr, 2 * 1024)
    assert hit == [False, True, True, False, False] and _names(tr, gone)[4] == "b"


def test_infinite_every_rereference_hits():
    tr = workloads.zipf_multimodal(2000, 0.8, seed=3)
    hit, adm, gone = _steps("infinite", tr, 1)  # the run's capacity is ignored
    seen = np.zeros(tr.n_keys, bool)
    want = []
    for k in tr.key.tolist():
        want.append(bool(seen[k]))
        seen[k] = True
    assert hit == want and adm == [not h for h in want] and not any(gone)


# ---- references in KiB (from the definitions) -----------------------------------------------
def _kib(tok):
    return int(pool_lib.block_kib(int(tok), bytes_per_token=COST.shape.bytes_per_token))


class RefARC:
    """The paper's ARC with |·| in KiB (see ``sim/policies/arc.py``)."""

    def __init__(self, c):
        self.c, self.p = c, 0
        self.T1, self.T2, self.B1, self.B2 = (OrderedDict() for _ in range(4))

    def _replace(self, x_in_b2):
        t1 = sum(self.T1.values())
        if self.T1 and (t1 > self.p or (x_in_b2 and t1 == self.p) or not self.T2):
            k, s = self.T1.popitem(last=False)
            self.B1[k] = s
        else:
            k, s = self.T2.popitem(last=False)
            self.B2[k] = s

    def request(self, x, s):
        c, T1, T2, B1, B2 = self.c, self.T1, self.T2, self.B1, self.B2
        if x in T1 or x in T2:
            (T1 if x in T1 else T2).pop(x)
            T2[x] = s
            return True, False, 0
        if s > c:
            return False, False, 0
        size = lambda d: sum(d.values())
        n = 0
        if x in B1:
            self.p = min(c, self.p + s * max(1, size(B2) // size(B1)))
        elif x in B2:
            self.p = max(0, self.p - s * max(1, size(B1) // size(B2)))
        elif size(T1) + size(B1) + s > c:
            while size(T1) + size(B1) + s > c and B1:
                B1.popitem(last=False)
            while size(T1) + s > c:
                T1.popitem(last=False)
                n += 1
        else:
            while size(T1) + size(T2) + size(B1) + size(B2) + s > 2 * c and B2:
                B2.popitem(last=False)
        in_b2 = x in B2
        while size(T1) + size(T2) + s > c:
            self._replace(in_b2)
            n += 1
        if x in B1 or x in B2:
            (B1 if x in B1 else B2).pop(x)
            T2[x] = s
        else:
            T1[x] = s
        return False, True, n


class RefS3FIFO:
    """S3-FIFO in KiB: S ⌊c/10⌋, M the rest, G ≤ |M|'s KiB; libCacheSim's eviction rounds."""

    def __init__(self, c):
        self.c, self.s_cap = c, c // 10
        self.m_cap = c - self.s_cap
        self.S, self.M, self.G = OrderedDict(), OrderedDict(), OrderedDict()
        self.freq = {}

    def _round(self):
        size = lambda d: sum(d.values())
        if size(self.M) > self.m_cap or not self.S:
            while True:
                k, s = self.M.popitem(last=False)
                if self.freq[k] == 0:
                    return 1
                self.freq[k] -= 1
                self.M[k] = s
        while self.S:
            k, s = self.S.popitem(last=False)
            if self.freq[k] >= 1:
                self.M[k], self.freq[k] = s, 0
            else:
                self.G[k] = s
                return 1
        return 0

    def request(self, x, s):
        if x in self.S or x in self.M:
            self.freq[x] = min(self.freq[x] + 1, 3)
            return True, False, 0
        ghost = self.G.pop(x, None) is not None
        if s > self.c:
            return False, False, 0
        n = 0
        while sum(self.S.values()) + sum(self.M.values()) + s > self.c:
            n += self._round()
        while sum(self.G.values()) > self.m_cap:
            self.G.popitem(last=False)
        (self.M if ghost else self.S)[x] = s
        self.freq[x] = 0
        return False, True, n


class RefSLRU:
    """SLRU in KiB: protected ≤ ⌊4c/5⌋."""

    def __init__(self, c):
        self.c, self.cap = c, c * 4 // 5
        self.prob, self.prot = OrderedDict(), OrderedDict()

    def request(self, x, s):
        if x in self.prob:
            self.prot[x] = self.prob.pop(x)
            while sum(self.prot.values()) > self.cap:
                k, v = self.prot.popitem(last=False)
                self.prob[k] = v
            return True, False, 0
        if x in self.prot:
            self.prot.move_to_end(x)
            return True, False, 0
        if s > self.c:
            return False, False, 0
        n = 0
        while sum(self.prob.values()) + sum(self.prot.values()) + s > self.c:
            (self.prob or self.prot).popitem(last=False)
            n += 1
        self.prob[x] = s
        return False, True, n


class RefWTinyLFU:
    """W-TinyLFU in KiB: main ⌊0.99c⌋ (protected ⌊4/5⌋ of it), window the rest; sequential
    duels; the sketch from its definition (4 rows, multiplicative hashing, halving)."""

    SEEDS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)

    def __init__(self, c, n_keys):
        self.main_cap = c * 99 // 100
        self.w_cap, self.p_cap = c - self.main_cap, self.main_cap * 4 // 5
        self.c = c
        self.win, self.prob, self.prot = OrderedDict(), OrderedDict(), OrderedDict()
        self.width = max(16, 1 << (n_keys - 1).bit_length())
        self.rows = [[0] * self.width for _ in self.SEEDS]
        self.sample, self.adds = 10 * n_keys, 0

    def _idx(self, k, r):
        return ((k + 1) * self.SEEDS[r] % 2**32) >> (32 - int(math.log2(self.width)))

    def _est(self, k):
        return min(row[self._idx(k, r)] for r, row in enumerate(self.rows))

    def _add(self, k):
        changed = False
        for r, row in enumerate(self.rows):
            if row[self._idx(k, r)] < 15:
                row[self._idx(k, r)] += 1
                changed = True
        self.adds += changed
        if self.adds >= self.sample:
            self.rows = [[v // 2 for v in row] for row in self.rows]
            self.adds //= 2

    def request(self, x, s):
        self._add(x)
        if x in self.win:
            self.win.move_to_end(x)
            return True, False, 0
        if x in self.prob:
            self.prot[x] = self.prob.pop(x)
            while sum(self.prot.values()) > self.p_cap:
                k, v = self.prot.popitem(last=False)
                self.prob[k] = v
            return True, False, 0
        if x in self.prot:
            self.prot.move_to_end(x)
            return True, False, 0
        if s > self.c:
            return False, False, 0
        self.win[x] = s
        n = 0
        while sum(self.win.values()) > self.w_cap:
            cand, kc = self.win.popitem(last=False)
            while True:
                if sum(self.prob.values()) + sum(self.prot.values()) + kc <= self.main_cap:
                    self.prob[cand] = kc
                    break
                seg = self.prob or self.prot
                if seg and self._est(cand) > self._est(next(iter(seg))):
                    seg.popitem(last=False)
                    n += 1
                    continue
                n += cand != x
                break
        return False, x in self.win or x in self.prob, n


class RefRanked:
    """GDSF (rank L + F·ν, L = the last victim's rank) or cost_aware (rank log ν +
    log Σ e^(n_k/τ)): evict the lowest rank until the block fits. Ranks are float32 as in the
    pool, and ties go to the lowest slot, so the pool's slot allocation is replayed (a stack of
    free slots, 0 on top; victims pushed in order, the new block takes the top)."""

    def __init__(self, c, n_keys, *, kind, tau=1000.0):
        self.c, self.kind, self.tau = c, kind, tau
        self.rank, self.size, self.freq, self.mass, self.slot = {}, {}, {}, {}, {}
        self.free = list(range(n_keys - 1, -1, -1))
        self.L = np.float32(0.0)

    def request(self, x, s, nu, i):
        if self.kind == "cost_aware":
            self.mass[x] = float(np.logaddexp(self.mass.get(x, -np.inf), i / self.tau))
            value = math.log(nu) + self.mass[x]
        nu = np.float32(nu)
        if x in self.rank:
            self.freq[x] += 1
            gd = self.L + np.float32(self.freq[x]) * nu
            self.rank[x] = gd if self.kind == "gdsf" else value
            return True, False, 0
        if s > self.c:
            return False, False, 0
        n = 0
        while sum(self.size.values()) + s > self.c:
            v = min(self.rank, key=lambda k: (self.rank[k], self.slot[k]))
            self.L = max(self.L, np.float32(self.rank.pop(v)))
            del self.size[v]
            self.free.append(self.slot.pop(v))
            n += 1
        self.freq[x], self.size[x], self.slot[x] = 1, s, self.free.pop()
        self.rank[x] = self.L + nu if self.kind == "gdsf" else value
        return False, True, n


def _nu(tokens):
    """ν as the simulator computes it (float32)."""
    return float(value_density(COST, np.int32(tokens)))


def _reference(name, trace, cap_kib):
    ref = {
        "arc": lambda: RefARC(cap_kib),
        "s3fifo": lambda: RefS3FIFO(cap_kib),
        "slru": lambda: RefSLRU(cap_kib),
        "wtinylfu": lambda: RefWTinyLFU(cap_kib, trace.n_keys),
        "gdsf": lambda: RefRanked(cap_kib, trace.n_keys, kind="gdsf"),
        "cost_aware": lambda: RefRanked(cap_kib, trace.n_keys, kind="cost_aware"),
    }[name]()
    out = []
    for i, (k, tok) in enumerate(zip(trace.key.tolist(), trace.tokens.tolist(), strict=True)):
        if name in ("gdsf", "cost_aware"):
            out.append(ref.request(k, _kib(tok), _nu(tok), i))
        else:
            out.append(ref.request(k, _kib(tok)))
    return [list(x) for x in zip(*out, strict=True)]


@pytest.mark.parametrize("name", ["arc", "s3fifo", "slru", "wtinylfu", "gdsf", "cost_aware"])
@pytest.mark.parametrize("alpha,pool", [(0.8, 600 * MIB), (1.1, 2 * GIB)])
def test_equals_the_reference_on_zipf_traces(name, alpha, pool):
    tr = workloads.zipf_multimodal(1500, alpha, seed=21)
    cap_kib = int(pool_lib.bytes_to_kib(int(pool)))
    hit, adm, gone = _steps(name, tr, cap_kib)
    r_hit, r_adm, r_n = _reference(name, tr, cap_kib)
    assert hit == r_hit
    assert adm == r_adm
    assert [len(g) for g in gone] == r_n
    assert sum(r_n) > 20  # the pool binds


def test_every_classical_policy_is_registered_and_runs_batched():
    assert set(CLASSICAL) <= set(policies_lib.POOL_POLICIES)
    tr = workloads.zipf_multimodal(400, 1.1, seed=5)
    for name in ("arc", "s3fifo", "wtinylfu"):
        one = simulate_lib.run(name, tr, capacity_bytes=1 * GIB)
        batch = simulate_lib.run_batch(name, [tr, tr], capacities_bytes=[1 * GIB] * 2, seeds=[0, 0])
        for b in batch:
            assert {k: b[k] for k in one} == one


@pytest.mark.parametrize("name", CLASSICAL)
def test_step_keeps_the_carry_shapes_and_dtypes(name):
    """One step maps each policy's state pytree onto itself (eval_shape, no compile)."""
    tr = workloads.zipf_multimodal(50, 1.1, seed=0)
    setup = PolicySetup(
        max_keys=tr.n_keys, n_requests=len(tr), kvlearn=simulate_lib.SimConfig().kvlearn
    )
    policy = policies_lib.make_policy(name, setup)
    inputs = RunInputs(np.int32(1 << 20), np.zeros(tr.n_keys, bool), jax.random.key(0))
    req = jax.tree.map(lambda a: a[0], simulate_lib.sim_requests(tr, cost=COST, seed=0))
    spec = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
    before = jax.eval_shape(policy.init, inputs)
    after, _ = jax.eval_shape(policy.step, before, req)
    assert jax.tree.structure(before) == jax.tree.structure(after)
    assert spec(before) == spec(after)
