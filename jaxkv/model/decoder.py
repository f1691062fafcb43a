"""The pure-functional Mistral/Llama decoder.

Three functions, no modes:

* ``forward(params, tokens)``: all logits of a batch, no cache (the golden path).
* ``prefill(params, tokens, cache)``: a prompt into an empty cache; last-token logits.
* ``extend(params, tokens, cache)`` / ``decode_step(params, token, cache)``: new tokens that
  attend to everything in the cache plus themselves.

The layer loop is a ``lax.scan`` over the stacked layer weights, with each layer's cache
slices as scan inputs. Measured on this 2-core CPU, against a Python loop unrolled inside jit
(which slices layer i out of the stacked weights and cache, and XLA copies those slices at
every call): decode at 4K context 61 vs 166 ms/token, batch 8 x 1K 124 vs 298 ms/token.
Where a decode step's time goes, op by op, is in results/profile_decode.md
(scripts/profile_decode.py): each layer's slices of the stacked weights and values are still
copied once per step (XLA's CPU dots need contiguous operands), the keys are not, nor the
weights at batch 1 when they are stored output channels first
(``weights_int8.transpose_params``, and int8 weights). With ``config.attention == "kernel"``
new tokens attend over the cache through ``jaxkv.model.cache_kernel``, a compiled CPU kernel
that reads the stacked cache in place, each key and value once (results/profile_decode.md,
"Session 43"); with ``config.matmul == "kernel"`` a step of 1-16 rows multiplies by each
layer's out-first weights through ``cache_kernel.stacked_matmul``, which reads them in place
too (``weights_int8.LayerWeight``; "Session 44"); and a prompt's causal self-attention goes
through ``cache_kernel.causal_attention``, flash-style ("Session 45").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv import kvcache
from jaxkv import stats as attn_stats
from jaxkv.config import ModelConfig
from jaxkv.kvcache import KVCache
from jaxkv.model import cache_kernel, layers
from jaxkv.model import weights_int8 as weights_lib

PREFILL_BLOCK = 256


def _project_qkv(lp: dict, x_BTD, pos_BT, config: ModelConfig):
    """Returns q [B, K, G, T, H] and k, v [B, K, T, H] (keys and queries rotated)."""
    return _projections(lp, x_BTD, pos_BT, config)[:3]


def _projections(lp: dict, x_BTD, pos_BT, config: ModelConfig):
    """``_project_qkv``'s q, k, v and the queries before RoPE [B, T, N, H] (for the query
    moments; unused, they cost nothing)."""
    B, T, _ = x_BTD.shape
    h = layers.rms_norm(x_BTD, lp["attn_norm"], config.norm_eps)
    q = weights_lib.einsum("btd,dnh->btnh", h, lp["wq"])
    k = weights_lib.einsum("btd,dkh->btkh", h, lp["wk"])
    v = weights_lib.einsum("btd,dkh->btkh", h, lp["wv"])
    q_rot = layers.rope(q, pos_BT, config.rope_theta)
    k = layers.rope(k, pos_BT, config.rope_theta)
    K, G, H = config.n_kv_heads, config.q_per_kv, config.head_dim
    q_BKGTH = q_rot.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4)
    return q_BKGTH, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), q


def _finish_layer(lp: dict, x_BTD, attn_BKGTH, config: ModelConfig):
    """Output projection, residual, and the SwiGLU MLP block."""
    B, K, G, T, H = attn_BKGTH.shape
    attn_BTNH = attn_BKGTH.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)
    x_BTD = x_BTD + weights_lib.einsum("btnh,nhd->btd", attn_BTNH, lp["wo"])
    h = layers.rms_norm(x_BTD, lp["mlp_norm"], config.norm_eps)
    return x_BTD + layers.swiglu(h, lp["w_gate"], lp["w_up"], lp["w_down"])


def _embed(params, tokens_BT, config: ModelConfig):
    return weights_lib.take_rows(params["embed"], tokens_BT).astype(config.jnp_dtype)


def _logits(params, x_BXD, config: ModelConfig, *, kernel: bool = False):
    """Logits through the output head (with ``kernel``, ``cache_kernel.stacked_matmul``)."""
    h = layers.rms_norm(x_BXD, params["final_norm"], config.norm_eps)
    vocab_first = config.tie_embeddings
    head = params["embed"] if vocab_first else params["lm_head"]
    if kernel:
        head = weights_lib.kernel_head(head, vocab_first=vocab_first)
    return weights_lib.head_logits(h, head, vocab_first=vocab_first)


def prompt_positions(tokens_BT: jax.Array, lengths_B: jax.Array | None) -> jax.Array:
    """Positions [B, T] of right-padded prompts: t for real tokens, -1 for padding."""
    B, T = tokens_BT.shape
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    if lengths_B is None:
        return t
    return jnp.where(t < lengths_B[:, None], t, -1)


def _value_stats(lp, v_BKTH, names) -> dict:
    """The new slots' statistics among ``names`` that are not attention's: each value's
    norm, and its norm after the layer's output projection (``kvcache.WEIGHT_STATS``)."""
    out = {}
    if "vnorm" in names:
        out["vnorm"] = attn_stats.value_norms(v_BKTH)
    if "wo_vnorm" in names:
        wo_NHD = weights_lib.dense(lp["wo"])  # int8 weights: their dequantized W_o
        out["wo_vnorm"] = attn_stats.projected_value_norms(v_BKTH, wo_NHD)
    return out


