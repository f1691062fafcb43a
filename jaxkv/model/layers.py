"""Pure building blocks of the decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention.

Axis letters as in ``jaxkv.config``; attention works in the grouped layout
``q_BKGTH`` (query head n = k * G + g) against keys ``k_BKSH``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv import stats as attn_stats
from jaxkv.model import weights_int8 as weights_lib

NEG_INF = -1e30


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in the input dtype (HF Llama/Mistral)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope(x_BTXH: jax.Array, pos_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in HF's half-split layout; padding positions (-1) are harmless."""
    H = x_BTXH.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    angle_BTh = pos_BT.astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.cos(angle_BTh)[:, :, None, :]
    sin = jnp.sin(angle_BTh)[:, :, None, :]
    x = x_BTXH.astype(jnp.float32)
    x1, x2 = x[..., : H // 2], x[..., H // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTXH.dtype)


def swiglu(x_BTD: jax.Array, w_gate_DF, w_up_DF, w_down_FD) -> jax.Array:
    """The SwiGLU MLP; the weights are float arrays or int8 (``jaxkv.model.weights_int8``)."""
    gate = jax.nn.silu(weights_lib.einsum("btd,df->btf", x_BTD, w_gate_DF))
    up = weights_lib.einsum("btd,df->btf", x_BTD, w_up_DF)
    return weights_lib.einsum("btf,fd->btd", gate * up, w_down_FD)


def visible(q_pos, k_pos, window: int | None) -> jax.Array:
    """Mask of keys a query may see: causal, non-empty, and inside the sliding window.

    Built from token positions, never slot indices, so it stays right after eviction.
    Arguments broadcast against each other; -1 marks an empty key or padding query.
    """
    ok = (k_pos >= 0) & (q_pos >= 0) & (k_pos <= q_pos)
    if window is not None:
        ok &= k_pos > q_pos - window
    return ok


# Most query rows (B * K * G * T) for which decode scores are one matrix-vector product per
# row; beyond it they are one batched dot.
MAX_ROWWISE = 512


def scores(q_BKGTH: jax.Array, k_BKSH: jax.Array, *, rowwise: bool | None = None) -> jax.Array:
    """Scaled dot products [B, K, G, T, S] in float32.

    Few query rows against many keys (G * T < H < S: decode over a cache) read the keys as
    stored, along their contiguous last axis. On CPU (``rowwise=None`` decides by backend
    and size) every query row is then its own matrix-vector product ``q @ k.T``, which XLA
    fuses with the read of this layer's keys out of the stacked cache; a batched dot first
    copies them (and, with the queries as its left operand, transposes them): see
    results/profile_decode.md. Many query rows (prefill blocks) or few keys use one batched
    dot with the queries first.
    """
    B, K, G, T, H = q_BKGTH.shape
    S = k_BKSH.shape[2]
    if G * T >= H or S <= H:
        s = jnp.einsum("bkgth,bksh->bkgts", q_BKGTH, k_BKSH, preferred_element_type=jnp.float32)
        return s * H**-0.5
    if rowwise is None:
        rowwise = jax.default_backend() == "cpu" and B * K * G * T <= MAX_ROWWISE
    q_BKNH = q_BKGTH.reshape(B, K, G * T, H)
    if rowwise:
        rows = [
            jnp.matmul(q_BKNH[b, k, n], k_BKSH[b, k].T, preferred_element_type=jnp.float32)
            for b in range(B)
            for k in range(K)
            for n in range(G * T)
        ]
        s_BKNS = jnp.stack(rows).reshape(B, K, G * T, S)
    else:
        dims = (((3,), (3,)), ((0, 1), (0, 1)))
        s_BKSN = jax.lax.dot_general(k_BKSH, q_BKNH, dims, preferred_element_type=jnp.float32)
        s_BKNS = s_BKSN.transpose(0, 1, 3, 2)
    return s_BKNS.reshape(B, K, G, T, S) * H**-0.5


def masked_softmax(s_BKGTS: jax.Array, mask_BKGTS: jax.Array) -> jax.Array:
    """Softmax over keys; a query that sees no key gets all-zero weights, not NaN."""
    return split_softmax((s_BKGTS,), (mask_BKGTS,))[0]


def split_softmax(s_parts, mask_parts) -> tuple[jax.Array, ...]:
    """One softmax over the keys of several parts (e.g. cache slots and new tokens),
    without concatenating them; masks broadcast against their scores.

    Returns:
        The probabilities of each part, shaped like its scores.
    """
    s_parts = [jnp.where(m, s, NEG_INF) for s, m in zip(s_parts, mask_parts, strict=True)]
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in s_parts])
    e_parts = [
        jnp.where(m, jnp.exp(s - top), 0.0) for s, m in zip(s_parts, mask_parts, strict=True)
    ]
    total = functools.reduce(jnp.add, [jnp.sum(e, axis=-1, keepdims=True) for e in e_parts])
    total = jnp.maximum(total, 1e-30)
    return tuple(e / total for e in e_parts)


def weighted_values(p_BKGTS: jax.Array, v_BKSH: jax.Array) -> jax.Array:
    return jnp.einsum("bkgts,bksh->bkgth", p_BKGTS.astype(v_BKSH.dtype), v_BKSH)


def causal_block_attention(
    q_BKGTH: jax.Array,
    k_BKTH: jax.Array,
    v_BKTH: jax.Array,
    pos_BT: jax.Array,
    *,
    window: int | None,
    block: int,
    stat_weights_BT3: jax.Array | None = None,
    stat_names: tuple[str, ...] = attn_stats.STAT_NAMES,
):
    """Causal self-attention over T tokens whose slot t holds position t (or -1).

    Queries go in blocks; block i reads only keys [lo, hi) that it can see, which keeps the
    work near T^2/2 (and T*window with a sliding window) instead of T^2.

    Returns:
        The attention output [B, K, G, T, H], and with ``stat_weights_BT3`` the statistics
        each key received (``jaxkv.stats.contributions`` of ``stat_names``, [B, K, T] each),
        else None.
    """
    T = q_BKGTH.shape[3]
    outs, stats = [], None
    for start in range(0, T, block):
        stop = min(start + block, T)
        lo = 0 if window is None else max(0, start - window + 1)
        q = q_BKGTH[:, :, :, start:stop]
        s = scores(q, k_BKTH[:, :, lo:stop])
        mask = visible(
            pos_BT[:, None, None, start:stop, None], pos_BT[:, None, None, None, lo:stop], window
        )
        p = masked_softmax(s, mask)
        outs.append(weighted_values(p, v_BKTH[:, :, lo:stop]))
        if stat_weights_BT3 is not None:
            w_BT3 = stat_weights_BT3[:, start:stop]
            (part,) = attn_stats.contributions((p,), w_BT3, stat_names)
            padded = {n: jnp.pad(x, [(0, 0), (0, 0), (lo, T - stop)]) for n, x in part.items()}
            # every statistic adds up over blocks (the final query lies in one block only)
            stats = padded if stats is None else jax.tree.map(jnp.add, stats, padded)
    return jnp.concatenate(outs, axis=3), stats
