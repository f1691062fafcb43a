"""``kvlearn_experts``: block KVLearn as regret-minimising expert learning (LeCaR / CACHEUS style).

The block KVLearn (``kvlearn.BlockKVLearn``) ranks blocks by one learned score, so when its PRP
is wrong the pool is wrong, and nothing pulls it back toward the rule that would have been
right. This policy keeps several *experts*, each an eviction order over the leaves of the
prefix cache, and learns online which one to follow from the misses its own evictions cause
(Vietri et al., "Driving cache replacement with ML-based LeCaR", HotStorage 2018; Rodriguez et
al., CACHEUS, FAST 2021):

* **Experts** (``experts``): ``lru`` (least recently touched leaf: ``mooncake``'s order),
  ``lfu`` (fewest accesses, ties LRU: ``lfu``'s order), ``gd`` (KVLearn's GreedyDual
  retention: L_gd + P̂·s_j with the block PRP of ``BlockKVLearn``, whose features, labels,
  horizon and training this class inherits unchanged) and ``gdsf`` (GreedyDual-Size-Frequency:
  L + F·C, F the accesses since stored, C the block's saving ``block_saving_ms``; the
  classical ``gdsf`` order). Each expert keeps its own lazy heap of the resident blocks
  (entries (value, touch tick, version, block); stale and non-leaf entries are dropped when
  met, and a block that becomes a leaf again is re-pushed).
* **Eviction**: each victim is the lowest leaf of one expert, drawn with probability w_e
  (``choice="sample"``, seeded) or the heaviest expert (``choice="max"``). The block goes into
  that expert's ghost history H_e (the last ``history`` × capacity blocks it evicted, with the
  block-access clock t at eviction). GreedyDual's L (``gd``, ``gdsf``) rises at every eviction to
  that expert's lowest value among the leaves (what it would itself have evicted), whoever
  evicts: alone, that is GreedyDual's L exactly.
* **Regret**: when a request misses a block that is in H_e (the block is recomputed because e
  evicted it), e pays: w_e ← w_e · exp(−λ · d^(t − t_evict)), d^(N) = ``discount`` with N the
  pool's capacity in blocks (LeCaR's λ = 0.45, d = 0.005^(1/N)), and the weights are
  renormalised (``cost_weighted``: the regret is scaled by the miss's recompute, s_j / s_0).
  The block leaves H_e; a block admitted again leaves every history.
* **Shadow pools** (``choice="shadow"``, the default, instead of the weights): every expert
  also runs its own pool of the same capacity (``ShadowPool``: the prefix cache it alone would
  keep, fed every request at lookup), scored by the recompute its hits saved, Σ s_j over the
  hit prefix, decayed over the label horizon H (γ = 1 − 1/H per request). The best-scoring
  expert evicts in the real pool (the first expert until another leads), switching only when
  a challenger leads by more than ``margin``. This credits each expert with what its whole
  policy would have saved in TTFT terms, where LeCaR's ghost hits count misses only.
* **Admission**: every computed block is admitted (``write_cost=False``, the default here);
  ``write_cost=True`` keeps ``BlockKVLearn``'s write-cost gate (admit iff P̂·s_j > T(512)).

Safe by construction in the sense that can be tested: with one expert the policy *is* that
expert (``lru`` → ``mooncake`` and ``lfu`` → ``lfu``, event for event; tested), and a PRP that
misjudges a workload can only cost the evictions its expert is given. It does not bound the
loss to the best expert: LeCaR's weights count misses, not what a policy saves, a sampled
mixture can be worse than either expert, and a change of shadow leader inherits the pool the
previous leader built. ``lru``/``lfu`` here are leaf orders of the prefix cache, not the
independent-key LRU-Pool (``lru``). In the leave-one-workload-out protocol no fold chose an
expert setting over the plain ``kvlearn`` ``gd`` (``docs/kvlearn.md``).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math

import numpy as np

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import block_saving_ms
from jaxkv.kvlearn.serving.policies.kvlearn import BlockKVLearn
from jaxkv.kvlearn.serving.prefix import ROOT, PrefixCache
from jaxkv.kvlearn.traces import MooncakeTrace

EXPERTS = ("lru", "lfu", "gd", "gdsf")
"""The expert eviction orders this policy can learn over."""


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
    """The expert learner's hyper-parameters (the PRP's are ``BlockKVLearnConfig``'s). The
    defaults are the expert setting with the lowest tuning score in every fold of the
    leave-one-workload-out protocol (``shadow:gd+gdsf+lru+lfu``; ``docs/kvlearn.md``); LeCaR's
    own rule is ``choice="sample", cost_weighted=False`` with λ, discount, history as here.

    Attributes:
        experts: names from ``EXPERTS``, distinct, at least one.
        learning_rate: λ of the multiplicative update (LeCaR: 0.45).
        discount: the regret of a ghost hit one capacity of block accesses after its eviction
            (LeCaR: 0.005).
        history: ghost history per expert, in capacities (LeCaR: 1).
        choice: ``"sample"`` (draw the evicting expert by weight), ``"max"`` (the heaviest) or
            ``"shadow"`` (the expert whose shadow pool saved the most recompute lately:
            ``ShadowPool``; the weights are then kept but unused).
        margin: (``"shadow"``) a challenger leads only once its score exceeds the leader's by
            this fraction (hysteresis against flapping).
        cost_weighted: scale a ghost hit's regret by what the miss costs, s_j / s_0 (a miss
            of a deep block costs more recompute than a shallow one); False: LeCaR's count.
    """

    experts: tuple[str, ...] = ("gd", "gdsf", "lru", "lfu")
    learning_rate: float = 0.45
    discount: float = 0.005
    history: float = 1.0
    choice: str = "shadow"
    cost_weighted: bool = True
    margin: float = 0.02

    def __post_init__(self):
        bad = [e for e in self.experts if e not in EXPERTS]
        if not self.experts or bad or len(set(self.experts)) != len(self.experts):
            raise ValueError(f"experts must be distinct names from {EXPERTS}, got {self.experts}")
        if self.choice not in ("sample", "max", "shadow"):
            raise ValueError(f"choice must be 'sample', 'max' or 'shadow', got {self.choice!r}")
        if not self.margin >= 0:
            raise ValueError(f"margin must be ≥ 0, got {self.margin}")
        if not (self.learning_rate >= 0 and 0 < self.discount <= 1 and self.history > 0):
            raise ValueError("need learning_rate ≥ 0, 0 < discount ≤ 1 and history > 0")


@dataclasses.dataclass
class ExpertState:
    """Everything the expert learner changes while it runs (the PRP's is ``BlockKVLearnState``).

    Attributes:
        weights_E: w_e, summing to 1.      value_EP: each expert's value of each block at its
            last touch.     tick_P: the touch clock then.     version_P: heap entries older
            than it are stale.
        heaps: one lazy heap per expert.   ghosts: per expert, block → block-access clock at
            eviction (oldest first).
        inflation_E: GreedyDual's L per expert (0 for non-GD experts).
        tick: touches so far.   t: block accesses so far.   chooser: the expert of the
            eviction in progress.   parent: the parent of the block being offered.
        ghost_hits_E, evictions_E: counters (diagnostics).
        freq_P: accesses since the block was last stored in the pool (``gdsf``).
        score_E: (``"shadow"``) each shadow pool's decayed recompute saved (ms).
        leader: (``"shadow"``) the expert that evicts.
    """

    weights_E: np.ndarray
    value_EP: np.ndarray
    tick_P: np.ndarray
    version_P: np.ndarray
    heaps: list[list]
    ghosts: list[collections.OrderedDict]
    inflation_E: np.ndarray
    ghost_hits_E: np.ndarray
    evictions_E: np.ndarray
    freq_P: np.ndarray
    score_E: np.ndarray
    tick: int = 0
    t: int = 0
    chooser: int = 0
    parent: int = ROOT
    leader: int = 0

    @classmethod
    def empty(cls, n_experts: int, n_blocks: int) -> ExpertState:
        e = n_experts
        return cls(
            weights_E=np.full(e, 1.0 / e),
            value_EP=np.zeros((e, n_blocks)),
            tick_P=np.zeros(n_blocks, np.int64),
            version_P=np.zeros(n_blocks, np.int64),
            heaps=[[] for _ in range(e)],
            ghosts=[collections.OrderedDict() for _ in range(e)],
            inflation_E=np.zeros(e),
            ghost_hits_E=np.zeros(e, np.int64),
            evictions_E=np.zeros(e, np.int64),
            freq_P=np.zeros(n_blocks, np.int64),
            score_E=np.zeros(e),
        )


def regret(age: float, *, capacity: int, discount: float) -> float:
    """LeCaR's regret of a ghost hit ``age`` block accesses after the eviction:
    d^age with d = discount^(1/capacity)."""
    return discount ** (age / max(capacity, 1))


def penalise(weights_E: np.ndarray, e: int, r: float, *, learning_rate: float) -> np.ndarray:
    """w_e ← w_e · exp(−λ r), renormalised (a new array)."""
    w = weights_E.copy()
    w[e] *= math.exp(-learning_rate * r)
    return w / w.sum()


class ExpertKVLearn(BlockKVLearn):
    """See the module docstring. ``hparams``: ``ExpertConfig``'s fields and
    ``BlockKVLearnConfig``'s (``write_cost`` defaults to False here; ``retention`` is unused)."""

    name = "kvlearn_experts"
    selects_victims = True

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int, **hparams):
        names = {f.name for f in dataclasses.fields(ExpertConfig)}
        mine = {k: hparams.pop(k) for k in list(hparams) if k in names}
        if "experts" in mine:
            mine["experts"] = tuple(mine["experts"])
        hparams.setdefault("write_cost", False)
        super().__init__(trace, cost, pool_blocks=pool_blocks, **hparams)
        self.xcfg = ExpertConfig(**mine)
        self.xs = ExpertState.empty(len(self.xcfg.experts), trace.n_blocks)
        self.rng = np.random.default_rng(self.cfg.seed)
        self.gd_experts = [k for k, e in enumerate(self.xcfg.experts) if e in ("gd", "gdsf")]
        self.block_save_P = block_saving_ms(trace, cost)
        shadows = self.xcfg.choice == "shadow" and len(self.xcfg.experts) > 1
        self.shadows = [
            ShadowPool(e, self.capacity, trace.n_blocks) for e in self.xcfg.experts if shadows
        ]
        self.request_blocks = trace.blocks

    # ---- expert values and heaps ------------------------------------------------------------
    def _value(self, e: str, k: int, b: int, j: int) -> float:
        if e == "lru":
            return float(self.xs.tick)
        if e == "lfu":
            return float(self.state.count_P[b])
        if e == "gdsf":
            return float(self.xs.inflation_E[k] + self.xs.freq_P[b] * self.block_save_P[b])
        return float(self.xs.inflation_E[k] + self.state.p_hat_P[b] * self.costs.save_ms[j])

    def _push(self, b: int) -> None:
        xs = self.xs
        for k in range(len(xs.heaps)):
            entry = (float(xs.value_EP[k, b]), int(xs.tick_P[b]), int(xs.version_P[b]), b)
            heapq.heappush(xs.heaps[k], entry)

    def _lowest(self, k: int) -> int | None:
        """Expert k's lowest resident leaf (stale and non-leaf entries are dropped)."""
        h, xs, cache = self.xs.heaps[k], self.xs, self.cache
        while h:
            _, _, ver, b = h[0]
            if cache.resident[b] and ver == xs.version_P[b] and cache.n_children[b] == 0:
                return b
            heapq.heappop(h)  # a non-leaf is re-pushed when it becomes a leaf (``on_evict``)
        return None

    def _choose(self) -> int:
        w = self.xs.weights_E
        if len(w) == 1:
            return 0
        if self.xcfg.choice == "shadow":
            return self.xs.leader
        if self.xcfg.choice == "max":
            return int(np.argmax(w))
        return min(int(np.searchsorted(np.cumsum(w), self.rng.random(), side="right")), len(w) - 1)

    # ---- the BlockPolicy hooks --------------------------------------------------------------
    def attach(self, cache: PrefixCache) -> None:
        self.cache = cache
        cache.bind(select_victim=self.victim, on_insert=self.on_insert)

    def prio(self, b, i, j, now):
        xs = self.xs
        xs.tick += 1
        xs.tick_P[b] = xs.tick
        xs.version_P[b] += 1
        xs.freq_P[b] = xs.freq_P[b] + 1 if self.cache.resident[b] else 1
        for k, e in enumerate(self.xcfg.experts):
            xs.value_EP[k, b] = self._value(e, k, b, j)
        if self.cache.resident[b]:  # an incoming block is pushed once resident (``on_insert``)
            self._push(b)
        return (xs.tick,)  # the cache keeps it but selects victims through ``victim``

    def gate(self, b, i, j, now):
        """Admit every computed block (``write_cost=True``: iff P̂·s_j > T(512))."""
        self.xs.parent = ROOT if j == 0 else int(self.request_blocks[i][j - 1])
        p = self.state.p_hat_P[b]
        return bool(p >= self.cfg.theta and p * self.costs.save_ms[j] > self.costs.write_ms), None

    def victim(self, incoming: int) -> int | None:
        xs = self.xs
        k = self._choose()
        v = self._lowest(k)
        if v is None:  # nothing evictable: the pinned parent becomes a leaf again
            if xs.parent != ROOT and self.cache.resident[xs.parent]:
                self._push(xs.parent)
            return None
        for g in self.gd_experts:  # L_gd: the value GreedyDual itself would evict now
            low = v if g == k else self._lowest(g)
            if low is not None:
                xs.inflation_E[g] = max(xs.inflation_E[g], float(xs.value_EP[g, low]))
        xs.chooser = k
        return v

    def on_evict(self, b: int) -> None:
        st, xs = self.state, self.xs
        st.n_evict += 1
        xs.version_P[b] += 1
        k = xs.chooser
        xs.evictions_E[k] += 1
        ghosts = xs.ghosts[k]
        ghosts[b] = xs.t
        ghosts.move_to_end(b)
        while len(ghosts) > self.xcfg.history * max(self.capacity, 1):
            ghosts.popitem(last=False)
        p = int(self.cache.parent[b])
        if p != ROOT and self.cache.resident[p] and self.cache.n_children[p] == 0:
            self._push(p)  # a leaf again: eligible in every expert's heap

    def on_insert(self, b: int) -> None:
        self._push(b)
        for ghosts in self.xs.ghosts:
            ghosts.pop(b, None)

    def on_access(self, blocks, hit, i, now):
        super().on_access(blocks, hit, i, now)
        xs, x = self.xs, self.xcfg
        xs.t += len(blocks)
        save = self.costs.save_ms
        for j, b in enumerate(blocks[hit:].tolist(), start=hit):
            for k, ghosts in enumerate(xs.ghosts):
                t_evict = ghosts.pop(b, None)
                if t_evict is None:
                    continue
                xs.ghost_hits_E[k] += 1
                r = regret(xs.t - t_evict, capacity=self.capacity, discount=x.discount)
                r *= save[j] / max(save[0], 1e-9) if x.cost_weighted else 1.0
                xs.weights_E = penalise(xs.weights_E, k, r, learning_rate=x.learning_rate)
        if self.shadows:
            saved = np.array([sh.step(self, blocks) for sh in self.shadows])
            xs.score_E = (1.0 - 1.0 / max(self.state.horizon, 1.0)) * xs.score_E + saved
            xs.leader = lead(xs.score_E, xs.leader, margin=x.margin)