def _prompt_attention(q, k, v, pos_BT, config: ModelConfig, stat_weights, stat_names):
    """Causal self-attention of a prompt's layer and (with ``stat_weights``) its statistics:
    ``layers.causal_block_attention``. With ``config.attention == "kernel"`` (float32, H a
    multiple of 64) the output comes from the compiled flash-style kernel
    (``cache_kernel.causal_attention``) whether or not statistics are gathered, so a cache
    with statistics holds the same keys and values as one without, bit for bit (r = 1 equals
    the full cache); the statistics still come from XLA's blocks, whose unused output XLA
    drops."""
    kernel = (
        config.attention == "kernel"
        and cache_kernel.prefill_supported(q)
        and _require_kernel("attention")
    )
    if kernel and stat_weights is None:
        return cache_kernel.causal_attention(q, k, v, pos_BT, window=config.sliding_window), None
    attn, st = layers.causal_block_attention(
        q,
        k,
        v,
        pos_BT,
        window=config.sliding_window,
        block=PREFILL_BLOCK,
        stat_weights_BT3=stat_weights,
        stat_names=stat_names,
    )
    if kernel:
        attn = cache_kernel.causal_attention(q, k, v, pos_BT, window=config.sliding_window)
    return attn, st


def _self_attention_stack(
    params,
    tokens_BT,
    pos_BT,
    config: ModelConfig,
    *,
    stat_window=None,
    stat_names=(),
    query_moments=False,
):
    """Runs all layers with causal self-attention only.

    Returns:
        Hidden states [B, T, D], new keys and values [L, B, K, T, H], (with
        ``stat_window``) the statistics ``stat_names`` of the new slots
        ({name: [L, B, K, T]}), else None, and (with ``query_moments``) the pass's query
        moments (``jaxkv.stats.query_moments`` stacked over L, and their ``weight`` [B]),
        else None.
    """
    weights = None if stat_window is None else attn_stats.query_weights(pos_BT, stat_window)
    q_weights = attn_stats.query_moment_weights(pos_BT) if query_moments else None

    def layer(x, lp):
        q, k, v, q_pre = _projections(lp, x, pos_BT, config)
        attn, st = _prompt_attention(q, k, v, pos_BT, config, weights, stat_names)
        if st is not None:
            st = {**st, **_value_stats(lp, v, stat_names)}
        qm = None
        if q_weights is not None:
            qm = attn_stats.query_moments(q_pre, q_weights, config.n_kv_heads)
        return _finish_layer(lp, x, attn, config), (k, v, st, qm)

    x, (ks, vs, new_stats, moments) = jax.lax.scan(
        layer, _embed(params, tokens_BT, config), params["layers"]
    )
    if moments is not None:
        moments = {"weight": jnp.sum(q_weights, axis=1), **moments}
    return x, ks, vs, new_stats, moments


