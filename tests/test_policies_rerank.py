"""``rerank:<policy>``: the transplant against a brute-force reference, kvzip's per-row counts
with the inner policy's tokens through the real eviction, and where it cannot run."""

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxkv import eviction, kvcache
from jaxkv.cli import eval as eval_lib
from jaxkv.config import ModelConfig
from jaxkv.evals import fidelity
from jaxkv.evals.runner import ByteTokenizer, EvalModel
from jaxkv.eviction import Compression
from jaxkv.model import decoder
from jaxkv.model.params import init_params
from jaxkv.policies import TIER, get_policy
from jaxkv.policies import rerank as rerank_lib

_BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_rank_blend.py"
_spec = importlib.util.spec_from_file_location("bench_rank_blend", _BENCH)
bench_rank_blend = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_rank_blend)  # the composition rank_blend replaced

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
MODEL = EvalModel("tiny", CFG, PARAMS, ByteTokenizer(), stop_tokens=(0,), pad_id=0)
PROMPT = 12
WINDOWS = np.asarray(jax.random.randint(jax.random.key(1), (2, 20), 1, 256), np.int32)


def test_transplant_against_brute_force():
    rng = np.random.default_rng(0)
    alloc = rng.random((2, 3, 2, 9))
    alloc[..., :2] += TIER  # protected slots
    order = rng.normal(size=alloc.shape)
    valid = rng.random(alloc.shape) > 0.2
    valid[..., :2] = True
    got = np.asarray(rerank_lib.transplant(alloc, order, valid))
    for idx in np.ndindex(alloc.shape[:-1]):
        a, o, v = alloc[idx], order[idx], valid[idx]
        want = np.full(a.shape, -np.inf)
        slots = sorted(
            np.flatnonzero(v), key=lambda c: (-a[c], 0) if a[c] >= TIER else (-TIER, -o[c])
        )
        for c, value in zip(slots, sorted(a[v], reverse=True), strict=True):
            want[c] = value
        np.testing.assert_allclose(got[idx], want, rtol=1e-6)


@pytest.mark.parametrize(
    "name,floor,cap", [("h2o", 0.0, 8.0), ("h2o", 0.2, 2.0), ("critical:h2o", 0.0, 8.0)]
)
def test_rows_keep_kvzips_counts_and_the_inner_policys_tokens(name, floor, cap):
    policy = get_policy("rerank:" + name)
    state = fidelity.window_state(MODEL, policy, WINDOWS, PROMPT)
    kvzip_state = fidelity.window_state(MODEL, get_policy("kvzip"), WINDOWS, PROMPT)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT, stats=policy.stats)
    _, cache = decoder.prefill(PARAMS, WINDOWS[:, :PROMPT], cache, config=CFG)
    pooled = {"granularity": "global", "protocol": "prefill", "head_floor": floor, "head_cap": cap}
    comp = lambda name: Compression.make(name, budget=5, **pooled)  # noqa: E731
    ours = eviction.evict(cache, comp("rerank:" + name), state, key=None)
    theirs = eviction.evict(cache, comp("kvzip"), kvzip_state, key=None)
    inner = get_policy(name)  # its own scores (h2o: accumulated attention, its recent window)
    budget_B = comp(name).budget_for(cache.length)
    scores = np.asarray(inner.score(inner.init(), cache, budget_B=budget_B, key=None))
    counts = set()
    for idx in np.ndindex(cache.pos.shape[:-1]):
        got = {int(p) for p in ours.pos[idx] if p >= 0}
        n = int(np.sum(np.asarray(theirs.pos[idx]) >= 0))
        assert len(got) == n
        sinks = [p for p in range(4) if p < PROMPT]  # kvzip's sinks, first in every row
        rest = [int(p) for p in np.argsort(-scores[idx][:PROMPT], stable=True) if p not in sinks]
        assert got == set((sinks + rest)[:n])
        counts.add(n)
    assert len(counts) > 1  # the allocation is uneven: the test sees kvzip's, not a uniform one


