"""The compiled few-row matmul (``cache_kernel.stacked_matmul``) against a float64 brute force,
and decoding with ``config.matmul="kernel"`` against the XLA matmuls: the same logits up to
float32 summation order (out-first float32 and int8 weights, tied and untied heads), r = 1
still bit-identical to the full cache, prefill untouched, clear errors."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import kvcache
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import teacher_forced
from jaxkv.model import cache_kernel, decoder, loading
from jaxkv.model import weights_int8 as weights_lib
from jaxkv.model.params import init_params

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler to build the kernel with", allow_module_level=True)
if jax.default_backend() != "cpu":
    pytest.skip("the kernel is XLA:CPU's", allow_module_level=True)

CFG = ModelConfig.tiny(n_heads=6, n_kv_heads=2, head_dim=16)
MCFG = CFG.replace(matmul="kernel")
FLOAT = init_params(CFG, key=jax.random.key(0), scale=0.2)
WEIGHTS = {  # out-first float32 and int8: the layouts the kernel reads
    "out-first": weights_lib.transpose_params(FLOAT),
    "int8": weights_lib.quantize_params(FLOAT),
}
TOKENS = jax.random.randint(jax.random.key(1), (4, 30), 0, CFG.vocab_size)
TOL = dict(atol=5e-5, rtol=1e-5)  # another float32 summation order


def brute_force(x, values, layer, scales):
    w = np.asarray(values[layer], np.float64)
    if scales is not None:
        w = w * np.asarray(scales[layer], np.float64)
    return np.asarray(x, np.float64) @ w.T


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 17])
# (O, I): odd sizes (one row: a four-vector loop, a vector tail and a scalar tail), SmolLM2's wk
@pytest.mark.parametrize("shape", [(37, 45), (9, 100), (192, 576)])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_kernel_equals_a_brute_force_product(rows, shape, dtype):
    O, I = shape
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.normal(size=(rows, I)), jnp.float32)
    scales = None
    if dtype == "int8":
        values = jnp.asarray(rng.integers(-128, 128, (3, O, I)), jnp.int8)
        scales = jnp.asarray(rng.uniform(0.001, 0.01, (3, O, 1)), jnp.float32)
    else:
        values = jnp.asarray(rng.normal(size=(3, O, I)), jnp.float32)
    for layer in range(3):
        got = jax.jit(cache_kernel.stacked_matmul)(x, values, jnp.int32(layer), scales)
        want = brute_force(x, values, layer, scales)
        scale = np.abs(want).max()
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-6 * scale, rtol=1e-5)


def test_int8_weights_need_their_scales():
    x, values = jnp.zeros((2, 8)), jnp.zeros((1, 4, 8), jnp.int8)
    with pytest.raises(ValueError, match="need their scales"):
        cache_kernel.stacked_matmul(x, values, 0)
    with pytest.raises(ValueError, match="float32 or int8"):
        cache_kernel.stacked_matmul(x, values.astype(jnp.float16), 0)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_decoding_a_batch_through_the_kernel_equals_xla(weights, tie):
    """Batch 4 (4 rows per step: every projection and the head through the kernel)."""
    cfg = CFG.replace(tie_embeddings=tie)
    params = FLOAT if tie else {**FLOAT, "lm_head": FLOAT["embed"].T * 0.5}
    params = (
        weights_lib.transpose_params(params)
        if weights == "out-first"
        else weights_lib.quantize_params(params)
    )
    want, _ = teacher_forced(params, TOKENS, prompt_len=12, config=cfg)
    got, _ = teacher_forced(params, TOKENS, prompt_len=12, config=cfg.replace(matmul="kernel"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_a_block_of_new_tokens_through_the_kernel():
    """``extend`` with 2 x 3 rows (T > 1) through the kernel equals XLA's."""
    params = WEIGHTS["out-first"]
    out = []
    for cfg in (CFG, MCFG):
        cache = kvcache.init_cache(cfg, batch_size=2, capacity=40)
        _, cache = decoder.prefill(params, TOKENS[:2, :20], cache, config=cfg)
        logits, _ = decoder.extend(params, TOKENS[:2, 20:23], cache, config=cfg)
        out.append(np.asarray(logits))
    np.testing.assert_allclose(out[1], out[0], **TOL)