def forward(params: dict, tokens_BT: jax.Array, *, config: ModelConfig, lengths_B=None):
    """Logits [B, T, V] (float32) of every position; padding positions are garbage."""
    pos_BT = prompt_positions(tokens_BT, lengths_B)
    x = _self_attention_stack(params, tokens_BT, pos_BT, config)[0]
    return _logits(params, x, config)


def prefill(
    params: dict, tokens_BT: jax.Array, cache: KVCache, *, config: ModelConfig, lengths_B=None
) -> tuple[jax.Array, KVCache]:
    """Runs a right-padded prompt batch into an empty cache.

    Args:
        params: model parameters.
        tokens_BT: prompt tokens, right-padded.
        cache: an empty cache with at least T slots; when it carries statistics they are
            computed inside attention (``jaxkv.stats``), and its query moments from the
            pass's queries.
        config: the model config.
        lengths_B: real prompt lengths (default: all T).

    Returns:
        Logits [B, V] at each sequence's last real token, and the filled cache.
    """
    if not isinstance(cache.pos, jax.core.Tracer) and bool(jnp.any(cache.pos >= 0)):
        raise ValueError("prefill needs an empty cache; use extend() to add to a filled one")
    kvcache.check_room(cache, tokens_BT.shape[1])
    pos_BT = prompt_positions(tokens_BT, lengths_B)
    x, k_LBKTH, v_LBKTH, new_stats, moments = _self_attention_stack(
        params,
        tokens_BT,
        pos_BT,
        config,
        stat_window=cache.window if cache.stats else None,
        stat_names=tuple(cache.stats),
        query_moments=bool(cache.query_stats),
    )
    last_B = jnp.max(pos_BT, axis=1)
    x_BD = jnp.take_along_axis(x, last_B[:, None, None], axis=1)[:, 0]
    cache = kvcache.fill_empty(cache, k_LBKTH, v_LBKTH, pos_BT, new_stats)
    if moments is not None:
        cache = cache.replace(query_stats=moments)
    return _guard(_logits(params, x_BD, config), cache), cache


def _cached_attention(q, k_new, v_new, pos_BT, cached, config: ModelConfig):
    """Attention of new queries over one layer's cache slots plus the new tokens.

    One softmax over both key parts, never concatenated; visibility comes from positions
    and broadcasts over the query heads inside the fused ops (no [B, K, G, T, C] mask).
    ``cached`` is the layer's (keys, values, pos, key scales, value scales); the scales are
    None for a full-precision cache. An int8 cache is dequantized by folding its scales: a
    slot's key scale multiplies its scores (s = scale * q.k_int8) and its value scale the
    probabilities that weight its value. The keys' widening is fused into the score dots
    (read in place); the values' is a float copy of the layer's values, which XLA:CPU's dot
    needs (results/profile_decode.md, "Compressed decoding with the int8 KV cache"). The new
    tokens attend to their own keys and values in full precision (quantized when written).

    Returns:
        The output [B, K, G, T, H] and the probabilities of the cache slots
        [B, K, G, T, C] and of the new tokens [B, K, G, T, T].
    """
    ck, cv, cpos, k_scale, v_scale = cached
    # A narrower cache (float16, int8) is widened to the model's dtype as it is read, never
    # the probabilities narrowed to the cache's: the dots run in the model's precision.
    ck, cv = ck.astype(q.dtype), cv.astype(v_new.dtype)
    q_pos = pos_BT[:, None, None, :, None]
    window = config.sliding_window
    sees_cache = layers.visible(q_pos, cpos[:, :, None, None, :], window)  # [B, K, 1, T, C]
    sees_new = layers.visible(q_pos, pos_BT[:, None, None, None, :], window)  # [B, 1, 1, T, T]
    s_cache = layers.scores(q, ck)
    if k_scale is not None:
        s_cache = s_cache * k_scale[:, :, None, None, :]
    p_cache, p_new = layers.split_softmax(
        (s_cache, layers.scores(q, k_new)), (sees_cache, sees_new)
    )
    p_values = p_cache if v_scale is None else p_cache * v_scale[:, :, None, None, :]
    out_cache = layers.weighted_values(p_values, cv)
    return out_cache + layers.weighted_values(p_new, v_new), p_cache, p_new