def test_rerank_runs_where_kvzip_runs_and_refuses_the_rest(tmp_path):
    assert get_policy("rerank:h2o").window_input == "reconstruction"
    with pytest.raises(ValueError, match="only the fidelity evaluation"):
        get_policy("rerank:h2o").init()
    for bad in ("rerank:kvzip", "rerank:oracle", "rerank:full", "rerank:rerank:h2o"):
        with pytest.raises(ValueError, match="rerank:"):
            get_policy(bad)
    common = ["--model", "tiny", "--policies", "full,rerank:h2o", "--limit", "1", "--window",
              "48", "--prompt-len", "32", "--ratios", "0.5,1"]  # fmt: skip
    prefill = [*common, "--protocol", "prefill", "--granularity", "global"]
    assert eval_lib.main(["fidelity", *prefill, "--out", str(tmp_path / "ok")]) == 0
    assert eval_lib.main(["fidelity", *common, "--out", str(tmp_path / "decode")]) == 2
    assert not (tmp_path / "decode").exists()


def test_blend_against_a_numpy_reference():
    rng = np.random.default_rng(1)
    order = rng.normal(size=(2, 1, 3, 7)) * 3 + 1
    recon = rng.random(order.shape) + 1e-3
    valid = rng.random(order.shape) > 0.25
    valid[..., :2] = True
    got = np.asarray(rerank_lib.blend(order, recon, valid, 0.3))
    for idx in np.ndindex(order.shape[:-1]):
        v = valid[idx]
        z = lambda x, v=v: (x - x[v].mean()) / x[v].std()  # noqa: E731
        want = np.where(v, 0.3 * z(order[idx]) + 0.7 * z(np.log(recon[idx])), -np.inf)
        np.testing.assert_allclose(got[idx], want, rtol=1e-5, atol=1e-5)


def _kept(name: str, floor=0.2, cap=2.0):
    policy = get_policy(name)
    state = fidelity.window_state(MODEL, policy, WINDOWS, PROMPT)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT, stats=policy.stats)
    _, cache = decoder.prefill(PARAMS, WINDOWS[:, :PROMPT], cache, config=CFG)
    pooled = {"granularity": "global", "protocol": "prefill", "head_floor": floor, "head_cap": cap}
    comp = Compression.make(name, budget=5, **pooled)
    pos = np.asarray(eviction.evict(cache, comp, state, key=None).pos)
    return [frozenset(int(p) for p in pos[idx] if p >= 0) for idx in np.ndindex(pos.shape[:-1])]


def test_blend_weights_zero_and_one_are_kvzip_and_rerank():
    assert _kept("rerank@0:h2o") == _kept("kvzip")
    assert get_policy("rerank@1:h2o").name == "rerank:h2o"
    assert _kept("rerank@1:h2o") == _kept("rerank:h2o")
    half = _kept("rerank@0.5:h2o")
    assert [len(s) for s in half] == [len(s) for s in _kept("kvzip")]  # kvzip's counts
    assert half not in (_kept("kvzip"), _kept("rerank:h2o"))  # a third order on this cache


@pytest.mark.parametrize(
    "bad", ["rerank@1.5:h2o", "rerank@x:h2o", "rerank@0.5:", "rerank@0.5:rerank:h2o"]
)
def test_bad_blend_names_are_refused(bad):
    with pytest.raises(ValueError, match="rerank"):
        get_policy(bad)


def _mix_rows(seed: int, n_slots: int):
    """alloc (two protected slots a row, ties), other (many ties) and valid, [2, 3, 2, n]."""
    rng = np.random.default_rng(seed)
    alloc = rng.random((2, 3, 2, n_slots))
    alloc[..., :2] += TIER  # protected slots
    alloc[..., 5] = alloc[..., 6]  # ties in both orders
    other = rng.integers(0, 4, size=alloc.shape).astype(float)
    return alloc, other, rng.random(alloc.shape) > 0.2


