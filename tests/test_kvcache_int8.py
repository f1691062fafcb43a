"""The int8 KV cache (``kvcache.init_cache(dtype="int8")``): quantization, attention over it,
and eviction with every policy, granularity and protocol, on the tiny model."""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import kvcache
from jaxkv.config import ModelConfig
from jaxkv.eviction import GRANULARITIES, PROTOCOLS, Compression
from jaxkv.generate import full_cache_attention, generate_tokens, teacher_forced
from jaxkv.model import decoder
from jaxkv.model.params import init_params
from jaxkv.policies import get_policy
from jaxkv.policies import oracle as oracle_lib
from jaxkv.policies.learned import init_mlp, learned_policy

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
PROMPT = 20


def np_quantize(x, scale=None):
    """NumPy reference: symmetric absmax int8 over the last axis (with ``scale``: that
    scale, to compare the rounding alone)."""
    x = np.asarray(x, np.float32)
    if scale is None:
        scale = (np.max(np.abs(x), axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))[..., None]
    return np.clip(np.round(x / safe), -127, 127).astype(np.int8), scale


def test_quantize_round_trip_matches_the_numpy_reference():
    x = jax.random.normal(jax.random.key(2), (2, 3, 2, 5, 16))
    x = x * jnp.exp(jax.random.normal(jax.random.key(3), (2, 3, 2, 5, 1)))  # varied row scales
    x = x.at[0, 0, 0, 0].set(0.0)  # an all-zero vector (a never-written slot)
    q, scale = kvcache.quantize(x)
    q_ref, scale_ref = np_quantize(x)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32
    # XLA divides by 127 as a product with 1/127: one ulp apart at most
    np.testing.assert_allclose(np.asarray(scale), scale_ref, rtol=2e-7, atol=0)
    scale_ref = np.asarray(scale)
    q_ref = np_quantize(x, scale_ref)[0]
    np.testing.assert_array_equal(np.asarray(q), q_ref)
    x_hat = np.asarray(kvcache.dequantize(q, scale))
    np.testing.assert_array_equal(x_hat, q_ref.astype(np.float32) * scale_ref[..., None])
    # round to nearest: at most half a step per element (plus f32 rounding of the product)
    err = np.abs(np.asarray(x) - x_hat)
    assert np.all(err <= scale_ref[..., None] * (0.5 + 1e-6))
    np.testing.assert_array_equal(x_hat[0, 0, 0, 0], 0.0)
    assert np.max(np.abs(q_ref), axis=-1)[1:].min() == 127  # each vector's range is used


def test_an_int8_cache_holds_int8_keys_scales_and_its_bytes():
    c = kvcache.init_cache(CFG, batch_size=2, capacity=8, dtype="int8", stats=("attn",))
    L, K, H = CFG.n_layers, CFG.n_kv_heads, CFG.head_dim
    assert c.quantized and c.k.dtype == c.v.dtype == jnp.int8
    assert c.k_scale.shape == c.v_scale.shape == c.pos.shape == (L, 2, K, 8)
    slots = L * 2 * K * 8
    # int8 k and v, f32 scales (2), pos (int32), one statistic; length [B] and overflow
    assert c.nbytes() == slots * (2 * H + 4 * 2 + 4 + 4) + 2 * 4 + 1
    full = kvcache.init_cache(CFG, batch_size=2, capacity=8)
    assert not full.quantized and full.k_scale is None and full.v_scale is None
    np.testing.assert_array_equal(full.keys(), full.k)
    assert kvcache.init_cache(CFG, batch_size=1, capacity=4, dtype=jnp.int8).quantized
    with pytest.raises(ValueError, match="float dtype or 'int8'"):
        kvcache.init_cache(CFG, batch_size=1, capacity=4, dtype=jnp.int32)


def _fake_quantized(cache):
    """A full-precision cache whose keys and values were rounded through int8."""
    (k, ks), (v, vs) = kvcache.quantize(cache.k), kvcache.quantize(cache.v)
    return cache.replace(k=kvcache.dequantize(k, ks), v=kvcache.dequantize(v, vs))


