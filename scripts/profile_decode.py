"""Where decode time goes: per-op profile, memory-bandwidth floor, old vs new side by side.

SmolLM2-135M, float32, on this CPU. Three measurements (``all`` runs them all and prints the
Markdown tables that ``results/profile_decode.md`` quotes):

* ``profile``: ``jax.profiler.trace`` of a few jitted ``decode_step`` calls (the cache donated,
  filled with random keys/values at positions 0..ctx-1), read back with
  ``jax.profiler.ProfileData``. Every XLA CPU thunk (a fusion, a dot, a copy) is one event;
  its wall time per step is the union of its intervals over the worker threads. Each op is
  labelled from the compiled HLO (shape, fused root, source op) and put in a category.
* ``bandwidth``: the streaming-read floor, a sum over a 1 GiB float32 array with numpy on
  one and on two threads (each summing half), median of several runs.
* ``compare``: decode ms/token (B = 1 and 8 at 1K and 4K context) and prefill tokens/s (512,
  2048) of the implementation before issue 17 (kept below as ``_old_*``, for this script
  only) and the library's, taking turns in one process; medians and their ratio.

    .venv/bin/python scripts/profile_decode.py all [--out report.md]   # everything
    .venv/bin/python scripts/profile_decode.py profile --batch 1 --context 4096 [--stats] \
        [--impl old]
    .venv/bin/python scripts/profile_decode.py bandwidth
    .venv/bin/python scripts/profile_decode.py compare [--reps 9]
    .venv/bin/python scripts/profile_decode.py parity --dtype out-first   # max |dlogit|
    .venv/bin/python scripts/profile_decode.py pvlayout --reps 21   # values slots-last?
    .venv/bin/python scripts/profile_decode.py stats --batch 8 [--stat-cache 1040,1105,65]
    .venv/bin/python scripts/profile_decode.py perlayer --decode 1:4096,8:4096 [--dtype out-first]
    .venv/bin/python scripts/profile_decode.py kernel --decode 1:4096,8:4096 [--kv-dtype float16]
    .venv/bin/python scripts/profile_decode.py prefill --prefill 1:512,1:2048
    .venv/bin/python scripts/profile_decode.py hugepages --decode 1:1024,1:4096 [--dtype int8]

``--dtype int8`` does the same for the int8-weight model (``jaxkv.model.weights_int8``):
"old" is then the int8 path before "After int8 weights" (``_old_int8_*``: qwix QArrays in
the float layout) and "new" the library; ``compare --decode 1:1024,8:1024 --prefill ''``
picks the rows. ``--dtype out-first`` compares float32 weights in the canonical layout
("old") with the same weights stored output channels first (``weights_int8.transpose_params``,
"new"), both through the library's decoder. ``pvlayout`` times p.v alone over all layers
with the values as the cache stores them (slots before the head dimension) against a
slots-last layout (fused matrix-vector loops, as q.k), in turns. ``stats`` times fused
decode loops whose caches carry no statistics, the policy's (all six by default) and H2O's,
with the library's statistics path, the one before session 30 (``s29:``) and the one
before session 34 (``s33:``), in turns. ``perlayer`` times full-cache decode with every
layer's weights and cache in buffers of their own (the layer loop unrolled; the step and its
cache writes as two jitted calls) against the library's stacked ``decode_step``, in turns.
``kernel`` times ``config.attention="kernel"`` (``jaxkv.model.cache_kernel``) against the XLA
attention, in turns: attention alone over every layer of a random filled cache, then whole
decode steps. ``matmul`` times the weights alone (every layer's seven projections as a
``lax.scan`` over the layers, then the output head) for ``--batch`` rows: float32 weights
canonical and out-first through XLA, out-first through ``config.matmul="kernel"``
(``cache_kernel.stacked_matmul``), int8 weights through XLA and the kernel, in turns.
``prefill`` times a prompt's attention alone over every layer, XLA's blocks against
``cache_kernel.causal_attention``, then whole prefills with ``config.attention`` "xla" and
"kernel", in turns. ``hugepages`` times decode steps through both kernels with the weights
as ``jaxkv.load`` leaves them (huge pages, ``jaxkv.model.memory``) and with a copy of them in
4 KiB pages, in turns.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import math
import re
import shutil
import statistics
import tempfile
import threading
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import qwix

import jaxkv
from jaxkv import kvcache
from jaxkv import stats as attn_stats
from jaxkv.evals import latency
from jaxkv.model import cache_kernel, decoder, layers, weights_int8
from jaxkv.model.params import PARAM_AXES

# --- the implementation before issue 17 (decode attention and statistics) -------------------


def _old_scores(q_BKGTH, k_BKSH):
    s = jnp.einsum("bkgth,bksh->bkgts", q_BKGTH, k_BKSH, preferred_element_type=jnp.float32)
    return s * q_BKGTH.shape[-1] ** -0.5


def _old_masked_softmax(s, mask):
    s = jnp.where(mask, s, layers.NEG_INF)
    p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(mask, p, 0.0)
    return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


def _old_contributions(p, w_BT3, names):
    names = [n for n in names if n in attn_stats._CHANNEL]
    ent = attn_stats.entropy(p) if "recent_ent" in names else None
    per_head = {}
    for n in names:
        c = attn_stats._CHANNEL[n]
        if c not in per_head:
            w = jnp.broadcast_to(w_BT3[..., min(c, 2)][:, None, None], p.shape[:4])
            w = w * ent if c == 3 else w
            per_head[c] = p[:, :, :, 0] * w[..., 0, None]
    return {
        n: jnp.mean(per_head[attn_stats._CHANNEL[n]] ** (2 if n == "attn_sq" else 1), axis=2)
        for n in names
    }


def _old_cached_attention(q, k_new, v_new, pos_BT, ck, cv, cpos, config):
    """Scores of cache and new tokens concatenated, a [B, K, G, T, C + T] mask, one softmax."""
    s = jnp.concatenate([_old_scores(q, ck), _old_scores(q, k_new)], axis=-1)
    q_pos = pos_BT[:, None, None, :, None]
    K, G, T = q.shape[1:4]
    parts = [
        layers.visible(q_pos, cpos[:, :, None, None, :], config.sliding_window),
        layers.visible(q_pos, pos_BT[:, None, None, None, :], config.sliding_window),
    ]
    mask = jnp.concatenate(
        [jnp.broadcast_to(m, (m.shape[0], K, G, T, m.shape[-1])) for m in parts], axis=-1
    )
    p = _old_masked_softmax(s, mask)
    C = ck.shape[2]
    out = layers.weighted_values(p[..., :C], cv) + layers.weighted_values(p[..., C:], v_new)
    return out, p


def _old_decode_step(params, token_B, cache, *, config):
    tokens_BT = token_B[:, None]
    pos_BT = cache.length[:, None] + jnp.arange(1, dtype=jnp.int32)
    weights = attn_stats.query_weights(pos_BT, cache.window) if cache.stats else None
    names = tuple(cache.stats)
    C = cache.capacity
    n_queries_B = jnp.full((tokens_BT.shape[0],), 1)
    acc = {n: a for n, a in cache.stats.items() if n in attn_stats.ACCUMULATING}

    def layer(x, xs):
        lp, ck, cv, cpos, acc_l = xs
        q, k, v = decoder._project_qkv(lp, x, pos_BT, config)
        attn, p = _old_cached_attention(q, k, v, pos_BT, ck, cv, cpos, config)
        x = decoder._finish_layer(lp, x, attn, config)
        if weights is None:
            return x, (k, v, None, None)
        st = _old_contributions(p, weights, names)
        old = {n: a[..., :C] for n, a in st.items()}
        merged = attn_stats.merge(acc_l, old, n_queries_B=n_queries_B, window=cache.window)
        new = {n: a[..., C:] for n, a in st.items()}
        if "vnorm" in names:
            new["vnorm"] = attn_stats.value_norms(v)
        return x, (k, v, merged, new)

    xs = (params["layers"], cache.k, cache.v, cache.pos, acc)
    x, (ks, vs, merged, new_stats) = jax.lax.scan(
        layer, decoder._embed(params, tokens_BT, config), xs
    )
    if weights is not None:
        cache = cache.replace(stats={**cache.stats, **merged})
    cache = kvcache.append(cache, ks, vs, pos_BT, new_stats)
    return decoder._guard(decoder._logits(params, x, config), cache)[:, 0], cache


@contextlib.contextmanager
def _old_prefill_ops():
    """Traces prefill with the old score and softmax functions."""
    saved = layers.scores, layers.masked_softmax
    layers.scores, layers.masked_softmax = _old_scores, _old_masked_softmax
    try:
        yield
    finally:
        layers.scores, layers.masked_softmax = saved


def _ops(impl, params):
    """The trace-time context of ``impl``: old int8 matmuls for old int8 params."""
    is_old_int8 = impl == "old" and any(
        isinstance(x, qwix.QArray) for x in jax.tree.leaves(params, is_leaf=_is_qarray)
    )
    return _old_int8_ops() if is_old_int8 else contextlib.nullcontext()


def _is_qarray(x):
    return isinstance(x, qwix.QArray)


def decode_fn(impl, config, params=None):
    """``impl`` "old": for float params the decode step before issue 17's part 1, for int8
    params the library's decode step with the int8 matmuls before "After int8 weights"."""
    if impl == "old" and not _is_int8(params):
        step = _old_decode_step
    else:
        step = decoder.decode_step

    def run(p, t, c):
        with _ops(impl, p):
            return step(p, t, c, config=config)

    return jax.jit(run, donate_argnums=2)


