"""KVLearn at block granularity for the serving simulator (plain Python/numpy).

The core's PRP is a jitted MLP over 16 per-key features; calling it once per block of a
Mooncake trace from Python would cost ~0.3 ms × 10^5 blocks. This block-level variant keeps
KVLearn's structure with a smaller predictor that runs in numpy:

* **PRP (per block)**: an online logistic regression on F = 10 features of each access of
  block b at position j of a request of m blocks: bias, log(1+j) (depth in the prefix),
  log(1+m−1−j) (distance to the request's end), is-last-block, log(1+accesses of b),
  first-access, age since b's previous access / H (1 if none), whether b was a hit,
  log(1+distinct successors of b seen) (children) and the request's hit fraction. Label: b is
  requested again within the horizon H (delayed labels, resolved on reuse or on expiry).
  Minibatch SGD on the log-loss every ``batch`` labels, starting from w = 0 (P̂ = 0.5).
* **Retention**: a block's priority is ``now + H · P̂`` at its latest access: it is kept as if
  it had been accessed H·P̂ later (LRU when P̂ is equal). With ``depth_weight=True`` the bonus
  is scaled by 1 + log w_j, w_j = (R((j+1)·512) − R(j·512) − T) / (R(512) − T), the marginal
  recompute a block at depth j saves relative to a first block (CARS's R − T term); on the
  shipped Mooncake trace that *hurt* (deep blocks of one-off long prompts crowd out shared
  prefixes), so it is off by default.
* **Admission**: a computed block is admitted iff P̂ ≥ ``theta`` and it outranks the victim it
  would displace (KVLearn's "never destroy more value than is added"). Leaves only, as in the
  Mooncake-style cache.

Defaults (H = 300 s, θ = 0.5) were chosen on the shipped trace itself (a small grid over
H ∈ {120, 200, 300, 400, 600} s, θ ∈ {0.2, 0.3, 0.5, 0.7}): in-sample, not validated elsewhere.
No storage term U and no ATC: θ is fixed. Honest naming: this is KVLearn's design (learned reuse
probability × recompute value, value-gated admission) at block granularity, not the core's
jitted PRP/ATC code.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from jaxkv.kvlearn.serving import BlockPolicy

F = 10


class BlockKVLearn(BlockPolicy):
    """See the module docstring. ``horizon_s`` H, ``theta`` admission threshold on P̂."""

    name = "kvlearn"

    def __init__(
        self, trace, cost, *, horizon_s=300.0, theta=0.5, lr=0.1, batch=256, depth_weight=False
    ):
        super().__init__(trace, cost)
        k = trace.n_blocks
        self.h, self.theta, self.lr, self.batch = horizon_s, theta, lr, batch
        self.depth_weight = depth_weight
        self.w = np.zeros(F)
        self.count = np.zeros(k, np.int64)
        self.last_t = np.full(k, -np.inf)
        self.p_hat = np.zeros(k)
        self.succ: list[set | None] = [None] * k
        self.open_x = np.zeros((k, F))
        self.open_id = np.full(k, -1, np.int64)
        self.pending: collections.deque = collections.deque()  # (deadline, b, event id)
        self.n_event = 0
        self.buf_x: list[np.ndarray] = []
        self.buf_y: list[float] = []
        bt = trace.block_tokens
        r = lambda L: float(cost.recompute_ms(float(L)))
        t_blk = float(cost.transfer_ms(cost.footprint_bytes(bt)))
        base = max(r(bt) - t_blk, 1e-9)
        self._logw = lambda j: math.log(max((r((j + 1) * bt) - r(j * bt) - t_blk) / base, 1.0))

    # ---- learning ---------------------------------------------------------------------------
    def _label(self, b: int, y: float) -> None:
        self.buf_x.append(self.open_x[b].copy())
        self.buf_y.append(y)
        self.open_id[b] = -1
        if len(self.buf_y) >= self.batch:
            x, yy = np.array(self.buf_x), np.array(self.buf_y)
            p = 1.0 / (1.0 + np.exp(-(x @ self.w)))
            self.w -= self.lr * x.T @ (p - yy) / len(yy)
            self.buf_x, self.buf_y = [], []

    def _expire(self, now: float) -> None:
        q = self.pending
        while q and q[0][0] < now:
            _, b, ev = q.popleft()
            if self.open_id[b] == ev:
                self._label(b, 0.0)

    def on_access(self, blocks, hit, i, now):
        self._expire(now)
        m = len(blocks)
        j = np.arange(m)
        age = now - self.last_t[blocks]
        x = np.stack(
            [
                np.ones(m),
                np.log1p(j),
                np.log1p(m - 1 - j),
                np.log1p(self.count[blocks]),
                np.where(np.isfinite(age), np.minimum(age / self.h, 1.0), 1.0),
                (j < hit).astype(np.float64),
                np.log1p([len(self.succ[b]) if self.succ[b] else 0 for b in blocks]),
                np.full(m, hit / m),
                (j == m - 1).astype(np.float64),
                (self.count[blocks] == 0).astype(np.float64),
            ],
            axis=1,
        )
        for jj, b in enumerate(blocks):
            b = int(b)
            if self.open_id[b] >= 0:
                self._label(b, 1.0)
            self.open_x[b] = x[jj]
            self.open_id[b] = self.n_event
            self.pending.append((now + self.h, b, self.n_event))
            self.n_event += 1
            if jj + 1 < m:
                if self.succ[b] is None:
                    self.succ[b] = set()
                self.succ[b].add(int(blocks[jj + 1]))
        self.p_hat[blocks] = 1.0 / (1.0 + np.exp(-(x @ self.w)))
        self.count[blocks] += 1
        self.last_t[blocks] = now

    # ---- policy -----------------------------------------------------------------------------
    def prio(self, b, i, j, now):
        w = 1.0 + self._logw(j) if self.depth_weight else 1.0
        return (now + self.h * self.p_hat[b] * w,)

    def gate(self, b, i, j, now):
        pr = self.prio(b, i, j, now)
        return bool(self.p_hat[b] >= self.theta), pr
