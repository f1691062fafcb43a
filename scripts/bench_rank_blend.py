"""``rerank.rank_blend`` (three row sorts of packed integers, ``topn.lex_argsort``) against the
same code with ``jnp.argsort``/``jnp.lexsort`` (its sorts before session 36) and against the
composition it replaced (six row sorts: ranks among the free slots, their mixed order, then
``transplant``), jitted, in turns, on the rows of a global decode-protocol eviction at batch
8 × 4K, r = 0.25 (30 layers × 8 × 3 KV heads, rows of up to 2·B = 2,082 slots). Same outputs bit
for bit (checked here and in tests/test_policies_rerank.py). Prints medians and the medians of
the per-turn ratios to the first.

Usage: python scripts/bench_rank_blend.py [--turns 15] [--weight 0.75] [--slots 2082]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.policies import TIER
from jaxkv.policies import rerank as rerank_lib
from jaxkv.topn import inverse_permutation


def rank_blend_by_transplant(alloc, other, valid, weight: float):
    """The composition ``rerank.rank_blend`` replaced (session 26): six row sorts."""
    free = valid & (alloc < TIER)
    own = rerank_lib.row_ranks(alloc, free)
    mixed = (1.0 - weight) * own + weight * rerank_lib.row_ranks(other, free)
    slots = jnp.lexsort((own, mixed), axis=-1)
    order = -inverse_permutation(slots).astype(jnp.float32)
    return rerank_lib.transplant(alloc, order, valid)


def jnp_sorts(fn):
    """``fn`` traced with ``rerank``'s packed sorts swapped for ``jnp``'s comparison sorts."""

    def lex_argsort(keys, bits):
        return jnp.lexsort(tuple(reversed(keys)), axis=-1)

    def argsort_desc(x):
        return jnp.argsort(-x, axis=-1, stable=True)

    def traced(*args):
        packed = rerank_lib.lex_argsort, rerank_lib.argsort_desc
        rerank_lib.lex_argsort, rerank_lib.argsort_desc = lex_argsort, argsort_desc
        try:
            return fn(*args)
        finally:
            rerank_lib.lex_argsort, rerank_lib.argsort_desc = packed

    return traced


def side_by_side(label: str, runs: dict[str, Callable], args: tuple, turns: int) -> None:
    """Checks that the runs agree, then times them in turns; prints medians and the ratios of
    the first to each other (each line after ``label``, when given)."""
    outs = [np.asarray(f(*args)) for f in runs.values()]  # compiles
    for out in outs[1:]:
        np.testing.assert_array_equal(outs[0], out)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(turns):
        for name, f in runs.items():
            t0 = time.perf_counter()
            f(*args).block_until_ready()
            times[name].append(1e3 * (time.perf_counter() - t0))
    prefix = f"{label}, " if label else ""
    for name, ts in times.items():
        print(f"{prefix}{name}: median {statistics.median(ts):.2f} ms over {turns} turns")
    first, *others = times
    for name in others:
        ratio = statistics.median(a / b for a, b in zip(times[first], times[name], strict=True))
        print(f"{prefix}per-turn ratio ({first} / {name}): median {ratio:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=15)
    ap.add_argument("--weight", type=float, default=0.75)
    ap.add_argument("--slots", type=int, default=2082)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shape = (30, 8, 3, args.slots)
    alloc = rng.random(shape, dtype=np.float32)
    alloc[..., :64] += TIER  # a protected tier (the ranker's attended slots)
    other = rng.random(shape, dtype=np.float32)
    valid = rng.random(shape) > 0.05
    args_ = tuple(jnp.asarray(x) for x in (alloc, other, valid))
    runs = {
        "three packed sorts (rank_blend)": jax.jit(rerank_lib.rank_blend, static_argnums=3),
        "three jnp sorts (before session 36)": jax.jit(
            jnp_sorts(rerank_lib.rank_blend), static_argnums=3
        ),
        "six jnp sorts (before session 26)": jax.jit(
            jnp_sorts(rank_blend_by_transplant), static_argnums=3
        ),
    }
    side_by_side("", runs, (*args_, args.weight), args.turns)
    print(f"1-minute load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
