"""Weight-only int8: every matmul weight as int8 with one scale per output channel.

``quantize_params`` turns the float params tree (``jaxkv.model.params``) into one whose matmul
weights are ``Int8Weight`` leaves: int8 values and a scale (the weight's float dtype) per
output channel and layer, symmetric absmax as qwix computes it (``qwix.quantize``: scale =
absmax / 127.5, values rounded half to even and saturated to [-128, 127], so
|w - q * scale| <= scale / 2). Norms stay float. The contraction axes get no scale of their
own, so a scale factors out of the dot product.

An ``Int8Weight`` stores each layer's values as one ``[O, I]`` matrix, output channels first
and the contracted (input) axes last and contiguous, whatever the float weight's axis order
(``[D, N, H]`` for ``wq`` becomes ``[N*H, D]``); the layers stay stacked on the leading
axis. The reason is speed: a decode step's ``x @ (q * scale).T`` with that layout is one fused
XLA:CPU loop that reads the int8 slice of the stacked weights in place, converts, scales and
accumulates in registers. With the float layout ``[I, O]`` XLA wrote each layer's dequantized
weight as a fresh float32 array (4 bytes per weight written, then read by the dot) every
step: 32-58 % of an int8 decode step at batch 1 (results/profile_decode.md, "After int8
weights"). With a few rows (batch > 1) or many (prefill) XLA does not fuse; ``_matmul_t``
picks the form that measured fastest for each.
``dense`` gives the float weight back in its own layout, so code that reads a weight as a
float array (``jaxkv.policies`` binding W_o) sees no difference.

With ``config.matmul == "kernel"`` the decoder hands a decode step's projections a
``LayerWeight`` (the stacked weight and the layer index) instead of the slice, and ``einsum``
/ ``head_logits`` multiply 1-16 rows by it (``cache_kernel.MATMUL_ROWS``) with
``cache_kernel.stacked_matmul``, which reads the layer in place (results/profile_decode.md,
"Session 44").

The decoder reads every weight through ``einsum``, ``head_logits`` and ``take_rows`` here,
the one place that knows about quantized weights: a float weight goes to ``jnp.einsum`` as
before, an int8 one to ``_matmul_t`` (``[T, I] @ [O, I].T``). Activations stay float:
an int8 x int8 dot (activations quantized per token, as llama.cpp's Q8_0) lost, since
XLA:CPU converts both operands to int32 first (results/weights_int8.md).

The tied embedding is quantized per vocabulary row: one scale serves both the lookup (a
row) and the output head.

Float weights can take the same ``[O, I]`` layout without quantization: ``transpose_params``
(``jaxkv.load(..., out_first=True)``) stores every layer's matmul weight as an ``OIWeight``,
and a float32 decode step at batch 1 then reads each layer's slice of the stacked weights
in place in the same fused loop, instead of copying the slice out for a dot thunk: 1.6x
faster at 1K and 4K context on the 2-core CPU. It is opt-in (``loading.out_first_for``
picks it for a batch of one, as ``python -m jaxkv.eval generate`` does) because with 2-64
rows XLA:CPU copies the slice anyway and YNNPACK's dot with the transposed weight is slower
than with the canonical one (batch-8 decode about 0.8x); prefill is unchanged
(results/profile_decode.md, "After out-first float weights").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix
from flax import struct

from jaxkv.model import cache_kernel
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
LEADING = ("layers",)  # axes kept in front, each entry its own matrix


class _OILayout:
    """Shape helpers of a weight stored ``[..., O, I]`` (``values``) that stands for a float
    weight of shape ``(..., *in_shape, *out_shape)`` (``in_first``) or
    ``(..., *out_shape, *in_shape)``."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape."""
        lead = self.values.shape[:-2]
        inner = (
            (self.in_shape, self.out_shape) if self.in_first else (self.out_shape, self.in_shape)
        )
        return (*lead, *inner[0], *inner[1])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def to_float_layout(self, a_XOI: jax.Array, *, scales: bool = False) -> jax.Array:
        """``a`` [..., O, I] (``scales``: [..., O, 1], size 1 on every contracted axis) in
        the float weight's axis order."""
        lead, n_lead = a_XOI.shape[:-2], a_XOI.ndim - 2
        ins = (1,) * len(self.in_shape) if scales else self.in_shape
        a = a_XOI.reshape(*lead, *self.out_shape, *ins)
        if not self.in_first:
            return a
        n_out = len(self.out_shape)
        perm = list(range(n_lead))
        perm += list(range(n_lead + n_out, a.ndim)) + list(range(n_lead, n_lead + n_out))
        return a.transpose(perm)


