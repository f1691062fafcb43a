"""The compiled prefill attention kernel (``cache_kernel.causal_attention``) against a
brute-force float64 causal softmax, on this CPU's own build and on the other vector width's
(AVX2 and AVX-512 builds of the shipped source, where this CPU runs them), and the decoder's
prompt pass with ``config.attention="kernel"`` against its XLA blocks."""

import ctypes
import platform
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import kvcache
from jaxkv.config import ModelConfig
from jaxkv.model import cache_kernel, decoder, layers
from jaxkv.model.params import init_params

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler to build the kernel with", allow_module_level=True)
if jax.default_backend() != "cpu":
    pytest.skip("the kernel is XLA:CPU's", allow_module_level=True)

SOURCE = Path(cache_kernel.__file__).parent / "csrc" / "causal_attention.cc"
TOL = dict(atol=2e-5, rtol=1e-5)


def reference(q, k, v, pos, window):
    """Each query row's softmax over the keys it may see, in float64 (zero when none)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    pos = np.asarray(pos)
    B, K, G, T, H = q.shape
    out = np.zeros(q.shape)
    for b, kh in np.ndindex(B, K):
        see = (pos[b, None, :] >= 0) & (pos[b, :, None] >= 0) & (pos[b, None, :] <= pos[b, :, None])
        if window:
            see &= pos[b, None, :] > pos[b, :, None] - window
        s = q[b, kh] @ k[b, kh].T * H**-0.5  # [G, T, T]
        s = np.where(see, s, -np.inf)
        top = np.max(s, axis=-1, keepdims=True)
        e = np.where(see, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
        total = e.sum(-1, keepdims=True)
        out[b, kh] = np.where(total > 0, e @ v[b, kh] / np.maximum(total, 1e-300), 0.0)
    return out


CASES = {  # name: (B, K, G, T, H, window, prompt lengths or None)
    "one group": (1, 3, 3, 5, 64, None, None),
    "SmolLM2's heads, blocks and a tail": (1, 3, 3, 203, 64, None, None),
    "padded prompts": (3, 2, 3, 77, 64, None, (77, 50, 1)),
    "sliding window": (1, 2, 2, 150, 64, 37, None),
    "window and padding": (2, 2, 3, 90, 64, 16, (90, 41)),
    "Mistral's head size": (1, 2, 4, 70, 128, None, (60,)),
}


def inputs(B, K, G, T, H, lengths, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((B, K, G, T, H)) * 2, jnp.float32)
    k = jnp.asarray(r.standard_normal((B, K, T, H)) * 2, jnp.float32)
    v = jnp.asarray(r.standard_normal((B, K, T, H)), jnp.float32)
    pos = decoder.prompt_positions(
        jnp.zeros((B, T), jnp.int32), None if lengths is None else jnp.asarray(lengths)
    )
    return q, k, v, pos


@pytest.mark.parametrize("case", CASES)
def test_the_kernel_equals_a_brute_force_causal_softmax(case):
    B, K, G, T, H, window, lengths = CASES[case]
    q, k, v, pos = inputs(B, K, G, T, H, lengths)
    got = np.asarray(cache_kernel.causal_attention(q, k, v, pos, window=window))
    want = reference(q, k, v, pos, window)
    np.testing.assert_allclose(got, want, **TOL)
    padded = np.asarray(pos) < 0
    assert (got.transpose(0, 3, 1, 2, 4)[padded] == 0).all()  # padding sees nothing


def test_the_kernel_equals_the_xla_blocks():
    """The XLA blocks (``layers.causal_block_attention``) are what the kernel replaces."""
    q, k, v, pos = inputs(2, 3, 3, 300, 64, (300, 123), seed=1)
    want, _ = layers.causal_block_attention(q, k, v, pos, window=None, block=128)
    got = cache_kernel.causal_attention(q, k, v, pos, window=None)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize(
    "march, flag", [("x86-64-v3", "avx2"), ("x86-64-v4", "avx512f")], ids=["avx2", "avx512"]
)
def test_each_vector_width_equals_the_brute_force(march, flag, tmp_path):
    """The shipped source built for 8 lanes (AVX2) and for 16 (AVX-512), run where this CPU
    can: both code paths are checked on one machine, whichever it is."""
    if platform.machine() != "x86_64" or flag not in cache_kernel._cpu_flags().split():
        pytest.skip(f"this CPU cannot run a {march} build")
    out = tmp_path / f"causal_{flag}.so"
    cache_kernel._compile((SOURCE,), out, march=march)
    lib = ctypes.cdll.LoadLibrary(str(out))
    target = f"jaxkv_test_causal_attention_{flag}"
    jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(lib.JaxkvCausalAttentionF32), platform="cpu"
    )
    for name in ("padded prompts", "window and padding", "Mistral's head size"):
        B, K, G, T, H, window, lengths = CASES[name]
        q, k, v, pos = inputs(B, K, G, T, H, lengths, seed=2)
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        got = call(q, k, v, pos, window=np.int64(window or 0), scale=np.float32(H**-0.5))
        np.testing.assert_allclose(np.asarray(got), reference(q, k, v, pos, window), **TOL)


def test_an_unsupported_head_size_is_refused():
    q, k, v, pos = inputs(1, 1, 2, 8, 16, None)
    assert not cache_kernel.prefill_supported(q)
    with pytest.raises(ValueError, match="H % 64"):
        cache_kernel.causal_attention(q, k, v, pos, window=None)


CFG = ModelConfig.tiny(n_heads=6, n_kv_heads=2, head_dim=64)
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
TOKENS = jax.random.randint(jax.random.key(1), (2, 100), 0, CFG.vocab_size)


@pytest.mark.parametrize("window", [None, 24])
def test_a_prompt_through_the_kernel_equals_the_xla_blocks(window):
    """``prefill`` with ``attention="kernel"``: the same logits and cache (up to float32
    summation order) as XLA's blocks, padded prompts included."""
    lengths = jnp.asarray([100, 61])
    out = []
    for attention in ("xla", "kernel"):
        cfg = CFG.replace(sliding_window=window, attention=attention)
        cache = kvcache.init_cache(cfg, batch_size=2, capacity=100)
        logits, cache = decoder.prefill(PARAMS, TOKENS, cache, config=cfg, lengths_B=lengths)
        out.append((np.asarray(logits), np.asarray(cache.k), np.asarray(cache.v)))
    for got, want in zip(out[1], out[0], strict=True):
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=1e-5)


def test_statistics_leave_the_kernel_output_alone():
    """With statistics the prompt's attention still comes from the kernel (the statistics
    from XLA's blocks): the cache holds the same keys and values, bit for bit, as without."""
    cfg = CFG.replace(attention="kernel")
    caches = []
    for stats in (False, True):
        cache = kvcache.init_cache(cfg, batch_size=2, capacity=100, stats=stats)
        logits, cache = decoder.prefill(PARAMS, TOKENS, cache, config=cfg)
        caches.append((np.asarray(logits), np.asarray(cache.k), np.asarray(cache.v)))
        if stats:
            xla = CFG.replace(attention="xla")
            ref = kvcache.init_cache(xla, batch_size=2, capacity=100, stats=True)
            _, ref = decoder.prefill(PARAMS, TOKENS, ref, config=xla)
            for n, a in ref.stats.items():
                np.testing.assert_allclose(
                    np.asarray(cache.stats[n]), np.asarray(a), atol=1e-5, rtol=1e-4, err_msg=n
                )
    for a, b in zip(*caches, strict=True):
        np.testing.assert_array_equal(a, b)
