"""The highest arrival rate a deployment sustains at its TTFT SLO (``max_sustainable_rate``)."""

from __future__ import annotations

import math

import numpy as np

from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving.engine import ServingConfig, simulate
from jaxkv.kvlearn.traces import MooncakeTrace


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
    failed or none passed), ``throughput_rps`` = S·R / arrival span of the unscaled trace, and
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