@struct.dataclass
class Int8Weight(_OILayout):
    """An int8 weight: ``qvalue`` [..., O, I] int8 and ``scale`` [..., O, 1], where ``...``
    are the leading (layer) axes, O the output channels and I the contracted axes, each
    flattened. The float weight it stands for has shape ``(..., *in_shape, *out_shape)``
    (``in_first``) or ``(..., *out_shape, *in_shape)``."""

    qvalue: jax.Array
    scale: jax.Array
    in_shape: tuple[int, ...] = struct.field(pytree_node=False)
    out_shape: tuple[int, ...] = struct.field(pytree_node=False)
    in_first: bool = struct.field(pytree_node=False)

    @property
    def values(self) -> jax.Array:
        return self.qvalue

    @property
    def dtype(self):
        """The float dtype the weight stands for (its scales')."""
        return self.scale.dtype

    def matrix(self) -> jax.Array:
        """The dequantized ``[..., O, I]`` matrices (``q * scale``)."""
        return self.qvalue.astype(self.scale.dtype) * self.scale


@struct.dataclass
class OIWeight(_OILayout):
    """A float weight stored output channels first: ``value`` [..., O, I], the layout of
    ``Int8Weight`` without quantization (``transpose_params``)."""

    value: jax.Array
    in_shape: tuple[int, ...] = struct.field(pytree_node=False)
    out_shape: tuple[int, ...] = struct.field(pytree_node=False)
    in_first: bool = struct.field(pytree_node=False)

    @property
    def values(self) -> jax.Array:
        return self.value

    @property
    def dtype(self):
        return self.value.dtype

    def matrix(self) -> jax.Array:
        """The ``[..., O, I]`` matrices."""
        return self.value


@struct.dataclass
class LayerWeight:
    """Layer ``layer`` of a stacked out-first weight (``Int8Weight`` or ``OIWeight`` with one
    leading layer axis, float32 values or int8 ones with float32 scales), multiplied by
    ``cache_kernel.stacked_matmul``, which reads that layer in place: inside the decoder's
    layer scan the stacked weights stay loop-invariant and nothing is sliced or copied
    (``config.matmul == "kernel"``, a decode step of ``cache_kernel.MATMUL_ROWS`` rows). Any
    other use (``dense``, an einsum the kernel cannot do) reads the slice."""

    stacked: Int8Weight | OIWeight
    layer: jax.Array

    def sliced(self) -> Int8Weight | OIWeight:
        return jax.tree.map(lambda a: a[self.layer], self.stacked)


def layer_weight(stacked, layer) -> LayerWeight:
    """``stacked`` (out-first, float32 or int8) as ``LayerWeight`` of ``layer``."""
    if not (is_out_first(stacked) and stacked.values.ndim == 3):
        raise ValueError("the matmul kernel reads stacked out-first weights [L, O, I]")
    if stacked.dtype != jnp.float32:
        raise ValueError(f"the matmul kernel reads float32 or int8 weights, not {stacked.dtype}")
    return LayerWeight(stacked, jnp.asarray(layer, jnp.int32))


