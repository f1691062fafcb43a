"""KVLearn at block granularity for the serving simulator.

The design of the core (PRP → CARS → keep/evict) carried to the blocks of a Mooncake prefix
cache:

* **PRP (per block)**: the core's jitted Flax MLP (``prp.py``: 16 → 32 → 1, Adam 5e-3, replay
  buffer of 20k labels, a training round every 100 labels, running whitening) over 16
  per-access block features (``block_features``): log depth in the prefix, log distance to the
  request's end, last (partial) block, log accesses of the block, first access, log requests
  since its previous access, log previous reuse gap, hit in the pool, seen before (ghost
  history), log distinct children, the request's hit and seen fractions, log request length,
  log accesses of the parent, log ghost misses (requests that recomputed a block seen before),
  log marginal saving at this depth. One request's blocks are observed and scored in one padded
  jitted call; labels are pushed (and training rounds run) in one more. ``predictor="logistic"``
  swaps in a numpy logistic regression (ablation).
* **Label** (one per access): the block is requested again within H requests. H is counted in
  *requests*, not seconds (it keeps its meaning when arrivals are scaled) and follows the pool:
  H = ``horizon_mult`` × pool turnover = capacity / evictions per request (capacity / blocks per
  request before the pool first fills), i.e. "reused before the pool would have cycled?".
  Windows opened earlier expire against the current H.
* **Retention (CARS at block level, GreedyDual)**: priority = L + P̂ · s_j, s_j = R((j+1)·512) −
  R(j·512) − T(512) the time a hit on a block at depth j saves (the suffix of a cached prefix pays
  its attention over the prefix, so deep blocks save more), L = the priority of the last victim
  (inflation: blocks not touched again age out). Eviction takes the lowest priority among leaves,
  so the resident set stays prefix-closed and value per slot (= per byte) decides.
  ``retention="recency"`` uses last access + H·P̂ instead (ablation).
* **Admission**: a computed block is admitted iff P̂ ≥ ``theta`` and its priority beats the
  victim's (never destroy more value than is added).

Hyper-parameters (``theta`` = 0.2, ``horizon_mult`` = 2, the MLP, GreedyDual retention) were
chosen on the first 2,000 requests of the shipped trace and on two MM-Session traces only, never
on the reported evaluation (``docs/kvlearn.md``). Not the core's CARS/ATC code: the pool is
counted in slots (every block one slot), there is no storage term U and θ is fixed; the adaptive
horizon and the GreedyDual inflation L play the ATC's role of pricing space.
"""

from __future__ import annotations

import collections
import functools
import math

import numpy as np

from jaxkv.kvlearn.serving import BlockPolicy

F = 16
_BUCKETS = (64, 128, 256, 512, 1024)


