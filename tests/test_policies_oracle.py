"""``oracle``: the full-cache attention of the future queries, against the numpy reference
decoder, and the tokens it keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_reference import RefModel

from jaxkv import eviction, kvcache
from jaxkv.cli import eval as eval_lib
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import full_cache_attention, teacher_forced
from jaxkv.model import decoder
from jaxkv.model.params import init_params
from jaxkv.policies import get_policy
from jaxkv.policies import oracle as oracle_lib

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)
PROMPT = 20


@pytest.fixture(scope="module")
def attention():
    return np.asarray(full_cache_attention(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG))


@pytest.fixture(scope="module")
def reference():
    """[Q, L, K, T] attention of the queries at positions PROMPT..T-2 of sequence 0, each row
    from the numpy decoder's full-cache pass of that token (its ``attn`` statistic)."""
    toks = np.asarray(TOKENS[0])
    T, L, K = len(toks), CFG.n_layers, CFG.n_kv_heads
    ref = RefModel(PARAMS, CFG)
    empty = {(l, k): [] for l in range(L) for k in range(K)}
    ref.run_pass(toks[:PROMPT], list(range(PROMPT)), empty)
    rows = []
    for p in range(PROMPT, T - 1):
        ref.run_pass(
            toks[p : p + 1], [p], {(l, k): list(range(p)) for l in range(L) for k in range(K)}
        )
        row = np.zeros((L, K, T))
        for (l, k, q), st in ref.stats.items():
            row[l, k, q] = st["attn"]
        rows.append(row)
    return np.stack(rows)


def test_full_cache_attention_equals_the_numpy_decoder(attention, reference):
    Q, T = TOKENS.shape[1] - PROMPT - 1, TOKENS.shape[1]
    assert attention.shape == (Q, CFG.n_layers, 2, CFG.n_kv_heads, T)
    np.testing.assert_allclose(attention[:, :, 0], reference, atol=2e-6, rtol=0)
    np.testing.assert_allclose(attention.sum(-1), 1.0, rtol=1e-5)  # each query's mass
    for i in range(Q):  # nothing on positions after the query
        assert not attention[i, ..., PROMPT + i + 1 :].any()


@pytest.mark.parametrize("budget", [6, 11])
def test_oracle_keeps_the_most_attended_future_tokens(attention, reference, budget):
    """After prefill the oracle keeps each row's top-B of the attention summed over every
    continuation query; one step later, the queries from the next one on."""
    state = oracle_lib.future_attention(jnp.asarray(attention), first_query=PROMPT)
    comp = Compression.make("oracle", budget=budget, granularity="head")
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT + 1)
    _, cache = decoder.prefill(PARAMS, TOKENS[:, :PROMPT], cache, config=CFG)
    after_prefill = eviction.evict(cache, comp, state, key=None)
    _, stepped = decoder.decode_step(PARAMS, TOKENS[:, PROMPT], cache, config=CFG)
    after_step = eviction.evict(stepped, comp, state, key=None)
    for evicted, first, n in ((after_prefill, 0, PROMPT), (after_step, 1, PROMPT + 1)):
        future = reference[first:].sum(axis=0)  # [L, K, T], sequence 0
        for l in range(CFG.n_layers):
            for k in range(CFG.n_kv_heads):
                kept = {int(p) for p in evicted.pos[l, 0, k] if p >= 0}
                assert kept == set(np.argsort(-future[l, k, :n])[:budget]), (first, l, k)


def test_oracle_is_the_bound_in_teacher_forcing_and_an_error_elsewhere(attention, tmp_path):
    state = oracle_lib.future_attention(jnp.asarray(attention), first_query=PROMPT)
    full = teacher_forced(PARAMS, TOKENS, prompt_len=PROMPT, config=CFG)[0]
    kl = {}
    for name in ("oracle", "h2o"):
        comp = Compression.make(name, ratio=0.25, min_budget=4, granularity="head")
        logits = teacher_forced(
            PARAMS,
            TOKENS,
            prompt_len=PROMPT,
            config=CFG,
            compression=comp,
            policy_state=state if name == "oracle" else None,
        )[0]
        p, q = jax.nn.log_softmax(full), jax.nn.log_softmax(logits)
        kl[name] = float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), axis=-1)))
    assert kl["oracle"] < kl["h2o"]
    with pytest.raises(ValueError, match="only the fidelity evaluation"):
        get_policy("oracle").init()
    with pytest.raises(ValueError, match="only the fidelity evaluation"):
        teacher_forced(
            PARAMS,
            TOKENS,
            prompt_len=PROMPT,
            config=CFG,
            compression=Compression.make("oracle", ratio=0.5),
        )
    for args in (
        ["generate", "--model", "tiny", "--prompt", "hi", "--policy", "oracle"],
        ["retrieval", "--model", "tiny", "--policies", "full,oracle", "--out", str(tmp_path)],
    ):
        assert eval_lib.main(args) == 2
