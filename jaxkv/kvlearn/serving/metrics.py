"""What a serving run reports: ``summarize`` (one policy's run: the core simulator's metric schema
plus serving fields) and ``compare`` (one summary row per block policy on one trace).

``goodput_rps`` is requests whose TTFT met the SLO divided by the arrival span;
``throughput_rps`` is the maximum sustainable rate (``rate.max_sustainable_rate``: the highest
arrival rate at which a target fraction of requests meets the TTFT SLO, found by searching the
load scale), filled by ``compare(rate_search=True)``.
"""

from __future__ import annotations

import time

import numpy as np

from jaxkv.kvlearn.cost import GIB, CostModel
from jaxkv.kvlearn.serving.engine import ServingConfig, simulate
from jaxkv.kvlearn.serving.policies import BLOCK_POLICIES
from jaxkv.kvlearn.serving.rate import max_sustainable_rate
from jaxkv.kvlearn.traces import MooncakeTrace, Progress


def summarize(policy: str, rec: dict, *, cost: CostModel, cfg: ServingConfig) -> dict:
    """One run's summary: the core simulator's metric schema (``sim.simulate.metrics``) plus
    serving fields."""
    ttft = rec["ttft_ms"]
    n_tok = rec["input_tokens"].sum()
    moved = rec["hit_tokens"].sum() + n_tok + rec["admitted_tokens"].sum()
    span = float(rec["arrival_s"][-1] - rec["arrival_s"][0]) if len(ttft) > 1 else 0.0
    good = int((ttft <= cfg.slo_ms).sum())
    return {
        "policy": policy,
        "ttft_ms_mean": float(ttft.mean()),
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "hit_rate": float(rec["hit_blocks"].sum() / rec["n_blocks"].sum()),
        "byte_hit_rate": float(rec["hit_tokens"].sum() / n_tok),
        "token_hit_rate": float(rec["hit_tokens"].sum() / n_tok),
        "transfer_gib": float(cost.footprint_bytes(float(moved)) / GIB),
        "admits": int(rec["admits"]),
        "evictions": int(rec["evictions"]),
        "discards": int(rec["discards"]),
        "wait_ms_mean": float(rec["wait_ms"].mean()),
        "decode_wait_ms_mean": float(rec["decode_wait_ms"].mean()),
        "e2e_ms_mean": float(rec["e2e_ms"].mean()),
        "e2e_ms_p99": float(np.percentile(rec["e2e_ms"], 99)),
        "slo_attainment": good / len(ttft),
        "goodput_rps": good / span if span > 0 else float("nan"),
        "throughput_rps": None,  # filled by ``max_sustainable_rate`` (compare(rate_search=True))
        "max_load_scale": None,
    }


def compare(
    trace: MooncakeTrace,
    *,
    cfg: ServingConfig,
    cost: CostModel,
    policies=BLOCK_POLICIES,
    rate_search: bool = False,
    attainment: float = 0.9,
    progress: Progress | None = None,
) -> list[dict]:
    """Summary (plus ``wall_s``, the time of the one simulation) of every policy on one trace;
    with ``rate_search`` also ``throughput_rps`` / ``max_load_scale`` (``max_sustainable_rate``
    at ``attainment``; ``rate_search_s``: its time). ``progress`` (optional) is told the
    requests replayed by each policy's simulation (len(policies) × len(trace) in all)."""
    out = []
    for p in policies:
        t0 = time.perf_counter()
        rec = simulate(trace, p, cfg=cfg, cost=cost, progress=progress)
        row = summarize(p, rec, cost=cost, cfg=cfg) | {"wall_s": time.perf_counter() - t0}
        if rate_search:
            t0 = time.perf_counter()
            r = max_sustainable_rate(trace, p, cfg=cfg, cost=cost, attainment=attainment)
            row |= {k: r[k] for k in ("throughput_rps", "max_load_scale")}
            row |= {"rate_search_s": time.perf_counter() - t0, "attainment_target": attainment}
        out.append(row)
    return out
