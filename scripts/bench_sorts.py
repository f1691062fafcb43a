"""Float sorts replaced by integer sorts or by none, side by side with what they replaced,
jitted, in turns:

* nucleus (top-p) sampling (``generate.sample``) on SmolLM2's vocabulary (49,152 logits) at
  batch 1 and 8: ``topn.top_p_mask`` (a bisection, no sort; session 37) against the sorted
  cutoff it replaced, with ``topn.sort_desc`` (one sort of 32-bit keys; session 36) and with
  ``jnp.sort`` (before). The same tokens are drawn on these logits (checked here; the masks
  can differ only where an entry's sorted predecessors hold p to within float rounding,
  tests/test_policies_adaptive.py);
* the hybrid's rows kept whole (``eviction.hybrid_full_rows``: every row's attention masses
  sorted) at batch 8 × 4K slots: ``sort_desc`` against ``jax.lax.top_k`` of the whole row
  (before session 37); the same rows.

Prints medians and the median per-turn ratios to the first of each group.

Usage: python scripts/bench_sorts.py [--turns 30] [--vocab 49152] [--top-p 0.9]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from bench_rank_blend import side_by_side

from jaxkv import eviction, kvcache
from jaxkv.config import ModelConfig
from jaxkv.generate import Sampling, sample
from jaxkv.topn import sort_desc


def sample_sorted(logits, sampling: Sampling, key, sort: Callable):
    """``generate.sample``'s nucleus before session 37: the logits sorted descending by
    ``sort``, their cumulative mass, and the value where it first reaches p."""
    logits = logits / sampling.temperature
    sorted_desc = sort(logits)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    n_keep = jnp.sum(before < sampling.top_p, axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def hybrid_rows_top_k(cache: kvcache.KVCache, comp: eviction.Compression):
    """``eviction.hybrid_full_rows`` with ``jax.lax.top_k`` in place of ``sort_desc``."""
    with mock.patch.object(eviction, "sort_desc", lambda x: jax.lax.top_k(x, x.shape[-1])[0]):
        return eviction.hybrid_full_rows(cache, comp)


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
    s = Sampling(temperature=1.0, top_p=args.top_p)
    key = jax.random.key(0)
    jnp_sort = lambda x: jnp.sort(x, axis=-1)[:, ::-1]
    for batch in (1, 8):
        logits = jnp.asarray(np.random.default_rng(batch).normal(size=(batch, args.vocab)) * 3)
        runs = {
            "top_p_mask (bisection)": jax.jit(lambda x, k: sample(x, s, key=k)),
            "sort_desc (session 36)": jax.jit(lambda x, k: sample_sorted(x, s, k, sort_desc)),
            "jnp.sort (before)": jax.jit(lambda x, k: sample_sorted(x, s, k, jnp_sort)),
        }
        side_by_side(f"top-p, batch {batch}", runs, (logits, key), args.turns)
    comp = eviction.Compression.make("h2o", ratio=0.25, granularity="head", full_heads=0.25)
    runs = {
        "sort_desc (integer keys)": jax.jit(lambda c: eviction.hybrid_full_rows(c, comp)),
        "top_k (before)": jax.jit(lambda c: hybrid_rows_top_k(c, comp)),
    }
    side_by_side("hybrid rows, batch 8 x 4K", runs, (hybrid_cache(8, 4096),), args.turns // 3)
    print(f"1-minute load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
