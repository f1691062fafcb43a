"""Decoder and cache: prefill + decode == forward, shapes, errors, presets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import kvcache
from jaxkv.config import ModelConfig
from jaxkv.generate import DecodeState, Sampling, decode_loop, generate_tokens, pad_prompts
from jaxkv.model import decoder, layers
from jaxkv.model.params import count_params, init_params, param_shapes

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)


@pytest.mark.parametrize("window", [None, 5])
def test_prefill_then_decode_equals_forward_at_every_position(window):
    cfg = CFG.replace(sliding_window=window)
    toks = jax.random.randint(jax.random.key(1), (2, 14), 0, cfg.vocab_size)
    full = decoder.forward(PARAMS, toks, config=cfg)
    cache = kvcache.init_cache(cfg, batch_size=2, capacity=16)
    logits, cache = decoder.prefill(PARAMS, toks[:, :6], cache, config=cfg)
    np.testing.assert_allclose(logits, full[:, 5], atol=1e-5, rtol=0)
    for t in range(6, 14):
        logits, cache = decoder.decode_step(PARAMS, toks[:, t], cache, config=cfg)
        np.testing.assert_allclose(logits, full[:, t], atol=1e-5, rtol=0)
    assert int(jnp.sum(cache.pos[0, 0, 0] >= 0)) == 14
    np.testing.assert_array_equal(cache.length, [14, 14])


def test_extend_chunk_equals_forward():
    toks = jax.random.randint(jax.random.key(2), (1, 12), 0, CFG.vocab_size)
    full = decoder.forward(PARAMS, toks, config=CFG)
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=12)
    _, cache = decoder.prefill(PARAMS, toks[:, :5], cache, config=CFG)
    logits, cache = decoder.extend(PARAMS, toks[:, 5:], cache, config=CFG)
    np.testing.assert_allclose(logits, full[:, 5:], atol=1e-5, rtol=0)


def test_batch_with_different_prompt_lengths_matches_single_runs():
    a = jax.random.randint(jax.random.key(3), (9,), 0, CFG.vocab_size)
    b = jax.random.randint(jax.random.key(4), (4,), 0, CFG.vocab_size)
    toks = jnp.zeros((2, 9), jnp.int32).at[0].set(a).at[1, :4].set(b)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=12)
    logits, cache = decoder.prefill(PARAMS, toks, cache, config=CFG, lengths_B=jnp.array([9, 4]))
    nxt = jnp.array([7, 11])
    step_logits, _ = decoder.decode_step(PARAMS, nxt, cache, config=CFG)
    for i, seq in enumerate([a, b]):
        ref = decoder.forward(PARAMS, jnp.concatenate([seq, nxt[i : i + 1]])[None], config=CFG)
        np.testing.assert_allclose(logits[i], ref[0, -2], atol=1e-5, rtol=0)
        np.testing.assert_allclose(step_logits[i], ref[0, -1], atol=1e-5, rtol=0)


def test_decode_scores_rowwise_and_batched_equal_the_einsum():
    q = jax.random.normal(jax.random.key(7), (2, 2, 3, 1, 16))
    k = jax.random.normal(jax.random.key(8), (2, 2, 40, 16))
    ref = jnp.einsum("bkgth,bksh->bkgts", q, k) / 4.0
    for rowwise in (True, False):
        got = layers.scores(q, k, rowwise=rowwise)
        assert got.shape == (2, 2, 3, 1, 40)
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_split_softmax_equals_one_softmax_over_the_concatenated_keys():
    s = jax.random.normal(jax.random.key(9), (2, 3, 7))
    mask = jax.random.bernoulli(jax.random.key(10), 0.6, (2, 3, 7)).at[1, 2].set(False)
    parts = layers.split_softmax((s[..., :5], s[..., 5:]), (mask[..., :5], mask[..., 5:]))
    whole = layers.masked_softmax(s, mask)
    np.testing.assert_allclose(jnp.concatenate(parts, axis=-1), whole, atol=1e-7, rtol=0)
    np.testing.assert_array_equal(whole[1, 2], 0.0)  # a row that sees nothing: zeros, no NaN


def test_bfloat16_runs_and_tracks_float32():
    cfg = CFG.replace(dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
    toks = jax.random.randint(jax.random.key(5), (1, 8), 0, CFG.vocab_size)
    lo = decoder.forward(params, toks, config=cfg)
    hi = decoder.forward(PARAMS, toks, config=CFG)
    assert lo.dtype == jnp.float32  # logits are accumulated in float32
    assert float(jnp.max(jnp.abs(lo - hi))) < 0.1 * float(jnp.max(jnp.abs(hi)))


def test_decode_loop_carry_keeps_shapes_and_dtypes():
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=8)
    state = DecodeState(
        cache=cache,
        tokens=jnp.zeros((2, 4), jnp.int32),
        next_token=jnp.zeros((2,), jnp.int32),
        done=jnp.zeros((2,), bool),
        step=jnp.zeros((), jnp.int32),
    )
    out = jax.eval_shape(
        lambda s: decode_loop(
            PARAMS,
            s,
            config=CFG,
            sampling=Sampling(),
            stop_tokens=(3,),
            pad_id=0,
            key=jax.random.key(0),
        ),
        state,
    )
    assert jax.tree.map(lambda x: (x.shape, x.dtype), out) == jax.tree.map(
        lambda x: (x.shape, x.dtype), state
    )


def test_greedy_generation_equals_argmax_of_forward():
    prompt = [5, 17, 3, 99, 42]
    (out,) = generate_tokens(PARAMS, [prompt], config=CFG, max_new_tokens=6)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(jnp.argmax(decoder.forward(PARAMS, jnp.array([seq]), config=CFG)[0, -1])))
    assert out == seq[len(prompt) :]


def test_generation_stops_at_stop_token_and_batches():
    prompts = [[5, 17, 3, 99, 42], [8, 1]]
    free = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=6)
    stop = free[0][2]
    stopped = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=6, stop_tokens=[stop])
    assert stopped[0] == free[0][: free[0].index(stop) + 1]
    single = generate_tokens(PARAMS, [prompts[1]], config=CFG, max_new_tokens=6)
    assert free[1] == single[0]


def test_sampling_is_seeded():
    s = Sampling(temperature=1.0, top_p=0.9)
    run = lambda seed: generate_tokens(
        PARAMS, [[1, 2, 3]], config=CFG, max_new_tokens=8, sampling=s, key=jax.random.key(seed)
    )
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_top_p_keeps_only_the_nucleus():
    from jaxkv.generate import sample

    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = jax.vmap(lambda k: sample(logits, Sampling(1.0, 0.7), key=k))(
        jax.random.split(jax.random.key(0), 400)
    )
    assert set(np.unique(draws).tolist()) == {0, 1}


def test_mistral_7b_parameter_count_from_eval_shape():
    cfg = ModelConfig.mistral_7b_v03()
    abstract = jax.eval_shape(lambda k: init_params(cfg, key=k), jax.random.key(0))
    assert count_params(abstract) == 7_248_023_552
    assert jax.tree.map(lambda x: x.shape, abstract) == jax.tree.map(
        tuple, param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)
    )
    cache = jax.eval_shape(lambda: kvcache.init_cache(cfg, batch_size=1, capacity=4096))
    assert cache.k.shape == (32, 1, 8, 4096, 128)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="empty"):
        pad_prompts([[]], vocab_size=CFG.vocab_size)
    with pytest.raises(ValueError, match="outside"):
        pad_prompts([[1, CFG.vocab_size]], vocab_size=CFG.vocab_size)
    with pytest.raises(TypeError, match="integers"):
        pad_prompts([[1.5, 2.0]], vocab_size=CFG.vocab_size)
    with pytest.raises(ValueError, match="no prompts"):
        pad_prompts([], vocab_size=CFG.vocab_size)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate_tokens(PARAMS, [[1] * 1000], config=CFG, max_new_tokens=100)
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=4)
    with pytest.raises(ValueError, match="overflow"):
        decoder.prefill(PARAMS, jnp.zeros((1, 5), jnp.int32), cache, config=CFG)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1.0)


def test_overflow_under_jit_poisons_logits_instead_of_corrupting():
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=3)
    step = jax.jit(lambda c, t: decoder.decode_step(PARAMS, t, c, config=CFG))
    for i in range(3):
        logits, cache = step(cache, jnp.array([i]))
        assert bool(jnp.all(jnp.isfinite(logits)))
    logits, cache = step(cache, jnp.array([3]))
    assert bool(jnp.all(jnp.isnan(logits)))
    assert bool(cache.overflow)


def test_gather_moves_every_slot_array_and_keeps_decoding_exact():
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=8, stats=True)
    toks = jax.random.randint(jax.random.key(6), (1, 8), 0, CFG.vocab_size)
    _, cache = decoder.prefill(PARAMS, toks[:, :6], cache, config=CFG)
    cache = cache.replace(stats={**cache.stats, "attn_cum": cache.pos.astype(jnp.float32) * 10})
    keep = jnp.array([[0, 2, 5]])
    small = kvcache.gather(cache, keep, capacity=5)
    assert small.capacity == 5
    np.testing.assert_array_equal(small.pos[0, 0, 0], [0, 2, 5, -1, -1])
    np.testing.assert_array_equal(small.stats["attn_cum"][0, 0, 0], [0, 20, 50, 0, 0])
    np.testing.assert_array_equal(small.k[:, :, :, :3], cache.k[:, :, :, jnp.array([0, 2, 5])])
    # decoding on the compressed cache == full cache with the evicted keys masked out
    logits, _ = decoder.decode_step(PARAMS, toks[:, 6], small, config=CFG)
    masked = cache.replace(pos=jnp.where(jnp.isin(cache.pos, jnp.array([0, 2, 5])), cache.pos, -1))
    ref, _ = decoder.decode_step(PARAMS, toks[:, 6], masked, config=CFG)
    np.testing.assert_allclose(logits, ref, atol=1e-5, rtol=0)


def test_gather_per_head_indices_differ_between_heads():
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=4)
    toks = jnp.array([[1, 2, 3, 4]])
    _, cache = decoder.prefill(PARAMS, toks, cache, config=CFG)
    idx = jnp.broadcast_to(jnp.array([[0, 1], [2, 3]])[None, None], (CFG.n_layers, 1, 2, 2))
    small = kvcache.gather(cache, idx)
    np.testing.assert_array_equal(small.pos[0, 0], [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="axes"):
        kvcache.gather(cache, jnp.zeros((3,), jnp.int32))


def test_config_presets_and_validation():
    assert ModelConfig.mistral_7b_v01().sliding_window == 4096
    s = ModelConfig.smollm2_135m()
    assert (s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim, s.tie_embeddings) == (
        30,
        9,
        3,
        64,
        True,
    )
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.tiny(n_heads=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("gpt5")


def test_config_from_hf_dicts():
    hf = {
        "model_type": "mistral",
        "vocab_size": 100,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "rope_theta": 1e6,
        "sliding_window": 16,
        "rms_norm_eps": 1e-6,
    }
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.head_dim, cfg.sliding_window, cfg.rope_theta) == (8, 16, 1e6)
    llama = dict(
        hf,
        model_type="llama",
        rope_theta=None,
        rope_parameters={"rope_theta": 1e5, "rope_type": "default"},
    )
    assert ModelConfig.from_hf(llama).rope_theta == 1e5
    assert ModelConfig.from_hf(llama).sliding_window is None
    bad = dict(hf, model_type="gpt2", hidden_act="gelu", attention_bias=True)
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(bad)
    for word in ("gpt2", "gelu", "attention_bias"):
        assert word in str(e.value)
