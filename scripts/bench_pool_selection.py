"""The pooled allocation, side by side with the sorts it replaced, on the ``global`` pool of a
decode step at batch 8 and a 4K context (r = 0.25: 30 layers x 3 KV heads = 90 rows of 2,083
slots per sequence, half of them occupied, floor 0.2 B, cap 2 B, B = 1,041):

* selection: ``topn.top_n_mask`` (a bisection for each pool's n-th largest score) against two
  stable argsorts of the pool;
* allocation: ``eviction.adaptive_budgets`` (three top-n masks, no sort) against the
  formulation before it (a sort of every row, then two argsorts of the pool).

Each pair gives the same result (checked first); then they take turns, and the medians and
ratios are printed and written to ``results/bench_pool_selection.md``.

    .venv/bin/python scripts/bench_pool_selection.py [--reps 20] [--batch 8]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import eviction, topn

RESULTS = Path(__file__).resolve().parents[1] / "results"


def argsort_mask(x, n):
    """The replaced formulation: the first n of a stable descending argsort, via its rank."""
    order = jnp.argsort(-x, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)
    return rank < n


def sorted_allocation(scores, pos, budget, floor, cap):
    """``adaptive_budgets(..., over_layers=True)`` as it was: every row sorted, then the pool."""
    L, B, K, C = scores.shape
    fold = lambda x: x.transpose(1, 0, 2, 3).reshape(1, B, L * K, C)  # noqa: E731
    s = jnp.where(fold(pos) >= 0, fold(scores), -jnp.inf)
    ranked = -jnp.sort(-s, axis=-1)
    j = jnp.arange(C)
    occupied = ranked > -jnp.inf
    f, c = floor[None, :, None, None], cap[None, :, None, None]
    cand = jnp.where(occupied & (j < f), jnp.inf, jnp.where(j < c, ranked, -jnp.inf))
    best = argsort_mask(cand.reshape(1, B, L * K * C), (L * K * budget)[None, :, None])
    taken = occupied & (j < jnp.maximum(c, f)) & best.reshape(ranked.shape)
    return jnp.sum(taken, axis=-1).reshape(B, L, K).transpose(1, 0, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2083, help="slots per row")
    ap.add_argument("--out", default=str(RESULTS / "bench_pool_selection.md"))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    L, K, C = 30, 3, args.slots
    x = rng.normal(size=(1, args.batch, (L * K) * C)).astype(np.float32)
    x[..., ::C] = -np.inf  # one free slot per row
    x = jnp.asarray(x)
    n = jnp.full((1, args.batch, 1), (L * K) * (C // 2), jnp.int32)
    scores = jnp.asarray(rng.normal(size=(L, args.batch, K, C)).astype(np.float32))
    pos = jnp.asarray(np.where(rng.uniform(size=scores.shape) < 0.5, -1, 1).astype(np.int32))
    budget = jnp.full((args.batch,), (C - 1) // 2, jnp.int32)
    bounds = dict(floor=budget // 5, cap=2 * budget)
    new_alloc = functools.partial(eviction.adaptive_budgets, over_layers=True)
    pairs = {
        "selection": {
            "two argsorts": (jax.jit(argsort_mask), (x, n), {}),
            "top_n_mask": (jax.jit(topn.top_n_mask), (x, n), {}),
        },
        "allocation": {
            "row sorts + two argsorts": (
                jax.jit(sorted_allocation),
                (scores, pos, budget, bounds["floor"], bounds["cap"]),
                {},
            ),
            "adaptive_budgets": (
                jax.jit(new_alloc),
                (scores, pos, budget),
                {"floor_B": bounds["floor"], "cap_B": bounds["cap"]},
            ),
        },
    }
    same = {}
    for what, variants in pairs.items():
        outs = [np.asarray(jax.block_until_ready(f(*a, **kw))) for f, a, kw in variants.values()]
        same[what] = np.array_equal(*outs)
    flat = {k: v for variants in pairs.values() for k, v in variants.items()}
    times = {k: [] for k in flat}
    load = [os.getloadavg()[0]]
    for _ in range(args.reps):
        for k, (f, a, kw) in flat.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*a, **kw))
            times[k].append(time.perf_counter() - t0)
    load.append(os.getloadavg()[0])
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    lines = [
        f"# Pooled allocation: batch {args.batch}, {(L * K)} rows x {C} slots per sequence, "
        f"median of {args.reps} interleaved calls",
        "",
        f"Load average (1 min) {load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} "
        "CPUs. Same result: "
        + ", ".join(f"{w} {'yes' if ok else 'NO'}" for w, ok in same.items())
        + ".",
        "",
        "| what | before | ms / call | now | ms / call | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    for what, variants in pairs.items():
        (old, new) = variants
        lines.append(
            f"| {what} | {old} | {ms[old]:.1f} | {new} | {ms[new]:.1f} | "
            f"**{ms[old] / ms[new]:.1f}x** |"
        )
    lines.append("")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)
    if not all(same.values()):
        raise SystemExit("a pair differs")


if __name__ == "__main__":
    main()
