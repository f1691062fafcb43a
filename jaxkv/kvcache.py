"""The KV cache: one frozen pytree with a fixed number of slots.

Every per-slot array shares the slot axis C as its axis 3 (``[L, B, K, C, ...]``), so one
``gather`` moves them all. A slot is free iff its ``pos`` is -1; validity is never stored
twice. Keys are stored after RoPE, at the token's original position.

New tokens go into the first free slots of each (layer, sequence, KV head) row, so evicting a
token is just freeing its slot (``free_slots``): no key or value moves. ``gather`` compacts a
cache into a new capacity (after prefill, when a long prompt is cut to its budget).
``length[b]`` counts the tokens sequence b has processed: the position of its next token.
Rows may hold different tokens and different numbers of them (per-head and ``adaptive``
selection, ``jaxkv.eviction``): C is the most one row can hold, the rest of a row is free.

Keys and values are stored in the model's dtype, or (``init_cache(dtype="int8")``) as int8
with one float32 scale per (layer, sequence, KV head, slot) each: ``k_scale`` and
``v_scale`` [L, B, K, C], per-slot arrays like ``pos`` that ``gather`` moves with their slots.
A token is quantized when it is written (``append``/``fill_empty``: symmetric absmax over the
head dim, ``quantize``); attention dequantizes by folding the scales into the scores and the
probabilities (``jaxkv.model.decoder``), and code that reads the stored keys or values reads
``cache.keys()`` / ``cache.values()`` (float32, dequantized). A full-precision cache has
``k_scale = v_scale = None`` and behaves exactly as before.

Besides the per-slot arrays a cache may carry query statistics (``query_stats``), which
belong to no slot: running sums of every (layer, query head)'s queries and of their outer
products, for policies that model the queries to come (Expected Attention,
``jaxkv.policies.expected``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.config import ModelConfig

FREE = -1

# Per-slot attention statistics (each [L, B, K, C] float32), updated inside attention:
#   attn       mass from the final query of the latest pass, mean over the G query heads
#   attn_sq    mean over G of that mass squared (variance across heads = attn_sq - attn^2)
#   attn_cum   mass summed over every query so far, mean over G (H2O's heavy hitters)
#   recent     sum over queries q of lam^age(q) * mass, lam = exp(-1/window), mean over G
#   recent_ent same, each query's mass weighted by its attention entropy H(a_q)
#   vnorm      L2 norm of the value vector (of an int8 cache: of the value before it was
#              quantized, as computed in the same pass)
STAT_NAMES = ("attn", "attn_sq", "attn_cum", "recent", "recent_ent", "vnorm")

# Per-slot statistics of the model's weights, not of attention: written once with the token,
# like ``vnorm`` (of an int8 cache: from the value before it was quantized), never updated,
# and carried only when asked for by name (``stats=True`` means ``STAT_NAMES``):
#   wo_vnorm   ||v W_o^(n)||_1, mean over the KV head's G query heads n (CriticalKV's norm,
#              ``jaxkv.policies.critical``)
WEIGHT_STATS = ("wo_vnorm",)

# Query statistics: a name a policy lists in its ``stats`` like the per-slot ones, but what it
# asks for lives in ``KVCache.query_stats`` (not per slot: ``gather`` leaves it alone). Sums
# over every real query so far at a position >= ``QUERY_SINKS`` (kvpress's ``n_sink``: the
# first tokens' queries are outliers), of the pre-RoPE query, in float32:
#   weight [B]                    number of queries summed (the same for every layer and head)
#   q_sum [L, B, K, G, H]         sum of the queries
#   q_outer [L, B, K, G, H, H]    sum of their outer products q q^T
QUERIES = "queries"
QUERY_SINKS = 4

INT8 = "int8"
INT8_MAX = 127  # symmetric range [-127, 127]: -128 is never used, so q and -q both exist


@struct.dataclass
class KVCache:
    """Explicit fixed-capacity KV cache.

    Attributes:
        k: [L, B, K, C, H] post-RoPE keys (int8 when ``quantized``).
        v: [L, B, K, C, H] values (int8 when ``quantized``).
        pos: [L, B, K, C] int32 token position held by each slot, -1 when free.
        stats: per-slot statistics, each [L, B, K, C] (empty: the decoder computes none).
        query_stats: query moments (``QUERIES``; empty: the decoder computes none).
        length: [B] int32 tokens processed so far per sequence.
        overflow: [] bool, a write found no free slot (set under jit, where raising is
            impossible; the decoder then returns NaN logits).
        window: time constant (in queries) of the ``recent`` statistics (static).
        rope_theta: the model's RoPE base, which ``query_stats`` (pre-RoPE) need to be
            compared with the stored (rotated) keys (static).
        k_scale: [L, B, K, C] float32 dequantization scale of each stored key (int8 cache),
            else None.
        v_scale: [L, B, K, C] float32 scale of each stored value, else None.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    stats: dict
    length: jax.Array
    overflow: jax.Array
    query_stats: dict = struct.field(default_factory=dict)
    window: int = struct.field(pytree_node=False, default=64)
    rope_theta: float = struct.field(pytree_node=False, default=10000.0)
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        """Keys and values are stored as int8 with per-slot scales."""
        return self.k_scale is not None

    def keys(self) -> jax.Array:
        """[L, B, K, C, H] float32 keys as attention sees them (dequantized when int8)."""
        return dequantize(self.k, self.k_scale)

    def values(self) -> jax.Array:
        """[L, B, K, C, H] float32 values as attention sees them (dequantized when int8)."""
        return dequantize(self.v, self.v_scale)

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
        """Bytes held by all arrays of the cache (its real memory)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self))


def init_cache(
    config: ModelConfig,
    *,
    batch_size: int,
    capacity: int,
    dtype=None,
    stats: bool | tuple[str, ...] = False,
    window: int = 64,
) -> KVCache:
    """An empty cache with ``capacity`` slots for ``batch_size`` sequences.

    Args:
        config: the model config.
        batch_size: sequences.
        capacity: slots per (layer, sequence, KV head).
        dtype: key/value dtype (default: the model's), or ``"int8"`` (also ``jnp.int8``):
            int8 keys and values with per-slot float32 scales (module docstring).
        stats: the statistics to carry (names from ``STAT_NAMES``, ``WEIGHT_STATS`` and
            ``QUERIES``, e.g. a policy's ``stats``), True for the attention ones and
            ``vnorm`` (``STAT_NAMES``), False for none. The decoder computes only the
            statistics a cache carries.
        window: time constant of the ``recent`` statistics, in queries.
    """
    if batch_size < 1 or capacity < 1:
        raise ValueError(f"batch_size and capacity must be >= 1, got {batch_size}, {capacity}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    names = stat_names(stats)
    dtype = jnp.dtype(dtype or config.jnp_dtype)
    L, K, H = config.n_layers, config.n_kv_heads, config.head_dim
    shape = (L, batch_size, K, capacity)
    int8 = dtype == jnp.int8
    if not int8 and not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"cache dtype must be a float dtype or {INT8!r}, got {dtype}")
    return KVCache(
        k=jnp.zeros((*shape, H), dtype),
        v=jnp.zeros((*shape, H), dtype),
        pos=jnp.full(shape, FREE, jnp.int32),
        stats={n: jnp.zeros(shape, jnp.float32) for n in names if n != QUERIES},
        length=jnp.zeros((batch_size,), jnp.int32),
        overflow=jnp.zeros((), bool),
        query_stats=init_query_stats(config, batch_size) if QUERIES in names else {},
        window=window,
        rope_theta=float(config.rope_theta),
        k_scale=jnp.zeros(shape, jnp.float32) if int8 else None,
        v_scale=jnp.zeros(shape, jnp.float32) if int8 else None,
    )


def quantize(x_XH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric absmax int8 quantization over the last axis (one scale per head-dim vector).

    Returns:
        q [..., H] int8 with ``|x - q * scale| <= scale / 2`` elementwise, and scale [...]
        float32 (``max |x| / 127``; 0 for an all-zero vector, which is then stored as 0).
    """
    x = x_XH.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    q = jnp.clip(jnp.round(x / safe), -INT8_MAX, INT8_MAX)
    return q.astype(jnp.int8), scale


def dequantize(x_XH: jax.Array, scale_X: jax.Array | None) -> jax.Array:
    """float32 values of stored keys or values: ``q * scale``, or ``x`` itself when
    ``scale`` is None (a full-precision cache)."""
    x = x_XH.astype(jnp.float32)
    return x if scale_X is None else x * scale_X[..., None]


def init_query_stats(config: ModelConfig, batch_size: int) -> dict:
    """Zero query moments (see ``QUERIES``): ``weight``, ``q_sum``, ``q_outer``."""
    L, K, G, H = config.n_layers, config.n_kv_heads, config.q_per_kv, config.head_dim
    return {
        "weight": jnp.zeros((batch_size,), jnp.float32),
        "q_sum": jnp.zeros((L, batch_size, K, G, H), jnp.float32),
        "q_outer": jnp.zeros((L, batch_size, K, G, H, H), jnp.float32),
    }


def stat_names(stats: bool | tuple[str, ...]) -> tuple[str, ...]:
    """The statistic names that ``init_cache(stats=...)`` means, in ``STAT_NAMES`` order
    (then ``WEIGHT_STATS``, then ``QUERIES``)."""
    if isinstance(stats, bool):
        return STAT_NAMES if stats else ()
    valid = (*STAT_NAMES, *WEIGHT_STATS, QUERIES)
    unknown = sorted(set(stats) - set(valid))
    if unknown:
        raise ValueError(f"unknown cache statistics {unknown}; valid: {list(valid)}")
    return tuple(n for n in valid if n in stats)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_room(cache: KVCache, n_new: int) -> None:
    """Raises if some row has fewer than ``n_new`` free slots (only outside jit)."""
    if _is_concrete(cache.pos):
        n_free = int(jnp.min(jnp.sum(cache.pos < 0, axis=-1)))
        if n_free < n_new:
            raise ValueError(
                f"KV cache overflow: {n_new} new tokens but only {n_free} free slots of "
                f"{cache.capacity}; allocate a larger cache or evict first"
            )


def first_free(pos_LBKC: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The ``n`` lowest free slot indices of every row, and whether each row had room.

    Returns:
        slots [L, B, K, n] int32 and ok [L, B, K] bool.
    """
    C = pos_LBKC.shape[-1]
    free = pos_LBKC < 0
    if n == 1:
        slots = jnp.argmax(free, axis=-1)[..., None]
    else:
        order = jnp.where(free, jnp.arange(C), C + jnp.arange(C))
        slots = jax.lax.top_k(-order, n)[1]
    return slots.astype(jnp.int32), jnp.sum(free, axis=-1) >= n


def _scatter(x, slots_LBKT, upd):
    """x[l, b, k, slots[l, b, k, t]] = upd[l, b, k, t] for every row."""
    L, B, K, T = slots_LBKT.shape
    li, bi, ki = jnp.ix_(jnp.arange(L), jnp.arange(B), jnp.arange(K))
    return x.at[li[..., None], bi[..., None], ki[..., None], slots_LBKT].set(
        upd.astype(x.dtype), unique_indices=True
    )


def _write(cache: KVCache, put, k_LBKTH, v_LBKTH, pos_BT, new_stats) -> KVCache:
    """Writes new tokens with ``put(array, update)`` into every per-slot array (quantizing
    them first into an int8 cache)."""
    L, B, K, T = k_LBKTH.shape[:4]
    pos_LBKT = jnp.broadcast_to(pos_BT[None, :, None, :], (L, B, K, T))
    if cache.quantized:
        k_LBKTH, k_scale = quantize(k_LBKTH)
        v_LBKTH, v_scale = quantize(v_LBKTH)
        cache = cache.replace(
            k_scale=put(cache.k_scale, k_scale), v_scale=put(cache.v_scale, v_scale)
        )
    return cache.replace(
        k=put(cache.k, k_LBKTH),
        v=put(cache.v, v_LBKTH),
        pos=put(cache.pos, pos_LBKT),
        stats={n: put(a, new_stats[n]) for n, a in cache.stats.items()},
        length=cache.length + jnp.sum(pos_BT >= 0, axis=1).astype(jnp.int32),
    )


def append(
    cache: KVCache,
    k_LBKTH: jax.Array,
    v_LBKTH: jax.Array,
    pos_BT: jax.Array,
    new_stats: dict | None = None,
) -> KVCache:
    """Writes T new tokens into the first T free slots of every row.

    ``pos_BT`` is -1 for padding tokens, whose slots stay free. ``new_stats`` gives the new
    slots' statistics ([L, B, K, T] each; required when the cache carries statistics).
    """
    check_room(cache, k_LBKTH.shape[3])
    slots, ok = first_free(cache.pos, k_LBKTH.shape[3])
    put = lambda x, upd: _scatter(x, slots, upd)  # noqa: E731
    cache = _write(cache, put, k_LBKTH, v_LBKTH, pos_BT, new_stats)
    return cache.replace(overflow=cache.overflow | ~jnp.all(ok))


def fill_empty(
    cache: KVCache,
    k_LBKTH: jax.Array,
    v_LBKTH: jax.Array,
    pos_BT: jax.Array,
    new_stats: dict | None = None,
) -> KVCache:
    """``append`` into an empty cache: the first free slots are 0..T-1, so the tokens are
    written as one contiguous block (no slot search, no scatter)."""
    check_room(cache, k_LBKTH.shape[3])

    def put(x, upd):
        return jax.lax.dynamic_update_slice(x, upd.astype(x.dtype), (0,) * x.ndim)

    return _write(cache, put, k_LBKTH, v_LBKTH, pos_BT, new_stats)


def free_slots(cache: KVCache, drop_LBKC: jax.Array) -> KVCache:
    """Evicts the slots where ``drop`` is true (broadcast to [L, B, K, C]) by freeing them."""
    return cache.replace(pos=jnp.where(drop_LBKC, FREE, cache.pos))


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
            ``broadcast_index``); an index of -1 yields a free slot.
        capacity: slots of the result (default C'); the extra slots are free.

    Returns:
        A cache with ``capacity`` slots whose first C' hold the gathered ones.
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

    scales = {}
    if cache.quantized:
        scales = dict(k_scale=take(cache.k_scale, 0), v_scale=take(cache.v_scale, 0))
    return cache.replace(
        k=take(cache.k, 0),
        v=take(cache.v, 0),
        pos=take(cache.pos, FREE),
        stats={name: take(acc, 0) for name, acc in cache.stats.items()},
        **scales,
    )


def compact(cache: KVCache, capacity: int) -> KVCache:
    """Moves each row's occupied slots (in slot order) to the front of a ``capacity`` cache.

    Raises (outside jit) when some row holds more tokens than ``capacity``; under jit the
    overflow flag is set instead.
    """
    C = cache.capacity
    n_used = jnp.sum(cache.pos >= 0, axis=-1)
    if _is_concrete(n_used) and int(jnp.max(n_used)) > capacity:
        raise ValueError(f"cannot compact {int(jnp.max(n_used))} tokens into {capacity} slots")
    order = jnp.where(cache.pos >= 0, jnp.arange(C), C + jnp.arange(C))
    k = min(capacity, C)
    idx = jax.lax.top_k(-order, k)[1]
    idx = jnp.where(jnp.take_along_axis(cache.pos, idx, axis=-1) >= 0, idx, -1)
    out = gather(cache, idx, capacity=capacity)
    return out.replace(overflow=out.overflow | jnp.any(n_used > capacity))
