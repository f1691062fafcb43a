"""``cost_aware``: keep the blocks that save the most recompute per slot, decayed by age (in the
style of Marconi, MLSys'25, and LMCache's cost-aware eviction proposal), over the leaves of the
prefix tree (like ``mooncake``: the resident set stays prefix-closed).

A block's value at request n is C · Σ_k exp(−(n − n_k)/τ): C what one hit on it saves
(``block_saving_ms``, from the run's ``CostModel``) per slot (every block fills one slot, so per
byte up to a constant), times its accesses n_k (request indices) decayed with time constant τ
requests. The victim is the leaf of lowest value; every computed block is admitted. The
ranking of two blocks by this value is the same at every n, so the priority is the
time-invariant log C + log Σ_k exp(n_k/τ), updated at each access, and the cache's lazy heap
orders it exactly. τ defaults to the pool's turnover, capacity / mean blocks per request of the
trace (an untuned choice: a block's accesses count for about one pass of the pool), times
``tau_scale`` (1 for the classical baseline); history is kept across evictions. A longer τ
weighs older accesses more (toward frequency), which on the MM-Session workloads trades mean
TTFT for a lower p99 (``docs/kvlearn.md``, session 32).
"""

from __future__ import annotations

import math

import numpy as np

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.policies.base import BlockPolicy, block_saving_ms
from jaxkv.kvlearn.traces import MooncakeTrace


class CostAware(BlockPolicy):
    """[P] ``log_saving_P`` (log C) and ``log_mass_P`` (log Σ_k exp(n_k/τ)); ``tau``."""

    name = "cost_aware"

    def __init__(
        self,
        trace: MooncakeTrace,
        cost: CostModel,
        *,
        pool_blocks: int,
        tau_requests: float | None = None,
        tau_scale: float = 1.0,
    ):
        super().__init__(trace, cost, pool_blocks=pool_blocks)
        per_req = float(np.mean([len(b) for b in trace.blocks])) if len(trace) else 1.0
        turnover = max(1.0, self.capacity / max(per_req, 1.0))
        if not tau_scale > 0:
            raise ValueError(f"cost_aware: tau_scale must be positive, got {tau_scale}")
        self.tau = tau_scale * turnover if tau_requests is None else tau_requests
        if not self.tau > 0:
            raise ValueError(f"cost_aware: tau_requests must be positive, got {tau_requests}")
        with np.errstate(divide="ignore"):
            self.log_saving_P = np.log(block_saving_ms(trace, cost))
        self.log_mass_P = np.full(trace.n_blocks, -np.inf)
        self._log_saving = self.log_saving_P.tolist()  # Python floats: faster block by block
        self._log_mass_v = memoryview(self.log_mass_P)

    def prio(self, b, i, j, now):
        mass = self._log_mass_v
        mass[b] = log_mass = _log_add_exp(mass[b], i / self.tau)
        self.clock += 1
        return (self._log_saving[b] + log_mass, self.clock)


def _log_add_exp(a: float, x: float) -> float:
    """log(e^a + e^x) for a possibly −inf."""
    if a == -math.inf:
        return x
    m = max(a, x)
    return m + math.log(math.exp(a - m) + math.exp(x - m))
