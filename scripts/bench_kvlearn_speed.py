"""KVLearn speed goals: a 10^6-request simulated run, and a 64-cell sweep as one vmapped batch vs
64 sequential runs.

Usage: python scripts/bench_kvlearn_speed.py [--out results/kvlearn] [--cells-requests 5000]

Times are wall clock on this machine; "run" excludes compilation (second call of the same
jitted function), "first" includes it. Writes speed.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxkv.kvlearn import simulate as S
from jaxkv.kvlearn import traces as T
from jaxkv.kvlearn.cost import GIB


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def million(policy: str) -> dict:
    tr = T.zipf_multimodal(1_000_000, 1.1, seed=0)
    run = lambda: S.run(policy, tr, capacity_bytes=4 * GIB, seed=0)
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


def sixty_four(policy: str, n: int) -> dict:
    cells = [(a, g, s) for a in (0.8, 1.0, 1.2, 1.4) for g in (1, 2, 4, 8) for s in (0, 1, 2, 3)]
    traces = {(a, s): T.zipf_multimodal(n, a, seed=s) for a, _, s in cells}
    trs = [traces[(a, s)] for a, _, s in cells]
    caps = [g * GIB for _, g, _ in cells]
    seeds = list(range(len(cells)))
    batch = lambda: S.run_batch(policy, trs, capacities_bytes=caps, seeds=seeds)
    b1, batch_first = _timed(batch)
    b2, batch_run = _timed(batch)
    S.run(policy, trs[0], capacity_bytes=caps[0], seed=0)  # compile the single-run function once
    seq, seq_run = _timed(
        lambda: [
            S.run(policy, t, capacity_bytes=c, seed=s)
            for t, c, s in zip(trs, caps, seeds, strict=True)
        ]
    )
    same = all(
        abs(x["ttft_ms_mean"] - y["ttft_ms_mean"]) <= 1e-9 * y["ttft_ms_mean"]
        for x, y in zip(b2, seq, strict=True)
    )
    return {
        "policy": policy,
        "cells": len(cells),
        "requests_per_cell": n,
        "batch_first_s": batch_first,
        "batch_run_s": batch_run,
        "sequential_run_s": seq_run,
        "speedup_run": seq_run / batch_run,
        "batch_equals_sequential": same,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kvlearn")
    ap.add_argument("--cells-requests", type=int, default=5000)
    args = ap.parse_args()
    result = {"million": [], "sweep64": []}
    for policy in ("lru", "kvlearn"):
        result["million"].append(million(policy))
        print(json.dumps(result["million"][-1]))
    for policy in ("lru", "kvlearn"):
        result["sweep64"].append(sixty_four(policy, args.cells_requests))
        print(json.dumps(result["sweep64"][-1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'speed.json'}")


if __name__ == "__main__":
    main()