def kernel_head(w, *, vocab_first: bool) -> LayerWeight:
    """The output head ``w`` (``head_logits``'s argument) as the one layer of a
    ``LayerWeight``; a tied float embedding ``[V, D]`` is output channels first already."""
    if not is_out_first(w):
        if not vocab_first:
            raise ValueError("the matmul kernel reads an untied head stored out-first")
        V, D = w.shape
        w = OIWeight(value=w, in_shape=(D,), out_shape=(V,), in_first=False)
    return layer_weight(jax.tree.map(lambda a: a[None], w), 0)


def _layout(w: jax.Array, name: str):
    """(kinds of ``w``'s axes: "lead" / "in" / "out", in_shape, out_shape, in_first) of the
    params leaf ``name``."""
    axes = PARAM_AXES["layers"].get(name) or PARAM_AXES[name]
    if len(axes) != w.ndim:
        raise ValueError(f"{name}: shape {w.shape} does not match axes {axes}")
    kinds = ["lead" if a in LEADING else "in" if a in CONTRACTED[name] else "out" for a in axes]
    n_lead = kinds.count("lead")
    inner = kinds[n_lead:]
    in_first = inner[0] == "in"
    if kinds[:n_lead] != ["lead"] * n_lead or inner != sorted(inner, reverse=not in_first):
        raise ValueError(f"{name}: axes {axes} are not (layers, inputs, outputs) or similar")
    dims = w.shape[n_lead:]
    in_shape = tuple(d for d, k in zip(dims, inner, strict=True) if k == "in")
    out_shape = tuple(d for d, k in zip(dims, inner, strict=True) if k == "out")
    return kinds, in_shape, out_shape, in_first


def _to_XOI(a: jax.Array, lead: tuple[int, ...], in_shape, out_shape, in_first, ins: int):
    """``a`` in a float weight's axis order as ``[*lead, O, ins]``."""
    n_lead, n_in = len(lead), len(in_shape)
    if in_first:  # [..., I..., O...] -> [..., O..., I...]
        a = jnp.moveaxis(a, tuple(range(n_lead, n_lead + n_in)), tuple(range(-n_in, 0)))
    return a.reshape(*lead, math.prod(out_shape), ins)


def quantize(w: jax.Array, name: str) -> Int8Weight:
    """The ``Int8Weight`` of the params leaf ``name`` (e.g. ``"wq"``), scales per output
    channel (and layer) in ``w``'s dtype."""
    w = dense(w)
    kinds, in_shape, out_shape, in_first = _layout(w, name)
    channelwise = tuple(i for i, k in enumerate(kinds) if k != "in")
    q = qwix.quantize(w, jnp.int8, channelwise_axes=channelwise)
    lead = w.shape[: kinds.count("lead")]
    layout = (lead, in_shape, out_shape, in_first)
    return Int8Weight(
        qvalue=_to_XOI(q.qvalue, *layout, math.prod(in_shape)),
        scale=_to_XOI(q.scale, *layout, 1),
        in_shape=in_shape,
        out_shape=out_shape,
        in_first=in_first,
    )


def transpose(w: jax.Array, name: str) -> OIWeight:
    """The ``OIWeight`` of the float params leaf ``name``: the same values, stored
    ``[..., O, I]``."""
    kinds, in_shape, out_shape, in_first = _layout(w, name)
    lead = w.shape[: kinds.count("lead")]
    value = _to_XOI(w, lead, in_shape, out_shape, in_first, math.prod(in_shape))
    return OIWeight(value=value, in_shape=in_shape, out_shape=out_shape, in_first=in_first)


@jax.jit
def quantize_params(params: dict) -> dict:
    """``params`` with every matmul weight (``CONTRACTED``) quantized; norms unchanged."""
    out = {k: quantize(v, k) if k in CONTRACTED else v for k, v in params.items() if k != "layers"}
    out["layers"] = {
        k: quantize(v, k) if k in CONTRACTED else v for k, v in params["layers"].items()
    }
    return out