class BlockKVLearn(BlockPolicy):
    """See the module docstring."""

    name = "kvlearn"

    def __init__(
        self,
        trace,
        cost,
        *,
        theta=0.2,
        horizon_mult=2.0,
        horizon_min=20.0,
        predictor="mlp",
        lr=0.05,
        batch=256,
        seed=0,
        retention="gd",
    ):
        super().__init__(trace, cost)
        k = trace.n_blocks
        self.theta, self.mult, self.h_min = theta, horizon_mult, horizon_min
        self.h = self.h_min
        self.cache = None
        self.n_evict = 0
        self.rate_blocks = 0.0
        self.rate_evict = 0.0
        self.n_req = 0
        self.count = np.zeros(k, np.int64)
        self.ghost = np.zeros(k, np.int64)
        self.last_i = np.full(k, -1, np.int64)
        self.gap = np.full(k, -1, np.int64)
        self.n_child = np.zeros(k, np.int64)
        self.seen_child: set[tuple[int, int]] = set()
        self.p_hat = np.zeros(k)
        self.open_x = np.zeros((k, F), np.float32)
        self.open_id = np.full(k, -1, np.int64)
        self.pending: collections.deque = collections.deque()  # (opened at, b, event id)
        self.n_event = 0
        self.lab_x: list[np.ndarray] = []
        self.lab_y: list[float] = []
        self.i = 0
        if retention not in ("gd", "recency"):
            raise ValueError(f"retention must be 'gd' or 'recency', got {retention!r}")
        self.retention = retention
        self.clock_l = 0.0  # GreedyDual inflation: priority of the last victim
        self.cur_prio = np.zeros(k)
        bt = trace.block_tokens
        t_blk = float(cost.transfer_ms(cost.footprint_bytes(bt)))
        j = np.arange(max((len(b) for b in trace.blocks), default=1) + 1, dtype=np.float64)
        r_j = np.asarray(cost.recompute_ms(j * bt), np.float64)
        self.save_ms = np.maximum(np.diff(r_j, append=2 * r_j[-1] - r_j[-2]) - t_blk, 0.0)
        self.log_save = np.log(np.maximum(self.save_ms, 1e-3) / max(self.save_ms[0], 1e-3))
        if predictor not in ("mlp", "logistic"):
            raise ValueError(f"predictor must be 'mlp' or 'logistic', got {predictor!r}")
        self.pred = _MLP(seed=seed) if predictor == "mlp" else _Logistic(lr=lr, batch=batch)

    # ---- features and labels ----------------------------------------------------------------
    def block_features(self, blocks, hit: int, i: int) -> np.ndarray:
        """[m, 16] features of request i's blocks (see the module docstring)."""
        m = len(blocks)
        j = np.arange(m)
        cnt = self.count[blocks]
        seen = np.cumprod(cnt > 0)  # prefix of blocks seen before (ghost history)
        since = np.where(self.last_i[blocks] >= 0, i - self.last_i[blocks], -1)
        parent_cnt = np.concatenate([[0], cnt[:-1]])
        return np.stack(
            [
                np.log1p(j),
                np.log1p(m - 1 - j),
                (j == m - 1),
                np.log1p(cnt),
                cnt == 0,
                np.log1p(np.maximum(since, 0)) * (since >= 0),
                np.log1p(np.maximum(self.gap[blocks], 0)) * (self.gap[blocks] >= 0),
                j < hit,
                seen,
                np.log1p(self.n_child[blocks]),
                np.full(m, hit / m),
                np.full(m, seen.sum() / m),
                np.full(m, np.log1p(m)),
                np.log1p(parent_cnt),
                np.log1p(self.ghost[blocks]),
                self.log_save[j],
            ],
            axis=1,
        ).astype(np.float32)

    def _label(self, b: int, y: float) -> None:
        self.lab_x.append(self.open_x[b].copy())
        self.lab_y.append(y)
        self.open_id[b] = -1

    def _expire(self, i: int) -> None:
        q = self.pending  # opened in request order; the current H decides expiry
        while q and q[0][0] + self.h < i:
            _, b, ev = q.popleft()
            if self.open_id[b] == ev:
                self._label(b, 0.0)

    def on_evict(self, b: int) -> None:
        self.clock_l = max(self.clock_l, float(self.cur_prio[b]))
        self.n_evict += 1

    def attach(self, cache) -> None:
        self.cache = cache

    def _update_horizon(self, m: int) -> None:
        """H = mult × pool turnover in requests: capacity / (evictions per request), or
        capacity / (blocks per request) before the pool first fills (EMAs over ~200 requests)."""
        a = 1.0 / 200
        self.rate_blocks += a * (m - self.rate_blocks)
        self.rate_evict += a * (self.n_evict - self.rate_evict)
        self.n_evict = 0
        self.n_req += 1
        debias = 1.0 - (1.0 - a) ** self.n_req  # EMAs start at 0
        cap = self.cache.capacity if self.cache is not None else 0
        rate = self.rate_evict if self.cache is not None and self.cache.evictions else 0.0
        rate = (rate or self.rate_blocks) / debias
        self.h = max(self.mult * cap / max(rate, 1e-9), self.h_min)

    def on_access(self, blocks, hit, i, now):
        self.i = i
        self._update_horizon(len(blocks))
        self._expire(i)
        x = self.block_features(blocks, hit, i)
        for jj, b in enumerate(blocks.tolist()):
            if self.open_id[b] >= 0:
                self._label(b, 1.0)
            self.open_x[b] = x[jj]
            self.open_id[b] = self.n_event
            self.pending.append((i, b, self.n_event))
            self.n_event += 1
            if jj + 1 < len(blocks) and (b, int(blocks[jj + 1])) not in self.seen_child:
                self.seen_child.add((b, int(blocks[jj + 1])))
                self.n_child[b] += 1
        if self.lab_y:
            self.pred.learn(np.array(self.lab_x), np.array(self.lab_y, np.float32))
            self.lab_x, self.lab_y = [], []
        p = self.pred.predict(x)  # observes x (whitening) even before the first training
        self.p_hat[blocks] = p if self.pred.trained else 1.0  # untrained: admit, rank by s_j
        miss = blocks[(np.arange(len(blocks)) >= hit) & (self.count[blocks] > 0)]
        self.ghost[miss] += 1
        prev = self.last_i[blocks]
        self.gap[blocks] = np.where(prev >= 0, i - prev, self.gap[blocks])
        self.count[blocks] += 1
        self.last_i[blocks] = i

    # ---- policy -----------------------------------------------------------------------------
    def prio(self, b, i, j, now):
        if self.retention == "gd":
            v = self.clock_l + self.p_hat[b] * self.save_ms[j]
        else:
            v = self.last_i[b] + self.h * self.p_hat[b]
        self.cur_prio[b] = v
        return (v,)

    def gate(self, b, i, j, now):
        pr = self.prio(b, i, j, now)
        return bool(self.p_hat[b] >= self.theta), pr


