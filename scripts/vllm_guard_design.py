"""Session 10's guard candidates on the design data (results/kvlearn/vllm_guard_rule_s10.md).

    .venv-vllm/bin/python scripts/vllm_guard_design.py CANDIDATE [--sets p,7,8] [--out DIR]
    .venv-vllm/bin/python scripts/vllm_guard_design.py --log SET WORKLOAD FRAC

CANDIDATE: ``V`` (baselines lru, arc), ``A0.1`` / ``A0.5`` (hysteresis 0.1 / 0.5 % anchored at
lru). Sets: ``p`` issue 15's cells, 7 and 8 the fresh seeds already spent. Only the cells where
the shipped guard changed leader are replayed (elsewhere every candidate decides as it does, the
rule file says why); lru's and arc's numbers are read from the existing vllm_replay*.json.
--log: the per-request leader and shadow scores of one cell with session 9's guard (diagnosis).
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

import bench_kvlearn_serving as protocol_lib  # scripts/, this script's folder
import bench_vllm_policy as bench_lib

from jaxkv.kvlearn.integrations import vllm_policy, vllm_replay
from jaxkv.kvlearn.serving.engine import ServingConfig

GUARD = vllm_policy.KVLearnGuardCachePolicy
CANDIDATES = {
    "V": {"baselines": ("lru", "arc"), "hysteresis": 0.0},
    "A0.1": {"baselines": vllm_policy.GUARD_BASELINES, "hysteresis": 0.001},
    "A0.5": {"baselines": vllm_policy.GUARD_BASELINES, "hysteresis": 0.005},
}
SHIPPED = {"p": "vllm_replay.json", "7": "vllm_replay_seed7.json", "8": "vllm_replay_seed8.json"}


def traces(which: str):
    return (
        bench_lib.protocol_traces(False)
        if which == "p"
        else bench_lib.fresh_traces(int(which), False)
    )


def candidate(name: str) -> type:
    return type(f"Guard_{name}", (GUARD,), dict(CANDIDATES[name]))


def evaluate(name: str, sets: list[str], out: Path) -> None:
    pol = candidate(name)
    rows = []
    for which in sets:
        doc = json.loads((Path("results/kvlearn") / SHIPPED[which]).read_text())
        trs = traces(which)
        for cell in doc["cells"]:
            runs = cell["runs"]
            ship = runs["KVLearnGuardCachePolicy"]
            row = {"set": which, "workload": cell["workload"], "pool_frac": cell["pool_frac"]}
            row |= {p: runs[p]["hit_saving_ms_mean"] for p in ("lru", "arc")}
            row["S"] = ship["hit_saving_ms_mean"]
            if ship["guard"]["leader_changes"] == 0:
                row |= {"cand": row["S"], "replayed": False}
            else:
                tr, nodes = trs[cell["workload"]]
                cfg = ServingConfig(pool_blocks=cell["pool_blocks"], prefill_nodes=nodes)
                t0 = time.perf_counter()
                (r,) = vllm_replay.run(tr, (pol,), cfg=cfg, cost=bench_lib.COST)
                row |= {"cand": r["hit_saving_ms_mean"], "replayed": True, "run": r}
                row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "run"}), flush=True)
            (out / f"design_{name}.json").write_text(json.dumps(rows, indent=1))


def logged(log: list, **attrs) -> type:
    """The guard with class attributes ``attrs``, appending (old leader, new, real score,
    shadow scores) to ``log`` after every request."""

    class Logged(GUARD):
        def _choose_leader(self):
            old = self.leader
            super()._choose_leader()
            log.append((old, self.leader, self.saved_real, [sh.saved for sh in self.shadows]))

    for k, v in attrs.items():
        setattr(Logged, k, v)
    return Logged


def log_cell(which: str, workload: str, frac: float, out: Path) -> None:
    log = []
    guard = logged(log, hysteresis=0.0)  # session 9's rule, the one diagnosed
    tr, nodes = traces(which)[workload]
    cfg = ServingConfig(pool_blocks=int(frac * protocol_lib._distinct(tr)), prefill_nodes=nodes)
    vllm_replay.run(tr, (guard,), cfg=cfg, cost=bench_lib.COST)
    names = [*GUARD.baselines, "kvlearn"]
    last = 0.0
    for i, (old, new, real, s) in enumerate(log):
        d = real - s[0]
        if old != new or d != last:
            lead = " ".join(f"{n} {x - s[0]:+.1f}" for n, x in zip(names, s, strict=True))
            print(f"#{i} {names[old]} -> {names[new]}: real − lru {d:+.1f}; shadows − lru {lead}")
        last = d
    (out / f"log_{which}_{workload}_{frac}.pkl").write_bytes(pickle.dumps(log))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("candidate", nargs="?", choices=sorted(CANDIDATES))
    ap.add_argument("--sets", default="p,7,8")
    ap.add_argument("--log", nargs=3, metavar=("SET", "WORKLOAD", "FRAC"))
    ap.add_argument("--out", default="/tmp/vllm_guard_design")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.log:
        log_cell(args.log[0], args.log[1], float(args.log[2]), out)
    else:
        evaluate(args.candidate, args.sets.split(","), out)


if __name__ == "__main__":
    main()
