"""Weight-only int8 (``jaxkv.model.weights_int8``, ``jaxkv.load(..., dtype="int8")``):
quantization against a NumPy reference, the int8 decoder against the float decoder on the
dequantized weights, composition with the int8 KV cache and eviction, KL against float32."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cli import eval as eval_lib
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import generate_tokens, teacher_forced
from jaxkv.model import decoder, weights_int8
from jaxkv.model.params import PARAM_AXES, init_params
from jaxkv.policies import get_policy

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
QPARAMS = weights_int8.quantize_params(PARAMS)
DEQ = weights_int8.dequantize_params(QPARAMS)
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
PROMPT = 20
# The tiny model's logits reach ~6.5; changing only the batch size moves the float32 decoder's
# by 8e-6 (another dot order), so int8 and dequantized float may differ by that much.
TOL = dict(atol=5e-5, rtol=1e-5)
WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def np_quantize(w, contracted_axes):
    """NumPy reference: symmetric absmax int8 over ``contracted_axes`` (qwix's bound 127.5,
    round half to even, saturating)."""
    w = np.asarray(w, np.float32)
    absmax = np.max(np.abs(w), axis=contracted_axes, keepdims=True)
    scale = absmax / np.float32(127.5)
    scale = np.where(scale > 0, scale, np.float32(1))
    return np.clip(np.rint(w / scale), -128, 127).astype(np.int8), scale


def _leaves():
    yield "embed", PARAMS["embed"], QPARAMS["embed"]
    for name in WEIGHTS:
        yield name, PARAMS["layers"][name], QPARAMS["layers"][name]


@pytest.mark.parametrize("name,w,q", list(_leaves()), ids=lambda x: x if isinstance(x, str) else "")
def test_quantize_matches_the_numpy_reference_and_rounds_to_half_a_step(name, w, q):
    axes = PARAM_AXES["layers"].get(name) or PARAM_AXES[name]
    contracted = tuple(i for i, a in enumerate(axes) if a in weights_int8.CONTRACTED[name])
    want_q, want_scale = np_quantize(w, contracted)
    assert q.qvalue.dtype == jnp.int8 and q.scale.dtype == jnp.float32
    assert q.shape == w.shape
    # stored [..., O, I]: output channels first, the contracted axes last and flattened
    n_in = np.prod([w.shape[i] for i in contracted])
    assert q.qvalue.shape == (
        *q.qvalue.shape[:-2],
        w.size // n_in // np.prod(q.qvalue.shape[:-2]),
        n_in,
    )
    assert q.scale.shape == (*q.qvalue.shape[:-1], 1)
    scale = q.to_float_layout(q.scale, scales=True)
    assert scale.shape == want_scale.shape  # one scale per output channel and layer
    # Exact but at rounding ties (|w| = absmax is one: w / scale = +-127.5), where the float
    # division may land on either side of the half.
    x = np.asarray(w) / want_scale
    tie = np.abs(np.abs(x - np.floor(x)) - 0.5) < 1e-4
    diff = np.abs(np.asarray(q.to_float_layout(q.qvalue), np.int32) - want_q)
    np.testing.assert_array_equal(np.where(tie, 0, diff), 0)
    assert np.all(diff <= 1)
    np.testing.assert_array_max_ulp(np.asarray(scale), want_scale, maxulp=1)
    err = np.abs(np.asarray(weights_int8.dense(q)) - np.asarray(w))
    # half a step, plus float rounding: of the scale (times |q| <= 128) and of q * scale,
    # each within an ulp of the weight
    assert np.all(err <= np.asarray(scale) / 2 + 2 * np.spacing(np.abs(np.asarray(w))))


def test_norms_stay_float_and_float_trees_pass_through():
    np.testing.assert_array_equal(QPARAMS["final_norm"], PARAMS["final_norm"])
    np.testing.assert_array_equal(QPARAMS["layers"]["attn_norm"], PARAMS["layers"]["attn_norm"])
    assert jax.tree.structure(weights_int8.dequantize_params(PARAMS)) == jax.tree.structure(PARAMS)
    assert jax.tree.structure(DEQ) == jax.tree.structure(PARAMS)


def test_int8_bytes_are_about_a_quarter_of_float32():
    ratio = weights_int8.nbytes(QPARAMS) / weights_int8.nbytes(PARAMS)
    assert 0.25 < ratio < 0.30  # int8 values, float32 scales and norms


def test_separate_head_is_quantized_per_vocabulary_entry():
    cfg = CFG.replace(tie_embeddings=False)
    q = weights_int8.quantize_params(init_params(cfg, key=jax.random.key(2)))
    assert q["lm_head"].shape == (cfg.d_model, cfg.vocab_size)
    assert q["lm_head"].scale.shape == (cfg.vocab_size, 1)  # stored [V, D] like the embedding
    assert q["lm_head"].to_float_layout(q["lm_head"].scale, scales=True).shape == (
        1,
        cfg.vocab_size,
    )


def test_int8_forward_equals_float_forward_on_the_dequantized_weights():
    got = decoder.forward(QPARAMS, TOKENS, config=CFG)
    want = decoder.forward(DEQ, TOKENS, config=CFG)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("batch", [1, 2])  # decode: one fused row, or a few rows
def test_int8_prefill_and_decode_equal_float_on_the_dequantized_weights(batch):
    tokens = TOKENS[:batch]
    got, _ = teacher_forced(QPARAMS, tokens, prompt_len=PROMPT, config=CFG)
    want, _ = teacher_forced(DEQ, tokens, prompt_len=PROMPT, config=CFG)
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("rows", [1, 5, weights_int8.FEW_ROWS + 6])
@pytest.mark.parametrize("w_name", ["wq", "wo", "w_down"])
def test_each_matmul_form_equals_a_float64_reference(rows, w_name):
    """The three forms of ``_matmul_t`` (one row fused, a few rows with the scales after the
    dot, many rows) against x @ (q * scale).T in float64, within the float32 rounding bound
    of a sum of I products: I * eps * sum_i |x_i w_i| (the product and scale roundings add
    2 eps, covered since I >= 64 here)."""
    w = jax.tree.map(lambda a: a[1], QPARAMS["layers"][w_name])  # layer 1
    x = jax.random.normal(jax.random.key(6), (rows, w.qvalue.shape[-1]))
    got = jax.jit(weights_int8._matmul_t)(x, w.qvalue, w.scale)
    q, scale = np.asarray(w.qvalue, np.float64), np.asarray(w.scale, np.float64)
    x64 = np.asarray(x, np.float64)
    want = x64 @ (q * scale).T
    n_in = w.qvalue.shape[-1]
    assert n_in >= 64
    bound = np.abs(x64) @ np.abs(q * scale).T * n_in * np.finfo(np.float32).eps
    assert got.shape == want.shape
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-30)


@pytest.mark.parametrize(
    "policy,kv_dtype", [("tova", None), ("snapkv", "int8"), ("expected_attention", "int8")]
)
def test_int8_weights_compose_with_eviction_and_the_int8_cache(policy, kv_dtype):
    comp = Compression.make(policy, ratio=0.5, min_budget=4)
    kw = dict(prompt_len=PROMPT, config=CFG, compression=comp, kv_dtype=kv_dtype)
    got, cache = teacher_forced(QPARAMS, TOKENS, key=jax.random.key(3), **kw)
    want, _ = teacher_forced(DEQ, TOKENS, key=jax.random.key(3), **kw)
    np.testing.assert_allclose(got, want, **TOL)
    assert int(jnp.max(jnp.sum(cache.pos[0] >= 0, axis=-1))) < TOKENS.shape[1]


@pytest.mark.parametrize(
    "subscripts,x_shape,w_name",
    [
        ("btd,dnh->btnh", (2, 3, 64), "wq"),  # a 2-D matmul for qwix
        ("btnh,nhd->btd", (2, 3, 4, 16), "wo"),
        ("bdt,dnh->btnh", (2, 64, 3), "wq"),  # contracted axis not last: qwix's own einsum
    ],
)
def test_einsum_equals_jnp_einsum_on_the_dequantized_weight(subscripts, x_shape, w_name):
    x = jax.random.normal(jax.random.key(5), x_shape)
    w = jax.tree.map(lambda a: a[0], QPARAMS["layers"][w_name])  # layer 0
    got = weights_int8.einsum(subscripts, x, w)
    np.testing.assert_allclose(got, jnp.einsum(subscripts, x, weights_int8.dense(w)), **TOL)


@pytest.mark.parametrize("fused_rows", [8, 0], ids=["fused", "chunked"])
def test_head_equals_the_dequantized_head(monkeypatch, fused_rows):
    """Tied ([V, D]) and separate ([D, V]) int8 heads, fused (decode) or in chunks, against
    the float head on the dequantized weights."""
    monkeypatch.setattr(weights_int8, "HEAD_CHUNK", CFG.vocab_size // 4)
    monkeypatch.setattr(weights_int8, "HEAD_FUSED_ROWS", fused_rows)
    assert weights_int8._n_chunks(CFG.vocab_size) == 4
    h = jax.random.normal(jax.random.key(4), (2, 3, CFG.d_model))
    head = weights_int8.quantize(PARAMS["embed"].T, "lm_head")
    for vocab_first, w in ((True, QPARAMS["embed"]), (False, head)):
        got = weights_int8.head_logits(h, w, vocab_first=vocab_first)
        want = h @ weights_int8.dense(QPARAMS["embed"]).T
        np.testing.assert_allclose(got, want, **TOL)


def test_head_chunks_divide_the_vocabulary():
    assert weights_int8._n_chunks(49152) == 12  # SmolLM2: 4096 each
    assert weights_int8._n_chunks(32768) == 8  # Mistral-7B v0.3
    assert weights_int8._n_chunks(32000) == 8  # Llama-2: 4000 each
    assert weights_int8._n_chunks(256) == 1
    assert weights_int8._n_chunks(65537) == 1  # prime: one whole head, not 65537 rows


def test_kl_against_float32_is_small():
    ref = jax.nn.log_softmax(decoder.forward(PARAMS, TOKENS, config=CFG))
    got = jax.nn.log_softmax(decoder.forward(QPARAMS, TOKENS, config=CFG))
    kl = float(jnp.mean(jnp.sum(jnp.exp(ref) * (ref - got), axis=-1)))
    assert 0 < kl < 5e-3  # measured 2.1e-3 (the random tiny model has peaked logits)


def test_generation_runs_on_int8_weights():
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    got = generate_tokens(QPARAMS, prompts, config=CFG, max_new_tokens=6, kv_dtype="int8")
    want = generate_tokens(DEQ, prompts, config=CFG, max_new_tokens=6, kv_dtype="int8")
    assert got == want


def test_quantize_params_traces_on_mistral_7b_shapes():
    cfg = ModelConfig.mistral_7b_v03()
    abstract = jax.eval_shape(lambda k: init_params(cfg, key=k), jax.random.key(0))
    q = jax.eval_shape(weights_int8.quantize_params, abstract)
    wq = q["layers"]["wq"]
    assert wq.shape == (32, 4096, 32, 128)
    assert wq.qvalue.shape == (32, 4096, 4096) and wq.scale.shape == (32, 4096, 1)
    assert q["layers"]["wk"].qvalue.shape == (32, 1024, 4096)
    assert q["layers"]["wo"].qvalue.shape == (32, 4096, 4096)
    assert q["layers"]["w_down"].qvalue.shape == (32, 4096, 14336)
    assert q["lm_head"].qvalue.shape == (32768, 4096) and q["lm_head"].scale.shape == (32768, 1)
    assert weights_int8.nbytes(q) / weights_int8.nbytes(abstract) < 0.2505


@pytest.mark.model
def test_load_int8_quantizes_the_embedded_model():
    import jaxkv

    model = jaxkv.load("smollm2-135m", dtype="int8")
    assert model.config.dtype == "float32"
    assert weights_int8.is_quantized(model.params["embed"])
    assert weights_int8.is_quantized(model.params["layers"]["w_down"])
    with pytest.raises(ValueError, match="int8"):
        jaxkv.load("smollm2-135m", dtype="int4")


def test_dtype_flag_reaches_the_suite_and_is_recorded(tmp_path):
    common = ["--model", "tiny", "--policies", "full,h2o", "--ratios", "0.5", "--limit", "1"]
    window = ["--window", "48", "--prompt-len", "32"]
    out = tmp_path / "int8"
    assert eval_lib.main(["fidelity", *common, *window, "--dtype", "int8", "--out", str(out)]) == 0
    assert json.loads((out / "fidelity.json").read_text())["config"]["dtype"] == "int8"
    plain = tmp_path / "f32"
    assert eval_lib.main(["fidelity", *common, *window, "--out", str(plain)]) == 0
    assert "dtype" not in json.loads((plain / "fidelity.json").read_text())["config"]
    with pytest.raises(SystemExit):
        eval_lib.main(["fidelity", *common, "--dtype", "int4", "--out", str(tmp_path / "x")])


def test_the_projected_value_norms_of_int8_weights_read_the_dequantized_w_o():
    """``critical:`` over int8 weights: the cache statistic ``wo_vnorm`` it reads is the one
    the dequantized float params write, and an eviction runs."""
    comp = Compression(get_policy("critical:h2o"), ratio=0.5, min_budget=4, granularity="head")
    runs = [
        teacher_forced(p, TOKENS, prompt_len=PROMPT, config=CFG, compression=comp)
        for p in (QPARAMS, DEQ)
    ]
    (logits, cache), (_, want) = runs
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(np.asarray(cache.pos), np.asarray(want.pos))
    np.testing.assert_allclose(
        np.asarray(cache.stats["wo_vnorm"]), np.asarray(want.stats["wo_vnorm"]), **TOL
    )