class _Logistic:
    """Online logistic regression (numpy): minibatch SGD every ``batch`` labels."""

    def __init__(self, *, lr: float, batch: int):
        self.w = np.zeros(F + 1)
        self.lr, self.batch = lr, batch
        self.trained = False
        self.bx: list[np.ndarray] = []
        self.by: list[np.ndarray] = []
        self.n = 0

    def learn(self, x, y):
        self.bx.append(x)
        self.by.append(y)
        self.n += len(y)
        if self.n >= self.batch:
            xx = np.concatenate(self.bx)
            xx = np.concatenate([xx, np.ones((len(xx), 1), np.float32)], axis=1)
            yy = np.concatenate(self.by)
            p = 1.0 / (1.0 + np.exp(-(xx @ self.w)))
            self.w -= self.lr * xx.T @ (p - yy) / len(yy)
            self.trained = True
            self.bx, self.by, self.n = [], [], 0

    def predict(self, x):
        return 1.0 / (1.0 + np.exp(-(x @ self.w[:F] + self.w[F])))


class _MLP:
    """The core's PRP (``prp.py``): jitted observe / predict / push / train on padded batches."""

    def __init__(self, *, seed: int):
        import jax

        from jaxkv.kvlearn import prp

        self.cfg = prp.PRPConfig()
        self.state = prp.init_prp(self.cfg, key=jax.random.key(seed))
        self.key = jax.random.key(seed + 1)
        self.step = 0
        self._trained = False
        self._jax = jax

    @property
    def trained(self) -> bool:
        self._trained = self._trained or int(self.state.n_updates) > 0
        return self._trained

    def predict(self, x):
        n = len(x)
        size = next((s for s in _BUCKETS if s >= n), _bucket(n))
        xp = np.zeros((size, F), np.float32)
        xp[:n] = x
        mask = np.arange(size) < n
        self.state, p = _observe_predict(self.state, xp, mask, cfg=self.cfg)
        return np.asarray(p)[:n]

    def learn(self, x, y):
        for s in range(0, len(y), _BUCKETS[-1]):
            xs, ys = x[s : s + _BUCKETS[-1]], y[s : s + _BUCKETS[-1]]
            n = len(ys)
            size = next(b for b in _BUCKETS if b >= n)
            xp = np.zeros((size, F), np.float32)
            yp = np.zeros(size, np.float32)
            xp[:n], yp[:n] = xs, ys
            self.step += 1
            key = self._jax.random.fold_in(self.key, self.step)
            self.state = _push_train(self.state, xp, yp, np.arange(size) < n, key, cfg=self.cfg)


def _bucket(n: int) -> int:
    return 1 << max(int(math.ceil(math.log2(n))), 6)


@functools.cache
def _jitted():
    import jax
    import jax.numpy as jnp

    from jaxkv.kvlearn import prp

    @functools.partial(jax.jit, static_argnames="cfg", donate_argnums=0)
    def observe_predict(state, x_BF, mask_B, *, cfg):
        # batched Welford (Chan et al.) over the masked rows, then predict with the new stats
        w_B = mask_B.astype(jnp.float32)
        nb = jnp.sum(w_B)
        mean_b = jnp.sum(x_BF * w_B[:, None], 0) / jnp.maximum(nb, 1.0)
        m2_b = jnp.sum(((x_BF - mean_b) ** 2) * w_B[:, None], 0)
        n = state.n_obs + nb
        delta = mean_b - state.mean_F
        mean = state.mean_F + delta * nb / jnp.maximum(n, 1.0)
        m2 = state.m2_F + m2_b + delta**2 * state.n_obs * nb / jnp.maximum(n, 1.0)
        state = state.replace(n_obs=n, mean_F=mean, m2_F=m2)
        return state, prp.predict(state, x_BF, cfg=cfg)

    @functools.partial(jax.jit, static_argnames="cfg", donate_argnums=0)
    def push_train(state, x_BF, y_B, mask_B, key, *, cfg):
        state = prp.push_labels(state, x_BF, y_B, mask_B)
        return prp.maybe_train(state, key=key, cfg=cfg)

    return observe_predict, push_train


def _observe_predict(state, x, mask, *, cfg):
    return _jitted()[0](state, x, mask, cfg=cfg)


def _push_train(state, x, y, mask, key, *, cfg):
    return _jitted()[1](state, x, y, mask, key, cfg=cfg)
