"""Compiled CPU kernels: for decode steps, attention over one layer of the stacked KV cache
(``cache_attention``) and few-row matmuls with one layer of the stacked weights
(``stacked_matmul``), each reading the stacked arrays in place; for prompts, causal
self-attention without T x T scores in memory (``causal_attention``).

XLA:CPU reads the cache at about half the machine's memory bandwidth in a decode step: the
score dots of the G query heads of a KV head each read that head's keys (G passes), and the
value dot copies each layer's values out of the stacked cache before reading them
(results/profile_decode.md). ``csrc/cache_attention.cc`` (an XLA FFI target) reads every
cached key and value once, for all the query rows of its KV head, straight out of the stacked
``[L, B, K, C, H]`` arrays, with the layer index as an operand (so nothing is sliced or
copied), on XLA's intra-op threads; in a decode step it can also update the layer's attention
statistics in place (``cache_attention_stats``), so their probabilities never go through
memory and XLA never merges the stacked statistics. ``csrc/stacked_matmul.cc`` does the same
for the weights of a decode step with 1-16 rows (a batch of sequences), where XLA:CPU copies
each layer's slice of the stacked weights out before its dot
(``jaxkv.model.weights_int8.LayerWeight``). ``csrc/drop_lowest.cc`` is eviction's selection
(``drop_lowest``: each row's lowest-scored slots freed in place, in one pass).
XLA computes a prompt's attention in blocks of queries whose scores go through memory
several times (``layers.causal_block_attention``); ``csrc/causal_attention.cc`` keeps each
group of queries' scores in registers and its softmax online, and masks only the blocks on
the diagonal (results/profile_decode.md, "Session 45").

The kernels are built (one library) on first use (about 10 s) with the machine's C++
compiler (``$CXX``, else ``c++``), for the machine's own CPU, into
``jaxkv.paths.cache_dir()/kernels`` (``~/.cache/jaxkv`` unless ``$JAXKV_CACHE_DIR`` says
otherwise), keyed by the sources, jaxlib's version and the CPU's flags; a build is written to
a temporary file and renamed, so an interrupted build leaves nothing half-written. Without a
compiler, or off CPU, ``available()`` is False (``unavailable_reason()`` says why) and
``config.attention="kernel"`` or ``config.matmul="kernel"`` is an error; the defaults,
``"xla"``, never need the kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxkv.paths import cache_dir

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cc")))
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))
"""What the sources include (``csrc/simd.h``): part of the build key, not compiled alone."""
_SUFFIX = {jnp.dtype(jnp.float32): "f32", jnp.dtype(jnp.float16): "f16", jnp.dtype(jnp.int8): "s8"}
_SYMBOLS = (
    {  # FFI target: the library's symbol
        f"jaxkv_cache_attention{probs}_{t}": f"JaxkvCacheAttention{probs.title()[1:]}{t.upper()}"
        for t in _SUFFIX.values()
        for probs in ("", "_probs", "_stats")
    }
    | {f"jaxkv_stacked_matmul_{t}": f"JaxkvStackedMatmul{t.upper()}" for t in ("f32", "s8")}
    | {"jaxkv_causal_attention_f32": "JaxkvCausalAttentionF32"}
    | {"jaxkv_drop_lowest": "JaxkvDropLowest"}
)
DTYPES = tuple(_SUFFIX)
"""Cache storage dtypes the kernel reads (others keep the XLA attention)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(sources: bytes) -> str:
    h = hashlib.sha256(sources)
    h.update(jaxlib.__version__.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def _kernel_dir() -> Path:
    return cache_dir() / "kernels"


def _compile(sources: tuple[Path, ...], out: Path, *, march: str = "native") -> None:
    """Builds ``sources`` into the shared library ``out`` for ``-march=march`` (the
    machine's own CPU; tests build other vector widths)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler ($CXX, c++ or g++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [
        cxx,
        "-O3",
        f"-march={march}",
        "-fopenmp-simd",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        "-I",
        jax.ffi.include_dir(),
        *map(str, sources),
        "-o",
        tmp,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def _load() -> tuple[bool, str]:
    """Builds (once per machine) and registers the kernels: (available, why not)."""
    if jax.default_backend() != "cpu":
        return False, f"the kernel is for the CPU backend, not {jax.default_backend()}"
    key = _build_key(b"".join(p.name.encode() + p.read_bytes() for p in SOURCES + HEADERS))
    lib_path = _kernel_dir() / f"kernels_{key}.so"
    try:
        if not lib_path.exists():
            _compile(SOURCES, lib_path)
        lib = ctypes.cdll.LoadLibrary(str(lib_path))
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), "cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return False, str(e)
    return True, ""


def available() -> bool:
    """Whether the compiled kernels can run here (builds them on first call)."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


def supports(dtype) -> bool:
    return jnp.dtype(dtype) in _SUFFIX


def _scale_args(keys_LBKCH, scales) -> tuple:
    """An int8 cache's key and value scales as the kernel's float32 arguments (none for a
    float cache); a ValueError unless scales come with an int8 cache and only with one."""
    if (scales is None) != (keys_LBKCH.dtype != jnp.int8):
        raise ValueError("an int8 cache needs its scales, and only an int8 cache has them")
    return () if scales is None else tuple(s.astype(jnp.float32) for s in scales)


def cache_attention(
    q_BKGTH,
    pos_BT,
    keys_LBKCH,
    values_LBKCH,
    kpos_LBKC,
    layer,
    *,
    window,
    scales=None,
    probabilities=False,
):
    """Attention of the queries over layer ``layer``'s cache slots, the keys and values read
    in place out of the stacked arrays.

    Args:
        q_BKGTH: rotated queries (float32).
        pos_BT: the queries' positions (-1: padding).
        keys_LBKCH, values_LBKCH: the whole stacked cache (float32, float16 or int8).
        kpos_LBKC: the slots' positions (-1: empty).
        layer: the layer index (a traced int32 scalar inside the layer scan).
        window: the sliding window (None: none).
        scales: an int8 cache's per-slot key and value scales ([L, B, K, C] each; None for a
            float cache): a slot's key scale multiplies its scores, its value scale its
            probability's weight on its value, as ``decoder._cached_attention`` folds them.
        probabilities: also return the probabilities of the slots.

    Returns:
        The output over the cache normalized by its own softmax [B, K, G, T, H], each row's
        maximum score m and sum of exp(s - m) l [B, K, G, T] (m = -1e30, l = 0 for a row that
        sees no slot), so the caller can merge in other keys; with ``probabilities``, then
        the probabilities of the slots [B, K, G, T, C] (normalized over the slots).
    """
    ok, why = _load()
    if not ok:
        raise RuntimeError(f"the cache attention kernel is unavailable: {why}")
    B, K, G, T, H = q_BKGTH.shape
    R = G * T
    q = q_BKGTH.astype(jnp.float32).reshape(B, K, R, H)
    C = keys_LBKCH.shape[3]
    out_types = [
        jax.ShapeDtypeStruct((B, K, R, H), jnp.float32),
        jax.ShapeDtypeStruct((B, K, R), jnp.float32),
        jax.ShapeDtypeStruct((B, K, R), jnp.float32),
    ]
    if probabilities:
        out_types.append(jax.ShapeDtypeStruct((B, K, R, C), jnp.float32))
    target = f"jaxkv_cache_attention{'_probs' if probabilities else ''}"
    call = jax.ffi.ffi_call(
        f"{target}_{_SUFFIX[jnp.dtype(keys_LBKCH.dtype)]}", out_types, vmap_method="sequential"
    )
    o, top, total, *p = call(
        q,
        pos_BT.astype(jnp.int32),
        keys_LBKCH,
        values_LBKCH,
        kpos_LBKC.astype(jnp.int32),
        *_scale_args(keys_LBKCH, scales),
        jnp.asarray(layer, jnp.int32).reshape(1),
        window=np.int64(window or 0),
        scale=np.float32(H**-0.5),
    )
    out = (o.reshape(B, K, G, T, H), top.reshape(B, K, G, T), total.reshape(B, K, G, T))
    return (*out, p[0].reshape(B, K, G, T, C)) if probabilities else out


STATS_IN_PLACE = ("attn", "attn_sq", "attn_cum", "recent", "recent_ent")
"""The attention statistics ``cache_attention_stats`` updates in place, in the order of the
kernel's ``which`` bits (``jaxkv.stats`` defines them)."""


def cache_attention_stats(
    q_BKGTH,
    pos_BT,
    k_new_BKH,
    keys_LBKCH,
    values_LBKCH,
    kpos_LBKC,
    layer,
    stats,
    *,
    window,
    lam,
    scales=None,
):
    """``cache_attention`` of a decode step (one query per sequence) that also updates layer
    ``layer``'s attention statistics in place, from the probabilities over the cache and the
    new token (whose rotated key ``k_new_BKH`` [B, K, H] the kernel scores itself): no
    probabilities go through memory, and the stacked statistics are rewritten only in their
    layer's slice (the outputs alias the inputs, so XLA updates the scan's carry in place).

    Args:
        stats: {name: stacked [L, B, K, C] float32} for names in ``STATS_IN_PLACE``, as
            ``jaxkv.stats.merge`` of ``jaxkv.stats.contributions`` would leave them after the
            step, up to float32 rounding: ``attn``/``attn_sq`` replaced, ``attn_cum`` added to,
            ``recent``/``recent_ent`` decayed by ``lam`` (``stats.decay(window)``) first.
        window, scales: as ``cache_attention``.

    Returns:
        The output over the cache, m and l (as ``cache_attention``), each row's entropy over
        the cache and the new token [B, K, G, 1] (for the new token's own ``recent_ent``),
        and the updated statistics.
    """
    ok, why = _load()
    if not ok:
        raise RuntimeError(f"the cache attention kernel is unavailable: {why}")
    B, K, G, T, H = q_BKGTH.shape
    if T != 1:
        raise ValueError(f"statistics in place need one query per sequence, not {T}")
    unknown = set(stats) - set(STATS_IN_PLACE)
    if unknown:
        raise ValueError(f"no in-place update for {sorted(unknown)}")
    names = [n for n in STATS_IN_PLACE if n in stats]
    arrays = [stats[n].astype(jnp.float32) for n in names]
    head = (
        q_BKGTH.astype(jnp.float32).reshape(B, K, G, H),
        pos_BT.astype(jnp.int32),
        keys_LBKCH,
        values_LBKCH,
        kpos_LBKC.astype(jnp.int32),
        *_scale_args(keys_LBKCH, scales),
        k_new_BKH.astype(jnp.float32),
        jnp.asarray(layer, jnp.int32).reshape(1),
    )
    rows = jax.ShapeDtypeStruct((B, K, G), jnp.float32)
    out_types = [jax.ShapeDtypeStruct((B, K, G, H), jnp.float32), rows, rows, rows]
    out_types += [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in arrays]
    call = jax.ffi.ffi_call(
        f"jaxkv_cache_attention_stats_{_SUFFIX[jnp.dtype(keys_LBKCH.dtype)]}",
        out_types,
        vmap_method="sequential",
        input_output_aliases={len(head) + i: 4 + i for i in range(len(names))},
    )
    o, top, total, ent, *new = call(
        *head,
        *arrays,
        window=np.int64(window or 0),
        scale=np.float32(H**-0.5),
        lam=np.float32(lam),
        which=np.int64(sum(1 << STATS_IN_PLACE.index(n) for n in names)),
    )
    rows4 = (B, K, G, T)
    return (
        o.reshape(B, K, G, T, H),
        top.reshape(rows4),
        total.reshape(rows4),
        ent.reshape(rows4),
        dict(zip(names, new, strict=True)),
    )


def prefill_supported(q_BKGTH) -> bool:
    """Whether ``causal_attention`` takes these queries: float32, a head dimension that is a
    multiple of 64 (at most 256)."""
    H = q_BKGTH.shape[-1]
    return q_BKGTH.dtype == jnp.float32 and H % 64 == 0 and H <= 256


def causal_attention(q_BKGTH, k_BKTH, v_BKTH, pos_BT, *, window):
    """Causal self-attention of a prompt (``csrc/causal_attention.cc``): the output of
    ``jaxkv.model.layers.causal_block_attention`` without statistics, flash-style (no
    T x T scores in memory, only the blocks on the diagonal masked).

    Args:
        q_BKGTH: rotated queries (float32, ``prefill_supported``).
        k_BKTH, v_BKTH: the prompt's rotated keys and its values (float32).
        pos_BT: slot t's position: t, or -1 for padding (``decoder.prompt_positions``).
        window: the sliding window (None: none).

    Returns:
        The attention output [B, K, G, T, H]; zero for a query that sees no key.
    """
    ok, why = _load()
    if not ok:
        raise RuntimeError(f"the causal attention kernel is unavailable: {why}")
    if not prefill_supported(q_BKGTH):
        raise ValueError(
            "causal_attention takes float32 queries with H % 64 == 0 (at most 256), not "
            f"{q_BKGTH.dtype} with H = {q_BKGTH.shape[-1]}"
        )
    H = q_BKGTH.shape[-1]
    out = jax.ShapeDtypeStruct(q_BKGTH.shape, jnp.float32)
    call = jax.ffi.ffi_call("jaxkv_causal_attention_f32", out, vmap_method="sequential")
    return call(
        q_BKGTH,
        k_BKTH.astype(jnp.float32),
        v_BKTH.astype(jnp.float32),
        pos_BT.astype(jnp.int32),
        window=np.int64(window or 0),
        scale=np.float32(H**-0.5),
    )


MATMUL_ROWS = (1, 16)
"""Rows of ``x`` (sequences x new tokens) for which a decode step's out-first float32 or int8
weights go through ``stacked_matmul``; many rows (prefill) are XLA's blocked matmuls. From one
row: at batch 1 the kernel reads each output channel's weights whole, one sequential stream
per work item, ahead of XLA's fused loop (session 50: a batch-1 step 1.12-1.19x faster with
float32 weights, where the kernel's 8-row tiles had tied XLA; int8 weights took the kernel
from one row since session 48)."""


def stacked_matmul(x_TI, values_LOI, layer, scales_LO1=None):
    """``x @ w[layer].T`` (float32 [T, O]) for a stacked weight ``w`` stored output channels
    first, read in place (nothing sliced or copied).

    Args:
        x_TI: the rows (float32).
        values_LOI: float32 weights, or int8 values whose ``scales_LO1`` (float32, one per
            layer and output channel) multiply their outputs.
        layer: the layer index (a traced int32 scalar inside the layer scan).
    """
    ok, why = _load()
    if not ok:
        raise RuntimeError(f"the stacked matmul kernel is unavailable: {why}")
    if (scales_LO1 is None) != (values_LOI.dtype != jnp.int8):
        raise ValueError("int8 weights need their scales, and only int8 weights have them")
    if values_LOI.dtype not in (jnp.int8, jnp.float32):
        raise ValueError(f"stacked_matmul reads float32 or int8 weights, not {values_LOI.dtype}")
    shape = (x_TI.shape[0], values_LOI.shape[1])
    target = f"jaxkv_stacked_matmul_{'s8' if scales_LO1 is not None else 'f32'}"
    out = jax.ShapeDtypeStruct(shape, jnp.float32)
    call = jax.ffi.ffi_call(target, out, vmap_method="sequential")
    scales = () if scales_LO1 is None else (scales_LO1.astype(jnp.float32),)
    return call(
        x_TI.astype(jnp.float32), values_LOI, *scales, jnp.asarray(layer, jnp.int32).reshape(1)
    )


def drop_lowest(scores_LBKC, pos_LBKC, keep_LBK, *, max_drop: int):
    """Eviction's selection in place (``csrc/drop_lowest.cc``): each row's positions with its
    ``min(occupied - keep, max_drop)`` lowest-scored occupied slots freed (-1), the slots
    ``jaxkv.eviction.drop_mask`` picks (ties to the lower slot index; its order of NaN
    scores), one pass over each row on XLA's threads.

    Args:
        scores_LBKC: float scores, one per slot ([..., C]).
        pos_LBKC: the slots' positions (-1: empty), the same shape.
        keep_LBK: int, how many occupied slots each row keeps.
        max_drop: at most this many slots freed per row (static).
    """
    ok, why = _load()
    if not ok:
        raise RuntimeError(f"the eviction kernel is unavailable: {why}")
    if scores_LBKC.shape != pos_LBKC.shape or keep_LBK.shape != pos_LBKC.shape[:-1]:
        raise ValueError(
            f"scores {scores_LBKC.shape}, positions {pos_LBKC.shape} and budgets "
            f"{keep_LBK.shape}: [..., C], [..., C] and [...]"
        )
    call = jax.ffi.ffi_call(
        "jaxkv_drop_lowest",
        jax.ShapeDtypeStruct(pos_LBKC.shape, jnp.int32),
        vmap_method="sequential",
        input_output_aliases={1: 0},
    )
    return call(
        scores_LBKC.astype(jnp.float32),
        pos_LBKC.astype(jnp.int32),
        keep_LBK.astype(jnp.int32),
        max_drop=np.int64(max_drop),
    )
