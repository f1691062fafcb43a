"""``topn.sort_desc`` (one sort of 32-bit integer keys) against the sorts it replaced, side by
side, jitted, in turns: nucleus (top-p) sampling's cutoff (``generate.sample``; ``jnp.sort``
before session 36) on SmolLM2's vocabulary (49,152 logits) at batch 1 and 8, and the hybrid's
rows kept whole (``eviction.hybrid_full_rows``: every row's attention masses sorted;
``jax.lax.top_k`` of the whole row before session 37) at batch 8 × 4K slots. The same tokens
are drawn and the same rows chosen (checked here; tests/test_policies_adaptive.py checks
``sort_desc`` against numpy). Prints medians and the median per-turn ratios.

Usage: python scripts/bench_sort_desc.py [--turns 30] [--vocab 49152] [--top-p 0.9]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import eviction, kvcache
from jaxkv.config import ModelConfig
from jaxkv.generate import Sampling

generate = importlib.import_module("jaxkv.generate")  # the module (jaxkv.generate is a function)


def with_sort(module, sort: Callable, fn: Callable, *args, **kw):
    """``fn(*args, **kw)`` traced with ``module.sort_desc`` swapped for ``sort``."""
    packed = module.sort_desc
    module.sort_desc = sort
    try:
        return fn(*args, **kw)
    finally:
        module.sort_desc = packed


def side_by_side(label: str, runs: dict[str, Callable], args: tuple, turns: int) -> None:
    """Checks that the runs agree, then times them in turns; prints medians and the ratio."""
    outs = [np.asarray(f(*args)) for f in runs.values()]  # compiles
    np.testing.assert_array_equal(*outs)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(turns):
        for name, f in runs.items():
            t0 = time.perf_counter()
            f(*args).block_until_ready()
            times[name].append(1e3 * (time.perf_counter() - t0))
    for name, ts in times.items():
        print(f"{label}, {name}: median {statistics.median(ts):.2f} ms")
    (new, old), (a, b) = times.values(), runs
    ratio = statistics.median(x / y for x, y in zip(new, old, strict=True))
    print(f"{label}, per-turn ratio ({a} / {b}): median {ratio:.2f}")


def hybrid_cache(batch: int, slots: int) -> kvcache.KVCache:
    """A SmolLM2-shaped cache (30 layers × 3 KV heads) full of random attention masses."""
    cfg = ModelConfig.smollm2_135m()
    cache = kvcache.init_cache(cfg, batch_size=batch, capacity=slots, stats=True)
    mass = np.random.default_rng(0).random(cache.pos.shape, dtype=np.float32)
    pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), cache.pos.shape)
    stats = dict(cache.stats, attn_cum=jnp.asarray(mass))
    return cache.replace(pos=pos, length=jnp.full((batch,), slots, jnp.int32), stats=stats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args()
    sampling = Sampling(temperature=1.0, top_p=args.top_p)
    key = jax.random.key(0)
    jnp_sort = lambda x: jnp.sort(x, axis=-1)[:, ::-1]
    for batch in (1, 8):
        logits = jnp.asarray(np.random.default_rng(batch).normal(size=(batch, args.vocab)) * 3)
        runs = {
            "sort_desc (integer keys)": jax.jit(lambda x, k: generate.sample(x, sampling, key=k)),
            "jnp.sort (before)": jax.jit(
                lambda x, k: with_sort(generate, jnp_sort, generate.sample, x, sampling, key=k)
            ),
        }
        side_by_side(f"top-p, batch {batch}", runs, (logits, key), args.turns)
    comp = eviction.Compression.make("h2o", ratio=0.25, granularity="head", full_heads=0.25)
    top_k = lambda x: jax.lax.top_k(x, x.shape[-1])[0]
    runs = {
        "sort_desc (integer keys)": jax.jit(lambda c: eviction.hybrid_full_rows(c, comp)),
        "top_k (before)": jax.jit(
            lambda c: with_sort(eviction, top_k, eviction.hybrid_full_rows, c, comp)
        ),
    }
    side_by_side("hybrid rows, batch 8 x 4K", runs, (hybrid_cache(8, 4096),), args.turns // 3)
    print(f"1-minute load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
