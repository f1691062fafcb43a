"""``critical:<policy>``: CriticalKV's two-stage selection, against a numpy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import eviction, kvcache
from jaxkv import stats as attn_stats
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import generate_tokens
from jaxkv.model import decoder
from jaxkv.model.params import init_params
from jaxkv.policies import get_policy

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
N = 24  # prompt tokens
# distinct ids: a repeated token has the same value and key norm, an exact tie of scores
TOKENS = jnp.stack([jax.random.permutation(jax.random.key(s), CFG.vocab_size)[:N] for s in (1, 2)])
BUDGET = 8


@pytest.fixture(scope="module")
def cache():
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=N, stats=("attn", "wo_vnorm"))
    return decoder.prefill(PARAMS, TOKENS[:, :N], cache, config=CFG)[1]


def _reference_norms(v_LBKCH, wo_LNHD):
    """||v W_o^(n)||_1 per slot, mean over the KV group's query heads, with loops."""
    L, B, K, C, _ = v_LBKCH.shape
    G = CFG.q_per_kv
    out = np.zeros((L, B, K, C))
    for l in range(L):
        for b in range(B):
            for k in range(K):
                for c in range(C):
                    norms = [
                        np.abs(v_LBKCH[l, b, k, c] @ wo_LNHD[l, k * G + g]).sum() for g in range(G)
                    ]
                    out[l, b, k, c] = np.mean(norms)
    return out


def _reference_kept(base_C, norm_C, budget, eps=1e-4, ratio=0.5):
    """Stage 1: the floor(ratio * B) best base scores; stage 2: the rest of the budget by
    (base + eps) * norm, with base shifted to be non-negative."""
    base = base_C - min(base_C.min(), 0.0)
    first = list(np.argsort(-base, kind="stable")[: int(ratio * budget)])
    rest = [c for c in np.argsort(-(base + eps) * norm_C, kind="stable") if c not in first]
    return set(first) | set(rest[: budget - len(first)])


def test_the_prefill_writes_the_projected_norms_of_the_loop_reference(cache):
    v = np.asarray(cache.v, np.float64)
    wo = np.asarray(PARAMS["layers"]["wo"], np.float64)
    want = _reference_norms(v, wo)
    np.testing.assert_allclose(np.asarray(cache.stats["wo_vnorm"]), want, rtol=1e-5)


def test_projected_norms_in_chunks_equal_the_loop_reference():
    """A prompt's norms are computed ``chunk`` tokens at a time (37 = 4 x 8 + 5: padding)."""
    v = jax.random.normal(jax.random.key(5), (2, CFG.n_kv_heads, 37, CFG.head_dim))
    wo = PARAMS["layers"]["wo"][0]
    want = _reference_norms(np.asarray(v, np.float64)[None], np.asarray(wo, np.float64)[None])[0]
    for chunk in (8, 37, 512):
        got = attn_stats.projected_value_norms(v, wo, chunk=chunk)
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_the_decoder_writes_each_slots_projected_norm_once(kv_dtype):
    """Prefill, three decode steps and an eviction between them: every resident slot's
    ``wo_vnorm`` is its value's projected norm (of an int8 cache: of the value before it was
    quantized, so within the quantization error of the stored one)."""
    comp = Compression.make("critical:h2o", budget=12, granularity="head")
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=N + 3, dtype=kv_dtype, stats=comp.stats)
    _, cache = decoder.prefill(PARAMS, TOKENS[:, :16], cache, config=CFG)
    cache = eviction.evict(cache, comp, comp.policy.init(), key=None)
    for t in range(16, 19):
        _, cache = decoder.decode_step(PARAMS, TOKENS[:, t], cache, config=CFG)
    want = _reference_norms(
        np.asarray(cache.values(), np.float64), np.asarray(PARAMS["layers"]["wo"])
    )
    got = np.asarray(cache.stats["wo_vnorm"])
    held = np.asarray(cache.pos) >= 0
    assert held.sum(-1).max() == 15 and held.sum(-1).min() == 15  # 12 kept + 3 new per row
    tol = 1e-5 if kv_dtype is None else 2e-2
    np.testing.assert_allclose(got[held], want[held], rtol=tol)


@pytest.mark.parametrize("inner", ["tova", "knorm"])  # attention mass; negative scores
def test_two_stage_selection_equals_the_numpy_reference(inner, cache):
    comp = Compression.make("critical:" + inner, budget=BUDGET, granularity="head")
    out = eviction.evict(cache, comp, comp.policy.init(), key=jax.random.key(0))
    if inner == "tova":
        base = np.asarray(cache.stats["attn"], np.float64)
    else:
        base = -np.linalg.norm(np.asarray(cache.k, np.float64), axis=-1)
    norms = _reference_norms(np.asarray(cache.v, np.float64), np.asarray(PARAMS["layers"]["wo"]))
    plain = eviction.evict(
        cache, Compression.make(inner, budget=BUDGET, granularity="head"), None, key=None
    )
    differs = False
    for l in range(CFG.n_layers):
        for b in range(2):
            for k in range(CFG.n_kv_heads):
                kept = set(np.flatnonzero(np.asarray(out.pos[l, b, k]) >= 0))
                assert kept == _reference_kept(base[l, b, k], norms[l, b, k], BUDGET), (l, b, k)
                differs |= kept != set(np.flatnonzero(np.asarray(plain.pos[l, b, k]) >= 0))
    assert differs  # the projected norms changed the choice somewhere


def test_critical_reads_the_cache_and_wraps_only_scorers():
    policy = get_policy("critical:h2o", first_stage_ratio=0.25)
    assert dict(policy.spec)["first_stage_ratio"] == 0.25
    assert policy.init() is None  # h2o's state: the norms are in the cache, not the state
    assert policy.stats == ("attn_cum", "wo_vnorm")
    assert policy.granularities == get_policy("h2o").granularities
    for bad in ("critical:oracle", "critical:full", "critical:critical:h2o"):
        with pytest.raises(ValueError, match="critical"):
            get_policy(bad)


def test_generation_runs_it_and_r1_equals_the_full_cache():
    prompts = [list(range(1, 50)), list(range(5, 20))]
    comp = Compression.make("critical:snapkv", ratio=0.25, min_budget=4)
    out = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=4, compression=comp)
    assert [len(o) for o in out] == [4, 4]
    one = dataclasses.replace(comp, ratio=1.0)
    full = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=4)
    assert generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=4, compression=one) == full