def _assert_placed(got, alloc, other, valid, order_free):
    """Each row of ``got`` holds the row's valid ``alloc`` scores, highest first along
    protected slots (by ``alloc``), then ``order_free(free, a, o)``; -inf elsewhere."""
    for idx in np.ndindex(alloc.shape[:-1]):
        a, o, v = alloc[idx], other[idx], valid[idx]
        free = [c for c in np.flatnonzero(v) if a[c] < TIER]
        protected = sorted((c for c in np.flatnonzero(v) if a[c] >= TIER), key=lambda c: -a[c])
        want = np.full(a.shape, -np.inf)
        want[protected + order_free(free, a, o)] = sorted(a[v], reverse=True)
        np.testing.assert_allclose(got[idx], want, rtol=1e-6)


def test_rank_blend_against_brute_force():
    alloc, other, valid = _mix_rows(2, 11)
    valid[..., :2] = True

    def order_free(free, a, o):
        ra, rb = ({c: k for k, c in enumerate(sorted(free, key=lambda c, x=x: (-x[c], c)))}
                  for x in (a, o))  # fmt: skip
        return sorted(free, key=lambda c: (0.7 * ra[c] + 0.3 * rb[c], ra[c]))

    got = np.asarray(rerank_lib.rank_blend(alloc, other, valid, 0.3))
    _assert_placed(got, alloc, other, valid, order_free)


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 1.0])
def test_rank_tier_against_brute_force(fraction):
    alloc, other, valid = _mix_rows(4, 13)
    valid[0, 0, 0, :] = False  # an empty row

    def order_free(free, a, o):
        by_other = sorted(free, key=lambda c: (-o[c], c))
        tier = set(by_other[: int(np.ceil(fraction * len(free)))])
        return sorted(free, key=lambda c: (c not in tier, -a[c], c))

    got = np.asarray(rerank_lib.rank_tier(alloc, other, valid, fraction))
    _assert_placed(got, alloc, other, valid, order_free)


def test_tier_keeps_the_other_policys_top_slots_in_each_row():
    """tier@q:a+b through a global decode eviction: a's count per row, b's top slots first."""
    name = "tier@0.25:h2o+tova"
    policy = get_policy(name)
    assert policy.name == name and dict(policy.spec)["tier"] == 0.25
    kept, h2o = _decode_kept(name), _decode_kept("h2o")
    assert [len(k) for k in kept] == [len(k) for k in h2o]  # h2o's allocation
    assert kept != h2o  # the tier changed which tokens some row keeps
    assert _decode_kept("tier@0:h2o+tova") == _decode_kept("tier@1:h2o+tova") == h2o  # no tier


def _decode_kept(name: str, budget=6):
    """Tokens each row keeps after one global decode-protocol eviction of a prefilled cache."""
    policy = get_policy(name)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT, stats=policy.stats)
    _, cache = decoder.prefill(PARAMS, WINDOWS[:, :PROMPT], cache, config=CFG)
    comp = Compression.make(name, budget=budget, granularity="global", protocol="decode")
    pos = np.asarray(eviction.evict(cache, comp, policy.init(), key=None).pos)
    return [frozenset(int(p) for p in pos[idx] if p >= 0) for idx in np.ndindex(pos.shape[:-1])]


