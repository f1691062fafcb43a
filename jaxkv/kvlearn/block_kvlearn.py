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
  log marginal saving at this depth. The optax training rounds run in the core's jitted code
  (``prp.push_labels`` + ``prp.maybe_train``, one padded shape, so one compilation); the running
  whitening statistics and the forward pass run in numpy on the host from the current
  parameters (equal to ``prp.predict`` up to float rounding; the host knows when a round ran and
  fetches the new parameters only then). ``predictor="logistic"`` swaps in a numpy logistic
  regression (ablation).
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
(``docs/kvlearn.md``;
``scripts/bench_kvlearn_serving.py --tune`` reruns the comparison). Not the core's CARS/ATC
code: the pool is counted in slots (every block one slot) and the storage term U is not priced
explicitly; the adaptive horizon and the GreedyDual inflation L play the ATC's role of pricing
space.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

from jaxkv.kvlearn.serving import BlockPolicy

F = 16
_CHUNK = 1024  # labels per jitted push (one padded shape)


class BlockKVLearn(BlockPolicy):
    """See the module docstring."""

    name = "kvlearn"

    def __init__(
        self,
        trace,
        cost,
        *,
        theta=0.0,
        horizon_mult=2.0,
        horizon_min=20.0,
        horizon_max=800.0,
        predictor="mlp",
        lr=0.05,
        batch=256,
        seed=0,
        retention="gd",
        write_cost=True,
        turnover_from_evictions=True,
    ):
        super().__init__(trace, cost)
        k = trace.n_blocks
        self.theta, self.mult = theta, horizon_mult
        self.h_min, self.h_max = horizon_min, horizon_max
        self.from_evictions = turnover_from_evictions
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
        self.n_blocks = k
        self.seen_child: set[int] = set()  # parent · n_blocks + child
        self.p_hat = np.zeros(k)
        self.open_x = np.zeros((k, F), np.float32)
        self.open_id = np.full(k, -1, np.int64)
        self.pending: collections.deque = collections.deque()  # (request, blocks, 1st event)
        self.n_event = 0
        self.lab_x: list[np.ndarray] = []
        self.lab_y: list[np.ndarray] = []
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
        self.write_ms = t_blk if write_cost else -np.inf  # prefill → pool, on the fabric
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

    def _label(self, bs: np.ndarray, y: float) -> None:
        """Closes the open windows of blocks ``bs`` with label y (features from their opening)."""
        self.lab_x.append(self.open_x[bs])
        self.lab_y.append(np.full(len(bs), y, np.float32))
        self.open_id[bs] = -1

    def _expire(self, i: int) -> None:
        q = self.pending  # one entry per request, in request order; the current H decides
        while q and q[0][0] + self.h < i:
            _, blocks, ev0 = q.popleft()
            still = self.open_id[blocks] == ev0 + np.arange(len(blocks))  # not reused since
            self._label(blocks[still], 0.0)

    def _count_children(self, blocks) -> None:
        keys = (blocks[:-1] * self.n_blocks + blocks[1:]).tolist()  # (parent, child) pairs
        new = set(keys) - self.seen_child
        if new:
            self.seen_child |= new
            np.add.at(self.n_child, np.fromiter(new, np.int64, len(new)) // self.n_blocks, 1)

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
        evicting = self.cache is not None and self.cache.evictions and self.from_evictions
        rate = self.rate_evict if evicting else 0.0
        rate = (rate or self.rate_blocks) / debias
        self.h = min(max(self.mult * cap / max(rate, 1e-9), self.h_min), self.h_max)

    def on_access(self, blocks, hit, i, now):
        self.i = i
        self._update_horizon(len(blocks))
        self._expire(i)
        x = self.block_features(blocks, hit, i)
        m = len(blocks)  # ids in one request are distinct (chained prefix hashes)
        self._label(blocks[self.open_id[blocks] >= 0], 1.0)  # reused within H
        self.open_x[blocks] = x
        self.open_id[blocks] = self.n_event + np.arange(m)
        self.pending.append((i, blocks, self.n_event))
        self.n_event += m
        self._count_children(blocks)
        y = np.concatenate(self.lab_y)
        if len(y):
            self.pred.learn(np.concatenate(self.lab_x), y)
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
        """Admit iff P̂ ≥ θ and the expected saving P̂·s_j exceeds the write cost T(512)."""
        pr = self.prio(b, i, j, now)
        p = self.p_hat[b]
        return bool(p >= self.theta and (p * self.save_ms[j] > self.write_ms)), pr


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
    """The core's PRP (``prp.py``): its optax training rounds run in one jitted call per chunk
    of labels (one fixed shape: one compilation); the whitening statistics and the 16 → 32 → 1
    forward pass run on the host in float32 numpy from the current parameters, which equals
    ``prp.predict`` up to float rounding and saves a device round trip per request."""

    def __init__(self, *, seed: int):
        import jax

        from jaxkv.kvlearn import prp

        self.cfg = prp.PRPConfig()
        self.state = _jitted().init(self.cfg, key=jax.random.key(seed))
        self.key = jax.random.key(seed + 1)
        self.step = 0
        self.trained = False
        self.labels_since = 0  # mirrors state.labels_since, so training rounds are known here
        self.n_obs = np.float32(0.0)
        self.mean_F = np.zeros(F, np.float32)
        self.m2_F = np.zeros(F, np.float32)
        self.var_floor = np.float32(prp.VAR_FLOOR)
        self._get = jax.device_get
        self.params = self._get(self.state.params)

    def predict(self, x_BF):
        """Observes the rows (batched Welford, Chan et al.), then P̂ with the new statistics."""
        nb = np.float32(len(x_BF))
        mean_b = x_BF.mean(0, dtype=np.float32)
        m2_b = ((x_BF - mean_b) ** 2).sum(0, dtype=np.float32)
        n = self.n_obs + nb
        delta = mean_b - self.mean_F
        self.mean_F = self.mean_F + delta * nb / n
        self.m2_F = self.m2_F + m2_b + delta**2 * self.n_obs * nb / n
        self.n_obs = n
        inv_std_F = 1.0 / np.sqrt(self.m2_F / n + self.var_floor)
        return _forward(self.params, (x_BF - self.mean_F) * inv_std_F)

    def learn(self, x, y):
        for s in range(0, len(y), _CHUNK):
            n = len(y[s : s + _CHUNK])
            xp = np.zeros((_CHUNK, F), np.float32)
            yp = np.zeros(_CHUNK, np.float32)
            xp[:n], yp[:n] = x[s : s + _CHUNK], y[s : s + _CHUNK]
            self.step += 1
            stats = (self.n_obs, self.mean_F, self.m2_F)
            args = (self.state, stats, xp, yp, np.arange(_CHUNK) < n, self.key, self.step)
            self.state = _jitted().push_train(*args, cfg=self.cfg)
            self.labels_since += n
            if self.labels_since >= self.cfg.train_every:  # prp.maybe_train ran a round
                self.labels_since -= self.cfg.train_every
                self.trained = True
                self.params = self._get(self.state.params)


def _forward(params, z_BF):
    """σ(PRPNet(z)) in numpy: Dense(32) → ReLU → Dense(1), flax's parameter layout."""
    d0, d1 = params["Dense_0"], params["Dense_1"]
    h_BH = np.maximum(z_BF @ d0["kernel"] + d0["bias"], 0.0)
    logit_B = (h_BH @ d1["kernel"] + d1["bias"])[:, 0]
    with np.errstate(over="ignore"):  # exp(−logit) → inf gives P̂ = 0, as it should
        return 1.0 / (1.0 + np.exp(-logit_B))


@functools.cache
def _jitted():
    import types

    import jax

    from jaxkv.kvlearn import prp

    @functools.partial(jax.jit, static_argnames="cfg", donate_argnums=0)
    def push_train(state, stats, x_BF, y_B, mask_B, key, step, *, cfg):
        n_obs, mean_F, m2_F = stats  # the host's whitening statistics, used by the round
        state = state.replace(n_obs=n_obs, mean_F=mean_F, m2_F=m2_F)
        state = prp.push_labels(state, x_BF, y_B, mask_B)
        return prp.maybe_train(state, key=jax.random.fold_in(key, step), cfg=cfg)

    init = jax.jit(prp.init_prp, static_argnums=0)  # one compilation, not one per op
    return types.SimpleNamespace(init=init, push_train=push_train)
