"""Float weights stored output channels first (``weights_int8.transpose_params``,
``jaxkv.load(..., out_first=True)``): the same values as the canonical layout, the same
logits up to float32 summation order, r = 1 still bit-identical to the full cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import kvcache
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import generate_tokens, teacher_forced
from jaxkv.model import decoder, weights_int8
from jaxkv.model.params import init_params

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
OI = weights_int8.transpose_params(PARAMS)
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
PROMPT = 20
# as tests/test_weights_int8.py: another summation order moves the tiny model's logits
# (up to ~6.5) by up to 8e-6
TOL = dict(atol=5e-5, rtol=1e-5)
WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@pytest.mark.parametrize("name", WEIGHTS)
def test_values_are_the_same_stored_output_channels_first(name):
    w, t = PARAMS["layers"][name], OI["layers"][name]
    assert isinstance(t, weights_int8.OIWeight) and t.shape == w.shape and t.dtype == w.dtype
    n_in = int(np.prod(t.in_shape))
    assert t.value.shape == (CFG.n_layers, w[0].size // n_in, n_in)
    np.testing.assert_array_equal(np.asarray(weights_int8.dense(t)), np.asarray(w))


def test_round_trip_and_unchanged_leaves():
    back = weights_int8.dequantize_params(OI)
    assert jax.tree.structure(back) == jax.tree.structure(PARAMS)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(PARAMS), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not weights_int8.is_out_first(OI["embed"])  # [V, D] already: rows and head
    np.testing.assert_array_equal(np.asarray(OI["embed"]), np.asarray(PARAMS["embed"]))
    assert weights_int8.nbytes(OI) == weights_int8.nbytes(PARAMS)


def test_quantizing_either_layout_gives_the_same_int8_weights():
    for a, b in zip(
        jax.tree.leaves(weights_int8.quantize_params(OI)),
        jax.tree.leaves(weights_int8.quantize_params(PARAMS)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_forward_equals_the_canonical_layout():
    got = decoder.forward(OI, TOKENS, config=CFG)
    np.testing.assert_allclose(got, decoder.forward(PARAMS, TOKENS, config=CFG), **TOL)


@pytest.mark.parametrize("rows", [1, 5, weights_int8.FEW_ROWS + 6])
@pytest.mark.parametrize("w_name", ["wq", "wo", "w_down"])
def test_each_matmul_form_equals_the_canonical_product(rows, w_name):
    """The three forms of ``_matmul_t_float`` (one fused row, a few rows, many rows through
    a canonical copy) against ``x @ W`` on the canonical layout."""
    w = jax.tree.map(lambda a: a[1], OI["layers"][w_name])  # layer 1
    x = jax.random.normal(jax.random.key(6), (rows, w.value.shape[-1]))
    got = jax.jit(weights_int8._matmul_t_float)(x, w.value)
    want = x @ weights_int8.dense(w).reshape(x.shape[-1], -1)
    np.testing.assert_allclose(got, want, **TOL)


def test_a_long_prompt_equals_the_canonical_layout():
    tokens = jax.random.randint(jax.random.key(7), (1, weights_int8.FEW_ROWS + 6), 0, 256)
    got = decoder.forward(OI, tokens, config=CFG)
    np.testing.assert_allclose(got, decoder.forward(PARAMS, tokens, config=CFG), **TOL)


@pytest.mark.parametrize("batch", [1, 2])  # decode: one fused row, or a few rows
def test_prefill_and_decode_equal_the_canonical_layout(batch):
    tokens = TOKENS[:batch]
    got, _ = teacher_forced(OI, tokens, prompt_len=PROMPT, config=CFG)
    want, _ = teacher_forced(PARAMS, tokens, prompt_len=PROMPT, config=CFG)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name", ["h2o", "snapkv", "tova"])
def test_ratio_one_equals_the_full_cache_logit_for_logit(name, batch):
    tokens = TOKENS[:batch]
    full, _ = teacher_forced(OI, tokens, prompt_len=12, config=CFG)
    comp = Compression.make(name, ratio=1.0)
    got, _ = teacher_forced(OI, tokens, prompt_len=12, config=CFG, compression=comp)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(full))


def test_generation_matches_the_canonical_layout():
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    got = generate_tokens(OI, prompts, config=CFG, max_new_tokens=6)
    assert got == generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=6)


def test_separate_head():
    cfg = CFG.replace(tie_embeddings=False)
    params = init_params(cfg, key=jax.random.key(2), scale=0.2)
    oi = weights_int8.transpose_params(params)
    assert oi["lm_head"].value.shape == (cfg.vocab_size, cfg.d_model)
    h = jax.random.normal(jax.random.key(4), (2, 3, cfg.d_model))
    for rows in (h[:1, :1], h):  # one fused row, several rows
        got = weights_int8.head_logits(rows, oi["lm_head"], vocab_first=False)
        want = weights_int8.head_logits(rows, params["lm_head"], vocab_first=False)
        np.testing.assert_allclose(got, want, **TOL)
    got, _ = teacher_forced(oi, TOKENS[:1], prompt_len=PROMPT, config=cfg)
    want, _ = teacher_forced(params, TOKENS[:1], prompt_len=PROMPT, config=cfg)
    np.testing.assert_allclose(got, want, **TOL)


def test_the_projected_value_norms_read_the_same_w_o():
    """``wo_vnorm``, the statistic ``critical:`` and a ranker's ``log_wo_vnorm`` read, is
    written from W_o in either layout."""
    norms = []
    for params in (OI, PARAMS):
        cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT, stats=("wo_vnorm",))
        _, cache = decoder.prefill(params, TOKENS[:, :PROMPT], cache, config=CFG)
        norms.append(np.asarray(cache.stats["wo_vnorm"]))
    assert norms[0].min() > 0
    np.testing.assert_allclose(*norms, **TOL)


def test_batch_one_decode_reads_the_stacked_weights_in_place():
    """On CPU no per-layer copy of a weight slice is left in the batch-1 decode step: each
    product is a fused loop over the stacked weights (results/profile_decode.md)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the fused loop is XLA:CPU's")
    from jaxkv import kvcache

    cache = kvcache.init_cache(CFG, batch_size=1, capacity=64)
    token = jnp.zeros((1,), jnp.int32)
    step = jax.jit(lambda p, t, c: decoder.decode_step(p, t, c, config=CFG))

    def weight_copies(params):
        text = step.lower(params, token, cache).compile().as_text()
        shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(params["layers"]) if x.ndim == 3}
        shapes |= {s[::-1] for s in shapes}
        return [
            line
            for line in text.splitlines()
            if "dynamic-slice" in line.split("=")[0]
            and any(f"f32[{','.join(map(str, s))}]" in line.split("=")[1][:40] for s in shapes)
        ]

    assert weight_copies(jax.tree.map(weights_int8.dense, OI, is_leaf=weights_int8.is_out_first))
    assert not weight_copies(OI)


def test_transpose_params_traces_on_mistral_7b_shapes():
    cfg = ModelConfig.mistral_7b_v03()
    abstract = jax.eval_shape(lambda k: init_params(cfg, key=k), jax.random.key(0))
    t = jax.eval_shape(weights_int8.transpose_params, abstract)
    assert t["layers"]["wq"].shape == (32, 4096, 32, 128)
    assert t["layers"]["wq"].value.shape == (32, 4096, 4096)
    assert t["layers"]["wk"].value.shape == (32, 1024, 4096)
    assert t["layers"]["w_down"].value.shape == (32, 4096, 14336)
    assert t["lm_head"].value.shape == (32768, 4096)


@pytest.mark.model
def test_load_out_first():
    import jaxkv

    model = jaxkv.load("smollm2-135m", out_first=True)
    assert isinstance(model.params["layers"]["w_down"], weights_int8.OIWeight)
    assert model.params["embed"].shape == (model.config.vocab_size, model.config.d_model)