def lead(score_E: np.ndarray, leader: int, *, margin: float) -> int:
    """The new leader: the best-scoring expert if it beats the current leader's score by more
    than ``margin`` (a fraction), else the current leader."""
    best = int(np.argmax(score_E))
    return best if score_E[best] > (1.0 + margin) * score_E[leader] else leader


class ShadowPool:
    """One expert's own pool (``choice="shadow"``): the prefix cache of the same capacity that
    this expert alone would keep, fed every request at its lookup (its misses stored at once,
    in prefix order, every block admitted). ``step`` returns the recompute its hits saved,
    Σ s_j over the hit prefix (ms), the score the leader is chosen by. The PRP's P̂ and the
    access counts are the policy's (``gd``, ``lfu``); GreedyDual's L (``gd``, ``gdsf``) and
    the frequency since stored (``gdsf``) are the shadow's own."""

    def __init__(self, kind: str, capacity: int, n_blocks: int):
        self.kind = kind
        self.cache = PrefixCache(capacity, n_blocks=n_blocks, on_evict=self._evicted)
        self.freq_P = np.zeros(n_blocks, np.int64)
        self.inflation = 0.0
        self.tick = 0

    def _evicted(self, b: int) -> None:
        self.inflation = max(self.inflation, self.cache.prio[b][0])

    def _key(self, pol: ExpertKVLearn, b: int, j: int) -> tuple:
        self.tick += 1
        if self.kind == "lru":
            return (self.tick,)
        if self.kind == "lfu":
            return (int(pol.state.count_P[b]), self.tick)
        if self.kind == "gdsf":
            self.freq_P[b] = self.freq_P[b] + 1 if self.cache.resident[b] else 1
            return (self.inflation + self.freq_P[b] * float(pol.block_save_P[b]), self.tick)
        v = self.inflation + float(pol.state.p_hat_P[b]) * float(pol.costs.save_ms[j])
        return (v, self.tick)

    def step(self, pol: ExpertKVLearn, blocks) -> float:
        """One request: touch the hit prefix, store the rest; the recompute saved (ms)."""
        c = self.cache
        hit = c.match(blocks) if c.capacity else 0
        for j in range(hit):
            c.touch(int(blocks[j]), self._key(pol, int(blocks[j]), j))
        parent = int(blocks[hit - 1]) if hit else ROOT
        for j in range(hit, len(blocks) if c.capacity else 0):
            b = int(blocks[j])
            if not c.insert(b, parent, self._key(pol, b, j)):
                break
            parent = b
        return float(pol.costs.save_ms[:hit].sum())