def prefill_fn(impl, config, params=None):
    def run(p, t, c):
        old_float = impl == "old" and not _is_int8(params)
        with _old_prefill_ops() if old_float else _ops(impl, p):
            return decoder.prefill(p, t, c, config=config)[0]

    return jax.jit(run)


def _is_int8(params) -> bool:
    leaves = jax.tree.leaves(
        params, is_leaf=lambda x: _is_qarray(x) or weights_int8.is_quantized(x)
    )
    return any(_is_qarray(x) or weights_int8.is_quantized(x) for x in leaves)


# --- int8 weights before "After int8 weights" (qwix QArrays in the float layout) ----------


def _old_int8_params(params):
    """The int8 params of the float ``params`` as before: ``qwix.QArray`` leaves in the float
    weights' layout, scales per output channel (the same int8 values and scales as now)."""

    def q(w, name):
        axes = PARAM_AXES["layers"].get(name) or PARAM_AXES[name]
        keep = tuple(i for i, a in enumerate(axes) if a not in weights_int8.CONTRACTED[name])
        return qwix.quantize(w, jnp.int8, channelwise_axes=keep)

    def tree(d):
        return {k: q(v, k) if k in weights_int8.CONTRACTED else v for k, v in d.items()}

    return jax.jit(lambda p: {**tree(p), "layers": tree(p["layers"])})(params)


def _old_int8_einsum(subscripts, x, w, **kwargs):
    if not isinstance(w, qwix.QArray):
        return jnp.einsum(subscripts, x, w, **kwargs)
    ins, out = subscripts.split("->")
    x_sub, w_sub = ins.split(",")
    n = sum(c not in out for c in w_sub)
    batch = x_sub[: len(x_sub) - n]
    if x_sub[len(batch) :] != w_sub[:n] or out != batch + w_sub[n:] or "." in subscripts:
        return qwix.einsum(subscripts, x, w, **kwargs)
    w_IO = jax.tree.map(lambda a: a.reshape(math.prod(a.shape[:n]), -1), w)
    y_TO = qwix.einsum("ti,io->to", x.reshape(-1, w_IO.shape[0]), w_IO, **kwargs)
    return y_TO.reshape(*x.shape[: len(batch)], *w.shape[n:])


def _old_int8_head_logits(h_XD, w, *, vocab_first):
    V = w.shape[0 if vocab_first else 1]
    n = weights_int8._n_chunks(V)
    if not isinstance(w, qwix.QArray) or n == 1:
        head_DV = w.T if vocab_first else w
        return _old_int8_einsum("...d,dv->...v", h_XD, head_DV, preferred_element_type=jnp.float32)
    sub = "...d,vd->...v" if vocab_first else "...d,dv->...v"
    axis = 0 if vocab_first else 1

    def split(a):
        a = a.reshape(*a.shape[:axis], n, a.shape[axis] // n, *a.shape[axis + 1 :])
        return jnp.moveaxis(a, axis, 0)

    out_nXv = jax.lax.map(
        lambda c: qwix.einsum(sub, h_XD, c, preferred_element_type=jnp.float32),
        jax.tree.map(split, w),
    )
    return jnp.moveaxis(out_nXv, 0, -2).reshape(*h_XD.shape[:-1], V)


def _old_int8_take_rows(w, idx):
    return qwix.dequantize(w[idx]) if isinstance(w, qwix.QArray) else w[idx]


_OLD_INT8 = types.SimpleNamespace(
    einsum=_old_int8_einsum, head_logits=_old_int8_head_logits, take_rows=_old_int8_take_rows
)


@contextlib.contextmanager
def _old_int8_ops():
    """Traces the decoder with the int8 matmuls as before (on ``_old_int8_params``)."""
    saved = decoder.weights_lib, layers.weights_lib
    decoder.weights_lib = layers.weights_lib = _OLD_INT8
    try:
        yield
    finally:
        decoder.weights_lib, layers.weights_lib = saved


# --- measurements ----------------------------------------------------------------------------


def filled_cache(config, batch, ctx, stats=False, extra=64, kv_dtype=None):
    """A cache whose first ``ctx`` slots hold random keys/values at positions 0..ctx-1
    (``kv_dtype``: the cache's storage, e.g. "int8" or "float16"; default the model's)."""
    cache = kvcache.init_cache(
        config, batch_size=batch, capacity=ctx + extra, stats=stats, dtype=kv_dtype
    )
    shape = cache.k[:, :, :, :ctx].shape
    key = jax.random.key(0)
    k, v = jax.random.normal(key, shape), jax.random.normal(jax.random.fold_in(key, 1), shape)
    if cache.quantized:
        (k, k_scale), (v, v_scale) = kvcache.quantize(k), kvcache.quantize(v)
        cache = cache.replace(
            k_scale=cache.k_scale.at[:, :, :, :ctx].set(k_scale),
            v_scale=cache.v_scale.at[:, :, :, :ctx].set(v_scale),
        )
    return cache.replace(
        k=cache.k.at[:, :, :, :ctx].set(k.astype(cache.k.dtype)),
        v=cache.v.at[:, :, :, :ctx].set(v.astype(cache.v.dtype)),
        pos=cache.pos.at[:, :, :, :ctx].set(jnp.arange(ctx)),
        stats={n: a.at[:, :, :, :ctx].set(0.01) for n, a in cache.stats.items()},
        length=jnp.full((batch,), ctx, jnp.int32),
    )


class Int8Model:
    """The int8 SmolLM2 as the library quantizes it ("new") and as before ("old"), both from
    one float model (the same int8 values and scales, in different layouts)."""

    def __init__(self, model):
        self.config, self.tokenizer = model.config, model.tokenizer
        self.params = weights_int8.quantize_params(model.params)
        self.old_params = _old_int8_params(model.params)

    def params_of(self, impl):
        return self.old_params if impl == "old" else self.params


class OutFirstModel:
    """The float SmolLM2 with its weights in the canonical layout ("old") and stored output
    channels first ("new"); both run the library's decoder."""

    def __init__(self, model):
        self.config, self.tokenizer = model.config, model.tokenizer
        self.old_params = model.params
        self.params = weights_int8.transpose_params(model.params)

    def params_of(self, impl):
        return self.old_params if impl == "old" else self.params

    @staticmethod
    def impl_of(impl):
        return "new"


def _impl_of(model, impl):
    """The decode/prefill implementation ``impl`` runs on ``model`` (``OutFirstModel``:
    always the library's)."""
    return model.impl_of(impl) if hasattr(model, "impl_of") else impl


class Decoder:
    """A jitted decode step that owns its (donated) cache."""

    def __init__(self, model, impl, batch, ctx, stats=False, kv_dtype=None):
        self.params = model.params_of(impl) if hasattr(model, "params_of") else model.params
        self.step = decode_fn(_impl_of(model, impl), model.config, self.params)
        self.cache = filled_cache(model.config, batch, ctx, stats, kv_dtype=kv_dtype)
        self.token = jnp.zeros((batch,), jnp.int32)

    def __call__(self):
        logits, self.cache = self.step(self.params, self.token, self.cache)
        logits.block_until_ready()

    def hlo(self):
        return self.step.lower(self.params, self.token, self.cache).compile().as_text()


class Prefiller:
    """A jitted prefill of random tokens into a fresh cache."""

    def __init__(self, model, impl, batch, n):
        self.params = model.params_of(impl) if hasattr(model, "params_of") else model.params
        self.model, self.batch, self.n = model, batch, n
        self.fn = prefill_fn(_impl_of(model, impl), model.config, self.params)
        rng = np.random.default_rng(0)
        self.tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (batch, n)))

    def __call__(self):
        cache = kvcache.init_cache(self.model.config, batch_size=self.batch, capacity=self.n)
        self.fn(self.params, self.tokens, cache).block_until_ready()