@jax.jit
def transpose_params(params: dict) -> dict:
    """``params`` with every layer's matmul weight and a separate head as ``OIWeight``
    (output channels first), the layout a float32 decode step at batch 1 reads in place
    (module docstring); the same values, so the logits differ only by summation order.
    The tied embedding (already ``[V, D]``) and the norms are unchanged."""
    out = dict(params)
    if "lm_head" in params:
        out["lm_head"] = transpose(params["lm_head"], "lm_head")
    out["layers"] = {
        k: transpose(v, k) if k in CONTRACTED else v for k, v in params["layers"].items()
    }
    return out


def dequantize_params(params: dict) -> dict:
    """The float params tree, in the canonical layout, that a quantized or transposed one
    stands for (canonical float trees pass through)."""
    return jax.tree.map(dense, params, is_leaf=is_out_first)


def is_quantized(x) -> bool:
    return isinstance(x, Int8Weight)


def is_out_first(x) -> bool:
    """Whether ``x`` is a weight stored ``[..., O, I]`` (``Int8Weight`` or ``OIWeight``)."""
    return isinstance(x, (Int8Weight, OIWeight))


def dense(w) -> jax.Array:
    """``w`` as a float array in its own layout: dequantized if it is int8, transposed back
    if it is an ``OIWeight``, sliced if it is a ``LayerWeight``, else itself."""
    if isinstance(w, LayerWeight):
        w = w.sliced()
    return w.to_float_layout(w.matrix()) if is_out_first(w) else w


def einsum(subscripts: str, x: jax.Array, w, **kwargs) -> jax.Array:
    """``jnp.einsum(subscripts, x, w)`` for a float, transposed or quantized weight ``w``.

    For a weight stored ``[..., O, I]`` (``Int8Weight``, ``OIWeight``) whose contracted axes
    end ``x``'s subscripts, in the weight's order (every projection of the decoder:
    ``"btd,dnh->btnh"``, ``"btnh,nhd->btd"``), the product is ``[T, I] @ [O, I].T`` on free
    reshapes, which XLA:CPU fuses with the read of the weight (and its dequantization) at
    batch 1 (module docstring); any other einsum runs on ``dense(w)``.
    """
    if isinstance(w, LayerWeight):
        return _layer_einsum(subscripts, x, w, **kwargs)
    if not is_out_first(w):
        return jnp.einsum(subscripts, x, w, **kwargs)
    if w.values.ndim != 2 or not _is_row_product(subscripts, w):
        return jnp.einsum(subscripts, x, dense(w), **kwargs)
    x_TI = x.reshape(-1, w.values.shape[-1])
    y_TO = _matmul_oi(x_TI, w, **kwargs)
    return y_TO.reshape(*x.shape[: x.ndim - len(w.in_shape)], *w.out_shape)


def _is_row_product(subscripts: str, w) -> bool:
    """Whether ``subscripts`` (x, then one layer's weight ``w`` in its float axis order) is
    ``x [..., I] @ w [O, I].T`` on free reshapes: x's last axes are w's contracted ones, in
    order, and the output is x's other axes, then w's output axes."""
    ins, out = subscripts.split("->")
    x_sub, w_sub = ins.split(",")
    n_in = len(w.in_shape)
    w_in = w_sub[:n_in] if w.in_first else w_sub[len(w_sub) - n_in :]
    w_out = w_sub[n_in:] if w.in_first else w_sub[: len(w.out_shape)]
    batch = x_sub[: len(x_sub) - n_in]
    return "." not in subscripts and x_sub[len(batch) :] == w_in and out == batch + w_out


def _layer_einsum(subscripts: str, x: jax.Array, w: LayerWeight, **kwargs) -> jax.Array:
    """``einsum`` with one layer of a stacked weight: ``cache_kernel.stacked_matmul`` for
    the decoder's projections over ``cache_kernel.MATMUL_ROWS`` rows, else the slice's einsum."""
    one = w.stacked
    n_in = len(one.in_shape)
    rows = math.prod(x.shape[: x.ndim - n_in])
    if not _is_row_product(subscripts, one) or not _kernel_rows(x, rows):
        return einsum(subscripts, x, w.sliced(), **kwargs)
    y = _kernel_matmul(x.reshape(rows, -1), w)
    return y.reshape(*x.shape[: x.ndim - n_in], *one.out_shape)