def test_blend_keeps_a_s_counts_and_its_ends_are_a_and_b_s_order():
    h2o = _decode_kept("h2o")
    assert _decode_kept("blend@0:h2o+tova") == h2o  # weight 0 is the allocator itself
    for w in ("0.5", "1"):
        kept = _decode_kept(f"blend@{w}:h2o+tova")
        assert [len(s) for s in kept] == [len(s) for s in h2o]  # h2o's allocation
    assert _decode_kept("blend@1:h2o+tova") != h2o
    assert len({len(s) for s in h2o}) > 1  # the allocation is uneven, so the counts test something
    # weight 1 keeps, in each row, h2o's protected slots, then tova's best
    policy, inner = get_policy("h2o"), get_policy("tova")
    stats = get_policy("blend@1:h2o+tova").stats
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=PROMPT, stats=stats)
    _, cache = decoder.prefill(PARAMS, WINDOWS[:, :PROMPT], cache, config=CFG)
    budget_B = Compression.make("h2o", budget=6, granularity="global").budget_for(cache.length)
    a = np.asarray(policy.score(None, cache, budget_B=budget_B, key=None))
    b = np.broadcast_to(np.asarray(inner.score(None, cache, budget_B=budget_B, key=None)), a.shape)
    kept = _decode_kept("blend@1:h2o+tova")
    for r, idx in enumerate(np.ndindex(a.shape[:-1])):
        prot = [c for c in range(PROMPT) if a[idx][c] >= TIER]
        free = sorted((c for c in range(PROMPT) if a[idx][c] < TIER), key=lambda c: -b[idx][c])
        assert kept[r] == set((sorted(prot, key=lambda c: -a[idx][c]) + free)[: len(h2o[r])])


def test_blend_of_a_ranker_and_critical_runs_in_fidelity(tmp_path):
    name = "blend@0.5:ranker:ranker_smollm2_cpu+critical:h2o"
    policy = get_policy(name)
    assert policy.name == name and policy.protocols == ("decode", "prefill")
    assert set(policy.stats) >= {"attn_cum", "wo_vnorm"}  # critical:'s norms, from the cache
    args = ["fidelity", "--model", "tiny", "--policies", f"full,{name},{name}@head", "--limit",
            "1", "--window", "40", "--prompt-len", "24", "--ratios", "0.5", "--granularity",
            "global", "--out", str(tmp_path / "run")]  # fmt: skip
    assert eval_lib.main(args) == 0


@pytest.mark.parametrize(
    "bad", ["blend@2:h2o+tova", "blend@x:h2o+tova", "blend@0.5:h2o", "blend@0.5:+tova",
            "blend@0.5:h2o+oracle", "blend@0.5:full+tova", "blend@0.5:h2o+kvzip"]
)  # fmt: skip
def test_bad_mix_names_are_refused(bad):
    with pytest.raises(ValueError, match="blend"):
        get_policy(bad)
    with pytest.raises(ValueError, match="tier"):  # the same names as a tier
        get_policy(bad.replace("blend@", "tier@"))


@pytest.mark.parametrize("weight", [0.0, 0.25, 0.75, 1.0])
def test_rank_blend_equals_the_transplant_composition_bit_for_bit(weight):
    rng = np.random.default_rng(3)
    shape = (3, 2, 3, 257)
    alloc = rng.random(shape).astype(np.float32)
    alloc[..., :9] += TIER * (1 + rng.random((*shape[:-1], 9)))  # protected tiers of any size
    alloc[..., 20:40] = alloc[..., 40:60]  # ties by alloc
    alloc[0, 0, 0, :] = 0.5  # a row of ties only
    other = rng.integers(0, 9, size=shape).astype(np.float32)  # many ties by other
    valid = rng.random(shape) > 0.3
    valid[1, 1, 1, :] = False  # an empty row
    valid[2, 0, 0, :] = True  # a full row
    args = (alloc, other, valid)
    got = np.asarray(jax.jit(rerank_lib.rank_blend, static_argnums=3)(*args, weight))
    reference = jax.jit(bench_rank_blend.rank_blend_by_transplant, static_argnums=3)
    np.testing.assert_array_equal(got, np.asarray(reference(*args, weight)))
    # and both with jnp's comparison sorts in place of the packed integer sorts
    for fn in (rerank_lib.rank_blend, bench_rank_blend.rank_blend_by_transplant):
        with_jnp_sorts = jax.jit(bench_rank_blend.jnp_sorts(fn), static_argnums=3)
        np.testing.assert_array_equal(got, np.asarray(with_jnp_sorts(*args, weight)))
