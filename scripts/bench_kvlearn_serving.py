"""KVLearn serving goals on a Mooncake trace: pools of 10 / 25 / 50 % of the distinct blocks,
every block-level policy, plus a load sweep; gaps to LRU-Pool, Mooncake-style and Belady.

Usage: python scripts/bench_kvlearn_serving.py [--trace PATH] [--out results/kvlearn]
       [--prefill-nodes 24] [--loads 1,1.5,2]

Writes serving_goals.json and serving_goals.md (``wall_s`` is the simulation time per policy).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from jaxkv.kvlearn import serving as SV
from jaxkv.kvlearn.cost import CostModel

TRACE = "../shared/data/mooncake_traces/synthetic_trace.jsonl"
FRACS = (0.1, 0.25, 0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--out", default="results/kvlearn")
    p.add_argument("--prefill-nodes", type=int, default=24)
    p.add_argument("--loads", default="1,1.5")
    args = p.parse_args()
    cost = CostModel.llama3_8b_a100()
    base = SV.load_mooncake_trace(args.trace)
    rows = []
    for load in [float(x) for x in args.loads.split(",")]:
        tr = base.scaled(load)
        for frac in FRACS:
            cfg = SV.ServingConfig(
                pool_blocks=int(frac * base.n_blocks), prefill_nodes=args.prefill_nodes
            )
            for r in SV.compare(tr, cfg=cfg, cost=cost):
                rows.append(r | {"pool_frac": frac, "load_scale": load})
                print(
                    f"load {load:g} pool {frac:.0%} {r['policy']:<9} "
                    f"TTFT {r['ttft_ms_mean']:9.1f} p99 {r['ttft_ms_p99']:9.1f} "
                    f"hit {r['hit_rate']:.3f} xfer {r['transfer_gib']:7.0f} GiB "
                    f"({r['wall_s']:.2f} s)",
                    flush=True,
                )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "trace": args.trace,
        "requests": len(base),
        "distinct_blocks": base.n_blocks,
        "prefill_nodes": args.prefill_nodes,
        "cost": "llama3-8b-a100",
    }
    (out / "serving_goals.json").write_text(json.dumps({"config": meta, "runs": rows}, indent=2))
    (out / "serving_goals.md").write_text(markdown(rows))
    print(f"wrote {out / 'serving_goals.json'} and serving_goals.md")


def markdown(rows: list[dict]) -> str:
    lines = [
        "| load | pool | policy | TTFT mean (ms) | p99 (ms) | block hit | transfer (GiB) "
        "| rps@SLO | vs mooncake (mean / p99 / xfer) | gap to belady (mean) | sim s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cell = [
            x
            for x in rows
            if (x["pool_frac"], x["load_scale"]) == (r["pool_frac"], r["load_scale"])
        ]
        ref = {x["policy"]: x for x in cell}
        m, b = ref["mooncake"], ref["belady"]
        rel = lambda k, r=r, m=m: 100 * (r[k] / m[k] - 1)
        gap = 100 * (r["ttft_ms_mean"] / b["ttft_ms_mean"] - 1)
        lines.append(
            f"| {r['load_scale']:g} | {r['pool_frac']:.0%} | {r['policy']} "
            f"| {r['ttft_ms_mean']:.0f} | {r['ttft_ms_p99']:.0f} | {r['hit_rate']:.3f} "
            f"| {r['transfer_gib']:.0f} | {r['throughput_rps']:.3f} "
            f"| {rel('ttft_ms_mean'):+.1f} % / {rel('ttft_ms_p99'):+.1f} % / "
            f"{rel('transfer_gib'):+.1f} % | {gap:+.1f} % "
            f"| {r['wall_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