def _kernel_rows(x: jax.Array, rows: int) -> bool:
    """Whether ``rows`` rows of ``x`` times a stacked weight go through the kernel
    (``cache_kernel.MATMUL_ROWS``)."""
    lo, hi = cache_kernel.MATMUL_ROWS
    return x.dtype == jnp.float32 and lo <= rows <= hi


def _kernel_matmul(x_RI: jax.Array, w: LayerWeight) -> jax.Array:
    """``x @ w.T`` [R, O] through ``cache_kernel.stacked_matmul``, int8 scales included."""
    scales = w.stacked.scale if is_quantized(w.stacked) else None
    return cache_kernel.stacked_matmul(x_RI, w.stacked.values, w.layer, scales)


def _materialized(x: jax.Array) -> jax.Array:
    """``x``, computed into a buffer of its own before the dot that reads it.

    XLA:CPU otherwise fuses cheap producers of the vector (the attention output's adds and
    broadcasts, for ``wo``) into the fused dot loop, which recomputes them for every output
    channel: 8-16 ms of a 24-36 ms step (results/profile_decode.md). A conditional is a
    fusion boundary; both branches are the identity (``optimization_barrier`` only keeps JAX
    from forwarding ``x`` around the conditional, XLA:CPU drops it before fusion), so the
    predicate does not matter. CPU only: elsewhere a conditional may wait for its predicate
    on the host, and the fusion above is XLA:CPU's.
    """
    same = jax.lax.optimization_barrier
    return jax.lax.cond(jnp.isnan(x.reshape(-1)[0]), same, same, x)


