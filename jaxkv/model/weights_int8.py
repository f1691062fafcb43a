"""Weight-only int8: every matmul weight as int8 with one scale per output channel (qwix).

``quantize_params`` turns the float params tree (``jaxkv.model.params``) into one whose matmul
weights are ``qwix.QArray`` leaves: int8 values and a scale (the weight's float dtype) per
output channel and layer, symmetric absmax (qwix's int8 bound: scale = absmax / 127.5,
values rounded half to even and saturated to [-128, 127], so |w - q * scale| <= scale / 2).
Norms stay float. The contraction axes get no scale of their own, so a scale factors out of
the dot product.

The decoder reads every weight through ``einsum``, ``head_logits`` and ``take_rows`` here,
the one place that knows about quantized weights: a float weight goes to ``jnp.einsum`` as
before, a quantized one to ``qwix.einsum``. Activations stay float (weight-only), for which
qwix dequantizes the weight (``q.astype(f) * scale``) and runs a float dot; under jit XLA
fuses that dequantization with the read of the layer's slice out of the stacked weights, so
each step reads 1 byte per weight instead of 4 (results/weights_int8.md has the measured
speed).

The tied embedding is quantized per vocabulary row: one scale serves both the lookup (a
row) and the output head (a column of ``embed.T``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix

from jaxkv.model.params import PARAM_AXES

# Logical axes (``jaxkv.model.params.PARAM_AXES``) each weight contracts with activations;
# every other axis (layers, output channels) gets its own scales.
CONTRACTED = {
    "embed": ("embed",),
    "lm_head": ("embed",),
    "wq": ("embed",),
    "wk": ("embed",),
    "wv": ("embed",),
    "wo": ("q_heads", "head_dim"),
    "w_gate": ("embed",),
    "w_up": ("embed",),
    "w_down": ("mlp",),
}

QArray = qwix.QArray


def quantize(w: jax.Array, name: str) -> QArray:
    """The int8 ``QArray`` of the params leaf ``name`` (e.g. ``"wq"``), scales per output
    channel (and layer) in ``w``'s dtype."""
    axes = PARAM_AXES["layers"].get(name) or PARAM_AXES[name]
    if len(axes) != w.ndim:
        raise ValueError(f"{name}: shape {w.shape} does not match axes {axes}")
    channelwise = tuple(i for i, a in enumerate(axes) if a not in CONTRACTED[name])
    return qwix.quantize(w, jnp.int8, channelwise_axes=channelwise)


@jax.jit
def quantize_params(params: dict) -> dict:
    """``params`` with every matmul weight (``CONTRACTED``) quantized; norms unchanged."""
    out = {k: quantize(v, k) if k in CONTRACTED else v for k, v in params.items() if k != "layers"}
    out["layers"] = {
        k: quantize(v, k) if k in CONTRACTED else v for k, v in params["layers"].items()
    }
    return out


def dequantize_params(params: dict) -> dict:
    """The float params tree a quantized one stands for (float trees pass through)."""
    return jax.tree.map(dense, params, is_leaf=is_quantized)


def is_quantized(x) -> bool:
    return isinstance(x, QArray)


def dense(w) -> jax.Array:
    """``w`` as a float array: dequantized if it is int8, else itself."""
    return qwix.dequantize(w) if is_quantized(w) else w


def einsum(subscripts: str, x: jax.Array, w, **kwargs) -> jax.Array:
    """``jnp.einsum(subscripts, x, w)`` for a float or a quantized weight ``w``.

    A quantized weight whose contracted axes lead (``"btd,dnh->btnh"``, ``"btnh,nhd->btd"``)
    goes to qwix as a 2-D matmul ``[T, I] @ [I, O]`` (free reshapes): with the head axes
    kept, qwix's dot makes XLA:CPU write the dequantized weight in a transposed layout,
    which made the q and o projections 3-6x slower (results/weights_int8.md).
    """
    if not is_quantized(w):
        return jnp.einsum(subscripts, x, w, **kwargs)
    ins, out = subscripts.split("->")
    x_sub, w_sub = ins.split(",")
    n = sum(c not in out for c in w_sub)  # contracted axes
    batch = x_sub[: len(x_sub) - n]
    if x_sub[len(batch) :] != w_sub[:n] or out != batch + w_sub[n:] or "." in subscripts:
        return qwix.einsum(subscripts, x, w, **kwargs)
    w_IO = jax.tree.map(lambda a: a.reshape(math.prod(a.shape[:n]), -1), w)
    x_TI = x.reshape(-1, w_IO.shape[0])
    y_TO = qwix.einsum("ti,io->to", x_TI, w_IO, **kwargs)
    return y_TO.reshape(*x.shape[: len(batch)], *w.shape[n:])


def head_logits(h_XD: jax.Array, w, *, vocab_first: bool) -> jax.Array:
    """Float32 logits ``[..., V]`` of hidden states ``[..., D]`` through the output head ``w``:
    ``[V, D]`` (a tied embedding, ``vocab_first``) or ``[D, V]``.

    A quantized head is dequantized and applied ``HEAD_CHUNK`` vocabulary entries at a time
    (a ``lax.map``): XLA:CPU does not fuse the int8 -> float conversion into the dot, and
    dequantizing the whole head at once writes a fresh 113 MB float array (SmolLM2) every
    call, about 10x the dot's own time (results/weights_int8.md).
    """
    V = w.shape[0 if vocab_first else 1]
    n = _n_chunks(V)
    if not is_quantized(w) or n == 1:
        head_DV = w.T if vocab_first else w
        return einsum("...d,dv->...v", h_XD, head_DV, preferred_element_type=jnp.float32)
    sub = "...d,vd->...v" if vocab_first else "...d,dv->...v"
    axis = 0 if vocab_first else 1
    chunks = jax.tree.map(lambda a: jnp.moveaxis(_split(a, axis, n), axis, 0), w)
    out_nXv = jax.lax.map(
        lambda c: qwix.einsum(sub, h_XD, c, preferred_element_type=jnp.float32), chunks
    )
    return jnp.moveaxis(out_nXv, 0, -2).reshape(*h_XD.shape[:-1], V)


HEAD_CHUNK = 4096


def _n_chunks(V: int) -> int:
    """The fewest chunks of at most ``HEAD_CHUNK`` that divide ``V`` evenly (1: no chunking,
    also when only chunks far below ``HEAD_CHUNK`` would)."""
    for n in range(-(-V // HEAD_CHUNK), V + 1):
        if V % n == 0:
            return n if V // n >= HEAD_CHUNK // 4 else 1
    return 1


def _split(a: jax.Array, axis: int, n: int) -> jax.Array:
    """``a`` with ``axis`` split into ``(n, size // n)``."""
    return a.reshape(*a.shape[:axis], n, a.shape[axis] // n, *a.shape[axis + 1 :])


def take_rows(w, idx) -> jax.Array:
    """``w[idx]`` (an embedding lookup), dequantized when ``w`` is int8."""
    return dense(w[idx])


def nbytes(params) -> int:
    """Bytes of every array in ``params`` (int8 values and their scales included)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
