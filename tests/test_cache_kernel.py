"""The compiled CPU attention kernel (``jaxkv.model.cache_kernel``) against a brute-force
float64 reference, and the decoder with ``config.attention="kernel"`` against its XLA
attention: the same logits up to float32 summation order, r = 1 still bit-identical to the
full cache, statistics from the kernel's probabilities, int8 caches' scales folded as XLA
folds them."""

import ctypes
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import kvcache
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import teacher_forced
from jaxkv.model import cache_kernel, decoder, loading
from jaxkv.model.params import init_params

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler to build the kernel with", allow_module_level=True)
if jax.default_backend() != "cpu":
    pytest.skip("the kernel is XLA:CPU's", allow_module_level=True)

# head_dim 64 and G = 3 (SmolLM2's) take the kernel's fixed-size path at T = 1
CFG = ModelConfig.tiny(n_heads=6, n_kv_heads=2, head_dim=64)
KCFG = CFG.replace(attention="kernel")
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
TOL = dict(atol=5e-5, rtol=1e-5)  # another float32 summation order, as out-first weights


def test_the_kernel_builds_here():
    assert cache_kernel.available(), cache_kernel.unavailable_reason()


def reference(q, qpos, keys, values, kpos, layer, window):
    """Brute force in float64: each query row's softmax over the slots it may see (its
    output, maximum score, sum of exponentials and probabilities)."""
    q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
    qpos, kpos = np.asarray(qpos), np.asarray(kpos)
    B, K, G, T, H = q.shape
    o = np.zeros((B, K, G, T, H))
    m = np.full((B, K, G, T), -1e30)
    total = np.zeros((B, K, G, T))
    p_all = np.zeros((B, K, G, T, keys.shape[3]))
    for b, k, g, t in np.ndindex(B, K, G, T):
        p, qp = kpos[layer, b, k], qpos[b, t]
        ok = (p >= 0) & (qp >= 0) & (p <= qp)
        if window:
            ok &= p > qp - window
        if not ok.any():
            continue
        s = keys[layer, b, k][ok] @ q[b, k, g, t] * H**-0.5
        e = np.exp(s - s.max())
        m[b, k, g, t], total[b, k, g, t] = s.max(), e.sum()
        o[b, k, g, t] = e @ values[layer, b, k][ok] / e.sum()
        p_all[b, k, g, t, ok] = e / e.sum()
    return o, m, total, p_all


def random_cache(rng, shape_LBKCH, dtype):
    """A random stacked cache: keys, values, an int8 cache's per-slot scales (as
    kvcache.quantize stores them; else None), the float64 keys and values they stand for, and
    slot positions in shuffled order (as after eviction), some empty, some in the future."""
    L, B, K, C, H = shape_LBKCH
    keys, values = (jnp.asarray(rng.normal(size=shape_LBKCH), dtype) for _ in range(2))
    scales, dense = None, (keys, values)
    if dtype == jnp.int8:
        keys, values = (jnp.asarray(rng.integers(-127, 128, shape_LBKCH), dtype) for _ in "kv")
        scales = tuple(
            jnp.asarray(rng.uniform(0.005, 0.02, (L, B, K, C)), jnp.float32) for _ in "kv"
        )
        dense = [
            np.asarray(x, np.float64) * np.asarray(sc)[..., None]
            for x, sc in zip((keys, values), scales, strict=True)
        ]
    kpos = np.stack([rng.permutation(C) for _ in range(L * B * K)]).reshape(L, B, K, C)
    kpos = np.where(rng.random(kpos.shape) < 0.1, -1, kpos).astype(np.int32)
    return keys, values, scales, dense, kpos