def in_turns(fns: dict, reps: int) -> dict:
    """Seconds of ``reps`` calls of each function, the functions taking turns."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


_MOVES = {"parameter", "constant", "bitcast", "copy", "transpose", "dynamic-slice", "slice"}


def hlo_ops(text: str) -> dict:
    """{instruction: (shape, kind, source op, shapes inside)} of compiled HLO. ``kind`` is the
    opcode, for a fusion that of its root, or "moves" for a fusion that only moves data
    ("transposes" when that includes a transpose)."""
    comps, info, comp = collections.defaultdict(list), {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            comp = head.group(1)
            continue
        m = re.match(r"^\s+(ROOT )?%(\S+) = (\([^)]*\)|\S+) ([\w-]+)\(", line)
        if not m:
            continue
        is_root, name, shape, opcode = m.groups()
        src = re.search(r'op_name="([^"]*)"', line)
        calls = re.search(r"calls=%([\w.-]+)", line)
        shape = shape.split("{")[0]
        info[name] = [shape, opcode, src.group(1) if src else "", calls, shape]
        comps[comp].append((opcode, is_root, name, shape))
    for v in info.values():
        calls, v[3] = v[3], None
        body = comps.get(calls.group(1), []) if calls else []
        opcodes = {op for op, _, _, _ in body}
        v[4] = " ".join([v[0]] + [sh for _, _, _, sh in body])
        if body and opcodes <= _MOVES:
            v[1] = "transposes" if "transpose" in opcodes else "moves"
        elif body:
            root = next(n for _, r, n, _ in body if r)
            v[1], v[2] = info[root][1], v[2] or info[root][2]
    return {k: (v[0], v[1], v[2], v[4]) for k, v in info.items()}


def category(name, op, *, capacity, head_dim, vocab):
    """A coarse label of one XLA op (``hlo_ops`` entry) from its shapes, kind and source."""
    shape, kind, source, inside = op
    dims = {int(d) for d in re.findall(r"\d+", shape)}
    touches_cache = bool({str(capacity), str(capacity + 1)} & set(re.findall(r"\d+", inside)))
    if kind == "copy" and not name.startswith(("copy_", "copy.")):
        kind = "moves"
    moves = kind in ("moves", "transposes", "copy")
    int8 = "s8[" in inside  # reads int8 weights
    n_chunks = weights_int8._n_chunks(vocab)  # the int8 head before: chunks of the vocabulary
    if vocab in dims or (n_chunks > 1 and vocab // n_chunks in dims):
        return "logits (tied embedding)"
    if "scatter" in kind or "scatter" in source:
        return "cache write (scatter of the new token)"
    if moves and {capacity, head_dim} <= dims:
        if kind == "transposes":
            return "copy of a layer's keys into a transposed layout"
        return "copy of a layer's K or V out of the stacked cache"
    if touches_cache and kind == "dot":
        return "attention dots (q.k, p.v)"
    if touches_cache and "dynamic_update_slice" in source:
        return "statistics (per-layer outputs)"
    if touches_cache and (kind in ("concatenate", "pad") or "concatenate" in source):
        return "concatenations / stacks of slot-shaped arrays"
    if touches_cache and moves:
        return "small copies of slot-shaped arrays (pos, scores, statistics)"
    if touches_cache:
        return "softmax, masks, statistics"
    if moves:
        return "copy of a layer's weights out of the stacked weights"
    if int8 and kind == "dot":
        return "weight matmuls, fused with the int8 read and dequantization"
    if int8:
        return "dequantization of a layer's int8 weights into a float32 copy"
    if kind == "dot":
        return "weight matmuls"
    return "other (norms, RoPE, residuals, loop)"


def profile(model, impl, batch, ctx, stats, steps=8, kv_dtype=None):
    """Profile of decode_step: (ms/step untraced (median), ms/step traced (mean),
    [(op, shape, category, source, ms/step)] sorted by time)."""
    dec = Decoder(model, impl, batch, ctx, stats, kv_dtype=kv_dtype)
    ops = hlo_ops(dec.hlo())
    for _ in range(3):
        dec()
    step_ms = 1e3 * statistics.median(in_turns({"d": dec}, 10)["d"])
    trace_dir = tempfile.mkdtemp(prefix="jaxkv_profile_")
    try:
        with jax.profiler.trace(trace_dir):
            traced_ms = 1e3 * sum(in_turns({"d": dec}, steps)["d"]) / steps
        (xplane,) = Path(trace_dir).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(xplane))
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    spans = collections.defaultdict(list)
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):  # XLA's CPU worker threads
                continue
            for e in line.events:
                if e.name in ops and ops[e.name][1] != "while":
                    spans[e.name].append((e.start_ns, e.start_ns + e.duration_ns))
    rows = []
    for name, iv in spans.items():
        cfg = model.config
        cat = category(
            name, ops[name], capacity=ctx + 64, head_dim=cfg.head_dim, vocab=cfg.vocab_size
        )
        rows.append((name, ops[name][0], cat, ops[name][2], _union_ns(iv) / steps / 1e6))
    return step_ms, traced_ms, sorted(rows, key=lambda r: -r[-1])


def _union_ns(intervals):
    total, (lo, hi) = 0, sorted(intervals)[0]
    for s, e in sorted(intervals)[1:]:
        if s > hi:
            total, lo, hi = total + hi - lo, s, e
        else:
            hi = max(hi, e)
    return total + hi - lo


def bandwidth(reps=7):
    """Median GB/s of a sum over 1 GiB float32: numpy on one thread, and on two threads."""
    a = np.ones(256 * 1024 * 1024, np.float32)
    halves = np.split(a, 2)

    def two_threads():
        ts = [threading.Thread(target=h.sum) for h in halves]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    times = in_turns({"1 thread": a.sum, "2 threads": two_threads}, reps)
    return {k: a.nbytes / statistics.median(v) / 1e9 for k, v in times.items()}


DECODE_ROWS = ((1, 1024), (1, 4096), (8, 1024), (8, 4096))
PREFILL_ROWS = ((1, 512), (1, 2048))


def compare(model, reps=9, decode_rows=DECODE_ROWS, prefill_rows=PREFILL_ROWS):
    """Old vs new in turns: rows (kind, batch, tokens, unit, old median, new median, old best,
    new best, paired speed-up); prefill in tokens/s, decode in ms/token."""
    out = []
    for batch, n in prefill_rows:
        fns = {impl: Prefiller(model, impl, batch, n) for impl in ("old", "new")}
        for f in fns.values():
            f()
        t = in_turns(fns, max(3, reps // 3))
        rates = [n * batch / f(t[k]) for f in (_med, min) for k in fns]
        out.append(("prefill", batch, n, "tokens/s", *rates, _paired(t["old"], t["new"])))
        print(out[-1], flush=True)
    for batch, ctx in decode_rows:
        fns = {impl: Decoder(model, impl, batch, ctx) for impl in ("old", "new")}
        for f in fns.values():
            f(), f()
        t = in_turns(fns, reps if batch == 1 else max(3, reps // 2))
        times = [1e3 * f(t[k]) for f in (_med, min) for k in fns]
        out.append(("decode", batch, ctx, "ms/token", *times, _paired(t["old"], t["new"])))
        print(out[-1], flush=True)
    return out


def _old_narrow_cached_attention(q, k_new, v_new, pos_BT, cached, config):
    """``decoder._cached_attention`` before the float16 fix: a float16 cache's probabilities
    were rounded to float16 for the p.v dot (int8 caches as in the library)."""
    ck, cv, cpos, k_scale, v_scale = cached
    q_pos = pos_BT[:, None, None, :, None]
    window = config.sliding_window
    sees_cache = layers.visible(q_pos, cpos[:, :, None, None, :], window)
    sees_new = layers.visible(q_pos, pos_BT[:, None, None, None, :], window)
    s_cache = layers.scores(q, ck.astype(q.dtype) if k_scale is not None else ck)
    if k_scale is not None:
        s_cache = s_cache * k_scale[:, :, None, None, :]
    p_cache, p_new = layers.split_softmax(
        (s_cache, layers.scores(q, k_new)), (sees_cache, sees_new)
    )
    if v_scale is None:
        out_cache = layers.weighted_values(p_cache, cv)
    else:
        p_scaled = p_cache * v_scale[:, :, None, None, :]
        out_cache = layers.weighted_values(p_scaled, cv.astype(v_new.dtype))
    return out_cache + layers.weighted_values(p_new, v_new), p_cache, p_new


@contextlib.contextmanager
def _patched(module, name, fn):
    saved = getattr(module, name)
    setattr(module, name, fn)
    try:
        yield
    finally:
        setattr(module, name, saved)


def kv_compare(model, kv_dtype, rows, reps):
    """Decode ms/token over a ``kv_dtype`` cache, the attention before the float16 fix
    ("old", ``_old_narrow_cached_attention``) and the library's ("new"), in turns: rows
    (batch, context, old median, new median, paired speed-up)."""
    out = []
    for batch, ctx in rows:
        fns = {
            impl: Decoder(model, "new", batch, ctx, kv_dtype=kv_dtype) for impl in ("old", "new")
        }
        with _patched(decoder, "_cached_attention", _old_narrow_cached_attention):
            fns["old"]()  # traced (and compiled) with the old attention
        fns["new"]()
        t = in_turns(fns, reps)
        ms = [1e3 * _med(t[k]) for k in fns]
        out.append((batch, ctx, *ms, _paired(t["old"], t["new"])))
        print(out[-1], flush=True)
    return out


def _with_config(model, **changes):
    """``model`` (a loaded model or one of this script's wrappers) with ``config`` changed."""
    m = copy.copy(model)
    object.__setattr__(m, "config", model.config.replace(**changes))
    return m


def kernel_compare(model, kv_dtype, rows, reps):
    """Decode ms/token with ``config.attention`` "xla" and "kernel" (``cache_kernel``), in
    turns: rows (batch, context, xla median, kernel median, paired speed-up)."""

    def make(attention, batch, ctx):
        return Decoder(
            _with_config(model, attention=attention), "new", batch, ctx, kv_dtype=kv_dtype
        )

    return _xla_vs_kernel(rows, reps, make)


def _xla_vs_kernel(rows, reps, make):
    """``make(attention, batch, n)`` (a call) for "xla" and "kernel", compiled, then in turns:
    rows (batch, n, xla median ms, kernel median ms, paired speed-up)."""
    return _a_vs_b(rows, reps, make, ("xla", "kernel"))


def _a_vs_b(rows, reps, make, names):
    """``make(name, batch, n)`` (a call) for both ``names`` (a, b), compiled, then in turns:
    rows (batch, n, a median ms, b median ms, paired speed-up of b)."""
    a, b = names
    out = []
    for batch, n in rows:
        fns = {k: make(k, batch, n) for k in names}
        for f in fns.values():
            f()  # compiled before the turns
        t = in_turns(fns, reps)
        out.append((batch, n, 1e3 * _med(t[a]), 1e3 * _med(t[b]), _paired(t[a], t[b])))
        print(out[-1], flush=True)
    return out


def kernel_piece(config, rows, reps, kv_dtype=None):
    """Attention alone over every layer of a filled stacked cache (a ``lax.scan`` over the
    layers, one decode query per sequence), the library's XLA attention against
    ``cache_kernel``, in turns: rows (batch, slots, xla ms, kernel ms, cache MB, kernel GB/s)."""
    out = []
    for batch, ctx in rows:
        t = in_turns(_attention_pieces(config, batch, ctx, jnp.dtype(kv_dtype or "float32")), reps)
        ms = {k: 1e3 * _med(v) for k, v in t.items()}
        mb = 2 * config.n_layers * batch * config.n_kv_heads * (ctx + 64) * config.head_dim
        mb *= jnp.dtype(kv_dtype or "float32").itemsize / 1e6  # keys and values (not the scales)
        out.append((batch, ctx, ms["xla"], ms["kernel"], mb, mb / ms["kernel"]))
        print(out[-1], flush=True)
    return out


def _attention_pieces(config, batch, ctx, dtype) -> dict:
    """``kernel_piece``'s two programs on one random cache, compiled: {name: call}."""
    L, K, G, H = config.n_layers, config.n_kv_heads, config.q_per_kv, config.head_dim
    rng = np.random.default_rng(0)
    C = ctx + 64
    q = jnp.asarray(rng.normal(size=(batch, K, G, 1, H)), jnp.float32)
    shape = (L, batch, K, C, H)
    keys, values = (jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(2))
    scales = None
    if dtype == jnp.int8:  # an int8 cache and its per-slot scales, as ``kvcache`` stores them
        (keys, k_scale), (values, v_scale) = kvcache.quantize(keys), kvcache.quantize(values)
        scales = (k_scale, v_scale)
    keys, values = keys.astype(dtype), values.astype(dtype)
    kpos = jnp.where(jnp.arange(C) < ctx, jnp.arange(C), -1).astype(jnp.int32)
    kpos = jnp.broadcast_to(kpos, (L, batch, K, C))
    pos = jnp.full((batch, 1), ctx, jnp.int32)
    new = q[:, :, 0]  # the new token's key and value [B, K, 1, H]

    def xla(q, keys, values, kpos, scales):
        def body(acc, xs):
            o, _, _ = decoder._cached_attention(q, new, new, pos, xs, config)
            return acc + o.sum(), None

        xs = (keys, values, kpos, *(scales or (None, None)))
        return jax.lax.scan(body, 0.0, xs)[0]

    def kernel(q, keys, values, kpos, scales):
        def body(acc, i):
            o, _, _ = cache_kernel.cache_attention(
                q, pos, keys, values, kpos, i, window=config.sliding_window, scales=scales
            )
            return acc + o.sum(), None

        return jax.lax.scan(body, 0.0, jnp.arange(L))[0]

    calls = {}
    for name, fn in (("xla", xla), ("kernel", kernel)):
        jitted = jax.jit(fn)
        calls[name] = functools.partial(_block, jitted, q, keys, values, kpos, scales)
        calls[name]()  # compiled before the turns
    return calls


def prefill_piece(config, rows, reps):
    """A prompt's attention alone over every layer (random q, k, v; a ``lax.scan`` over the
    layers), XLA's blocks (``layers.causal_block_attention``) against
    ``cache_kernel.causal_attention``, in turns: rows (batch, tokens, xla ms, kernel ms,
    kernel GFLOP/s of the causal work, 4 * T^2 / 2 * H per query head and layer)."""
    L, K, G, H = config.n_layers, config.n_kv_heads, config.q_per_kv, config.head_dim
    out = []
    for batch, n in rows:
        t = in_turns(_prompt_attention_pieces(config, batch, n), reps)
        ms = {name: 1e3 * _med(times) for name, times in t.items()}
        flops = 4 * n * n / 2 * H * L * batch * K * G
        out.append((batch, n, ms["xla"], ms["kernel"], flops / ms["kernel"] / 1e6))
        print(out[-1], flush=True)
    return out


def _prompt_attention_pieces(config, batch, n) -> dict:
    """``prefill_piece``'s two programs on random queries, keys and values, compiled."""
    L, K, G, H = config.n_layers, config.n_kv_heads, config.q_per_kv, config.head_dim
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(L, batch, K, G, n, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(L, batch, K, n, H)), jnp.float32) for _ in "kv")
    pos = decoder.prompt_positions(jnp.zeros((batch, n), jnp.int32), None)
    window = config.sliding_window

    def xla_layer(qkv):
        return layers.causal_block_attention(*qkv, pos, window=window, block=decoder.PREFILL_BLOCK)[
            0
        ]

    def kernel_layer(qkv):
        return cache_kernel.causal_attention(*qkv, pos, window=window)

    calls = {}
    for name, one in (("xla", xla_layer), ("kernel", kernel_layer)):

        def run(q, k, v, one=one):
            body = lambda acc, qkv: (acc + one(qkv).sum(), None)  # noqa: E731
            return jax.lax.scan(body, 0.0, (q, k, v))[0]

        calls[name] = functools.partial(_block, jax.jit(run), q, k, v)
        calls[name]()  # compiled before the turns
    return calls


