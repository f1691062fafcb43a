"""The compression engine: statistics, policies, budgets, eviction, compressed generation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from np_reference import RefModel

from jaxkv import eviction, kvcache, stats
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import DecodeState, Sampling, decode_loop, generate_tokens, teacher_forced
from jaxkv.model import cache_kernel, decoder
from jaxkv.model.params import init_params
from jaxkv.policies import Policy, get_policy, policy_names
from jaxkv.policies.learned import init_mlp, learned_policy

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
HEURISTICS = ["random", "streaming_llm", "h2o", "snapkv", "tova", "keydiff", "knorm"]
TOKENS = jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size)


@pytest.fixture(scope="module")
def full_stream():
    return teacher_forced(PARAMS, TOKENS, prompt_len=12, config=CFG)[0]


@pytest.mark.parametrize("name", HEURISTICS)
def test_ratio_one_equals_full_cache_logit_for_logit(name, full_stream):
    comp = Compression.make(name, ratio=1.0)
    logits, cache = teacher_forced(PARAMS, TOKENS, prompt_len=12, config=CFG, compression=comp)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(full_stream))


def test_budget_above_tokens_seen_equals_full_cache(full_stream):
    big_budget = Compression.make("snapkv", budget=64)
    logits, _ = teacher_forced(PARAMS, TOKENS, prompt_len=12, config=CFG, compression=big_budget)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(full_stream))


def test_ratio_one_generation_equals_full_cache_with_ragged_batch():
    prompts = [list(range(1, 40)), list(range(5, 20)), [7, 8, 9]]
    full = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=8)
    for name in HEURISTICS:
        comp = Compression.make(name, ratio=1.0)
        assert (
            generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=8, compression=comp) == full
        )


@pytest.mark.parametrize("name", HEURISTICS)
def test_every_policy_compresses_a_ragged_batch_under_jit(name):
    prompts = [list(range(1, 50)), list(range(5, 20))]
    comp = Compression.make(name, ratio=0.25, min_budget=4)
    out = generate_tokens(PARAMS, prompts, config=CFG, max_new_tokens=6, compression=comp)
    assert [len(o) for o in out] == [6, 6]
    assert all(0 <= t < CFG.vocab_size for o in out for t in o)


@pytest.mark.parametrize("name", [*HEURISTICS, "learned"])
def test_a_cache_with_only_the_statistics_a_policy_reads_evicts_the_same(name):
    policy = (
        learned_policy(init_mlp(key=jax.random.key(3))) if name == "learned" else get_policy(name)
    )
    every = dataclasses.replace(policy, stats=kvcache.STAT_NAMES)
    runs = []
    for p in (policy, every):
        comp = Compression(policy=p, ratio=0.25, min_budget=4)
        runs.append(teacher_forced(PARAMS, TOKENS, prompt_len=20, config=CFG, compression=comp))
    (lean_logits, lean), (all_logits, full) = runs
    assert set(lean.stats) == set(policy.stats)
    assert set(full.stats) == set(kvcache.STAT_NAMES)
    np.testing.assert_array_equal(np.asarray(lean.pos), np.asarray(full.pos))
    np.testing.assert_array_equal(np.asarray(lean_logits), np.asarray(all_logits))
    # Two programs (the caches carry different statistics): XLA may fuse their reductions
    # differently. Equal to the last bit under XLA:CPU's fusion emitters; under the legacy
    # emitters the suite compiles with (tests/conftest.py), a statistic of the learned
    # policy's was 1-2 float32 ulp apart while the positions and the logits stayed equal.
    for n in lean.stats:
        np.testing.assert_array_max_ulp(np.asarray(lean.stats[n]), np.asarray(full.stats[n]), 2)


def test_budget_follows_tokens_seen_and_the_cache_really_shrinks():
    comp = Compression.make("h2o", ratio=0.25)
    np.testing.assert_array_equal(comp.budget_for(jnp.array([10, 200, 4000])), [32, 50, 1000])
    n_max = 4096 + 64
    assert comp.capacity(n_max) == 1040 + 1
    full = jax.eval_shape(lambda: kvcache.init_cache(CFG, batch_size=8, capacity=n_max))
    small = jax.eval_shape(
        lambda: kvcache.init_cache(CFG, batch_size=8, capacity=comp.capacity(n_max), stats=True)
    )
    nbytes = lambda c: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(c))  # noqa: E731
    assert nbytes(small) / nbytes(full) < 0.30
    _, cache = teacher_forced(
        PARAMS,
        TOKENS,
        prompt_len=12,
        config=CFG,
        compression=Compression.make("h2o", ratio=0.25, min_budget=4),
    )
    assert cache.capacity == 11  # floor(0.25 * 40) + 1 slot of slack
    np.testing.assert_array_equal(jnp.sum(cache.pos >= 0, axis=-1), 9)  # floor(0.25 * 39)


def _run_with_reference(comp, config=CFG, n_steps=5, prompt_len=10):
    """Runs jaxkv (prefill + evict + decode/evict steps) beside the numpy reference, which
    sees exactly the tokens jaxkv kept. Yields (jax logits, ref logits, cache, ref)."""
    toks = np.asarray(TOKENS[0, : prompt_len + n_steps])
    ref = RefModel(PARAMS, config, window=comp.policy.window)
    cache = kvcache.init_cache(
        config, batch_size=1, capacity=prompt_len + n_steps, stats=True, window=comp.policy.window
    )
    state = comp.policy.init()
    logits, cache = decoder.prefill(
        PARAMS, jnp.asarray(toks[None, :prompt_len]), cache, config=config
    )
    empty = {(l, k): [] for l in range(config.n_layers) for k in range(config.n_kv_heads)}
    ref_logits = ref.run_pass(toks[:prompt_len], list(range(prompt_len)), empty)
    yield logits[0], ref_logits[-1], cache, ref
    for t in range(prompt_len, prompt_len + n_steps):
        cache = eviction.evict(cache, comp, state, key=jax.random.key(t), max_drop=cache.capacity)
        visible = {
            (l, k): [int(p) for p in cache.pos[l, 0, k] if p >= 0]
            for l in range(config.n_layers)
            for k in range(config.n_kv_heads)
        }
        logits, cache = decoder.decode_step(
            PARAMS, jnp.asarray(toks[t : t + 1]), cache, config=config
        )
        ref_logits = ref.run_pass(toks[t : t + 1], [t], visible)
        yield logits[0], ref_logits[-1], cache, ref


def _assert_stats_match(cache, ref):
    for l in range(CFG.n_layers):
        for k in range(CFG.n_kv_heads):
            for slot, p in enumerate(np.asarray(cache.pos[l, 0, k])):
                if p < 0:
                    continue
                want = ref.stats[(l, k, int(p))]
                for name in kvcache.STAT_NAMES:
                    got = float(cache.stats[name][l, 0, k, slot])
                    assert got == pytest.approx(want[name], rel=1e-4, abs=1e-6), (name, l, k, p)


@pytest.mark.parametrize("granularity", ["shared", "head"])
def test_statistics_and_logits_equal_brute_force_after_evictions(granularity):
    comp = Compression.make("h2o", ratio=0.5, min_budget=3, granularity=granularity)
    for logits, ref_logits, cache, ref in _run_with_reference(comp):
        np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=2e-5, rtol=0)
        _assert_stats_match(cache, ref)


@pytest.mark.parametrize("max_slab", [stats.MAX_SLAB, 0])
@pytest.mark.parametrize(
    "names", [kvcache.STAT_NAMES, ("attn_sq",), ("recent", "attn"), ("vnorm",)]
)
def test_decode_contributions_equal_each_channels_product_bit_for_bit(names, max_slab, monkeypatch):
    """One query per row (decode), one of them padding, with and without the slab: every
    statistic equals the mean over heads of probability x its channel's weight (x the entropy
    for recent_ent), squared after for attn_sq, as the general path defines them, to the last
    bit."""
    monkeypatch.setattr(stats, "MAX_SLAB", max_slab)
    rng = np.random.default_rng(3)
    B, K, G, S = 3, 2, 3, 7
    parts = [jax.nn.softmax(jnp.asarray(rng.normal(size=(B, K, G, 1, n))), axis=-1) for n in (S, 1)]
    pos_BT = jnp.array([[9], [-1], [4]], jnp.int32)
    w = stats.query_weights(pos_BT, window=5)
    got = stats.contributions(parts, w, names)
    ent = sum(stats.entropy(p) for p in parts)
    for p, out in zip(parts, got, strict=True):
        assert set(out) == {n for n in names if n != "vnorm"}
        for n in out:
            c = {"attn": 0, "attn_sq": 0, "attn_cum": 1, "recent": 2, "recent_ent": 2}[n]
            wq = w[:, None, None, :, c] * (ent if n == "recent_ent" else 1.0)
            m = p[:, :, :, 0] * wq[..., 0, None]
            want = stats._mean_over_heads(m**2 if n == "attn_sq" else m)
            np.testing.assert_array_equal(np.asarray(out[n]), np.asarray(want), err_msg=n)
            assert not np.any(np.asarray(out[n])[1])  # the padding query adds nothing


@pytest.mark.parametrize("max_slab", [0, 3 * 2 * 1, 3 * 2 * 7 - 1, 3 * 2 * 7])
def test_decode_slab_takes_every_part_or_none(max_slab, monkeypatch):
    """The cache slots and the new token go through the slab together or not at all: a cache
    part above ``MAX_SLAB`` keeps its new token's part off the slab too (mixing the paths cost
    ~10 ms a step at batch 8 x 2145 slots)."""
    monkeypatch.setattr(stats, "MAX_SLAB", max_slab)
    calls = []
    slab = stats._decode_slab
    monkeypatch.setattr(stats, "_decode_slab", lambda *a: calls.append(1) or slab(*a))
    rng = np.random.default_rng(4)
    parts = [jax.nn.softmax(jnp.asarray(rng.normal(size=(3, 2, 3, 1, n))), axis=-1) for n in (7, 1)]
    w = stats.query_weights(jnp.array([[9], [2], [4]], jnp.int32), window=5)
    stats.contributions(parts, w, kvcache.STAT_NAMES)
    assert len(calls) == (2 if max_slab >= 3 * 2 * 7 else 0)


def _reference_drops(scores, pos, keep, max_drop, keep_rows):
    """Each row's min(occupied - keep, max_drop) lowest-scored occupied slots, ties to the
    lower slot, written out (+-0.0 compare equal, as in a sort by value)."""
    drop = np.zeros(scores.shape, bool)
    for row in np.ndindex(scores.shape[:-1]):
        occupied = [c for c in range(scores.shape[-1]) if pos[row][c] >= 0]
        n = 0 if keep_rows[row] else max(len(occupied) - keep[row], 0)
        order = sorted(occupied, key=lambda c: (scores[row][c], c))
        drop[row][order[: min(n, max_drop)]] = True
    return drop


def _needs_kernel(select):
    if select == "kernel" and not cache_kernel.available():
        pytest.skip(f"no compiled kernels here: {cache_kernel.unavailable_reason()}")


def _kernel_drops(scores, pos, keep, *, max_drop, keep_rows):
    keep = jnp.where(keep_rows, jnp.iinfo(jnp.int32).max, keep)
    return cache_kernel.drop_lowest(scores, pos, keep, max_drop=max_drop) < 0


@pytest.mark.parametrize("select", ["xla", "kernel"])
@pytest.mark.parametrize("max_drop", [1, 3, eviction._TOP_K_DROPS + 1, 200])
def test_drop_mask_frees_each_rows_lowest_slots_as_written_out(max_drop, select):
    """Both ways of taking the candidates (lax.top_k up to _TOP_K_DROPS, a bisection above),
    and the compiled kernel (its sorted buffer up to 64 drops, a partial sort above), against
    the reference: ties everywhere (+-0.0 among them), free slots, per-row budgets, rows that
    keep everything, rows asked to drop more than max_drop."""
    _needs_kernel(select)
    rng = np.random.default_rng(7)
    L, B, K, C = 2, 2, 3, 150
    scores = rng.choice(np.float32([-0.0, 0.0, 0.5, 2.0, -1.0]), size=(L, B, K, C))
    scores[0, 0, 0] = rng.normal(size=C)  # one row without ties
    pos = np.where(rng.uniform(size=(L, B, K, C)) < 0.3, -1, 1).astype(np.int32)
    keep = rng.integers(0, 120, size=(L, B, K)).astype(np.int32)
    keep_rows = np.zeros((L, B, K), bool)
    keep_rows[1, 1, 2] = True
    drops = eviction.drop_mask if select == "xla" else _kernel_drops
    got = drops(
        jnp.asarray(scores),
        jnp.asarray(pos),
        jnp.asarray(keep),
        max_drop=max_drop,
        keep_rows=jnp.asarray(keep_rows),
    )
    want = _reference_drops(scores, pos, keep, max_drop, keep_rows)
    np.testing.assert_array_equal(np.asarray(got) & (pos >= 0), want)
    assert max_drop == 200 or (want.sum(-1) == max_drop).any()  # the bound binds in a row


@pytest.mark.parametrize("granularity", eviction.GRANULARITIES)
def test_eviction_through_the_kernel_frees_the_same_slots(granularity):
    """``evict(kernel=True)`` (``cache_kernel.drop_lowest``) frees exactly the slots
    ``drop_mask`` frees, at every granularity (token sets, per-row and pooled budgets), with
    and without rows that keep everything, after prefill and for a few decode drops."""
    _needs_kernel("kernel")
    comp = Compression.make("h2o", ratio=0.5, min_budget=4, granularity=granularity)
    tokens = jax.random.randint(jax.random.key(3), (2, 24), 0, CFG.vocab_size)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=24, stats=comp.stats)
    _, cache = decoder.prefill(PARAMS, tokens, cache, config=CFG)
    rows = jnp.zeros(cache.pos.shape[:3], bool).at[0, 1, 0].set(True)
    for keep_rows in (None, rows):
        for max_drop in (cache.capacity, 3):
            kw = dict(key=jax.random.key(0), max_drop=max_drop, keep_rows=keep_rows)
            want = eviction.evict(cache, comp, None, **kw)
            got = eviction.evict(cache, comp, None, **kw, kernel=True)
            np.testing.assert_array_equal(np.asarray(got.pos), np.asarray(want.pos))
            assert (np.asarray(got.pos) < 0).sum() > (np.asarray(cache.pos) < 0).sum()


def test_sliding_window_positions_stay_right_after_eviction():
    comp = Compression.make("streaming_llm", ratio=0.5, min_budget=4)
    for logits, ref_logits, _, _ in _run_with_reference(comp, CFG.replace(sliding_window=6)):
        np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=2e-5, rtol=0)


def test_streaming_llm_keeps_exactly_sinks_and_most_recent():
    comp = Compression.make("streaming_llm", budget=10)
    _, cache = teacher_forced(PARAMS, TOKENS, prompt_len=20, config=CFG, compression=comp)
    kept = sorted(int(p) for p in cache.pos[0, 0, 0] if p >= 0)
    assert kept == [0, 1, 2, 3] + list(range(33, 39))
    assert bool(jnp.all(cache.pos == cache.pos[:1, :, :1]))  # one set for all layers/heads


def test_h2o_scores_are_accumulated_attention_plus_recent_window():
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=16, stats=True)
    _, cache = decoder.prefill(PARAMS, TOKENS[:1, :16], cache, config=CFG)
    pol = get_policy("h2o", recent_fraction=0.25)
    s = pol.score(None, cache, budget_B=jnp.array([8]), key=None)
    recent = np.asarray(cache.pos) >= 14  # 25 % of 8 = 2 most recent positions
    cum = np.asarray(cache.stats["attn_cum"])
    unit = cum / cum.max(axis=-1, keepdims=True)  # heavy hitters scaled into [0, 1) per row
    np.testing.assert_allclose(np.asarray(s)[~recent], unit[~recent], rtol=1e-6)
    recency = np.asarray(cache.pos) / 15.0  # the recent tier ranks by recency
    np.testing.assert_allclose(np.asarray(s)[recent], 2.0 + recency[recent], rtol=1e-6)
    # prefill accumulated attention: column sums of the causal attention, mean over heads
    assert float(jnp.sum(cache.stats["attn_cum"][0, 0, 0])) == pytest.approx(16.0, rel=1e-5)


def test_per_head_selection_keeps_different_tokens_in_different_heads():
    comp = Compression.make("tova", budget=6, granularity="head")
    _, cache = teacher_forced(PARAMS, TOKENS, prompt_len=20, config=CFG, compression=comp)
    sets = {
        tuple(sorted(int(p) for p in cache.pos[l, 0, k] if p >= 0))
        for l in range(CFG.n_layers)
        for k in range(CFG.n_kv_heads)
    }
    assert len(sets) > 1
    assert all(len(s) == 6 for s in sets)


def test_layer_granularity_shares_tokens_within_a_layer_only():
    comp = Compression.make("tova", budget=6, granularity="layer")
    _, cache = teacher_forced(PARAMS, TOKENS, prompt_len=20, config=CFG, compression=comp)
    assert bool(jnp.all(cache.pos == cache.pos[:, :, :1]))


def test_head_level_hybrid_keeps_every_token_in_the_chosen_heads():
    comp = Compression.make("h2o", budget=6, granularity="head", full_heads=0.25)
    _, cache = teacher_forced(PARAMS, TOKENS, prompt_len=20, config=CFG, compression=comp)
    counts = np.asarray(jnp.sum(cache.pos >= 0, axis=-1))[:, 0]  # [L, K]
    assert (counts == 39).sum() == 1 and (counts == 6).sum() == CFG.n_layers * CFG.n_kv_heads - 1


def test_hybrid_full_rows_match_a_numpy_reference():
    """The rows the hybrid keeps whole: those losing the largest share of their cumulative
    attention mass to the budget (each row's masses sorted, the budget's largest kept),
    recomputed in numpy on random masses with ties, zeros and empty slots."""
    comp = Compression.make("h2o", budget=5, granularity="head", full_heads=0.25)
    cache = kvcache.init_cache(CFG, batch_size=3, capacity=16, stats=True)
    rng = np.random.default_rng(0)
    L, B, K, C = cache.pos.shape
    pos = np.where(rng.random((L, B, K, C)) < 0.8, np.arange(C), -1).astype(np.int32)
    mass = rng.choice([0.0, 0.25, 0.5, 1.0, 2.0], size=(L, B, K, C)).astype(np.float32)
    mass += rng.random((L, B, K, C)).astype(np.float32) * (rng.random((L, B, K, C)) < 0.5)
    stats_ = dict(cache.stats, attn_cum=jnp.asarray(mass))
    cache = cache.replace(pos=jnp.asarray(pos), length=jnp.full((B,), C), stats=stats_)
    got = np.asarray(eviction.hybrid_full_rows(cache, comp))
    m = np.where(pos >= 0, mass, 0.0).astype(np.float32)
    kept = -np.sort(-m, axis=-1)[..., : comp.budget].sum(-1, dtype=np.float32)
    lost = 1.0 - kept / np.maximum(m.sum(-1, dtype=np.float32), 1e-30)  # [L, B, K]
    n_full = round(0.25 * L * K)
    flat = np.moveaxis(lost, 1, 0).reshape(B, L * K)
    thresh = -np.sort(-flat, axis=-1)[:, n_full - 1]
    np.testing.assert_array_equal(got, lost >= thresh[None, :, None])
    assert (got.sum(axis=(0, 2)) >= n_full).all()


def test_features_follow_their_definitions():
    cache = kvcache.init_cache(CFG, batch_size=1, capacity=12, stats=True)
    _, cache = decoder.prefill(PARAMS, TOKENS[:1, :12], cache, config=CFG)
    f = np.asarray(stats.features(cache))[0]
    st = {n: np.asarray(a)[:, 0] for n, a in cache.stats.items()}  # [L, K, C]
    np.testing.assert_allclose(f[:, 0], st["attn"].mean(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_allclose(f[:, 1], st["vnorm"].mean(axis=(0, 1)), rtol=1e-6)
    np.testing.assert_allclose(
        f[:, 2], st["attn_sq"].mean((0, 1)) - st["attn"].mean((0, 1)) ** 2, atol=1e-7
    )
    np.testing.assert_allclose(
        f[:, 3], st["recent_ent"].sum((0, 1)) / st["recent"].sum((0, 1)), rtol=1e-5
    )
    np.testing.assert_allclose(f[:, 4], np.arange(12) / 12)
    assert abs(f[0, 0] - f[0, 0]) == 0 and f[:, 0].sum() == pytest.approx(1.0, rel=1e-5)


def test_decode_loop_with_compression_keeps_carry_shapes():
    comp = Compression.make("snapkv", ratio=0.5, min_budget=4)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=8, stats=True)
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
            stop_tokens=(),
            pad_id=0,
            key=jax.random.key(0),
            compression=comp,
        ),
        state,
    )
    shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
    assert shapes(out) == shapes(state)


def test_invalid_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown policy 'h3o'.*snapkv"):
        get_policy("h3o")
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
            Compression.make("h2o", ratio=bad)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        Compression.make("h2o", budget=0)
    with pytest.raises(ValueError, match="exactly one"):
        Compression.make("h2o")
    with pytest.raises(ValueError, match="granularity 'diagonal'"):
        Compression.make("h2o", ratio=0.5, granularity="diagonal")
    only_shared = Policy("mine", score=lambda *a, **k: None, granularities=("shared",))
    with pytest.raises(ValueError, match="does not support granularity 'head'"):
        Compression(only_shared, ratio=0.5, granularity="head")
    with pytest.raises(ValueError, match="hybrid"):
        Compression.make("h2o", ratio=0.5, full_heads=0.2)
    assert "learned:<checkpoint>" in policy_names()
    with pytest.raises(ValueError, match=r"unknown cache statistics \['attention'\]; valid"):
        kvcache.init_cache(CFG, batch_size=1, capacity=4, stats=("attention",))
    with pytest.raises(ValueError, match=r"unknown cache statistics \['attention'\]; valid"):
        Policy("mine", score=lambda *a, **k: None, stats=("attention",))


def test_bad_budget_is_named_even_beside_a_ratio():
    # ``generate --budget 0`` used to pass the default ratio too and got "give exactly one"
    with pytest.raises(ValueError, match="budget must be >= 1, got 0"):
        Compression.make("h2o", ratio=0.25, budget=0)
    with pytest.raises(ValueError, match="not both"):
        Compression.make("h2o", ratio=0.25, budget=8)
    for field in ("budget", "min_budget", "evict_every"):
        with pytest.raises(ValueError, match=f"{field} must be an integer"):
            Compression.make("h2o", **{"ratio": None, "budget": 8, field: 2.5})


@pytest.mark.parametrize("name", ["snapkv", "h2o", "streaming_llm"])
def test_evict_after_prefill_reaches_the_budget_by_default(name):
    # the README's snippet: prefill 256 tokens, then one evict() call without max_drop
    comp = Compression.make(name, ratio=0.25, min_budget=32)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=256, stats=comp.stats)
    tokens = jax.random.randint(jax.random.key(4), (2, 256), 0, CFG.vocab_size)
    _, cache = decoder.prefill(PARAMS, tokens, cache, config=CFG)
    evicted = eviction.evict(cache, comp, comp.policy.init(), key=jax.random.key(5))
    np.testing.assert_array_equal(jnp.sum(evicted.pos >= 0, axis=-1), 64)  # floor(0.25 * 256)
    # the decode path's bounded form still frees at most max_drop slots per call
    one = eviction.evict(cache, comp, comp.policy.init(), key=jax.random.key(5), max_drop=1)
    np.testing.assert_array_equal(jnp.sum(one.pos >= 0, axis=-1), 255)
