"""Small MM-Session cells where session 9's guard (no hysteresis) ends below vLLM's lru, and the
shipped guard's (hysteresis 0.1 %) result there (results/kvlearn/vllm_guard_design_s10.md).

    .venv-vllm/bin/python scripts/vllm_guard_small_mm.py SESSIONS FIRST_SEED END_SEED
"""

import sys
import tempfile
import time
from pathlib import Path

import bench_kvlearn_serving as protocol_lib  # scripts/, this script's folder
import bench_vllm_policy as bench_lib

from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.integrations import vllm_policy, vllm_replay
from jaxkv.kvlearn.serving.engine import ServingConfig
from jaxkv.kvlearn.traces import load_mooncake_trace, save_mooncake_jsonl

GUARD = vllm_policy.KVLearnGuardCachePolicy
UNGUARDED = type("S", (GUARD,), {"hysteresis": 0.0})
SHIPPED = type("A", (GUARD,), {"hysteresis": 0.001})


def trace(sessions: int, seed: int):
    recs = workloads.mm_session(
        sessions, seed=seed, cfg=workloads.MMSessionConfig(**protocol_lib.MM_HEAVY)
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        save_mooncake_jsonl(recs, path)
        tr = load_mooncake_trace(path)
    rho = protocol_lib._busy(bench_lib.shipped(), bench_lib.COST) / protocol_lib.REF_NODES
    nodes, load = protocol_lib.deployment(tr, bench_lib.COST, rho)
    return tr.scaled(load), nodes


def main() -> None:
    sessions, first, end = (int(a) for a in sys.argv[1:4])
    for seed in range(first, end):
        tr, nodes = trace(sessions, seed)
        for frac in (0.25, 0.5):
            cfg = ServingConfig(
                pool_blocks=int(frac * protocol_lib._distinct(tr)), prefill_nodes=nodes
            )
            t0 = time.time()
            rows = vllm_replay.run(tr, ("lru", UNGUARDED), cfg=cfg, cost=bench_lib.COST)
            lru, old = (r["hit_saving_ms_mean"] for r in rows)
            line = (
                f"seed {seed} frac {frac} n {len(tr)} nodes {nodes} lru {lru:.4f} S {old:.4f} "
                f"changes {rows[1]['guard']['leader_changes']}"
            )
            if old < lru:
                (a,) = vllm_replay.run(tr, (SHIPPED,), cfg=cfg, cost=bench_lib.COST)
                line += f" A {a['hit_saving_ms_mean']:.4f} changes {a['guard']['leader_changes']}"
            print(line, f"{time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