CASES = {  # name: (B, K, G, T, H, C, window, dtype)
    "decode, fixed path": (2, 3, 3, 1, 64, 1030, None, jnp.float32),
    "decode, window": (1, 2, 3, 1, 64, 700, 300, jnp.float32),
    "decode, float16 cache": (2, 3, 3, 1, 64, 1030, None, jnp.float16),
    "Mistral's shape": (1, 2, 4, 1, 128, 513, None, jnp.float32),
    "several tokens, general path": (2, 2, 3, 3, 64, 600, 200, jnp.float32),
    "several tokens, float16": (1, 2, 3, 2, 64, 90, None, jnp.float16),
    "odd head size": (1, 2, 2, 1, 16, 70, None, jnp.float32),
    "decode, int8 cache": (2, 3, 3, 1, 64, 1030, 300, jnp.int8),
    "several tokens, int8": (2, 2, 3, 2, 64, 90, None, jnp.int8),
    # from cache_attention.cc's kFusedPairs (b, k) pairs, one work item per pair with statistics
    "decode, many pairs": (4, 3, 3, 1, 64, 1030, None, jnp.float32),
    "decode, many pairs, int8, window": (3, 3, 3, 1, 64, 700, 300, jnp.int8),
}


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_equals_a_brute_force_softmax(case):
    B, K, G, T, H, C, window, dtype = CASES[case]
    L, layer = 3, 1
    rng = np.random.default_rng(len(case))
    q = jnp.asarray(rng.normal(size=(B, K, G, T, H)), jnp.float32)
    keys, values, scales, dense, kpos = random_cache(rng, (L, B, K, C, H), dtype)
    qpos = np.tile(np.arange(C - T - 20, C - 20, dtype=np.int32), (B, 1))
    if B > 1:
        qpos[-1, -1] = -1  # a padding query sees nothing
    args = (q, jnp.asarray(qpos), keys, values, jnp.asarray(kpos), jnp.int32(layer))
    kw = dict(window=window, scales=scales)
    got = jax.jit(lambda *a: cache_kernel.cache_attention(*a, **kw, probabilities=True))(*args)
    want = reference(q, qpos, *dense, kpos, layer, window)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-6, rtol=2e-5)
    lean = jax.jit(lambda *a: cache_kernel.cache_attention(*a, **kw))(*args)
    for g, w in zip(lean, got[:3], strict=True):  # the same numbers without probabilities
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    o, m, total, _ = (np.asarray(a) for a in got)
    assert (total[:-1] > 0).all()
    if B > 1:
        assert (m[-1, :, :, -1] == np.float32(-1e30)).all() and (total[-1, :, :, -1] == 0).all()
        assert (o[-1, :, :, -1] == 0).all()