def test_prefill_is_xla_bit_for_bit():
    """Outside ``MATMUL_ROWS`` nothing changes: a prompt's prefill gives the XLA matmuls'
    logits exactly."""
    params = WEIGHTS["out-first"]
    out = []
    for cfg in (CFG, MCFG):
        cache = kvcache.init_cache(cfg, batch_size=2, capacity=40)
        logits, _ = decoder.prefill(params, TOKENS[:2, :20], cache, config=cfg)
        out.append(np.asarray(logits))
    np.testing.assert_array_equal(out[1], out[0])


@pytest.mark.parametrize("weights", WEIGHTS)
def test_one_row_goes_through_the_kernel(weights, monkeypatch):
    """A decode step at batch 1 takes the kernel (``MATMUL_ROWS`` from one row), float32 and
    int8 weights alike: its logits equal XLA's up to summation order."""
    params = WEIGHTS[weights]
    want, _ = teacher_forced(params, TOKENS[:1], prompt_len=12, config=CFG)
    got, _ = teacher_forced(params, TOKENS[:1], prompt_len=12, config=MCFG)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)
    calls = []
    real = cache_kernel.stacked_matmul
    monkeypatch.setattr(cache_kernel, "stacked_matmul", lambda *a: calls.append(1) or real(*a))
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=8)
    decoder.decode_step(params, jnp.zeros((1,), jnp.int32), cache, config=MCFG)
    assert calls


@pytest.mark.parametrize("name", ["streaming_llm", "h2o"])
def test_ratio_one_equals_the_full_cache_through_the_kernel(name):
    params = WEIGHTS["out-first"]
    full, _ = teacher_forced(params, TOKENS, prompt_len=12, config=MCFG)
    comp = Compression.make(name, ratio=1.0)
    got, _ = teacher_forced(params, TOKENS, prompt_len=12, config=MCFG, compression=comp)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(full))


def test_both_kernels_together_equal_xla():
    """The attention kernel and the matmul kernel in one step, with statistics."""
    params = WEIGHTS["out-first"]
    both = MCFG.replace(attention="kernel")
    comp = Compression.make("h2o", ratio=0.5, granularity="head")
    want, _ = teacher_forced(params, TOKENS, prompt_len=12, config=CFG, compression=comp)
    got, _ = teacher_forced(params, TOKENS, prompt_len=12, config=both, compression=comp)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_canonical_float_weights_are_a_clear_error():
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=8)
    with pytest.raises(ValueError, match=r"matmul='kernel'.*out-first"):
        decoder.decode_step(FLOAT, jnp.zeros((2,), jnp.int32), cache, config=MCFG)


def test_an_unavailable_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cache_kernel, "_load", lambda: (False, "no C++ compiler"))
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=8)
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler.*matmul=.xla."):
        decoder.decode_step(WEIGHTS["int8"], jnp.zeros((2,), jnp.int32), cache, config=MCFG)


def test_a_layer_weight_outside_the_kernel_is_its_slice():
    """``LayerWeight`` where the kernel does not apply (an einsum of another form, more rows
    than ``MATMUL_ROWS``, ``dense``) reads the slice: the same numbers as the sliced weight."""
    stacked = WEIGHTS["out-first"]["layers"]["wq"]
    lw = weights_lib.layer_weight(stacked, 1)
    sliced = jax.tree.map(lambda a: a[1], stacked)
    x = jax.random.normal(jax.random.key(2), (cache_kernel.MATMUL_ROWS[1] + 1, 1, CFG.d_model))
    for sub in ("btd,dnh->btnh", "...d,dnh->...nh"):
        np.testing.assert_array_equal(
            np.asarray(weights_lib.einsum(sub, x, lw)),
            np.asarray(weights_lib.einsum(sub, x, sliced)),
        )
    np.testing.assert_array_equal(weights_lib.dense(lw), weights_lib.dense(sliced))


def test_load_stores_float_weights_out_first_for_the_kernel():
    model = jaxkv.load("smollm2-135m", matmul="kernel")
    assert model.config.matmul == "kernel"
    assert weights_lib.is_out_first(model.params["layers"]["wq"])


def test_an_unknown_matmul_is_rejected_before_loading():
    with pytest.raises(ValueError, match="matmul"):
        CFG.replace(matmul="blas")
    with pytest.raises(ValueError, match="matmul must be one of"):
        loading.load_model("no-such-model", matmul="blas")
