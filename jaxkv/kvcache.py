"""The KV cache: one frozen pytree with a fixed number of slots.

Every per-slot array shares the slot axis C as its axis 3 (``[L, B, K, C, ...]``), so one
``gather`` moves them all. A slot is empty iff its ``pos`` is -1; validity is never stored
twice. Keys are stored after RoPE, at the token's original position.

``cursor`` is the next free slot, shared by the batch (sequences of different lengths leave
empty slots behind, which eviction compacts away). ``length[b]`` counts the tokens sequence b
has processed: it is the position of its next token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.config import ModelConfig

EMPTY = -1


@struct.dataclass
class KVCache:
    """Explicit fixed-capacity KV cache.

    Attributes:
        k: [L, B, K, C, H] post-RoPE keys.
        v: [L, B, K, C, H] values.
        pos: [L, B, K, C] int32 token position held by each slot, -1 when empty.
        stats: per-slot accumulators, each [L, B, K, C] (attention statistics for policies).
        cursor: [] int32 next free slot.
        length: [B] int32 tokens processed so far per sequence.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    stats: dict
    cursor: jax.Array
    length: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def valid(self) -> jax.Array:
        """[L, B, K, C] bool: slot holds a token."""
        return self.pos >= 0

    def nbytes(self) -> int:
        """Bytes held by all slot arrays (the real memory of the cache)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self))


def init_cache(
    config: ModelConfig,
    *,
    batch_size: int,
    capacity: int,
    dtype=None,
    stat_names: tuple[str, ...] = (),
) -> KVCache:
    """An empty cache with ``capacity`` slots for ``batch_size`` sequences."""
    if batch_size < 1 or capacity < 1:
        raise ValueError(f"batch_size and capacity must be >= 1, got {batch_size}, {capacity}")
    dtype = dtype or config.jnp_dtype
    L, K, H = config.n_layers, config.n_kv_heads, config.head_dim
    shape = (L, batch_size, K, capacity)
    return KVCache(
        k=jnp.zeros((*shape, H), dtype),
        v=jnp.zeros((*shape, H), dtype),
        pos=jnp.full(shape, EMPTY, jnp.int32),
        stats={name: jnp.zeros(shape, jnp.float32) for name in stat_names},
        cursor=jnp.zeros((), jnp.int32),
        length=jnp.zeros((batch_size,), jnp.int32),
    )


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_room(cache: KVCache, n_new: int) -> None:
    """Raises if ``n_new`` more slots do not fit (only when the cursor is concrete)."""
    if _is_concrete(cache.cursor):
        used = int(cache.cursor)
        if used + n_new > cache.capacity:
            raise ValueError(
                f"KV cache overflow: {used} slots used + {n_new} new tokens > capacity "
                f"{cache.capacity}; allocate a larger cache or evict first"
            )


def append(
    cache: KVCache,
    k_LBKTH: jax.Array,
    v_LBKTH: jax.Array,
    pos_BT: jax.Array,
    stats: dict | None = None,
) -> KVCache:
    """Writes T new tokens at slots ``cursor .. cursor+T-1`` of every layer and head.

    ``pos_BT`` is -1 for padding tokens, which leave empty slots. ``stats`` optionally gives
    the new slots' accumulators ([L, B, K, T] each; missing ones start at zero). Under jit an
    overflow cannot raise: the cursor then runs past the capacity and ``overflowed`` reports
    it (the decoder turns the logits to NaN), so it is never silent.
    """
    T = k_LBKTH.shape[3]
    check_room(cache, T)
    L, B, K = cache.pos.shape[:3]
    start = (0, 0, 0, cache.cursor)
    pos_LBKT = jnp.broadcast_to(pos_BT[None, :, None, :], (L, B, K, T)).astype(jnp.int32)
    new_stats = {}
    for name, acc in cache.stats.items():
        upd = (stats or {}).get(name, jnp.zeros((L, B, K, T), acc.dtype))
        new_stats[name] = jax.lax.dynamic_update_slice(acc, upd.astype(acc.dtype), start)
    n_real = jnp.sum(pos_BT >= 0, axis=1).astype(jnp.int32)
    return cache.replace(
        k=jax.lax.dynamic_update_slice(cache.k, k_LBKTH.astype(cache.k.dtype), (*start, 0)),
        v=jax.lax.dynamic_update_slice(cache.v, v_LBKTH.astype(cache.v.dtype), (*start, 0)),
        pos=jax.lax.dynamic_update_slice(cache.pos, pos_LBKT, start),
        stats=new_stats,
        cursor=cache.cursor + T,
        length=cache.length + n_real,
    )


def overflowed(cache: KVCache) -> jax.Array:
    """[] bool: more tokens were appended than the cache holds (their keys were lost)."""
    return cache.cursor > cache.capacity


def broadcast_index(cache: KVCache, idx: jax.Array) -> jax.Array:
    """Expands a slot index ``[B, C']`` (shared by layers and heads), ``[L, B, C']`` (per
    layer) or ``[L, B, K, C']`` (per KV head) to ``[L, B, K, C']``."""
    L, B, K = cache.pos.shape[:3]
    if idx.ndim == 2:
        idx = idx[None, :, None, :]
    elif idx.ndim == 3:
        idx = idx[:, :, None, :]
    elif idx.ndim != 4:
        raise ValueError(f"slot index must have 2, 3 or 4 axes, got shape {idx.shape}")
    return jnp.broadcast_to(idx, (L, B, K, idx.shape[-1]))


def gather(cache: KVCache, idx: jax.Array, *, capacity: int | None = None) -> KVCache:
    """Keeps the slots ``idx`` (in that order) of every per-slot array.

    Args:
        cache: the cache.
        idx: slot indices, ``[B, C']``, ``[L, B, C']`` or ``[L, B, K, C']`` (see
            ``broadcast_index``); an index of -1 yields an empty slot.
        capacity: slots of the result (default C'); extra slots are empty, so new tokens fit.

    Returns:
        A cache with ``capacity`` slots whose first C' hold the gathered ones; cursor = C'.
    """
    idx_LBKc = broadcast_index(cache, idx).astype(jnp.int32)
    n_keep = idx_LBKc.shape[-1]
    capacity = n_keep if capacity is None else capacity
    if capacity < n_keep:
        raise ValueError(f"capacity {capacity} < number of gathered slots {n_keep}")
    hole = idx_LBKc < 0
    safe = jnp.where(hole, 0, idx_LBKc)
    pad = capacity - n_keep

    def take(x, fill):
        extra = x.ndim - 4
        ix = safe.reshape(safe.shape + (1,) * extra)
        out = jnp.take_along_axis(x, ix, axis=3)
        out = jnp.where(hole.reshape(hole.shape + (1,) * extra), fill, out)
        widths = [(0, 0)] * 3 + [(0, pad)] + [(0, 0)] * extra
        return jnp.pad(out, widths, constant_values=fill)

    return cache.replace(
        k=take(cache.k, 0),
        v=take(cache.v, 0),
        pos=take(cache.pos, EMPTY),
        stats={name: take(acc, 0) for name, acc in cache.stats.items()},
        cursor=jnp.asarray(n_keep, jnp.int32),
    )