def prefill_compare(model, rows, reps):
    """Whole prefills with ``config.attention`` "xla" and "kernel", in turns: rows (batch,
    tokens, xla median ms, kernel median ms, paired speed-up)."""

    def make(attention, batch, n):
        return Prefiller(_with_config(model, attention=attention), "new", batch, n)

    return _xla_vs_kernel(rows, reps, make)


def matmul_piece(model, rows, reps):
    """The weights alone for ``rows`` rows (``matmul_pieces``), in turns: {name: (median ms,
    GB/s of weights read)}."""
    float_params = weights_int8.dequantize_params(model.params)
    out_first = weights_int8.transpose_params(float_params)
    int8 = weights_int8.quantize_params(float_params)
    variants = {
        "xla canonical": (float_params, False),
        "xla out-first": (out_first, False),
        "kernel out-first": (out_first, True),
        "xla int8": (int8, False),
        "kernel int8": (int8, True),
    }
    calls = {k: _matmul_call(p, model.config, rows, kernel) for k, (p, kernel) in variants.items()}
    t = in_turns(calls, reps)
    out = {}
    for k, (p, _) in variants.items():
        gb = weights_int8.nbytes({n: w for n, w in p.items() if n != "final_norm"}) / 1e9
        out[k] = (1e3 * _med(t[k]), gb / _med(t[k]))
    return out