def test_attention_over_an_int8_cache_equals_full_precision_over_its_dequantized_values():
    # Prefill computes the same keys either way, so the int8 cache holds exactly the rounded
    # keys; each decode step then reads them through folded scales (s = scale * q.k_int8,
    # p * scale weighting v_int8) where the f32 path reads scale * k_int8: the same numbers
    # up to the order of one multiplication, so float32 rounding alone separates the logits.
    f32 = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT + 6, stats=True)
    i8 = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT + 6, stats=True, dtype="int8")
    _, f32 = decoder.prefill(PARAMS, TOKENS[:, :PROMPT], f32, config=CFG)
    _, i8 = decoder.prefill(PARAMS, TOKENS[:, :PROMPT], i8, config=CFG)
    np.testing.assert_array_equal(i8.keys(), _fake_quantized(f32).k)
    np.testing.assert_array_equal(i8.values(), _fake_quantized(f32).v)
    step = jax.jit(decoder.decode_step, static_argnames="config")
    for t in range(PROMPT, PROMPT + 6):
        f32 = _fake_quantized(f32)
        ref, f32 = step(PARAMS, TOKENS[:, t], f32, config=CFG)
        out, i8 = step(PARAMS, TOKENS[:, t], i8, config=CFG)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        for name in kvcache.STAT_NAMES:  # statistics: f32, from the same probabilities
            assert i8.stats[name].dtype == jnp.float32
            np.testing.assert_allclose(i8.stats[name], f32.stats[name], rtol=1e-4, atol=1e-6)


def _rounded_to(cache, dtype):
    """A float32 cache whose keys and values were rounded through ``dtype``."""
    return cache.replace(
        k=cache.k.astype(dtype).astype(jnp.float32), v=cache.v.astype(dtype).astype(jnp.float32)
    )


def test_attention_over_a_float16_cache_computes_in_float32():
    # A float16 cache stores rounded keys and values; widening them to float32 is exact, so
    # attention over it must equal float32 attention over the rounded values up to float32
    # rounding (1e-5). Rounding the probabilities to float16 instead (relative error up to
    # 2^-11 = 5e-4 per weight) moves these logits by ~1e-4 and fails this tolerance.
    f32 = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT + 6, stats=True)
    f16 = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT + 6, stats=True, dtype="float16")
    _, f32 = decoder.prefill(PARAMS, TOKENS[:, :PROMPT], f32, config=CFG)
    _, f16 = decoder.prefill(PARAMS, TOKENS[:, :PROMPT], f16, config=CFG)
    assert f16.k.dtype == jnp.float16
    step = jax.jit(decoder.decode_step, static_argnames="config")
    for t in range(PROMPT, PROMPT + 6):
        f32 = _rounded_to(f32, jnp.float16)
        ref, f32 = step(PARAMS, TOKENS[:, t], f32, config=CFG)
        out, f16 = step(PARAMS, TOKENS[:, t], f16, config=CFG)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        for name in kvcache.STAT_NAMES:
            np.testing.assert_allclose(f16.stats[name], f32.stats[name], rtol=1e-4, atol=1e-6)


def test_int8_logits_stay_close_to_the_full_precision_cache():
    # Each stored element moves by at most half a step, max|row| / 254 (0.4 % of the row's
    # largest entry; test above). On this model that costs the next-token distribution a
    # mean KL of ~3e-4 nats (measured); the bound 1e-3 is three orders of magnitude below
    # what eviction costs at r = 0.25 (0.3-0.6 nats on SmolLM2, results/kv_int8.md).
    ref, _ = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG)
    out, cache = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG, kv_dtype="int8")
    assert cache.quantized
    lp, lq = jax.nn.log_softmax(ref), jax.nn.log_softmax(out)
    kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)
    assert 0 < float(jnp.mean(kl)) < 1e-3
    assert float(jnp.mean(jnp.argmax(ref, -1) == jnp.argmax(out, -1))) >= 0.9


@pytest.mark.parametrize(
    "name, granularity, protocol",
    [("h2o", "shared", "decode"), ("keydiff", "head", "decode"), ("tova", "adaptive", "prefill")],
)
def test_ratio_one_with_int8_equals_the_int8_full_cache_bit_for_bit(name, granularity, protocol):
    full, _ = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG, kv_dtype="int8")
    comp = Compression.make(name, ratio=1.0, granularity=granularity, protocol=protocol)
    logits, cache = teacher_forced(
        PARAMS, TOKENS, prompt_len=PROMPT, config=CFG, compression=comp, kv_dtype="int8"
    )
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(full))
    np.testing.assert_array_equal(jnp.sum(cache.pos >= 0, axis=-1), TOKENS.shape[1] - 1)


def test_ratio_one_generation_with_int8_equals_the_int8_full_cache():
    prompts = [list(range(1, 40)), [7, 8, 9]]
    full = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=6, kv_dtype="int8")
    comp = Compression.make("snapkv", ratio=1.0)
    out = generate_tokens(
        PARAMS, prompts, config=CFG, max_new_tokens=6, compression=comp, kv_dtype="int8"
    )
    assert out == full


