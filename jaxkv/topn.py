"""Sort-free order statistics. ``top_n_mask``: the n largest entries of each vector, as a
stable descending sort's first n would pick them, without sorting; the pooled allocation
(``jaxkv.eviction.adaptive_budgets``), the attended tier
(``jaxkv.policies.heuristics.protect_attended``) and CriticalKV's first stage select with it.
``inverse_permutation``: the ranks of a sort's order by one scatter, not a second sort."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_n_mask(x, n) -> jax.Array:
    """The ``n`` largest entries of each last-axis vector of ``x``, ties to the lower index:
    the first ``n`` of a stable descending sort, without the sort.

    A bisection over the 32 bits of an order-preserving integer key finds each vector's n-th
    largest value t (32 passes of one comparison each, instead of two argsorts of the whole
    vector: the ``global`` pool of a 4K cache holds ~190K slots per sequence); then every
    entry above t is taken, and the first ``n - #(> t)`` entries equal to t. ``-0.0`` counts
    as ``0.0``, as in a sort's comparison.

    Args:
        x: [..., M] float scores.
        n: int, broadcastable to ``x.shape[:-1] + (1,)``; 0 <= n <= M.

    Returns:
        [..., M] bool, ``n`` True per vector.
    """
    x = jnp.where(x == 0, 0.0, x.astype(jnp.float32))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    sign = jnp.uint32(1 << 31)
    key = jnp.where(bits >= sign, ~bits, bits | sign)  # unsigned order = float order
    n = jnp.asarray(n, jnp.int32)

    def bisect(i, t):  # the largest t with #(key >= t) >= n, one bit at a time from the top
        trial = t | (sign >> i.astype(jnp.uint32))
        enough = jnp.sum(key >= trial, axis=-1, keepdims=True) >= n
        return jnp.where(enough, trial, t)

    t = jax.lax.fori_loop(0, 32, bisect, jnp.zeros(key.shape[:-1] + (1,), jnp.uint32))
    above = key > t
    tied = key == t
    need = n - jnp.sum(above, axis=-1, keepdims=True)
    return above | (tied & (jnp.cumsum(tied, axis=-1) <= need))


def inverse_permutation(perm) -> jax.Array:
    """The inverse of each last-axis permutation, ``out[..., perm[..., i]] = i``: the rank of
    every entry when ``perm`` is an argsort. Equal to ``jnp.argsort(perm, axis=-1)``, by one
    scatter instead of a sort (8-20x faster on XLA:CPU for rows of 1-2K slots)."""
    idx = jnp.broadcast_to(jnp.arange(perm.shape[-1], dtype=perm.dtype), perm.shape)
    return jnp.put_along_axis(jnp.zeros_like(perm), perm, idx, axis=-1, inplace=False)
