"""Bit-identity check of the serving simulator's decisions, for speed-ups that must not change
them: an md5 over every array of ``engine.simulate``'s record, ``metrics.summarize``'s JSON and
an md5 of the block PRP's parameters after every training round, per (trace, pool, setting).

    python scripts/check_serving_identity.py --out ref.json            # the code before
    python scripts/check_serving_identity.py --out new.json --compare ref.json   # after

``--set small``: every block policy and ``PROTOCOL_GRID`` setting on generated ``chat`` and
``rag`` (3,000 requests, seed 0, 10 and 25 % pools), ``agent`` (2,000, seed 1), ``mm_session``
(300 sessions, seed 3) and the shipped trace's first 2,000 requests (10 %), 4 prefill nodes
(175 runs); ``--set heavy``: the guard, ``gd`` and ``kvlearn`` on ``--heavy-trace`` (25 %, 24
nodes); ``--set all``: both. Generated traces are cached under ``--cache``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from bench_kvlearn_serving import CONFIRM_SETTING, PROTOCOL_GRID, TRACE, _distinct, _grid_policy

from jaxkv.kvlearn import traces, workloads
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine, metrics, predictors
from jaxkv.kvlearn.serving.policies import BLOCK_POLICIES

HEAVY = ("guard:moon+ca+gdsf,0%", "gd", "kvlearn", CONFIRM_SETTING)


class _ParamHash:
    """An md5 of the PRP's parameters after every ``DeferredPRP`` flush (a training round)."""

    def __init__(self):
        self.reset()
        flush = predictors.DeferredPRP._flush

        def hashed(prp):
            flush(prp)
            for a in predictors.jax.tree.leaves(prp.params):
                self.md5.update(np.asarray(a).tobytes())
            self.rounds += 1

        predictors.DeferredPRP._flush = hashed

    def reset(self) -> str:
        out = f"{self.md5.hexdigest()}/{self.rounds}" if hasattr(self, "md5") else ""
        self.md5, self.rounds = hashlib.md5(), 0
        return out


def _digest(rec: dict) -> str:
    h = hashlib.md5()
    for k in sorted(rec):
        a = np.asarray(rec[k])
        h.update(k.encode() + str(a.dtype).encode() + a.tobytes())
    return h.hexdigest()


def _run(tr, name: str, frac: float, nodes: int, cost, params: _ParamHash) -> list[str]:
    policy, kw = _grid_policy(PROTOCOL_GRID[name]) if name in PROTOCOL_GRID else (name, {})
    cfg = engine.ServingConfig(pool_blocks=int(frac * _distinct(tr)), prefill_nodes=nodes)
    rec = engine.simulate(tr, policy, cfg=cfg, cost=cost, **kw)
    summary = json.dumps(metrics.summarize(name, rec, cost=cost, cfg=cfg), sort_keys=True)
    return [_digest(rec), summary, params.reset()]


def _generated(cache: Path, name: str, make) -> traces.MooncakeTrace:
    path = cache / f"{name}.jsonl"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        traces.save_mooncake_jsonl(make(), path)
    return traces.load_mooncake_trace(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON of every run's digests")
    p.add_argument("--compare", help="a reference JSON: report the runs that differ")
    p.add_argument("--set", choices=("small", "heavy", "all"), default="all")
    p.add_argument("--heavy-trace", default="chat_heavy_12k.jsonl")
    p.add_argument("--cache", default="/tmp/serving_identity", help="generated traces")
    args = p.parse_args()
    cost, params, cache, out = CostModel.llama3_8b_a100(), _ParamHash(), Path(args.cache), {}
    jobs = []
    if args.set in ("small", "all"):
        small = {
            "chat3k": (lambda: workloads.chat(3000, seed=0), (0.1, 0.25)),
            "rag3k": (lambda: workloads.rag(3000, seed=0), (0.1, 0.25)),
            "agent2k": (lambda: workloads.agent(2000, seed=1), (0.1,)),
            "mm": (lambda: workloads.mm_session(300, seed=3), (0.1,)),
        }
        names = list(BLOCK_POLICIES) + list(PROTOCOL_GRID)
        for tn, (make, fracs) in small.items():
            tr = _generated(cache, tn, make)
            jobs += [(tn, tr, f, n, 4) for f in fracs for n in names]
        head = traces.load_mooncake_trace(traces.trace_path(TRACE)).head(2000)
        jobs += [("example2k", head, 0.1, n, 4) for n in names]
    if args.set in ("heavy", "all"):
        heavy = traces.load_mooncake_trace(args.heavy_trace)
        jobs += [("heavy", heavy, 0.25, n, 24) for n in HEAVY]
    for tn, tr, frac, name, nodes in jobs:
        t0 = time.process_time()
        out[f"{tn}|{frac}|{name}"] = _run(tr, name, frac, nodes, cost, params)
        print(f"{tn} {frac} {name}: {time.process_time() - t0:.1f} s CPU", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True))
    if args.compare:
        ref = json.loads(Path(args.compare).read_text())
        bad = [k for k in sorted(set(ref) & set(out)) if ref[k] != out[k]]
        print(f"{len(set(ref) & set(out))} runs compared, {len(bad)} differ", *bad, sep="\n")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
