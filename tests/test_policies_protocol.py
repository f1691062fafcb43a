"""The two protocols: ``decode`` (evict at every step, the paper) and ``prefill`` (compress the
prompt once, kvpress), on the tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import eviction, kvcache
from jaxkv.config import ModelConfig
from jaxkv.eviction import PROTOCOLS, Compression
from jaxkv.generate import generate_tokens, teacher_forced
from jaxkv.model import decoder
from jaxkv.model.params import init_params

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
PROMPT = 20


@pytest.fixture(scope="module")
def full_stream():
    return teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG)[0]


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    "name, granularity",
    [
        ("h2o", "shared"),
        ("snapkv", "head"),
        ("tova", "adaptive"),
        ("critical:knorm", "layer"),
        ("h2o", "global"),
    ],
)
def test_ratio_one_equals_the_full_cache_bit_for_bit(name, granularity, protocol, full_stream):
    comp = Compression.make(name, ratio=1.0, protocol=protocol, granularity=granularity)
    logits, cache = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG, compression=comp)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(full_stream))
    np.testing.assert_array_equal(jnp.sum(cache.pos >= 0, axis=-1), TOKENS.shape[1] - 1)


@pytest.mark.parametrize(
    "ratio, min_budget, kept",
    [(0.25, 4, 5), (0.1, 4, 4)],  # max(floor(r * 20), B_min)
)
def test_prefill_protocol_compresses_the_prompt_once_then_keeps_every_token(
    ratio, min_budget, kept
):
    comp = Compression.make(
        "h2o", ratio=ratio, min_budget=min_budget, protocol="prefill", granularity="head"
    )
    assert comp.budget_for(PROMPT) == kept
    T = TOKENS.shape[1]
    assert comp.capacity(T, prompt_len=PROMPT) == kept + T - PROMPT
    # the prompt compressed on its own: the tokens the one eviction keeps
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT, stats=comp.stats)
    _, cache = decoder.prefill(PARAMS, TOKENS[:, :PROMPT], cache, config=CFG)
    once = eviction.evict(cache, comp, comp.policy.init(), key=jax.random.key(0))
    np.testing.assert_array_equal(jnp.sum(once.pos >= 0, axis=-1), kept)
    # teacher forcing the rest evicts nothing more: the cache grew by one per token fed
    _, final = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG, compression=comp)
    assert final.capacity == kept + T - PROMPT
    L, B, K = final.pos.shape[:3]
    for l in range(L):
        for b in range(B):
            for k in range(K):
                held = sorted(int(p) for p in final.pos[l, b, k] if p >= 0)
                prompt_kept = sorted(int(p) for p in once.pos[l, b, k] if p >= 0)
                assert held == prompt_kept + list(range(PROMPT, T - 1))


def test_decode_protocol_holds_the_budget_of_tokens_seen(full_stream):
    comp = Compression.make("h2o", ratio=0.25, min_budget=4, granularity="head")
    logits, final = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG, compression=comp)
    np.testing.assert_array_equal(jnp.sum(final.pos >= 0, axis=-1), 9)  # floor(0.25 * 39)
    assert not np.array_equal(np.asarray(logits), np.asarray(full_stream))


def test_generation_under_both_protocols():
    prompts = [list(range(1, 50)), list(range(5, 20))]
    full = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=6)
    for protocol in PROTOCOLS:
        one = Compression.make("snapkv", ratio=1.0, protocol=protocol)
        assert generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=6, compression=one) == (
            full
        )
        small = Compression.make("snapkv", ratio=0.25, min_budget=4, protocol=protocol)
        out = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=6, compression=small)
        assert [len(o) for o in out] == [6, 6]
    # a 64-token prompt keeps max(floor(0.25 * 64), B_min = 32) per row, then 6 new tokens
    assert Compression.make("h2o", ratio=0.25, protocol="prefill").capacity(70, prompt_len=64) == (
        32 + 6
    )


def test_protocol_errors_are_clear():
    with pytest.raises(ValueError, match="unknown protocol 'once'"):
        Compression.make("h2o", ratio=0.5, protocol="once")
    with pytest.raises(ValueError, match="prefill protocol needs prompt_len"):
        Compression.make("h2o", ratio=0.5, protocol="prefill").capacity(100)
