"""Latency of the jitted control-plane calls with a pool holding 100k resident blocks.

Usage: python scripts/bench_kvlearn_api.py [--blocks 100000] [--repeats 200] [--json PATH]

Median wall time of one jitted ``lookup`` / ``admit`` / ``tick`` call from Python (state
donated, result blocked on), each ``admit`` forcing one eviction of the lowest-value block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kvlearn.core import control
from jaxkv.kvlearn.core import features as features_lib
from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.core.facade import _admit, _lookup, _tick

BLOCK_TOKENS = 64  # 8 MiB blocks with the LLaMA-3-8B footprint


def full_state(cfg: control.KVLearnConfig, n_blocks: int):
    """A state whose pool holds ``n_blocks`` blocks (keys 0..n-1) and is exactly full."""
    kib = int(pool_lib.bytes_to_kib(cfg.cost.footprint_bytes(BLOCK_TOKENS)))
    state = control.init(cfg, capacity_bytes=n_blocks * kib * 1024, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    c = state.pool.n_slots
    key_Z = np.full(c, -1, np.int32)
    key_Z[:n_blocks] = np.arange(n_blocks)
    slot_P = np.full(cfg.max_keys, -1, np.int32)
    slot_P[:n_blocks] = np.arange(n_blocks)
    rank_Z = np.where(key_Z >= 0, rng.random(c), 0).astype(np.float32)
    pool = state.pool.replace(
        key_Z=jnp.asarray(key_Z),
        kib_Z=jnp.asarray(np.where(key_Z >= 0, kib, 0).astype(np.int32)),
        rank_Z=jnp.asarray(rank_Z),
        value_Z=jnp.asarray(rank_Z * 1e-3),
        slot_P=jnp.asarray(slot_P),
        used_kib=jnp.int32(n_blocks * kib),
        n_free=jnp.int32(0),
    )
    pool = pool_lib.set_ranks(pool, rank_Z=pool.rank_Z, value_Z=pool.value_Z)
    table = state.hist.table_PJ.at[:n_blocks, features_lib.N_REQ].set(1.0)
    hist = state.hist.replace(table_PJ=table.at[:n_blocks, features_lib.TOKENS].set(BLOCK_TOKENS))
    atc = state.atc.replace(theta=jnp.float32(-0.5))
    return state.replace(pool=pool, hist=hist, atc=atc)


def _request(key: int, t: float) -> control.Request:
    return control.Request(jnp.int32(key), jnp.int32(BLOCK_TOKENS), jnp.int32(0), jnp.float32(t))


def bench(n_blocks: int, repeats: int) -> dict:
    cfg = control.KVLearnConfig(max_blocks=n_blocks, max_keys=2 * n_blocks + 2 * repeats + 8)
    state = full_state(cfg, n_blocks)
    times = {"lookup": [], "admit": [], "tick": []}
    for i in range(repeats + 3):  # the first calls compile
        t = 1.0 + i
        req = _request(n_blocks + i, t)
        t0 = time.perf_counter()
        state, hit = _lookup(state, req, cfg=cfg)
        hit.block_until_ready()
        t1 = time.perf_counter()
        state, res = _admit(state, req, cfg=cfg)
        res.admitted.block_until_ready()
        t2 = time.perf_counter()
        if i < 3 or i % 20 == 0:
            state = _tick(state, jnp.float32(t), cfg=cfg)
            jax.block_until_ready(state.atc.theta)
            times["tick"].append(time.perf_counter() - t2) if i >= 3 else None
        if i >= 3:
            times["lookup"].append(t1 - t0)
            times["admit"].append(t2 - t1)
    resident = int(jnp.sum(state.pool.key_Z >= 0))
    out = {f"{k}_ms_median": 1e3 * statistics.median(v) for k, v in times.items()}
    return out | {
        "resident_blocks": resident,
        "repeats": repeats,
        "admitted_last": bool(res.admitted),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = bench(args.blocks, args.repeats)
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