def _uses_kernel(cache: KVCache, config: ModelConfig) -> bool:
    """Whether ``extend`` attends over the cache with ``cache_kernel`` (``config.attention``
    is ``"kernel"`` and the kernel reads the cache's dtype: float32, float16 or int8);
    ``"kernel"`` where the kernel cannot be built raises."""
    if config.attention != "kernel" or not cache_kernel.supports(cache.k.dtype):
        return False
    return _require_kernel("attention")


def _require_kernel(flag: str) -> bool:
    """True where the compiled kernels can run; else a RuntimeError naming ``config.flag``."""
    if not cache_kernel.available():
        raise RuntimeError(
            f"config.{flag}='kernel', but the CPU {flag} kernel is unavailable: "
            f"{cache_kernel.unavailable_reason()} (use {flag}='xla')"
        )
    return True


def _uses_matmul_kernel(rows: int, config: ModelConfig) -> bool:
    """Whether ``extend`` multiplies ``rows`` rows by the layers' stacked weights with
    ``cache_kernel.stacked_matmul`` (``config.matmul`` is ``"kernel"`` and ``rows`` within
    ``cache_kernel.MATMUL_ROWS``); ``"kernel"`` where the kernel cannot be built raises."""
    lo, hi = cache_kernel.MATMUL_ROWS
    if config.matmul != "kernel" or not lo <= rows <= hi:
        return False
    return _require_kernel("matmul")


def _layer_weights(stacked: dict, layer) -> dict:
    """Layer ``layer``'s matmul weights as ``weights_lib.LayerWeight``, read in place out of
    the stacked ``params["layers"]``."""
    try:
        return {
            n: weights_lib.layer_weight(w, layer)
            for n, w in stacked.items()
            if n in weights_lib.CONTRACTED
        }
    except ValueError as e:
        raise ValueError(
            f"config.matmul='kernel': {e}; jaxkv.load(..., matmul='kernel') stores float32 "
            "weights out-first (int8 weights are)"
        ) from None


def _kernel_attention(
    q, k_new, v_new, pos_BT, layer, cache: KVCache, config: ModelConfig, *, probabilities
):
    """``_cached_attention`` through ``cache_kernel``: the kernel attends over layer
    ``layer``'s slots (read in place from the stacked cache) and returns its rows' softmax
    maximum and sum, with which the new tokens' own keys and values are merged here.

    Returns:
        The output [B, K, G, T, H] and, with ``probabilities`` (for the statistics), the
        probabilities of the cache slots and of the new tokens (else None, None).
    """
    window = config.sliding_window
    o, m, total_cache, *p_slots = cache_kernel.cache_attention(
        q,
        pos_BT,
        cache.k,
        cache.v,
        cache.pos,
        layer,
        window=window,
        scales=_scales(cache),
        probabilities=probabilities,
    )
    out, share_cache, p_new = _merge_new_tokens(o, m, total_cache, q, k_new, v_new, pos_BT, window)
    if not probabilities:
        return out, None, None
    return out, p_slots[0] * share_cache, p_new


