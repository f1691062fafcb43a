"""Session 11: the guard's leader rule on short MM-Session traces (vllm_guard_rule_s11.md).

    .venv-vllm/bin/python scripts/vllm_guard_short.py log SESSIONS FIRST_SEED END_SEED [--out DIR]
    .venv-vllm/bin/python scripts/vllm_guard_short.py eval SESSIONS FIRST_SEED END_SEED \
        [--set ATTR=VALUE ...]

log: per cell (the traces and pools of ``vllm_guard_small_mm.py``), vLLM's lru and arc and the
guard, with the guard's per-request leader, real score and shadow scores pickled (diagnosis and
design). eval: the same, one line per cell, no pickles. ``--set`` changes a guard class
attribute (e.g. ``floor=20``, ``baselines=lru+arc``); without it, the shipped guard.
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path

import bench_vllm_policy as bench_lib
from vllm_guard_design import logged
from vllm_guard_small_mm import cells

from jaxkv.kvlearn.integrations import vllm_replay


def attr(text: str) -> tuple[str, object]:
    """``--set NAME=VALUE`` as a guard class attribute (``baselines=lru+arc``: a tuple)."""
    name, value = text.split("=", 1)
    if name == "baselines":
        return name, tuple(value.split("+"))
    return name, (int(value) if name == "min_requests" else float(value))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("log", "eval"))
    ap.add_argument("sessions", type=int)
    ap.add_argument("first", type=int)
    ap.add_argument("end", type=int)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="ATTR=VALUE",
        help="guard class attribute (floor, min_requests, hysteresis, baselines=a+b)",
    )
    ap.add_argument("--out", default="/tmp/vllm_guard_short")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    attrs = dict(attr(a) for a in args.set)
    for seed, frac, tr, cfg in cells(args.sessions, args.first, args.end):
        t0 = time.time()
        log: list = []
        rows = vllm_replay.run(
            tr, ("lru", "arc", logged(log, **attrs)), cfg=cfg, cost=bench_lib.COST
        )
        lru, arc, g = (r["hit_saving_ms_mean"] for r in rows)
        gd = rows[2]["guard"]
        print(
            f"seed {seed} frac {frac} n {len(tr)} lru {lru:.4f} arc {arc:.4f} guard {g:.4f} "
            f"-lru {g - lru:+.4f} -arc {g - arc:+.4f} changes {gd['leader_changes']} "
            f"learner {gd['learner_requests']} {time.time() - t0:.0f}s",
            flush=True,
        )
        if args.mode == "log":
            doc = {"seed": seed, "frac": frac, "lru": lru, "arc": arc, "guard": g, "log": log}
            (out / f"log_{seed}_{frac}.pkl").write_bytes(pickle.dumps(doc))


if __name__ == "__main__":
    main()