def head_logits(h_XD: jax.Array, w, *, vocab_first: bool) -> jax.Array:
    """Float32 logits ``[..., V]`` of hidden states ``[..., D]`` through the output head ``w``:
    ``[V, D]`` (a tied embedding, ``vocab_first``) or ``[D, V]``.

    A quantized head (stored ``[V, D]`` either way) is one fused dequantize-and-dot for
    decode; for more than ``HEAD_FUSED_ROWS`` rows it is applied ``HEAD_CHUNK`` vocabulary
    entries at a time (a ``lax.map``), since XLA then dequantizes before the dot, and the
    whole head at once would be a fresh 113 MB float array (SmolLM2) per call. A
    transposed float head (``OIWeight``, ``[V, D]``) goes through ``_matmul_t`` whole.
    """
    if isinstance(w, LayerWeight):  # a kernel_head: [1, V, D]
        h_RD = h_XD.reshape(-1, h_XD.shape[-1])
        if not _kernel_rows(h_XD, h_RD.shape[0]):
            return head_logits(h_XD, w.sliced(), vocab_first=True)
        return _kernel_matmul(h_RD, w).reshape(*h_XD.shape[:-1], -1)
    if not is_out_first(w):
        head_DV = w.T if vocab_first else w
        return jnp.einsum("...d,dv->...v", h_XD, head_DV, preferred_element_type=jnp.float32)
    V = w.values.shape[0]
    n = _n_chunks(V) if is_quantized(w) else 1
    h_RD = h_XD.reshape(-1, h_XD.shape[-1])
    f32 = dict(preferred_element_type=jnp.float32)
    if h_RD.shape[0] <= HEAD_FUSED_ROWS or n == 1:
        logits_RV = _matmul_oi(h_RD, w, **f32)
        return logits_RV.reshape(*h_XD.shape[:-1], V)
    chunks = (w.qvalue.reshape(n, V // n, -1), w.scale.reshape(n, V // n, 1))
    out_nRv = jax.lax.map(lambda c: _matmul_t(h_RD, *c, **f32), chunks)
    return jnp.moveaxis(out_nRv, 0, 1).reshape(*h_XD.shape[:-1], V)


def _matmul_oi(x_TI, w, **kwargs):
    """``x @ w.matrix().T`` for a weight ``w`` stored ``[O, I]`` (``Int8Weight`` or
    ``OIWeight``)."""
    if is_quantized(w):
        return _matmul_t(x_TI, w.qvalue, w.scale, **kwargs)
    return _matmul_t_float(x_TI, w.value, **kwargs)


def _matmul_t(x_TI, q_OI, scale_O1, **kwargs):
    """``x @ (q * scale).T``, in the form XLA:CPU runs fastest for T rows.

    One row (decode at batch 1): ``x @ (q * scale).T`` becomes one fused loop that reads the
    int8 values in place (module docstring). Only this spelling fuses: ``einsum("ti,oi->to")``
    does not (the explicit transpose is a free layout change that XLA folds into the dot).
    A few rows: XLA cannot fuse, and ``(q @ x.T) * scale`` (the converted int8 values on the
    left, scales after the dot) was 0.9-1.1x the float-layout dot at 4-8 rows where
    ``x @ (q * scale).T`` was 0.55-0.77x (results/weights_int8.md). Many rows
    (prefill): ``x @ (q * scale).T``, even with the float layout.
    """
    T = x_TI.shape[0]
    if T == 1 and jax.default_backend() == "cpu":
        x_TI = _materialized(x_TI)
    if T == 1 or T > FEW_ROWS:
        w_OI = q_OI.astype(scale_O1.dtype) * scale_O1
        return jnp.matmul(x_TI, w_OI.T, **kwargs)
    dims = (((1,), (1,)), ((), ()))
    y_OT = jax.lax.dot_general(q_OI.astype(scale_O1.dtype), x_TI, dims, **kwargs)
    return (y_OT * scale_O1).T


def _matmul_t_float(x_TI, w_OI, **kwargs):
    """``x @ w.T`` for a float ``[O, I]`` weight.

    One row on CPU: XLA:CPU fuses it into one loop that reads the layer's slice of the
    stacked weights in place (along its contiguous rows) instead of copying the slice for a
    dot thunk, with ``x`` materialized first (``_materialized``). Many rows (prefill): the
    weight is copied back into the canonical ``[I, O]`` layout first (``.copy()`` keeps XLA
    from folding the transpose into the dot), once per call and layer; the dot with the
    transposed operand was 0.88x at 512 rows, the copy and canonical dot 1.0x (30 layers'
    projections, in turns). A few rows: ``x @ w.T`` (both forms ~0.65x the canonical layout).
    """
    T = x_TI.shape[0]
    if T == 1 and jax.default_backend() == "cpu":
        x_TI = _materialized(x_TI)
    if T > FEW_ROWS:
        return jnp.matmul(x_TI, jnp.swapaxes(w_OI, 0, 1).copy(), **kwargs)
    return jnp.matmul(x_TI, w_OI.T, **kwargs)


FEW_ROWS = 64  # up to this many rows, ``_matmul_t``'s few-row form
HEAD_CHUNK = 4096
HEAD_FUSED_ROWS = 1  # up to this many rows, the int8 head is one fused loop


def _n_chunks(V: int) -> int:
    """The fewest chunks of at most ``HEAD_CHUNK`` that divide ``V`` evenly (1: no chunking,
    also when only chunks far below ``HEAD_CHUNK`` would)."""
    for n in range(-(-V // HEAD_CHUNK), V + 1):
        if V % n == 0:
            return n if V // n >= HEAD_CHUNK // 4 else 1
    return 1


def take_rows(w, idx) -> jax.Array:
    """``w[idx]`` (an embedding lookup), dequantized when ``w`` is int8."""
    if isinstance(w, OIWeight):
        w = dense(w)
    if not is_quantized(w):
        return w[idx]
    if w.in_first or w.qvalue.ndim != 2:
        raise ValueError(f"take_rows needs a [rows, D] weight, got {w.shape}")
    return w.qvalue[idx].astype(w.scale.dtype) * w.scale[idx]


def nbytes(params) -> int:
    """Bytes of every array in ``params`` (int8 values and their scales included)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