def stats_reference(q, qpos, k_new, dense, kpos, layer, window, old, lam):
    """Brute force in float64 of a decode step's statistics (``jaxkv.stats``' definitions):
    each row's softmax over the slots it may see and the new token, means over the G rows of a
    KV head, padding queries contributing nothing; and the rows' entropies."""
    o, m, total, p_cache = reference(q, qpos, *dense, kpos, layer, window)
    B, K, G, _, H = q.shape
    valid = (np.asarray(qpos)[:, 0] >= 0)[:, None, None, None]
    s_new = np.einsum("bkgth,bkh->bkgt", np.asarray(q, np.float64), k_new) * H**-0.5
    top = np.maximum(m, np.where(valid, s_new, -1e30))
    w_cache = total * np.exp(m - top)
    e_new = np.exp(np.where(valid, s_new - top, -np.inf))
    share = w_cache / np.maximum(w_cache + e_new, 1e-300)
    p = p_cache[:, :, :, 0] * share[..., 0, None]  # [B, K, G, C]
    p_new = np.where(valid, e_new / np.maximum(w_cache + e_new, 1e-300), 0.0)[..., 0]
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0).sum(-1)
    ent = -(plogp + np.where(p_new > 0, p_new * np.log(np.where(p_new > 0, p_new, 1)), 0))
    a, a2, ae = ((x * valid).mean(2) for x in (p, p**2, p * ent[..., None]))
    want = {n: np.array(x, np.float64) for n, x in old.items()}
    want["attn"][layer], want["attn_sq"][layer] = a, a2
    want["attn_cum"][layer] += a
    want["recent"][layer] = lam * want["recent"][layer] + a
    want["recent_ent"][layer] = lam * want["recent_ent"][layer] + ae
    return want, ent * valid[..., 0]


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][3] == 1])
def test_statistics_in_place_equal_a_brute_force_reference(case):
    """``cache_attention_stats`` (a decode step's statistics updated inside the kernel, in
    place) against float64 brute force: every statistic of the layer, the rows' entropies,
    the other layers untouched bit for bit, and the output, m and l the lean kernel's."""
    B, K, G, T, H, C, window, dtype = CASES[case]
    L, layer, lam = 3, 1, 0.97
    rng = np.random.default_rng(len(case) + 1)
    q = jnp.asarray(rng.normal(size=(B, K, G, T, H)), jnp.float32)
    k_new = rng.normal(size=(B, K, H)).astype(np.float32)
    keys, values, scales, dense, kpos = random_cache(rng, (L, B, K, C, H), dtype)
    qpos = np.full((B, 1), C - 20, np.int32)
    if B > 1:
        qpos[-1, 0] = -1  # a padding query: no contribution, its recent statistics decay
    old = {
        n: rng.uniform(0, 0.05, (L, B, K, C)).astype(np.float32)
        for n in cache_kernel.STATS_IN_PLACE
    }
    args = (q, jnp.asarray(qpos), jnp.asarray(k_new), keys, values, jnp.asarray(kpos), layer)

    def run(names):
        st = {n: jnp.asarray(old[n]) for n in names}
        return jax.jit(
            lambda *a: cache_kernel.cache_attention_stats(
                *a, st, window=window, lam=lam, scales=scales
            )
        )(*args)

    o, m, total, ent, got = run(cache_kernel.STATS_IN_PLACE)
    want, want_ent = stats_reference(q, qpos, k_new, dense, kpos, layer, window, old, lam)
    np.testing.assert_allclose(np.asarray(ent)[..., 0], want_ent, atol=2e-5, rtol=2e-5)
    for n, w in want.items():
        g = np.asarray(got[n])
        np.testing.assert_allclose(g[layer], w[layer], atol=1e-7, rtol=2e-5, err_msg=n)
        for other in set(range(L)) - {layer}:
            np.testing.assert_array_equal(g[other], old[n][other], err_msg=n)
    lean = cache_kernel.cache_attention(
        q, jnp.asarray(qpos), keys, values, jnp.asarray(kpos), layer, window=window, scales=scales
    )
    for g, w in zip((o, m, total), lean, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # H2O's one statistic alone: the same numbers
    np.testing.assert_array_equal(np.asarray(run(["attn_cum"])[4]["attn_cum"]), got["attn_cum"])


def test_statistics_in_place_take_one_query_and_known_names():
    q = jnp.zeros((1, 1, 2, 2, 64))
    keys = jnp.zeros((2, 1, 1, 8, 64))
    kpos = jnp.zeros((2, 1, 1, 8), jnp.int32)
    st = {"attn_cum": jnp.zeros((2, 1, 1, 8))}
    args = (jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 1, 64)), keys, keys, kpos, 0)
    with pytest.raises(ValueError, match="one query"):
        cache_kernel.cache_attention_stats(q, *args, st, window=None, lam=0.9)
    with pytest.raises(ValueError, match="vnorm"):
        cache_kernel.cache_attention_stats(
            q[:, :, :, :1], *args, {"vnorm": st["attn_cum"]}, window=None, lam=0.9
        )


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("kv_dtype", [None, "float16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_decoding_through_the_kernel_equals_the_xla_attention(batch, kv_dtype, window):
    cfg, kcfg = CFG.replace(sliding_window=window), KCFG.replace(sliding_window=window)
    tokens = TOKENS[:batch]
    want, _ = teacher_forced(PARAMS, tokens, prompt_len=20, config=cfg, kv_dtype=kv_dtype)
    got, _ = teacher_forced(PARAMS, tokens, prompt_len=20, config=kcfg, kv_dtype=kv_dtype)
    # float16: one step's float32 differences can round a new key to the next float16
    tol = TOL if kv_dtype is None else dict(atol=2e-3, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tol)


def test_a_whole_block_of_new_tokens_through_the_kernel():
    """``extend`` with T > 1 (the kernel's general path; the new tokens see each other
    causally) equals the XLA attention."""
    out = []
    for cfg in (CFG, KCFG):
        cache = kvcache.init_cache(cfg, batch_size=2, capacity=40)
        _, cache = decoder.prefill(PARAMS, TOKENS[:, :20], cache, config=cfg)
        logits, _ = decoder.extend(PARAMS, TOKENS[:, 20:27], cache, config=cfg)
        out.append(np.asarray(logits))
    np.testing.assert_allclose(out[1], out[0], **TOL)


@pytest.mark.parametrize("name", ["streaming_llm", "knorm", "h2o", "snapkv"])
def test_ratio_one_equals_the_full_cache_through_the_kernel(name):
    full, _ = teacher_forced(PARAMS, TOKENS, prompt_len=12, config=KCFG)
    comp = Compression.make(name, ratio=1.0)
    got, _ = teacher_forced(PARAMS, TOKENS, prompt_len=12, config=KCFG, compression=comp)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(full))


@pytest.mark.parametrize("granularity", ["shared", "head"])
def test_an_evicted_cache_through_the_kernel_equals_the_xla_attention(granularity):
    """Eviction leaves slots empty and out of order; the kernel reads positions, as XLA does."""
    comp = Compression.make("knorm", ratio=0.5, granularity=granularity)
    want, _ = teacher_forced(PARAMS, TOKENS, prompt_len=12, config=CFG, compression=comp)
    got, _ = teacher_forced(PARAMS, TOKENS, prompt_len=12, config=KCFG, compression=comp)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_statistics_through_the_kernel_equal_the_xla_attention():
    """The kernel returns the slots' probabilities when the cache carries statistics: the
    statistics (all six) and logits equal the XLA attention's, and the logits with statistics
    equal those without, bit for bit (the probabilities never enter the output)."""
    out = {}
    for name, cfg, stats in (("xla", CFG, True), ("kernel", KCFG, True), ("lean", KCFG, False)):
        cache = kvcache.init_cache(cfg, batch_size=2, capacity=40, stats=stats)
        _, cache = decoder.prefill(PARAMS, TOKENS[:, :20], cache, config=cfg)
        logits = []
        for t in range(20, 28):
            lg, cache = decoder.decode_step(PARAMS, TOKENS[:, t], cache, config=cfg)
            logits.append(np.asarray(lg))
        out[name] = np.stack(logits), {n: np.asarray(a) for n, a in cache.stats.items()}
    np.testing.assert_allclose(out["kernel"][0], out["xla"][0], **TOL)
    np.testing.assert_array_equal(out["kernel"][0], out["lean"][0])
    assert set(out["kernel"][1]) == set(kvcache.STAT_NAMES)
    for n, a in out["xla"][1].items():
        np.testing.assert_allclose(out["kernel"][1][n], a, atol=1e-5, rtol=1e-4, err_msg=n)


@pytest.mark.parametrize("name", ["streaming_llm", "h2o"])
def test_an_int8_cache_through_the_kernel_equals_the_xla_attention(name):
    """The kernel folds an int8 cache's scales as the XLA attention does (key scales into the
    scores, value scales into the probabilities' weights), with and without statistics."""
    comp = Compression.make(name, ratio=0.5)
    kw = dict(prompt_len=12, compression=comp, kv_dtype="int8")
    want, _ = teacher_forced(PARAMS, TOKENS, config=CFG, **kw)
    got, _ = teacher_forced(PARAMS, TOKENS, config=KCFG, **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_scales_go_with_an_int8_cache_only():
    q = jnp.zeros((1, 1, 1, 1, 64))
    keys = jnp.zeros((1, 1, 1, 8, 64), jnp.int8)
    args = (q, jnp.zeros((1, 1), jnp.int32), keys, keys, jnp.zeros((1, 1, 1, 8), jnp.int32), 0)
    with pytest.raises(ValueError, match="int8 cache needs its scales"):
        cache_kernel.cache_attention(*args, window=None)


def test_an_unavailable_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cache_kernel, "_load", lambda: (False, "no C++ compiler"))
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=8)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler.*attention=.xla."):
        decoder.decode_step(PARAMS, jnp.zeros((1,), jnp.int32), cache, config=KCFG)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler.*attention=.xla."):
        decoder.prefill(PARAMS, jnp.zeros((1, 4), jnp.int32), cache, config=KCFG)


def test_the_shipped_source_builds_on_a_fresh_machine(tmp_path):
    """What a first use does where no build is cached: compile the shipped sources, then load
    every FFI symbol the module registers."""
    out = tmp_path / "kernel.so"
    cache_kernel._compile(cache_kernel.SOURCES, out)
    lib = ctypes.cdll.LoadLibrary(str(out))
    for symbol in cache_kernel._SYMBOLS.values():
        assert getattr(lib, symbol)
    assert [p.name for p in tmp_path.iterdir()] == ["kernel.so"]  # no temporary file left


def test_a_failed_build_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    out = tmp_path / "kernel.so"
    with pytest.raises(RuntimeError, match="failed"):
        cache_kernel._compile(cache_kernel.SOURCES, out)
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_attention_is_rejected_before_loading():
    with pytest.raises(ValueError, match="attention"):
        CFG.replace(attention="flash")
    with pytest.raises(ValueError, match="attention must be one of"):
        loading.load_model("no-such-model", attention="flash")