def _matmul_call(params, config, rows, kernel):
    """One compiled program: every layer's projections of fixed random inputs (``rows`` rows)
    and the output head, as the decoder multiplies them (``weights_int8.einsum``; with
    ``kernel`` through ``decoder._layer_weights`` and ``kernel_head``)."""
    rng = np.random.default_rng(0)
    D, F, N, H = config.d_model, config.d_ff, config.n_heads, config.head_dim
    x, h, a = (jnp.asarray(rng.normal(size=(rows, 1, n)), jnp.float32) for n in (D, F, N * H))
    a = a.reshape(rows, 1, N, H)
    subs = {
        "wq": ("btd,dnh->btnh", x),
        "wk": ("btd,dkh->btkh", x),
        "wv": ("btd,dkh->btkh", x),
        "wo": ("btnh,nhd->btd", a),
        "w_gate": ("btd,df->btf", x),
        "w_up": ("btd,df->btf", x),
        "w_down": ("btf,fd->btd", h),
    }
    stacked = {n: params["layers"][n] for n in subs}

    def layer(acc, lp):
        ys = [weights_int8.einsum(sub, v, lp[n]) for n, (sub, v) in subs.items()]
        return acc + sum(y.sum() for y in ys), None

    def run(stacked, embed):
        if kernel:
            body = lambda acc, i: layer(acc, decoder._layer_weights(stacked, i))  # noqa: E731
            acc, _ = jax.lax.scan(body, 0.0, jnp.arange(config.n_layers))
            embed = weights_int8.kernel_head(embed, vocab_first=True)
        else:
            acc, _ = jax.lax.scan(layer, 0.0, stacked)
        return acc + weights_int8.head_logits(x, embed, vocab_first=True).sum()

    jitted = jax.jit(run)
    call = functools.partial(_block, jitted, stacked, params["embed"])
    call()  # compiled before the turns
    return call


def _block(fn, *args):
    return fn(*args).block_until_ready()


def _no_cache_attention(q, k_new, v_new, pos_BT, cached, config):
    """A stand-in for ``decoder._cached_attention`` that reads no cache slot (each query sees
    its own token only): what a decode step costs without attention over the cache."""
    C = cached[0].shape[2]
    p_new = jnp.ones((*q.shape[:4], 1), jnp.float32)
    out = jnp.broadcast_to(v_new[:, :, None], q.shape).astype(q.dtype)
    return out, jnp.zeros((*q.shape[:4], C), jnp.float32), p_new


def attention_share(model, kv_dtype, rows, reps):
    """Decode ms/token with the library's attention ("with") and without attention over the
    cache ("without", ``_no_cache_attention``), in turns: rows (batch, context, with,
    without, median of paired with - without)."""
    out = []
    for batch, ctx in rows:
        fns = {k: Decoder(model, "new", batch, ctx, kv_dtype=kv_dtype) for k in ("with", "w/o")}
        fns["with"]()
        with _patched(decoder, "_cached_attention", _no_cache_attention):
            fns["w/o"]()  # traced without the cache's attention
        t = in_turns(fns, reps)
        ms = [1e3 * _med(t[k]) for k in fns]
        diff = 1e3 * _med([a - b for a, b in zip(t["with"], t["w/o"], strict=True)])
        out.append((batch, ctx, *ms, diff))
    return out


class FusedDecoder:
    """``steps`` decode steps in one program (as a compressed call between evictions runs
    them), batch ``batch``, ``slots`` occupied of ``capacity``; each step frees the slot it
    wrote, so the cache stays in its state; each feeds its logits' greedy token to the next
    (unused logits would let XLA drop the vocabulary projection). Times are per decode step."""

    def __init__(self, model, batch, slots, capacity, steps, stats):
        cfg, params = model.config, model.params

        def step(_, ct):
            return latency.decode_and_forget(params, ct[1], ct[0], config=cfg)

        self.fn = jax.jit(lambda ct: jax.lax.fori_loop(0, steps, step, ct), donate_argnums=0)
        cache = filled_cache(cfg, batch, slots, stats, extra=capacity - slots)
        self.cache = (cache, jnp.zeros((batch,), jnp.int32))
        self.steps = steps
        self()

    def __call__(self):
        self.cache = jax.block_until_ready(self.fn(self.cache))


