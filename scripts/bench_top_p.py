"""Nucleus (top-p) sampling's sort, side by side: ``generate.sample`` (``topn.sort_desc``, one
sort of 32-bit integer keys) against the same code with ``jnp.sort`` (its sort before session
36), jitted, in turns, on SmolLM2's vocabulary (49,152 logits) at batch 1 and 8. The same
tokens are drawn (checked here and in tests/test_policies_adaptive.py's ``sort_desc`` test).
Prints medians and the median per-turn ratio.

Usage: python scripts/bench_top_p.py [--turns 30] [--vocab 49152] [--top-p 0.9]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.generate import Sampling

generate = importlib.import_module("jaxkv.generate")  # the module (jaxkv.generate is a function)


def with_jnp_sort(logits, sampling, key):
    """``generate.sample`` with ``jnp.sort`` in place of ``topn.sort_desc``."""
    packed = generate.sort_desc
    generate.sort_desc = lambda x: jnp.sort(x, axis=-1)[:, ::-1]
    try:
        return generate.sample(logits, sampling, key=key)
    finally:
        generate.sort_desc = packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args()
    sampling = Sampling(temperature=1.0, top_p=args.top_p)
    key = jax.random.key(0)
    for batch in (1, 8):
        logits = jnp.asarray(np.random.default_rng(batch).normal(size=(batch, args.vocab)) * 3)
        runs = {
            "sort_desc (integer keys)": jax.jit(lambda x, k: generate.sample(x, sampling, key=k)),
            "jnp.sort (before)": jax.jit(lambda x, k: with_jnp_sort(x, sampling, k)),
        }
        outs = [np.asarray(f(logits, key)) for f in runs.values()]  # compiles
        np.testing.assert_array_equal(*outs)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.turns):
            for name, f in runs.items():
                t0 = time.perf_counter()
                f(logits, key).block_until_ready()
                times[name].append(1e3 * (time.perf_counter() - t0))
        for name, ts in times.items():
            print(f"batch {batch}, {name}: median {statistics.median(ts):.2f} ms")
        new, old = times.values()
        ratio = statistics.median(a / b for a, b in zip(new, old, strict=True))
        print(f"batch {batch}, per-turn ratio (sort_desc / jnp.sort): median {ratio:.2f}")
    print(f"1-minute load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
