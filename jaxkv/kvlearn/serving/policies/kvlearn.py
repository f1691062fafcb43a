"""``kvlearn``: KVLearn at block granularity for the serving simulator (``BlockKVLearn``).

The design of the core (PRP → CARS → keep/evict) carried to the blocks of a Mooncake prefix
cache:

* **PRP (per block)**: the core's jitted Flax MLP (``core.prp``: 16 → 32 → 1, Adam 5e-3, replay
  buffer of 20k labels, a training round every 100 labels, running whitening) over 16
  per-access block features (``block_features``): log depth in the prefix, log distance to the
  request's end, last (partial) block, log accesses of the block, first access, log requests
  since its previous access, log previous reuse gap, hit in the pool, seen before (ghost
  history), log distinct children, the request's hit and seen fractions, log request length,
  log accesses of the parent, log ghost misses (requests that recomputed a block seen before),
  log marginal saving at this depth. The optax training rounds run in the core's jitted code
  (``prp.push_labels`` + ``prp.maybe_train``, one padded shape, so one compilation); the running
  whitening statistics and the forward pass run in numpy on the host from the current
  parameters (``prp.host_predict``: equal to ``prp.predict`` up to float rounding; the host
  knows when a round ran and fetches the new parameters only then; ``predictors.HostPRP``).
  ``predictor="logistic"`` swaps in a numpy logistic regression (ablation).
* **Label** (one per access): the block is requested again within H requests. H is counted in
  *requests*, not seconds (it keeps its meaning when arrivals are scaled) and follows the pool:
  H = ``horizon_mult`` × pool turnover = capacity / evictions per request (capacity / blocks per
  request before the pool first fills), i.e. "reused before the pool would have cycled?".
  Windows opened earlier expire against the current H. H is capped at ``horizon_max`` = 800
  requests: in a pool that rarely evicts the turnover outgrows the trace, no window ever
  expires, the PRP sees only positives and admits every block (at the 50 % pool 71 % of the
  admitted blocks were never requested again). (``turnover_from_evictions=False`` always uses
  capacity / blocks per request: an ablation.)
* **Retention (CARS at block level, GreedyDual)**: priority = L + P̂ · s_j, s_j = R((j+1)·512) −
  R(j·512) − T(512) the time a hit on a block at depth j saves (the suffix of a cached prefix pays
  its attention over the prefix, so deep blocks save more), L = the priority of the last victim
  (inflation: blocks not touched again age out). Eviction takes the lowest priority among leaves,
  so the resident set stays prefix-closed and value per slot (= per byte) decides.
  ``retention="recency"`` uses last access + H·P̂ instead (ablation).
* **Admission (CARS with the write cost)**: a computed block is admitted iff its expected saving
  P̂ · s_j exceeds the cost of writing it to the pool, T(512) on the fabric (CARS = P̂·(R − T) − U
  with the write as the cost: break-even P̂ = T / s_j, 0.25 for a shallow block and falling with
  depth under the A100 preset), and its priority beats the victim's (never destroy more value
  than is added). ``theta`` adds a fixed floor P̂ ≥ θ and ``write_cost=False`` drops the write
  cost (ablations; the previous rule was θ = 0.2 alone).

Hyper-parameters (the write-cost admission without θ, ``horizon_mult`` = 2, ``horizon_max`` =
800 of {300, 800, ∞}, the MLP, GreedyDual retention) were chosen on the first 2,000 requests of
the shipped trace and on two MM-Session traces only, never on the reported evaluation
(``docs/kvlearn.md``; ``scripts/bench_kvlearn_serving.py --tune`` reruns the comparison). Not
the core's CARS/ATC code: the pool is counted in slots (every block one slot) and the storage
term U is not priced explicitly; the adaptive horizon and the GreedyDual inflation L play the
ATC's role of pricing space.

The policy's hyper-parameters are a ``BlockKVLearnConfig``; everything it changes while it runs
is one ``BlockKVLearnState`` (per-block numpy arrays, label windows, the horizon's estimates);
its costs per depth are a ``DepthCosts``; the predictor keeps its own state
(``predictors``).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from jaxkv.kvlearn.core.features import N_FEATURES
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy
from jaxkv.kvlearn.serving.predictors import BlockPredictor, DeferredPRP, Logistic
from jaxkv.kvlearn.serving.prefix import PrefixCache
from jaxkv.kvlearn.traces import MooncakeTrace

_BY_LENGTH = [0, 1, 2, 12, 15]  # feature columns that depend on the request's length alone


@dataclasses.dataclass(frozen=True)
class BlockKVLearnConfig:
    """Hyper-parameters (see the module docstring; the defaults are the tuned ones).

    Attributes:
        theta: fixed admission floor P̂ ≥ θ (0: the write cost alone decides).
        horizon_mult, horizon_min, horizon_max: H = mult × pool turnover, clipped (requests).
        predictor: ``"mlp"`` (the core's PRP) or ``"logistic"`` (ablation; ``lr``, ``batch``).
        seed: the PRP's initialisation and training keys.
        retention: ``"gd"`` (GreedyDual on P̂·s_j) or ``"recency"`` (ablation).
        write_cost: admit only if P̂·s_j exceeds the write T(512) (False: ablation).
        turnover_from_evictions: measure the turnover by evictions once the pool evicts.
    """

    theta: float = 0.0
    horizon_mult: float = 2.0
    horizon_min: float = 20.0
    horizon_max: float = 800.0
    predictor: str = "mlp"
    lr: float = 0.05
    batch: int = 256
    seed: int = 0
    retention: str = "gd"
    write_cost: bool = True
    turnover_from_evictions: bool = True

    def __post_init__(self):
        if self.retention not in ("gd", "recency"):
            raise ValueError(f"retention must be 'gd' or 'recency', got {self.retention!r}")
        if self.predictor not in ("mlp", "logistic"):
            raise ValueError(f"predictor must be 'mlp' or 'logistic', got {self.predictor!r}")


@dataclasses.dataclass(frozen=True)
class DepthCosts:
    """What a block is worth by its depth j in a request (fixed for a trace and cost model).

    Attributes:
        write_ms: T(512), writing one block prefill → pool (−inf without the write cost).
        save_ms: [max depth + 1] s_j = R((j+1)·512) − R(j·512) − T(512), floored at 0.
        log_save: [max depth + 1] log(s_j / s_0) (feature 15).
    """

    write_ms: float
    save_ms: np.ndarray
    log_save: np.ndarray

    @classmethod
    def of(cls, trace: MooncakeTrace, cost: CostModel, *, write_cost: bool) -> DepthCosts:
        bt = trace.block_tokens
        t_blk = float(cost.transfer_ms(cost.footprint_bytes(bt)))
        j = np.arange(max((len(b) for b in trace.blocks), default=1) + 1, dtype=np.float64)
        r_j = np.asarray(cost.recompute_ms(j * bt), np.float64)
        save = np.maximum(np.diff(r_j, append=2 * r_j[-1] - r_j[-2]) - t_blk, 0.0)
        log_save = np.log(np.maximum(save, 1e-3) / max(save[0], 1e-3))
        return cls(write_ms=t_blk if write_cost else -np.inf, save_ms=save, log_save=log_save)


@dataclasses.dataclass
class BlockKVLearnState:
    """Everything ``BlockKVLearn`` changes while it runs ([P] arrays over block ids, updated in
    place, and counters).

    Attributes:
        count_P: accesses so far.           ghost_P: misses after the block had been seen.
        last_req_P: the last request holding the block (-1: none).
        gap_P: requests between its last two accesses (-1: fewer than two).
        n_child_P: distinct children seen; ``seen_child`` holds the (parent · P + child) pairs.
        p_hat_P: P̂ at the block's latest access.   prio_P: the priority it was last given.
        inflation: GreedyDual's L, the priority of the last victim.
        window_x_PI: features at the opening of each block's label window.
        window_id_P: event id of the open window (-1: none); ``n_event`` ids given so far.
        pending: (request, blocks, first event id) per request, in request order (expiry).
        new_x, new_y: labels closed since the predictor last learned.
        horizon: H in requests.   rate_blocks, rate_evict: EMAs of blocks and evictions per
            request.   n_req: requests seen.   n_evict: evictions since the last request.
    """

    count_P: np.ndarray
    ghost_P: np.ndarray
    last_req_P: np.ndarray
    gap_P: np.ndarray
    n_child_P: np.ndarray
    seen_child: set[int]
    p_hat_P: np.ndarray
    prio_P: np.ndarray
    window_x_PI: np.ndarray
    window_id_P: np.ndarray
    pending: collections.deque
    horizon: float
    new_x: list[np.ndarray] = dataclasses.field(default_factory=list)
    new_y: list[np.ndarray] = dataclasses.field(default_factory=list)
    inflation: float = 0.0
    n_event: int = 0
    rate_blocks: float = 0.0
    rate_evict: float = 0.0
    n_req: int = 0
    n_evict: int = 0

    @classmethod
    def empty(cls, n_blocks: int, *, horizon: float) -> BlockKVLearnState:
        """Nothing seen yet, for ``n_blocks`` block ids."""
        p = n_blocks
        return cls(
            count_P=np.zeros(p, np.int64),
            ghost_P=np.zeros(p, np.int64),
            last_req_P=np.full(p, -1, np.int64),
            gap_P=np.full(p, -1, np.int64),
            n_child_P=np.zeros(p, np.int64),
            seen_child=set(),
            p_hat_P=np.zeros(p),
            prio_P=np.zeros(p),
            window_x_PI=np.zeros((p, N_FEATURES), np.float32),
            window_id_P=np.full(p, -1, np.int64),
            pending=collections.deque(),
            horizon=horizon,
        )


class BlockKVLearn(BlockPolicy):
    """See the module docstring; ``hparams`` are ``BlockKVLearnConfig``'s fields."""

    name = "kvlearn"

    def __init__(self, trace: MooncakeTrace, cost: CostModel, *, pool_blocks: int, **hparams):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        self.cfg = BlockKVLearnConfig(**hparams)
        self.costs = DepthCosts.of(trace, cost, write_cost=self.cfg.write_cost)
        self.state = BlockKVLearnState.empty(trace.n_blocks, horizon=self.cfg.horizon_min)
        self.cache: PrefixCache | None = None
        self._length_features: dict[int, np.ndarray] = {}  # m → ``_by_length(m)``
        # per-block reads and writes go through memoryviews (the same memory, Python floats:
        # about twice as fast as the arrays, block by block); s_j as a list
        self._p_hat_v, self._prio_v = memoryview(self.state.p_hat_P), memoryview(self.state.prio_P)
        self._save = self.costs.save_ms.tolist()
        self.pred: BlockPredictor = (
            DeferredPRP(seed=self.cfg.seed)
            if self.cfg.predictor == "mlp"
            else Logistic(lr=self.cfg.lr, batch=self.cfg.batch)
        )

    # ---- features and labels ----------------------------------------------------------------
    def block_features(self, blocks, hit: int, i: int) -> np.ndarray:
        """[m, I] features of request i's m blocks (see the module docstring)."""
        st = self.state
        m = len(blocks)
        x_BI = np.empty((m, N_FEATURES))  # float64 columns, rounded to float32 once at the end
        x_BI[:, _BY_LENGTH] = self._by_length(m)
        cnt = st.count_P[blocks]
        seen = np.cumprod(cnt > 0)  # prefix of blocks seen before (ghost history)
        since = np.where(st.last_req_P[blocks] >= 0, i - st.last_req_P[blocks], -1)
        parent_cnt = np.concatenate([[0], cnt[:-1]])
        gap = st.gap_P[blocks]
        x_BI[:, 3] = np.log1p(cnt)
        x_BI[:, 4] = cnt == 0
        x_BI[:, 5] = np.log1p(np.maximum(since, 0)) * (since >= 0)
        x_BI[:, 6] = np.log1p(np.maximum(gap, 0)) * (gap >= 0)
        x_BI[:, 7] = np.arange(m) < hit
        x_BI[:, 8] = seen
        x_BI[:, 9] = np.log1p(st.n_child_P[blocks])
        x_BI[:, 10] = hit / m
        x_BI[:, 11] = seen.sum() / m
        x_BI[:, 13] = np.log1p(parent_cnt)
        x_BI[:, 14] = np.log1p(st.ghost_P[blocks])
        return x_BI.astype(np.float32)

    def _by_length(self, m: int) -> np.ndarray:
        """[m, 5] the features that depend on the request's length alone (``_BY_LENGTH``:
        depth, distance to the end, last block, length, marginal saving), computed once per
        length."""
        out = self._length_features.get(m)
        if out is None:
            j = np.arange(m)
            cols = [np.log1p(j), np.log1p(m - 1 - j), (j == m - 1)]
            cols += [np.full(m, np.log1p(m)), self.costs.log_save[j]]
            out = self._length_features[m] = np.stack(cols, axis=1).astype(np.float64)
        return out

    def _label(self, bs: np.ndarray, y: float) -> None:
        """Closes the open windows of blocks ``bs`` with label y (features from their opening)."""
        st = self.state
        st.new_x.append(st.window_x_PI[bs])
        st.new_y.append(np.full(len(bs), y, np.float32))
        st.window_id_P[bs] = -1

    def _expire(self, i: int) -> None:
        st = self.state
        q = st.pending  # one entry per request, in request order; the current H decides
        while q and q[0][0] + st.horizon < i:
            _, blocks, ev0 = q.popleft()
            still = st.window_id_P[blocks] == ev0 + np.arange(len(blocks))  # not reused since
            self._label(blocks[still], 0.0)

    def _count_children(self, blocks) -> None:
        st = self.state
        p = len(st.n_child_P)
        keys = (blocks[:-1] * p + blocks[1:]).tolist()  # (parent, child) pairs
        new = set(keys) - st.seen_child
        if new:
            st.seen_child |= new
            np.add.at(st.n_child_P, np.fromiter(new, np.int64, len(new)) // p, 1)

    def _update_horizon(self, m: int) -> None:
        """H = mult × pool turnover in requests: capacity / (evictions per request), or
        capacity / (blocks per request) before the pool first fills (EMAs over ~200 requests)."""
        st, cfg = self.state, self.cfg
        a = 1.0 / 200
        st.rate_blocks += a * (m - st.rate_blocks)
        st.rate_evict += a * (st.n_evict - st.rate_evict)
        st.n_evict = 0
        st.n_req += 1
        debias = 1.0 - (1.0 - a) ** st.n_req  # EMAs start at 0
        cap = self.cache.capacity if self.cache is not None else 0
        evicting = self.cache is not None and self.cache.evictions and cfg.turnover_from_evictions
        rate = st.rate_evict if evicting else 0.0
        rate = (rate or st.rate_blocks) / debias
        st.horizon = min(
            max(cfg.horizon_mult * cap / max(rate, 1e-9), cfg.horizon_min), cfg.horizon_max
        )

    # ---- the BlockPolicy hooks --------------------------------------------------------------
    def attach(self, cache: PrefixCache) -> None:
        self.cache = cache

    def on_evict(self, b: int) -> None:
        st = self.state
        st.inflation = max(st.inflation, self._prio_v[b])
        st.n_evict += 1

    def on_access(self, blocks, hit, i, now):
        self.end_access(blocks, hit, i, self.begin_access(blocks, hit, i))

    def begin_access(self, blocks, hit: int, i: int) -> np.ndarray:
        """``on_access`` up to the PRP's training on the labels request i closes (a round is
        dispatched, not waited for); returns the request's block features for
        ``end_access``, which must follow before anything else reads or changes this policy."""
        st = self.state
        self._update_horizon(len(blocks))
        self._expire(i)
        x_BI = self.block_features(blocks, hit, i)
        m = len(blocks)  # ids in one request are distinct (chained prefix hashes)
        self._label(blocks[st.window_id_P[blocks] >= 0], 1.0)  # reused within H
        st.window_x_PI[blocks] = x_BI
        st.window_id_P[blocks] = st.n_event + np.arange(m)
        st.pending.append((i, blocks, st.n_event))
        st.n_event += m
        self._count_children(blocks)
        y = np.concatenate(st.new_y)
        if len(y):
            self.pred.learn(np.concatenate(st.new_x), y)
        st.new_x, st.new_y = [], []
        return x_BI

    def end_access(self, blocks, hit: int, i: int, x_BI: np.ndarray) -> None:
        """The rest of ``on_access``: P̂ of request i's blocks (after the round
        ``begin_access`` dispatched) and their reuse counts."""
        self.set_p_hat(blocks, self.count_access(blocks, hit, i, x_BI))

    def set_p_hat(self, blocks, observed: tuple) -> None:
        """P̂ of a request's blocks from ``count_access``'s answer (waits for the PRP's round).
        Between ``count_access`` and this, only ``begin_access`` and ``count_access`` of later
        requests may run (they read no P̂), and answers are set in request order."""
        trained, rows = observed
        self.state.p_hat_P[blocks] = self.pred.resolve(rows) if trained else 1.0

    def count_access(self, blocks, hit: int, i: int, x_BI: np.ndarray) -> tuple:
        """``end_access`` but P̂: the PRP observes the features (whitening, even before the
        first training) and the blocks' reuse counts are updated; returns what ``set_p_hat``
        needs (untrained: P̂ = 1, admit and rank by s_j)."""
        st = self.state
        observed = self.pred.trained, self.pred.observe(x_BI)
        miss = blocks[(np.arange(len(blocks)) >= hit) & (st.count_P[blocks] > 0)]
        st.ghost_P[miss] += 1
        prev = st.last_req_P[blocks]
        st.gap_P[blocks] = np.where(prev >= 0, i - prev, st.gap_P[blocks])
        st.count_P[blocks] += 1
        st.last_req_P[blocks] = i
        return observed

    def prio(self, b, i, j, now):
        st = self.state
        if self.cfg.retention == "gd":
            v = st.inflation + self._p_hat_v[b] * self._save[j]
        else:
            v = st.last_req_P[b] + st.horizon * st.p_hat_P[b]
        self._prio_v[b] = v
        return (v,)

    def gate(self, b, i, j, now):
        """Admit iff P̂ ≥ θ and the expected saving P̂·s_j exceeds the write cost T(512)."""
        pr = self.prio(b, i, j, now)
        p = self._p_hat_v[b]
        return bool(p >= self.cfg.theta and (p * self._save[j] > self.costs.write_ms)), pr
