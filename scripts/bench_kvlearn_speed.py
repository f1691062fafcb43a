"""KVLearn speed goals: a 10^6-request simulated run, and a 64-cell sweep as one batched run vs
64 sequential runs.

Usage: python scripts/bench_kvlearn_speed.py [--out results/kvlearn] [--cells-requests 5000]
       [--repeats 3] [--parts million,sweep64] [--name speed.json]

Times are wall clock on this machine, including the host work of each run (trace arrays,
oracle set, metrics). "first" includes compilation (first call of a jitted function);
"run" excludes it. For the sweep, the batched and the sequential runs alternate ``--repeats``
times in one process and the medians are compared, so that load from other jobs hits both.
Writes OUT/NAME (speed.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.cost import GIB
from jaxkv.kvlearn.sim import simulate as simulate_lib


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def million(policy: str) -> dict:
    tr = workloads.zipf_multimodal(1_000_000, 1.1, seed=0)
    run = lambda: simulate_lib.run(policy, tr, capacity_bytes=4 * GIB, seed=0)
    m1, first = _timed(run)
    m2, second = _timed(run)
    assert m1 == m2
    return {
        "policy": policy,
        "requests": 1_000_000,
        "first_s": first,
        "run_s": second,
        "ttft_ms_mean": m2["ttft_ms_mean"],
    }


def sixty_four(policy: str, n: int, repeats: int) -> dict:
    cells = [(a, g, s) for a in (0.8, 1.0, 1.2, 1.4) for g in (1, 2, 4, 8) for s in (0, 1, 2, 3)]
    traces = {(a, s): workloads.zipf_multimodal(n, a, seed=s) for a, _, s in cells}
    trs = [traces[(a, s)] for a, _, s in cells]
    caps = [g * GIB for _, g, _ in cells]
    seeds = list(range(len(cells)))
    batch = lambda: simulate_lib.run_batch(policy, trs, capacities_bytes=caps, seeds=seeds)
    seq = lambda: [
        simulate_lib.run(policy, t, capacity_bytes=c, seed=s)
        for t, c, s in zip(trs, caps, seeds, strict=True)
    ]
    simulate_lib._runner.cache_clear()  # both "first" timings include their compilation
    b_out, batch_first = _timed(batch)
    s_out, seq_first = _timed(seq)
    batch_s, seq_s = [], []
    for _ in range(repeats):
        batch_s.append(_timed(batch)[1])
        seq_s.append(_timed(seq)[1])
    rel = [
        abs(x["ttft_ms_mean"] - y["ttft_ms_mean"]) / y["ttft_ms_mean"]
        for x, y in zip(b_out, s_out, strict=True)
    ]
    return {
        "policy": policy,
        "cells": len(cells),
        "requests_per_cell": n,
        "repeats": repeats,
        "batch_first_s": batch_first,
        "sequential_first_s": seq_first,
        "batch_run_s": batch_s,
        "sequential_run_s": seq_s,
        "batch_run_s_median": statistics.median(batch_s),
        "sequential_run_s_median": statistics.median(seq_s),
        "speedup_run": statistics.median(seq_s) / statistics.median(batch_s),
        "speedup_first": seq_first / batch_first,
        "cells_identical": sum(r == 0 for r in rel),
        "max_rel_ttft_diff": max(rel),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kvlearn")
    ap.add_argument("--cells-requests", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="million,sweep64")
    ap.add_argument("--name", default="speed.json", help="output file name inside --out")
    args = ap.parse_args()
    parts = args.parts.split(",")
    result = {"million": [], "sweep64": []}
    for policy in ("lru", "kvlearn"):
        if "million" in parts:
            result["million"].append(million(policy))
            print(json.dumps(result["million"][-1]), flush=True)
    for policy in ("lru", "kvlearn"):
        if "sweep64" in parts:
            result["sweep64"].append(sixty_four(policy, args.cells_requests, args.repeats))
            print(json.dumps(result["sweep64"][-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / args.name).write_text(json.dumps(result, indent=2))
    print(f"wrote {out / args.name}")


if __name__ == "__main__":
    main()