def test_gather_and_compact_move_the_scales_with_their_slots():
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT, dtype="int8", stats=True)
    _, cache = decoder.prefill(PARAMS, TOKENS[:, :PROMPT], cache, config=CFG)
    L, B, K, C = cache.pos.shape
    keys = jax.random.split(jax.random.key(4), L * B * K)
    idx = jnp.stack([jax.random.permutation(k, C)[:7] for k in keys]).reshape(L, B, K, 7)
    idx = idx.at[0, 0, 0, 3].set(-1)  # a hole: a free slot
    out = kvcache.gather(cache, idx, capacity=9)
    safe = jnp.where(idx < 0, 0, idx)
    for name in ("k_scale", "v_scale", "pos"):
        moved = jnp.take_along_axis(getattr(cache, name), safe, axis=3)
        np.testing.assert_array_equal(getattr(out, name)[..., :7][idx >= 0], moved[idx >= 0])
    np.testing.assert_array_equal(out.k_scale[0, 0, 0, 3], 0.0)
    np.testing.assert_array_equal(out.k_scale[..., 7:], 0.0)
    want = jnp.take_along_axis(cache.keys(), safe[..., None], axis=3)
    np.testing.assert_array_equal(out.keys()[..., :7, :][idx >= 0], want[idx >= 0])
    # free every other slot, then compact: each kept slot's keys and values come along
    freed = kvcache.free_slots(cache, (jnp.arange(C) % 2 == 1)[None, None, None])
    packed = kvcache.compact(freed, C // 2)
    np.testing.assert_array_equal(packed.keys(), cache.keys()[..., ::2, :])
    np.testing.assert_array_equal(packed.values(), cache.values()[..., ::2, :])
    np.testing.assert_array_equal(packed.v_scale, cache.v_scale[..., ::2])


POLICIES = [
    "random",
    "streaming_llm",
    "h2o",
    "snapkv",
    "tova",
    "keydiff",
    "knorm",
    "expected_attention",
    "learned",  # shared only: it lands on (shared, decode)
    "critical:knorm",
    "oracle",
]
GRID_TOKENS = TOKENS[:1, :32]
GRID_PROMPT = 16


def _grid() -> list[tuple[str, str, str]]:
    """Every policy once, the granularities and protocols in turn so that each of the 8
    (granularity, protocol) pairs runs too: the int8 cache changes only what a policy
    reads (``keys()``, ``values()``) and what ``gather`` moves, both per policy and per
    layout. The whole product (88 compiled streams, ~10 min on 2 cores) runs with
    ``JAXKV_INT8_FULL_GRID=1``."""
    if os.environ.get("JAXKV_INT8_FULL_GRID"):
        return list(itertools.product(POLICIES, GRANULARITIES, PROTOCOLS))
    n = len(GRANULARITIES)
    return [
        (name, GRANULARITIES[i % n], PROTOCOLS[(i // n) % len(PROTOCOLS)])
        for i, name in enumerate(POLICIES)
    ]


def _grid_policy(name):
    if name == "learned":
        return learned_policy(init_mlp(key=jax.random.key(3))), None
    policy = get_policy(name)
    if name != "oracle":
        return policy, None
    attn = full_cache_attention(PARAMS, GRID_TOKENS, prompt_len=GRID_PROMPT, config=CFG)
    return policy, oracle_lib.future_attention(attn, first_query=GRID_PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize("name, granularity, protocol", _grid())
def test_every_policy_granularity_and_protocol_keeps_the_budget_on_an_int8_cache(
    name, granularity, protocol
):
    policy, state = _grid_policy(name)
    try:
        comp = Compression(
            policy=policy, ratio=0.25, min_budget=4, granularity=granularity, protocol=protocol
        )
    except ValueError as e:
        pytest.skip(f"unsupported: {e}")
    if state is None:
        state = policy.init()
    logits, cache = teacher_forced(
        PARAMS,
        GRID_TOKENS,
        prompt_len=GRID_PROMPT,
        config=CFG,
        compression=comp,
        policy_state=state,
        kv_dtype="int8",
    )
    assert cache.quantized and bool(jnp.all(jnp.isfinite(logits)))
    n_seen, n_decoded = GRID_TOKENS.shape[1] - 1, GRID_TOKENS.shape[1] - 1 - GRID_PROMPT
    if protocol == "decode":
        budget = int(comp.budget_for(n_seen))  # floor(0.25 * 31) = 7
    else:
        budget = int(comp.budget_for(GRID_PROMPT)) + n_decoded  # 4 + 15
    held_LBK = np.asarray(jnp.sum(cache.pos >= 0, axis=-1))
    if granularity == "adaptive":  # a layer holds K * B, spread unevenly over its heads
        np.testing.assert_array_equal(held_LBK.sum(axis=-1), CFG.n_kv_heads * budget)
    elif granularity == "global":  # a sequence holds L * K * B, spread over all its rows
        rows = CFG.n_layers * CFG.n_kv_heads
        np.testing.assert_array_equal(held_LBK.sum(axis=(0, 2)), rows * budget)
    else:
        np.testing.assert_array_equal(held_LBK, budget)
    # every held slot has a real scale; quantized keys of free slots are never read
    assert bool(jnp.all(jnp.where(cache.pos >= 0, cache.k_scale > 0, True)))