def _kernel_attention_stats(q, k_new, v_new, pos_BT, layer, cache: KVCache, stats: dict, config):
    """``_kernel_attention`` of a decode step (one new token per sequence) whose kernel also
    updates layer ``layer``'s attention ``stats`` (the stacked arrays of the scan's carry) in
    place (``cache_kernel.cache_attention_stats``).

    Returns:
        The output [B, K, G, 1, H], the new token's probabilities [B, K, G, 1, 1], the rows'
        entropies [B, K, G, 1] and the updated statistics.
    """
    window = config.sliding_window
    o, m, total_cache, entropy, stats = cache_kernel.cache_attention_stats(
        q,
        pos_BT,
        k_new[:, :, 0],
        cache.k,
        cache.v,
        cache.pos,
        layer,
        stats,
        window=window,
        lam=attn_stats.decay(cache.window),
        scales=_scales(cache),
    )
    out, _, p_new = _merge_new_tokens(o, m, total_cache, q, k_new, v_new, pos_BT, window)
    return out, p_new, entropy, stats


def _scales(cache: KVCache):
    """An int8 cache's (key scales, value scales); None for a float cache."""
    return None if cache.k_scale is None else (cache.k_scale, cache.v_scale)


def _merge_new_tokens(o, m, total_cache, q, k_new, v_new, pos_BT, window):
    """The new tokens' own keys and values merged into the kernel's attention over the cache
    (its output ``o`` normalized over the cache, its rows' maximum ``m`` and sum
    ``total_cache``): the output, the cache's share of each row, the new tokens'
    probabilities."""
    q_pos = pos_BT[:, None, None, :, None]
    sees_new = layers.visible(q_pos, pos_BT[:, None, None, None, :], window)  # [B, 1, 1, T, T]
    s_new = jnp.where(sees_new, layers.scores(q, k_new), layers.NEG_INF)
    top = jnp.maximum(m, jnp.max(s_new, axis=-1))
    w_cache = total_cache * jnp.exp(m - top)
    e_new = jnp.where(sees_new, jnp.exp(s_new - top[..., None]), 0.0)
    total = jnp.maximum(w_cache + jnp.sum(e_new, axis=-1), 1e-30)[..., None]
    share_cache, p_new = w_cache[..., None] / total, e_new / total
    out = o * share_cache + layers.weighted_values(p_new, v_new)
    return out.astype(q.dtype), share_cache, p_new