def _s33_slab_parts(p_parts, names):
    """``stats._slab_parts`` before session 34: each key part chose the slab alone, so a new
    token's part was a slab beside a cache part above ``MAX_SLAB``."""
    return [attn_stats._slab_fits(p, names) for p in p_parts]


def stats_cost(model, batch, slots, capacity, steps, stat_sets, reps):
    """ms per decode step of fused loops whose caches carry each statistic set (name ->
    names; ``()`` none), with the library's statistics, (``s29:`` rows) the path before
    session 30 (``stats.MAX_SLAB`` = 0: one product per weight channel, each statistic its own
    fusion) and (``s33:`` rows) the one before session 34 (``_s33_slab_parts``), in turns:
    {row: (median ms, median of paired ms over the ``none`` row)}."""
    fns = {}
    for name, names in stat_sets.items():
        fns[name] = FusedDecoder(model, batch, slots, capacity, steps, names)
        if names:
            with _patched(attn_stats, "MAX_SLAB", 0):  # one product per channel, as before
                fns[f"s29:{name}"] = FusedDecoder(model, batch, slots, capacity, steps, names)
            with _patched(attn_stats, "_slab_parts", _s33_slab_parts):
                fns[f"s33:{name}"] = FusedDecoder(model, batch, slots, capacity, steps, names)
    t = {k: [x / steps for x in v] for k, v in in_turns(fns, reps).items()}
    base = next(k for k, names in stat_sets.items() if not names)
    return {
        k: (1e3 * _med(v), 1e3 * _med([a - b for a, b in zip(v, t[base], strict=True)]))
        for k, v in t.items()
    }


def _pv_slots_first(p_LBKGC, v_LBKCH):
    """p.v over every layer as the library computes it: values ``[B, K, C, H]`` (slots
    before the head dimension), widened to float32 and one batched dot."""

    def layer(x, xs):
        p, v = xs
        return x + jnp.einsum("bkgc,bkch->bkgh", p, v.astype(jnp.float32)), None

    x0 = jnp.zeros((*p_LBKGC.shape[1:4], v_LBKCH.shape[-1]), jnp.float32)
    return jax.lax.scan(layer, x0, (p_LBKGC, v_LBKCH))[0]


def _pv_slots_last(p_LBKGC, v_LBKHC, chunks=1):
    """p.v with the values stored slots last (``[B, K, H, C]``): one matrix-vector product
    per query row, each output reading a contiguous row of slots (``layers.scores``'s form
    for q.k), in ``chunks`` pieces along the slots (XLA:CPU fuses a dot whose vector is at
    most 16 KB)."""
    B, K, G, C = p_LBKGC.shape[1:]
    edges = [C * i // chunks for i in range(chunks + 1)]

    def row(p, v):
        parts = zip(edges[:-1], edges[1:], strict=True)
        return sum(jnp.matmul(p[a:b], v[:, a:b].astype(jnp.float32).T) for a, b in parts)

    def layer(x, xs):
        p, v = xs
        rows = [row(p[b, k, g], v[b, k]) for b in range(B) for k in range(K) for g in range(G)]
        return x + jnp.stack(rows).reshape(B, K, G, -1), None

    x0 = jnp.zeros((B, K, G, v_LBKHC.shape[-2]), jnp.float32)
    return jax.lax.scan(layer, x0, (p_LBKGC, v_LBKHC))[0]


def pv_layout(model, rows, reps):
    """p.v alone for all layers, values slots-first (the cache's layout) against slots-last,
    in turns; rows (batch, slots, kv dtype). Returns (batch, slots, dtype, {variant: ms},
    max |difference|)."""
    cfg = model.config
    L, K, H = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
    G = cfg.n_heads // K
    out = []
    for batch, slots, dtype in rows:
        key = jax.random.key(0)
        p = jax.nn.softmax(jax.random.normal(key, (L, batch, K, G, slots)), axis=-1)
        v = jax.random.normal(jax.random.fold_in(key, 1), (L, batch, K, slots, H))
        if dtype == "int8":
            v = jnp.clip(jnp.round(16 * v), -127, 127).astype(jnp.int8)
        v_last = jnp.swapaxes(v, -1, -2).copy()
        fns = {"slots-first": (jax.jit(_pv_slots_first), v)}
        for chunks in (1, 2) if slots * 4 > 16384 else (1,):
            fn = jax.jit(functools.partial(_pv_slots_last, chunks=chunks))
            fns[f"slots-last/{chunks}"] = (fn, v_last)
        ref = fns["slots-first"][0](p, v)
        diff = max(float(jnp.max(jnp.abs(f(p, a) - ref))) for f, a in fns.values())
        t = in_turns(
            {k: lambda f=f, a=a, p=p: jax.block_until_ready(f(p, a)) for k, (f, a) in fns.items()},
            reps,
        )
        out.append((batch, slots, dtype, {k: 1e3 * _med(v) for k, v in t.items()}, diff))
    return out


def _layer_list(layers_tree) -> list:
    """Stacked per-layer arrays (the layer weights, a cache array) as one pytree per layer,
    each leaf its own buffer."""
    n = jax.tree.leaves(layers_tree)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: jnp.array(a[i]), layers_tree) for i in range(n)]


def _perlayer_compute(params, layer_params, ks, vs, ps, token_B, length_B, *, config):
    """A full-cache decode step over per-layer buffers, the layer loop unrolled and nothing
    written: the logits [B, V] and each layer's new key and value [B, K, 1, H]."""
    pos_BT = length_B[:, None]
    x = decoder._embed(params, token_B[:, None], config)
    new = []
    for lp, k_l, v_l, p_l in zip(layer_params, ks, vs, ps, strict=True):
        q, k, v, _ = decoder._projections(lp, x, pos_BT, config)
        cached = (k_l, v_l, p_l, None, None)
        attn, _, _ = decoder._cached_attention(q, k, v, pos_BT, cached, config)
        x = decoder._finish_layer(lp, x, attn, config)
        new.append((k, v))
    return decoder._logits(params, x, config)[:, 0], new


def _perlayer_write(ks, vs, ps, new, length_B):
    """Each layer's new key, value and position into its own buffers at slot ``length``
    (the next free slot of a contiguously filled cache, the same in every row)."""
    at = length_B[0]
    put = lambda a, u: jax.lax.dynamic_update_slice(a, u.astype(a.dtype), (0, 0, at, 0))  # noqa: E731
    ks = tuple(put(a, k) for a, (k, _) in zip(ks, new, strict=True))
    vs = tuple(put(a, v) for a, (_, v) in zip(vs, new, strict=True))
    ps = tuple(
        jax.lax.dynamic_update_slice(p, jnp.full(p.shape[:2] + (1,), at), (0, 0, at)) for p in ps
    )
    return ks, vs, ps


