"""Eviction cost and compressed-decode speed on the embedded model, one run, side by side.

Batch 8, a 4096-token context, 64 decode steps, r = 0.25. The caches are filled with random
keys, values and statistics of the right shapes (decode cost does not depend on the values;
a real 8 x 4K prefill would take minutes here). Per decode step (medians):

* full cache, no statistics (the baseline);
* compressed cache (capacity 1041 = 25 % + 1 slot): decode with statistics, then eviction,
  for the shared token set and per KV head;
* the parts: decode without statistics, decode with statistics, eviction alone.

Writes ``results/bench_eviction.{json,md}``.

    .venv/bin/python scripts/bench_eviction.py [--steps 64] [--context 4096] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv import eviction, kvcache
from jaxkv.eviction import Compression
from jaxkv.model import decoder

RESULTS = Path(__file__).resolve().parents[1] / "results"


def filled_cache(config, *, batch, capacity, n_valid, stats):
    """A cache whose first ``n_valid`` slots hold random tokens at positions 0..n_valid-1."""
    cache = kvcache.init_cache(config, batch_size=batch, capacity=capacity, stats=stats)
    key = jax.random.key(0)
    shape = cache.k[:, :, :, :n_valid].shape
    filled = {
        n: jax.random.uniform(jax.random.fold_in(key, i), cache.pos.shape)
        for i, n in enumerate(cache.stats)
    }
    return cache.replace(
        k=cache.k.at[:, :, :, :n_valid].set(jax.random.normal(key, shape)),
        v=cache.v.at[:, :, :, :n_valid].set(jax.random.normal(jax.random.fold_in(key, 99), shape)),
        pos=cache.pos.at[:, :, :, :n_valid].set(jnp.arange(n_valid)),
        stats=filled,
        length=jnp.full((batch,), n_valid, jnp.int32),
    )


def time_steps(step, cache, steps):
    """Median seconds of ``cache = step(cache)`` after one warm-up (compile) call."""
    cache = step(cache)
    jax.block_until_ready(cache)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        cache = step(cache)
        jax.block_until_ready(cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--policy", default="h2o")
    args = ap.parse_args()
    model = jaxkv.load("smollm2-135m")
    cfg, params = model.config, model.params
    n_max = args.context + args.steps
    tok = jnp.zeros((args.batch,), jnp.int32)

    def decode(c):
        return decoder.decode_step(params, tok, c, config=cfg)[1]

    def make(comp):
        def step(c):
            c = decode(c)
            return eviction.evict(c, comp, None, key=jax.random.key(0), max_drop=1)

        return jax.jit(step, donate_argnums=0), jax.jit(
            lambda c: eviction.evict(c, comp, None, key=jax.random.key(0), max_drop=1),
            donate_argnums=0,
        )

    rows = {}
    full = filled_cache(cfg, batch=args.batch, capacity=n_max, n_valid=args.context, stats=False)
    rows["full"] = time_steps(jax.jit(decode, donate_argnums=0), full, args.steps)
    full_bytes = full.nbytes()
    del full
    for gran in ("shared", "head"):
        comp = Compression.make(args.policy, ratio=args.ratio, granularity=gran)
        cap = comp.capacity(n_max)
        budget = comp.max_budget(n_max)

        def fresh(stats=True, cap=cap, budget=budget):
            return filled_cache(cfg, batch=args.batch, capacity=cap, n_valid=budget, stats=stats)

        step, evict_only = make(comp)
        rows[f"compressed_{gran}"] = time_steps(step, fresh(), args.steps)
        rows[f"evict_only_{gran}"] = time_steps(evict_only, fresh(), args.steps)
        if gran == "shared":
            small_bytes = fresh().nbytes()
            rows["decode_stats"] = time_steps(
                jax.jit(decode, donate_argnums=0), fresh(), args.steps
            )
            rows["decode_nostats"] = time_steps(
                jax.jit(decode, donate_argnums=0), fresh(stats=False), args.steps
            )
    report = summarize(rows, full_bytes, small_bytes, args)
    print(report)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_eviction.md").write_text(report)
    (RESULTS / "bench_eviction.json").write_text(
        json.dumps(
            dict(
                args=vars(args),
                ms={k: 1e3 * v for k, v in rows.items()},
                full_bytes=full_bytes,
                compressed_bytes=small_bytes,
            ),
            indent=1,
        )
    )


def summarize(rows, full_bytes, small_bytes, args):
    ms = {k: 1e3 * v for k, v in rows.items()}
    lines = [
        f"# Eviction benchmark (SmolLM2-135M, batch {args.batch}, context {args.context}, "
        f"r = {args.ratio}, policy {args.policy}, median of {args.steps} steps)",
        "",
        "| measurement | ms / step |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in ms.items()]
    for gran in ("shared", "head"):
        total = ms[f"compressed_{gran}"]
        lines += [
            "",
            f"- {gran}: decode throughput vs full cache: **{ms['full'] / total:.2f}x**; "
            f"statistics + scoring + selection = {total - ms['decode_nostats']:.1f} ms = "
            f"**{100 * (total - ms['decode_nostats']) / total:.1f} %** of a step "
            f"(eviction alone {ms[f'evict_only_{gran}']:.1f} ms)",
        ]
    lines += [
        "",
        f"- cache bytes: {small_bytes / 2**20:.0f} MiB compressed (with statistics) vs "
        f"{full_bytes / 2**20:.0f} MiB full = **{100 * small_bytes / full_bytes:.1f} %**",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