def extend(
    params: dict, tokens_BT: jax.Array, cache: KVCache, *, config: ModelConfig
) -> tuple[jax.Array, KVCache]:
    """Appends T tokens per sequence at positions ``cache.length + t``.

    When the cache carries statistics, those of the cached slots are updated and those of the
    new slots computed, from the same attention probabilities; query moments (when carried)
    add the new queries'.

    Returns:
        Logits [B, T, V] and the cache with the new keys and values appended.
    """
    kvcache.check_room(cache, tokens_BT.shape[1])
    T = tokens_BT.shape[1]
    pos_BT = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)
    weights = attn_stats.query_weights(pos_BT, cache.window) if cache.stats else None
    names = tuple(cache.stats)
    n_queries_B = jnp.full((tokens_BT.shape[0],), T)
    # The attention statistics ride in the scan's carry: each layer reads its slice of the
    # accumulating ones and writes its merged slice back in place, so no statistic array is
    # allocated, zeroed or copied per step (as scan outputs they were, at every step).
    carried = {n: a for n, a in cache.stats.items() if n in attn_stats.ATTENTION_STATS}
    q_weights = attn_stats.query_moment_weights(pos_BT) if cache.query_stats else None
    q_acc = {n: a for n, a in cache.query_stats.items() if n != "weight"}
    kernel = _uses_kernel(cache, config)
    # With the matmul kernel the stacked matmul weights stay out of the scan's inputs (which
    # XLA would slice, copying each layer's): each layer reads its own in place.
    stacked = params["layers"]
    matmul = _uses_matmul_kernel(tokens_BT.shape[0] * T, config)
    if matmul:
        _layer_weights(stacked, 0)  # a wrong layout fails here, not inside the scan
    scanned = {n: w for n, w in stacked.items() if not (matmul and n in weights_lib.CONTRACTED)}

    # A decode step through the kernel updates the statistics inside it (no probabilities).
    stats_in_kernel = kernel and weights is not None and T == 1

    def moments_of(q_pre, q_acc_l):
        if q_weights is None:
            return None
        new_moments = attn_stats.query_moments(q_pre, q_weights, config.n_kv_heads)
        return attn_stats.merge_query_moments(q_acc_l, new_moments)

    def layer(carry, xs):
        x, stats = carry
        i, lp, cached, q_acc_l = xs
        if matmul:
            lp = {**lp, **_layer_weights(stacked, i)}
        q, k, v, q_pre = _projections(lp, x, pos_BT, config)
        if stats_in_kernel:  # the kernel also updates layer i's statistics in place
            attn, p_new, entropy, stats = _kernel_attention_stats(
                q, k, v, pos_BT, i, cache, stats, config
            )
            x = _finish_layer(lp, x, attn, config)
            (new,) = attn_stats.contributions((p_new,), weights, names, entropy_BKGT=entropy)
            new.update(_value_stats(lp, v, names))
            return (x, stats), (k, v, new, moments_of(q_pre, q_acc_l))
        if kernel:  # reads the stacked cache itself, layer i
            attn, p_cache, p_new = _kernel_attention(
                q, k, v, pos_BT, i, cache, config, probabilities=weights is not None
            )
        else:
            attn, p_cache, p_new = _cached_attention(q, k, v, pos_BT, cached, config)
        x = _finish_layer(lp, x, attn, config)
        moments = moments_of(q_pre, q_acc_l)
        if weights is None:
            return (x, stats), (k, v, None, moments)
        old, new = attn_stats.contributions((p_cache, p_new), weights, names)
        acc_l = {n: stats[n][i] for n in old if n in attn_stats.ACCUMULATING}
        merged = attn_stats.merge(acc_l, old, n_queries_B=n_queries_B, window=cache.window)
        put = jax.lax.dynamic_update_index_in_dim
        stats = {**stats, **{n: put(stats[n], m, i, 0) for n, m in merged.items()}}
        new.update(_value_stats(lp, v, names))
        return (x, stats), (k, v, new, moments)

    cached = None if kernel else (cache.k, cache.v, cache.pos, cache.k_scale, cache.v_scale)
    xs = (jnp.arange(config.n_layers), scanned, cached, q_acc)
    (x, merged), (ks, vs, new_stats, moments) = jax.lax.scan(
        layer, (_embed(params, tokens_BT, config), carried), xs
    )
    cache = cache.replace(stats={**cache.stats, **merged})  # nothing merged without statistics
    if q_weights is not None:
        weight = cache.query_stats["weight"] + jnp.sum(q_weights, axis=1)
        cache = cache.replace(query_stats={"weight": weight, **moments})
    cache = kvcache.append(cache, ks, vs, pos_BT, new_stats)
    return _guard(_logits(params, x, config, kernel=matmul), cache), cache


def decode_step(
    params: dict, token_B: jax.Array, cache: KVCache, *, config: ModelConfig
) -> tuple[jax.Array, KVCache]:
    """One token per sequence: logits [B, V] and the updated cache."""
    logits_B1V, cache = extend(params, token_B[:, None], cache, config=config)
    return logits_B1V[:, 0], cache


def _guard(logits, cache: KVCache):
    """NaN logits when the cache overflowed under jit: loud, never silently wrong."""
    return jnp.where(cache.overflow, jnp.nan, logits)