def per_layer(model, rows, reps):
    """Full-cache decode with per-layer buffers (weights and cache, the layer loop unrolled)
    against the library's ``decode_step`` (stacked arrays, a ``lax.scan`` over layers), in
    turns. The per-layer step is two jitted calls, the step and then the writes (its cache
    donated): with the writes in the step, XLA:CPU copies the per-layer cache buffers (the
    count of such copies in that one-call program is reported). Yields (batch, context,
    library ms, per-layer ms, paired ratio, max |dlogit| of the first step, copies)."""
    config = model.config
    params = model.params_of("new") if hasattr(model, "params_of") else model.params
    layer_params = _layer_list(params["layers"])
    top = {k: v for k, v in params.items() if k != "layers"}
    lib_step = jax.jit(functools.partial(decoder.decode_step, config=config), donate_argnums=2)
    compute = jax.jit(functools.partial(_perlayer_compute, config=config))
    write = jax.jit(_perlayer_write, donate_argnums=(0, 1, 2))

    def one_call(top, layer_params, ks, vs, ps, token_B, length_B):
        logits, new = _perlayer_compute(
            top, layer_params, ks, vs, ps, token_B, length_B, config=config
        )
        return logits, _perlayer_write(ks, vs, ps, new, length_B)

    for batch, ctx in rows:
        cache = filled_cache(config, batch, ctx)
        per = tuple(tuple(_layer_list(a)) for a in (cache.k, cache.v, cache.pos))
        state = {"lib": cache, "per": per}
        token = jnp.zeros((batch,), jnp.int32)
        shape = f"f32[{batch},{config.n_kv_heads},{cache.capacity},{config.head_dim}]"
        hlo = (
            jax.jit(one_call, donate_argnums=(2, 3, 4))
            .lower(top, layer_params, *state["per"], token, cache.length)
            .compile()
            .as_text()
        )
        copies = sum("copy(" in line and shape in line for line in hlo.splitlines())

        def lib(state=state, token=token):
            state["lib_logits"], state["lib"] = lib_step(params, token, state["lib"])
            jax.block_until_ready(state["lib"])

        def per(state=state, token=token):
            length = state["per_len"]
            logits, new = compute(top, layer_params, *state["per"], token, length)
            state["per"] = write(*state["per"], new, length)
            state["per_logits"], state["per_len"] = logits, length + 1
            jax.block_until_ready(state["per"])

        state["per_len"] = cache.length
        per()  # compile both and compare the first step's logits (the same cache, token)
        lib()
        diff = float(jnp.max(jnp.abs(state["lib_logits"] - state["per_logits"])))
        times = in_turns({"lib": lib, "per": per}, reps)
        yield (
            batch,
            ctx,
            1e3 * _med(times["lib"]),
            1e3 * _med(times["per"]),
            _paired(times["lib"], times["per"]),
            diff,
            copies,
        )


def _med(x):
    return statistics.median(x)


def parity(model, n_windows=4, window=352, prompt_len=256):
    """Teacher-forced logits (``prompt_len`` prefilled, the rest decoded) of held-out text
    windows, "new" params against "old": rows (windows per call, max |dlogit|, mean |dlogit|,
    top-1 agreement). One window per call decodes through the batch-1 path, all at once
    through the few-row path."""
    from jaxkv.evals import tasks
    from jaxkv.generate import teacher_forced

    windows = tasks.text_windows(window=window, n_windows=n_windows, tokenizer=model.tokenizer)

    def stream(impl, batch):
        params = model.params_of(impl)
        parts = [
            teacher_forced(
                params, windows[i : i + batch], prompt_len=prompt_len, config=model.config
            )[0]
            for i in range(0, n_windows, batch)
        ]
        return np.concatenate([np.asarray(p, np.float64) for p in parts])

    out = []
    for batch in (1, n_windows):
        ref, got = stream("old", batch), stream("new", batch)
        delta = np.abs(got - ref)
        agree = float(np.mean(np.argmax(ref, -1) == np.argmax(got, -1)))
        out.append((batch, float(delta.max()), float(delta.mean()), agree))
        print(out[-1], flush=True)
    return out


def hugepages_compare(rows, reps, dtype):
    """Decode ms/token with the weights in 4 KiB pages and in huge pages
    (``jaxkv.model.memory.huge_pages``), both kernels, in turns: the weights as ``jaxkv.load``
    leaves them (huge pages) against a copy of them in fresh buffers, never advised (4 KiB
    pages). Returns (MB in huge pages, rows (batch, context, 4 KiB median ms, huge median ms,
    paired speed-up))."""
    from jaxkv.model import memory

    kw = {"dtype": "int8"} if dtype == "int8" else {"out_first": True}
    loaded = jaxkv.load("smollm2-135m", attention="kernel", matmul="kernel", **kw)
    small = copy.copy(loaded)
    fresh = jax.tree.map(lambda a: a.copy(), loaded.params)  # XLA's buffers: 4 KiB pages
    object.__setattr__(small, "params", fresh)
    huge_mb = memory.huge_pages(loaded.params) / 1e6  # already done by the load: counted here
    models = {"4k": small, "huge": loaded}
    make = lambda name, batch, ctx: Decoder(models[name], "new", batch, ctx)  # noqa: E731
    return huge_mb, _a_vs_b(rows, reps, make, ("4k", "huge"))


def _paired(old, new):
    """Median over turns of old time / new time (each turn runs both back to back)."""
    return _med([a / b for a, b in zip(old, new, strict=True)])


# --- report ----------------------------------------------------------------------------------


def profile_table(untraced_ms, step_ms, rows, top=15):
    """Markdown: the top ops and every category, in ms per step and % of the traced step."""
    lines = [
        f"Step {untraced_ms:.1f} ms untraced (median), {step_ms:.1f} ms traced (mean, the "
        "base of the percentages). Top ops, ms per step (union of an op's intervals over "
        "the two worker threads):",
        "",
        "| # | XLA op | shape | category | ms | % of step |",
        "|---|---|---|---|---|---|",
    ]
    for i, (name, shape, cat, _, ms) in enumerate(rows[:top], 1):
        lines.append(
            f"| {i} | `{name}` | `{shape}` | {cat} | {ms:.2f} | {100 * ms / step_ms:.1f} |"
        )
    by_cat = collections.Counter()
    for _, _, cat, _, ms in rows:
        by_cat[cat] += ms
    lines += ["", "| category | ms | % of step |", "|---|---|---|"]
    for cat, ms in by_cat.most_common():
        lines.append(f"| {cat} | {ms:.2f} | {100 * ms / step_ms:.1f} |")
    rest = step_ms - sum(by_cat.values())
    lines.append(
        f"| (step minus all ops: dispatch, idle; < 0 where ops overlap on two threads) "
        f"| {rest:.2f} | {100 * rest / step_ms:.1f} |"
    )
    return "\n".join(lines)


