"""Small MM-Session cells where session 9's guard (no hysteresis) ends below vLLM's lru, and the
shipped guard's (hysteresis 0.1 %) result there (results/kvlearn/vllm_guard_design_s10.md).

    .venv-vllm/bin/python scripts/vllm_guard_small_mm.py SESSIONS FIRST_SEED END_SEED
"""

import sys
import time

import bench_kvlearn_serving as protocol_lib  # scripts/, this script's folder
import bench_vllm_policy as bench_lib

from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.integrations import vllm_policy, vllm_replay
from jaxkv.kvlearn.serving.engine import ServingConfig

GUARD = vllm_policy.KVLearnGuardCachePolicy
UNGUARDED = type("S", (GUARD,), {"hysteresis": 0.0})
SHIPPED = type("A", (GUARD,), {"hysteresis": 0.001})


def trace(sessions: int, seed: int, rho: float):
    cfg = workloads.MMSessionConfig(**workloads.MM_HEAVY)
    return bench_lib.deployed(
        protocol_lib._loaded(workloads.mm_session(sessions, seed=seed, cfg=cfg)), rho
    )


def cells(sessions: int, first: int, end: int):
    """(seed, pool fraction, trace, config) of every cell: seeds ``first``..``end - 1``, pools
    of 25 and 50 % of the trace's distinct blocks."""
    rho = bench_lib.protocol_rho()
    for seed in range(first, end):
        tr, nodes = trace(sessions, seed, rho)
        for frac in (0.25, 0.5):
            cfg = ServingConfig(
                pool_blocks=int(frac * protocol_lib._distinct(tr)), prefill_nodes=nodes
            )
            yield seed, frac, tr, cfg


def main() -> None:
    sessions, first, end = (int(a) for a in sys.argv[1:4])
    for seed, frac, tr, cfg in cells(sessions, first, end):
        t0 = time.time()
        rows = vllm_replay.run(tr, ("lru", UNGUARDED), cfg=cfg, cost=bench_lib.COST)
        lru, old = (r["hit_saving_ms_mean"] for r in rows)
        line = (
            f"seed {seed} frac {frac} n {len(tr)} nodes {cfg.prefill_nodes} lru {lru:.4f} "
            f"S {old:.4f} changes {rows[1]['guard']['leader_changes']}"
        )
        if old < lru:
            (a,) = vllm_replay.run(tr, (SHIPPED,), cfg=cfg, cost=bench_lib.COST)
            line += f" A {a['hit_saving_ms_mean']:.4f} changes {a['guard']['leader_changes']}"
        print(line, f"{time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
