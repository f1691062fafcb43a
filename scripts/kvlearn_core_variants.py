"""Issue 15 core design tool: key-level KVLearn alone, with a variant ``KVLearnConfig``, on
``bench_kvlearn_goals.py``'s grid (same PRNG seeds), against the classical policies' medians
that a full bench run stored (seeds < 100: results/kvlearn/goals.json, else core_fresh/).

Usage: python scripts/kvlearn_core_variants.py --seeds 0,1,2,3,4 \
    --cfg '{"count_prior_s": 180}' [--tag NAME] [--out DIR]
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxkv.kvlearn.core.control import KVLearnConfig
from jaxkv.kvlearn.sim import simulate as S

ap = argparse.ArgumentParser()
ap.add_argument("--seeds", default="0,1,2,3,4")
ap.add_argument("--cfg", default="{}")
ap.add_argument("--pools", default="1,4,16")
ap.add_argument("--tag", default="x")
ap.add_argument("--out", default=None, help="folder for <tag>_<first seed>.json")
a = ap.parse_args()
seeds = [int(s) for s in a.seeds.split(",")]
ref = "results/kvlearn/goals.json" if seeds[0] < 100 else "results/kvlearn/core_fresh/goals.json"
ref = json.loads(Path(ref).read_text())
best = {
    (c["alpha"], c["pool_gib"]): (c["best_classical"], c["ttft_best_classical"])
    for c in ref["checks"]
}
lfu = {}
for r in ref["runs"]:
    if r["policy"] == "lfu":
        lfu[(r["alpha"], r["pool_gib"], r["seed"])] = r["ttft_ms_mean"]
kw = json.loads(a.cfg)
cfg = S.SimConfig(kvlearn=KVLearnConfig(**kw))
t0 = time.time()
pools = [int(p) for p in a.pools.split(",")]
assert pools == [1, 4, 16], "PRNG seeds follow the full grid"
rows, _ = S.sweep(
    n_requests=20000,
    alphas=[0.8, 1.1, 1.4],
    pools_gib=pools,
    seeds=seeds,
    policies=("kvlearn",),
    sim_cfg=cfg,
)
out = []
nmet = 0
worst = 0
for al in [0.8, 1.1, 1.4]:
    for g in pools:
        v = [r["ttft_ms_mean"] for r in rows if r["alpha"] == al and r["pool_gib"] == g]
        per = [
            r["ttft_ms_mean"] / lfu[(al, g, r["seed"])]
            for r in rows
            if r["alpha"] == al and r["pool_gib"] == g
        ]
        m = float(np.median(v))
        b = best[(al, g)]
        ratio = m / b[1]
        nmet += ratio <= 1
        if g < 16:
            worst = max(worst, ratio)
        out.append(dict(alpha=al, pool=g, kv=m, best=b, ratio=ratio, per_seed_vs_lfu=per))
        print(
            f"{al} {g:>2} kv {m:.4f} best {b[0]} {b[1]:.4f} ratio {ratio:.4f}  seeds/lfu "
            + " ".join(f"{p:.4f}" for p in per)
        )
took = time.time() - t0
print(f"TAG {a.tag} seeds {a.seeds} cfg {a.cfg}: met {nmet}/9, worst pressured ratio {worst:.4f}")
print(f"({took:.0f} s)")
if a.out:
    path = Path(a.out, f"{a.tag}_{seeds[0]}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(tag=a.tag, cfg=kw, seeds=seeds, cells=out)))