def _rows(text):
    return tuple(tuple(int(v) for v in r.split(":")) for r in text.split(",") if r)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "what",
        choices=[
            "all",
            "profile",
            "bandwidth",
            "compare",
            "parity",
            "kvcompare",
            "attnshare",
            "pvlayout",
            "stats",
            "perlayer",
            "kernel",
            "matmul",
            "prefill",
            "hugepages",
        ],
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--stats", action="store_true", help="the cache carries every statistic")
    ap.add_argument("--impl", choices=["old", "new"], default="new")
    ap.add_argument(
        "--dtype",
        choices=["float32", "int8", "out-first"],
        default="float32",
        help="the model's weights (out-first: float32, canonical vs output channels first)",
    )
    ap.add_argument(
        "--kv-dtype", default=None, help="``profile``: the cache's storage (int8, float16)"
    )
    ap.add_argument(
        "--attention",
        choices=["xla", "kernel"],
        default="xla",
        help="``profile``: config.attention of the profiled model",
    )
    ap.add_argument(
        "--matmul",
        choices=["xla", "kernel"],
        default="xla",
        help="``profile``: config.matmul of the profiled model (kernel: out-first or int8 weights)",
    )
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument(
        "--decode", type=_rows, default=DECODE_ROWS, help="``compare``: B:CTX,... ('' for none)"
    )
    ap.add_argument(
        "--prefill", type=_rows, default=PREFILL_ROWS, help="``compare``: B:N,... ('' for none)"
    )
    ap.add_argument(
        "--stat-cache",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        default=(1040, 1105, 65),
        help="``stats``: SLOTS,CAPACITY,STEPS (default: batch 8 x 4K at r = 0.25, k = 65)",
    )
    ap.add_argument(
        "--stat-names",
        type=lambda t: tuple(t.split(",")),
        default=kvcache.STAT_NAMES,
        help="``stats``: the statistics the policy row carries (default: all six)",
    )
    ap.add_argument("--out", type=Path, help="``all``: also write the Markdown report here")
    args = ap.parse_args()
    if args.what == "bandwidth":
        print(bandwidth())
        return
    model = jaxkv.load("smollm2-135m")
    if args.dtype == "int8":
        model = Int8Model(model)
    elif args.dtype == "out-first":
        model = OutFirstModel(model)
    if args.what == "profile":
        model = _with_config(model, attention=args.attention, matmul=args.matmul)
        print(
            profile_table(
                *profile(
                    model,
                    args.impl,
                    args.batch,
                    args.context,
                    args.stats,
                    kv_dtype=args.kv_dtype,
                ),
                args.top,
            )
        )
    elif args.what == "parity":
        parity(model)
    elif args.what == "kvcompare":
        print(open("/proc/loadavg").read().strip())
        for b, ctx, old, new, up in kv_compare(model, args.kv_dtype, args.decode, args.reps):
            print(f"batch {b} context {ctx}: old {old:.1f} ms, new {new:.1f} ms, paired {up:.3f}x")
        print(open("/proc/loadavg").read().strip())
    elif args.what == "attnshare":
        print(open("/proc/loadavg").read().strip())
        for b, ctx, w, wo, d in attention_share(model, args.kv_dtype, args.decode, args.reps):
            print(
                f"batch {b} context {ctx}: {w:.1f} ms, without cache attention {wo:.1f} ms,"
                f" attention {d:.1f} ms ({100 * d / w:.0f} %)"
            )
        print(open("/proc/loadavg").read().strip())
    elif args.what == "stats":
        print(open("/proc/loadavg").read().strip())
        slots, capacity, steps = args.stat_cache
        sets = {"none": (), "policy": args.stat_names, "h2o": ("attn_cum",)}
        rows = stats_cost(model, args.batch, slots, capacity, steps, sets, args.reps)
        print(f"batch {args.batch}, {slots} of {capacity} slots, {steps} fused steps; ms/step")
        for k, (ms, d) in rows.items():
            print(f"{k:14s} {ms:7.2f}  statistics {d:+6.2f} ({100 * d / ms:5.1f} % of the step)")
        print(open("/proc/loadavg").read().strip())
    elif args.what == "pvlayout":
        print(open("/proc/loadavg").read().strip())
        rows = ((8, 1041, "int8"), (1, 4160, "float32"))
        for b, slots, dtype, ms, diff in pv_layout(model, rows, args.reps):
            times = ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
            print(
                f"batch {b}, {slots} {dtype} slots, {len(ms)} forms: {times}; max |diff| {diff:.1e}"
            )
        print(open("/proc/loadavg").read().strip())
    elif args.what == "perlayer":
        print(open("/proc/loadavg").read().strip())
        for b, ctx, lib, per, up, diff, copies in per_layer(model, args.decode, args.reps):
            print(
                f"batch {b} context {ctx}: library {lib:.1f} ms, per-layer buffers (two calls)"
                f" {per:.1f} ms, paired {up:.3f}x; max |dlogit| {diff:.1e}; the one-call"
                f" per-layer step copies the cache {copies} times"
            )
        print(open("/proc/loadavg").read().strip())
    elif args.what == "kernel":
        print(open("/proc/loadavg").read().strip())
        for b, ctx, x, k, mb, gbs in kernel_piece(
            model.config, args.decode, args.reps, args.kv_dtype
        ):
            print(
                f"attention alone, batch {b} context {ctx} ({mb:.0f} MB of KV): xla {x:.2f} ms,"
                f" kernel {k:.2f} ms ({gbs:.1f} GB/s)"
            )
        for b, ctx, x, k, up in kernel_compare(model, args.kv_dtype, args.decode, args.reps):
            print(
                f"decode step, batch {b} context {ctx}: xla {x:.1f} ms, kernel {k:.1f} ms,"
                f" paired {up:.3f}x"
            )
        print(open("/proc/loadavg").read().strip())
    elif args.what == "prefill":
        print(open("/proc/loadavg").read().strip())
        for b, n, x, k, gflops in prefill_piece(model.config, args.prefill, args.reps):
            print(
                f"prompt attention alone, batch {b}, {n} tokens, 30 layers: xla {x:.1f} ms,"
                f" kernel {k:.1f} ms ({gflops:.0f} GFLOP/s)"
            )
        for b, n, x, k, up in prefill_compare(model, args.prefill, args.reps):
            print(
                f"prefill, batch {b}, {n} tokens: xla {x:.0f} ms ({b * n / x * 1e3:.0f} tokens/s),"
                f" kernel {k:.0f} ms ({b * n / k * 1e3:.0f} tokens/s), paired {up:.3f}x"
            )
        print(open("/proc/loadavg").read().strip())
    elif args.what == "matmul":
        print(open("/proc/loadavg").read().strip())
        for name, (ms, gbs) in matmul_piece(model, args.batch, args.reps).items():
            print(f"weights alone, {args.batch} rows, {name}: {ms:.2f} ms ({gbs:.1f} GB/s)")
        print(open("/proc/loadavg").read().strip())
    elif args.what == "hugepages":
        print(open("/proc/loadavg").read().strip())
        mb, rows = hugepages_compare(
            args.decode, args.reps, "int8" if args.dtype == "int8" else "float32"
        )
        for b, ctx, small, huge, up in rows:
            print(
                f"decode step, batch {b} context {ctx}, {args.dtype} weights through both kernels:"
                f" 4 KiB pages {small:.1f} ms, huge pages ({mb:.0f} MB) {huge:.1f} ms,"
                f" paired {up:.3f}x"
            )
        print(open("/proc/loadavg").read().strip())
    elif args.what == "compare":
        for r in compare(model, args.reps, args.decode, args.prefill):
            print(r)
    else:
        write_report(model, args)


def write_report(model, args):
    parts = ["# Decode profile (SmolLM2-135M, float32, CPU)", ""]
    for impl in ("old", "new"):
        for batch, ctx, stats in (
            (1, 4096, False),
            (1, 4096, True),
            (1, 1024, False),
            (8, 4096, False),
        ):
            parts += [
                f"## {impl}: B={batch}, context {ctx}, statistics {'on' if stats else 'off'}",
                "",
                profile_table(*profile(model, impl, batch, ctx, stats), args.top),
                "",
            ]
            print(parts[-2], flush=True)
    bw = bandwidth()
    cfg = model.config
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    parts += [
        "## Memory-bandwidth floor",
        "",
        "Streaming read, sum over 1 GiB float32 (median of 7): "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items()),
        "",
        "| batch | context | weights MB | KV MB | floor ms/token at the best rate |",
        "|---|---|---|---|---|",
    ]
    for batch, ctx in ((1, 1024), (1, 4096), (8, 1024), (8, 4096)):
        kv = 2 * cfg.n_layers * batch * cfg.n_kv_heads * ctx * cfg.head_dim * 4
        floor = (weights + kv) / max(bw.values()) / 1e6
        parts.append(f"| {batch} | {ctx} | {weights / 1e6:.0f} | {kv / 1e6:.0f} | {floor:.1f} |")
    parts.append("")
    rows = compare(model, args.reps)
    parts += [
        "## Before / after (in turns, one process)",
        "",
        "| phase | batch | tokens / context | unit | before | after | speed-up | "
        "before, best turn | after, best turn | speed-up, median of paired turns |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, batch, n, unit, old, new, old_best, new_best, paired in rows:
        up = new / old if unit == "tokens/s" else old / new
        parts.append(
            f"| {kind} | {batch} | {n} | {unit} | {old:.1f} | {new:.1f} | {up:.2f}x | "
            f"{old_best:.1f} | {new_best:.1f} | {paired:.2f}x |"
        )
    report = "\n".join(parts) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
