"""``ranker:<path>``: its targets against the oracle's full-cache attention, its features and
loss by hand, and a trained checkpoint end to end through the CLIs."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import eviction, kvcache
from jaxkv.cli import eval as eval_cli
from jaxkv.cli import train as train_cli
from jaxkv.config import ModelConfig
from jaxkv.evals import fidelity
from jaxkv.evals.runner import ByteTokenizer
from jaxkv.generate import full_cache_attention
from jaxkv.model import decoder
from jaxkv.model.params import init_params
from jaxkv.policies import get_policy, heuristics
from jaxkv.policies import ranker as ranker_lib
from jaxkv.policies.base import TIER
from jaxkv.policies.learned import checkpoint_path
from jaxkv.rl import ranker
from jaxkv.rl.data import HELDOUT_DOMAIN, domain_text

CFG = ModelConfig.tiny()
PARAMS = init_params(CFG, key=jax.random.key(0), scale=0.2)
TOKENS = np.asarray(jax.random.randint(jax.random.key(1), (2, 40), 0, CFG.vocab_size))
SMALL = ranker.RankerConfig(
    window=40, points=(8, 16), chunk=8, horizon=16, row_fraction=1.0, batch=2
)
RECON = ranker_lib.DEFAULT_FEATURES + ranker_lib.RECON_FEATURES  # reads kvzip's scores too
REPEAT = fidelity.repeat_ids(ByteTokenizer())  # kvzip's repeat request


def test_targets_are_the_oracles_future_attention():
    sets = ranker.collect(PARAMS, CFG, TOKENS, SMALL, rng=np.random.default_rng(0))
    for s in sets:
        p = s.point
        attn = np.asarray(full_cache_attention(PARAMS, TOKENS, prompt_len=p, config=CFG))
        want = attn[: SMALL.horizon].sum(0)[..., :p]  # queries p .. p + horizon - 1
        np.testing.assert_allclose(s.target, want.reshape(-1, p), rtol=2e-5, atol=1e-6)
        assert s.feats.shape == (CFG.n_layers * 2 * CFG.n_kv_heads, p, len(ranker_lib.FEATURES))
        np.testing.assert_array_equal(s.future, s.target)  # target "attention"


def test_features_by_hand():
    names = tuple(n for n in ranker_lib.FEATURES if n not in ranker_lib.RECON_FEATURES)
    stats = ranker_lib.stats_for(names)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=24, stats=stats)
    _, cache = decoder.prefill(PARAMS, jnp.asarray(TOKENS[:, :12]), cache, config=CFG)
    _, cache = decoder.extend(PARAMS, jnp.asarray(TOKENS[:, 12:16]), cache, config=CFG)
    f = np.asarray(ranker_lib.head_features(cache, names=names))
    col = {n: f[..., i] for i, n in enumerate(names)}
    st = {n: np.asarray(x) for n, x in cache.stats.items()}
    L = CFG.n_layers
    # slot s holds position s; 16 tokens processed, so position s was seen by 16 - s queries
    s = np.arange(16)
    np.testing.assert_allclose(col["log_age"][..., :16], np.log(16 - s) + 0 * f[..., :16, 0])
    np.testing.assert_allclose(col["pos_frac"][..., :16], s / 16 + 0 * f[..., :16, 0])
    np.testing.assert_allclose(col["depth"][:, 0, 0, 0], np.arange(L) / (L - 1))
    np.testing.assert_allclose(
        col["log_attn_mean"][..., :16],
        np.log(st["attn_cum"][..., :16] / (16 - s) + 1e-6),
        rtol=1e-5,
        atol=1e-5,
    )
    z = col["z_attn_cum"][..., :16]
    np.testing.assert_allclose(z.mean(-1), 0, atol=1e-4)
    np.testing.assert_allclose(z.std(-1), 1, atol=1e-3)
    assert np.all(f[..., 16:, :] == 0)  # free slots


def test_listnet_is_minimal_at_the_log_target():
    rng = np.random.default_rng(0)
    t = rng.random((5, 12)) ** 3
    h = -np.mean(np.sum((t / t.sum(-1, keepdims=True)) * np.log(t / t.sum(-1, keepdims=True)), -1))
    assert float(ranker.listnet(jnp.log(t), t)) == pytest.approx(h, rel=1e-5)
    assert float(ranker.listnet(jnp.log(t) + 7.0, t)) == pytest.approx(h, rel=1e-5)  # row shift
    for _ in range(5):
        assert float(ranker.listnet(jnp.log(t) + rng.normal(size=t.shape), t)) > h


def test_pooled_listnet_ranks_across_rows():
    """pool > 1: one softmax over a group's rows, minimal only at log target plus one constant
    for the whole group; per-row shifts, which the per-row loss ignores, now cost."""
    rng = np.random.default_rng(2)
    t = rng.random((6, 8)) ** 3
    g = t.reshape(2, 24) / t.reshape(2, 24).sum(-1, keepdims=True)
    h = -np.mean(np.sum(g * np.log(g), -1))
    assert ranker.pooled(t, 3).shape == (2, 24)
    np.testing.assert_array_equal(ranker.pooled(t, 3)[1, 8:16], t[4])
    assert float(ranker.listnet(ranker.pooled(jnp.log(t) + 3.0, 3), ranker.pooled(t, 3))) == (
        pytest.approx(h, rel=1e-5)
    )
    shifted = jnp.log(t) + jnp.arange(6.0)[:, None]  # a constant per row
    assert float(ranker.listnet(ranker.pooled(shifted, 3), ranker.pooled(t, 3))) > h + 0.1
    assert float(ranker.listnet(shifted, t)) == pytest.approx(float(ranker.listnet(jnp.log(t), t)))
    with pytest.raises(ValueError, match="pool"):
        ranker.RankerConfig(rows_per_step=256, pool=90)


def test_kept_mass_against_brute_force():
    rng = np.random.default_rng(1)
    scores, target = rng.random((6, 16)), rng.random((6, 16))
    B = 4
    want = [
        target[i, np.argsort(-scores[i])[:B]].sum() / np.sort(target[i])[::-1][:B].sum()
        for i in range(6)
    ]
    assert ranker.kept_mass(scores, target, 0.25) == pytest.approx(np.mean(want))
    assert ranker.kept_mass(target, target, 0.25) == pytest.approx(1.0)


def test_trained_ranker_end_to_end(tmp_path, capsys):
    out = tmp_path / "rk"
    argv = ["ranker", "--model", "tiny", "--windows-per-domain", "2", "--steps", "3"]
    every = [n for n in ranker_lib.FEATURES if n not in ranker_lib.RECON_FEATURES]
    every = ",".join(every)  # log_wo_vnorm too: the policy reads the cache's wo_vnorm
    pooled = ["--pool", "2", "--rows-per-step", "16"]
    assert (
        train_cli.main(
            [*argv, *pooled, "--features", every, "--target", "critical", "--out", str(out)]
        )
        == 0
    )
    params, meta = ranker_lib.load_ranker_params(out)
    assert meta["config"]["pool"] == 2
    rows = [r for domain in meta["validation"].values() for r in domain.values()]
    assert any(0 < r.get("kept_pooled_0.25", -1) <= 1 for r in rows)
    assert meta["trained_on"] == ["prose", "math", "code", "chat"]
    assert meta["features"] == every.split(",")
    assert set(meta["validation"]) == {"prose", "math", "code", "chat"}
    policy = get_policy(f"ranker:{out}")
    weights, recon = policy.init()
    assert jax.tree.all(jax.tree.map(np.array_equal, weights, params))
    assert policy.stats == (*ranker_lib.STATS, "wo_vnorm")  # log_wo_vnorm reads the cache
    assert recon is None and policy.window_input is None
    for granularity in ("shared", "head", "adaptive"):
        code = eval_cli.main(
            ["fidelity", "--model", "tiny", "--policies", f"full,ranker:{out}", "--limit", "1",
             "--window", "96", "--prompt-len", "64", "--ratios", "0.5,1",
             "--granularity", granularity, "--protocol", "prefill",
             "--out", str(tmp_path / granularity)]
        )  # fmt: skip
        assert code == 0
    assert train_cli.main([*argv, "--domains", "prose,poetry"]) == 2
    assert "unknown ['poetry']" in capsys.readouterr().err


def test_pruned_rows_carry_the_full_caches_targets_at_their_positions():
    cfg = ranker.RankerConfig(
        window=40, points=(16, 24), chunk=8, horizon=16, row_fraction=1.0, batch=2,
        pruned_ratios=(0.5,), min_budget=8,
    )  # fmt: skip
    full16, full24, pruned16, pruned24 = ranker.collect(
        PARAMS, CFG, TOKENS, cfg, rng=np.random.default_rng(0)
    )
    np.testing.assert_array_equal(pruned16.target, full16.target)  # nothing evicted yet
    # at 24: H2O kept max(0.5 * 16, 8) = 8 of the first 16 tokens, then 8 arrived
    assert pruned24.target.shape == (full24.target.shape[0], 16)
    for got, row in zip(pruned24.target, full24.target, strict=True):
        assert np.isin(got, row).all()  # each kept token's target is its position's
        assert np.isin(row[16:], got).all()  # the 8 new tokens are all there


def _mlp_reference(params, feats):
    """The ranker's score by hand, in float64: standardize, two ReLU layers, the output."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    x = (np.asarray(feats, np.float64) - p["mean"]) / p["scale"]
    for i in range(2):
        x = np.maximum(x @ p["mlp"][f"Dense_{i}"]["kernel"] + p["mlp"][f"Dense_{i}"]["bias"], 0)
    return (x @ p["mlp"]["Dense_2"]["kernel"] + p["mlp"]["Dense_2"]["bias"])[..., 0]


def test_layerwise_scores_are_the_mlp_of_the_features():
    """The policy scores one layer at a time (``head_scores``): the scores of the MLP over all
    layers' features at once, and of a float64 reference, so it keeps the reference's top B."""
    policy = get_policy("ranker:ranker_smollm2_cpu")
    params, names = policy.init()[0], dict(policy.spec)["features"]
    cache = _prefilled()
    comp = eviction.Compression(policy, budget=10, granularity="head")
    cache = eviction.evict(cache, comp, policy.init(), key=jax.random.key(0))
    _, cache = decoder.extend(PARAMS, jnp.asarray(TOKENS[:, 16:20]), cache, config=CFG)
    valid = np.asarray(cache.valid)  # 10 kept of 16 in every row, then 4 more: holes
    got = np.asarray(ranker_lib.head_scores(params, cache, names=names))
    feats = ranker_lib.head_features(cache, names=names)
    at_once = np.asarray(ranker_lib.scores_from_features(params, feats, cache.valid))
    want = _mlp_reference(params, feats)
    assert np.all(got[~valid] == -np.inf) and np.all(np.isfinite(got[valid]))
    np.testing.assert_allclose(got[valid], at_once[valid], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    B = 6
    kept = eviction.evict(
        cache, dataclasses.replace(comp, budget=B), policy.init(), key=jax.random.key(0)
    )
    want = np.where(valid, want, -np.inf).reshape(-1, cache.capacity)
    for row, ref, pos in zip(
        np.asarray(kept.pos).reshape(-1, cache.capacity),
        want,
        np.asarray(cache.pos).reshape(-1, cache.capacity),
        strict=True,
    ):
        assert set(row[row >= 0].tolist()) == set(pos[np.argsort(-ref)[:B]].tolist())


def test_sinks_and_recent_window_are_kept():
    params = ranker_lib.init_params(key=jax.random.key(3))
    policy = ranker_lib.ranker_policy(params, recent_fraction=0.5, sinks=4)
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=40, stats=policy.stats)
    _, cache = decoder.prefill(PARAMS, jnp.asarray(TOKENS), cache, config=CFG)
    comp = eviction.Compression(policy, budget=16, granularity="head")
    state = policy.init()
    kept = eviction.evict(cache, comp, state, key=jax.random.key(0)).pos
    for row in np.asarray(kept).reshape(-1, 40):
        row = set(row[row >= 0].tolist())
        assert len(row) == 16 and set(range(4)) | set(range(32, 40)) <= row


def test_value_target_weights_the_future_attention_by_the_value_norm():
    attention = ranker.collect(PARAMS, CFG, TOKENS, SMALL, rng=np.random.default_rng(0))
    value = ranker.collect(
        PARAMS, CFG, TOKENS, dataclasses.replace(SMALL, target="value"),
        rng=np.random.default_rng(0),
    )  # fmt: skip
    iv = ranker_lib.FEATURES.index("log_vnorm")
    for a, v in zip(attention, value, strict=True):
        vnorm = np.exp(a.feats[..., iv].astype(np.float32))  # log(||v|| + 1e-6), float16
        np.testing.assert_allclose(v.target, a.target * vnorm, rtol=1e-6)
    with pytest.raises(ValueError, match="target must be one of"):
        dataclasses.replace(SMALL, target="mass")


def test_peak_target_is_the_most_any_future_query_pays_times_the_value_norm():
    peak = dataclasses.replace(SMALL, target="peak", chunk=1)
    sets = ranker.collect(PARAMS, CFG, TOKENS, peak, rng=np.random.default_rng(0))
    iv = ranker_lib.FEATURES.index("log_vnorm")
    for s in sets:
        p = s.point
        attn = np.asarray(full_cache_attention(PARAMS, TOKENS, prompt_len=p, config=CFG))
        want = attn[: SMALL.horizon].max(0)[..., :p].reshape(-1, p)  # queries p .. p + 15
        np.testing.assert_allclose(s.future, want, rtol=2e-5, atol=1e-6)
        vnorm = np.exp(s.feats[..., iv].astype(np.float32))
        np.testing.assert_allclose(s.target, want * vnorm, rtol=2e-5, atol=1e-6)
        assert not np.allclose(s.future, attn[: SMALL.horizon].sum(0)[..., :p].reshape(-1, p))
    with pytest.raises(ValueError, match="chunk=1"):  # a pass of 8 queries keeps only its last
        dataclasses.replace(SMALL, target="peak")


def _prefilled(n=16, stats=None):
    stats = ranker_lib.stats_for(ranker_lib.FEATURES) if stats is None else stats
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=24, stats=stats)
    return decoder.prefill(PARAMS, jnp.asarray(TOKENS[:, :n]), cache, config=CFG)[1]


def test_wo_vnorm_feature_is_the_l1_norm_after_the_output_projection():
    cache = _prefilled()  # the decoder wrote each token's norm, the cache statistic wo_vnorm
    wo = PARAMS["layers"]["wo"]  # [L, N, H, D], query head n = k * G + g
    f = np.asarray(ranker_lib.head_features(cache, names=("log_wo_vnorm",)))[..., 0]
    v = np.asarray(cache.values(), np.float64)  # [L, B, K, C, H]
    L, B, K, C, H = v.shape
    w = np.asarray(wo, np.float64).reshape(L, K, -1, H, wo.shape[-1])
    want = np.abs(np.einsum("lbkch,lkghd->lbkcgd", v, w)).sum(-1).mean(-1)
    np.testing.assert_allclose(f[..., :16], np.log(want[..., :16] + 1e-6), rtol=1e-5, atol=1e-5)
    assert np.all(f[..., 16:] == 0)
    with pytest.raises(ValueError, match="wo_vnorm"):  # a cache without the statistic
        ranker_lib.head_features(_prefilled(stats=ranker_lib.STATS), names=("log_wo_vnorm",))


def test_named_features_are_columns_of_all_features():
    cache = _prefilled()
    recon = fidelity.prompt_reconstruction(PARAMS, TOKENS[:, :16], REPEAT, config=CFG)
    every = np.asarray(ranker_lib.head_features(cache, reconstruction=recon))
    names = ("depth", "log_attn", "log_wo_vnorm", "z_recon")
    some = np.asarray(ranker_lib.head_features(cache, names=names, reconstruction=recon))
    idx = [ranker_lib.FEATURES.index(n) for n in names]
    np.testing.assert_array_equal(some, every[..., idx])
    with pytest.raises(ValueError, match="unknown ranker features"):
        ranker_lib.head_features(cache, names=("log_attn", "mass"))


def test_critical_target_weights_the_future_attention_by_the_projected_norm():
    crit = ranker.collect(
        PARAMS, CFG, TOKENS, dataclasses.replace(SMALL, target="critical"),
        rng=np.random.default_rng(0),
    )  # fmt: skip
    cache = _prefilled(SMALL.points[0])
    norm = np.asarray(cache.stats["wo_vnorm"])
    first = crit[0]  # point 8: slot s holds position s
    want = first.future * norm[..., : first.point].reshape(-1, first.point)
    np.testing.assert_allclose(first.target, want, rtol=2e-3)  # the norm is stored in float16


def test_a_ranker_on_some_features_trains_saves_and_scores(tmp_path):
    out = tmp_path / "rk"
    argv = ["ranker", "--model", "tiny", "--windows-per-domain", "2", "--steps", "2",
            "--hidden", "8", "--features", "log_attn,log_attn_cum,depth", "--out", str(out)]  # fmt: skip
    assert train_cli.main(argv) == 0
    params, meta = ranker_lib.load_ranker_params(out)
    assert meta["features"] == ["log_attn", "log_attn_cum", "depth"] and meta["hidden"] == 8
    assert params["mlp"]["Dense_0"]["kernel"].shape == (3, 8)
    policy = get_policy(f"ranker:{out}")
    cache = _prefilled()
    s = policy.score(policy.init(), cache, budget_B=jnp.full((2,), 8))
    feats = ranker_lib.head_features(cache, names=tuple(meta["features"]))
    want = ranker_lib.scores_from_features(params, feats, cache.valid)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want))


@pytest.mark.parametrize(
    "name,pool",
    [
        ("ranker_smollm2_cpu", 1),
        ("ranker_global_smollm2_cpu", 90),
        ("ranker_kvzip_smollm2_cpu", 90),
        ("ranker_kvzipres_smollm2_cpu", 90),
        ("ranker_recall_smollm2_cpu", 90),
        ("ranker_recall_attended_smollm2_cpu", 90),
        ("ranker_recall_tier_smollm2_cpu", 90),
        ("ranker_peak_tier_smollm2_cpu", 90),
    ],
)
def test_shipped_rankers_load_and_never_read_the_held_out_domain(name, pool):
    policy = get_policy(f"ranker:{name}")
    _, meta = ranker_lib.load_ranker_params(checkpoint_path(name))
    assert HELDOUT_DOMAIN not in meta["trained_on"] and HELDOUT_DOMAIN not in meta["validation"]
    assert meta["config"].get("pool", 1) == pool  # global pools raw scores: only pool > 1 ranks
    assert policy.spec[0] == ("path", name)
    reads_kvzip = set(ranker_lib.RECON_FEATURES) <= set(meta["features"])
    assert policy.window_input == ("reconstruction" if reads_kvzip else None)
    assert reads_kvzip == name.startswith("ranker_kvzip")
    assert meta.get("base") == ("log_recon" if name == "ranker_kvzipres_smollm2_cpu" else None)
    tiers = {"ranker_recall_attended_smollm2_cpu": 0.125, "ranker_recall_tier_smollm2_cpu": 0.5}
    tiers["ranker_peak_tier_smollm2_cpu"] = 0.5
    assert meta.get("attended_fraction") == tiers.get(name)
    peak = meta["config"]["target"] == "peak"  # needs one query per pass (``chunk`` 1)
    assert peak == (name == "ranker_peak_tier_smollm2_cpu")
    assert peak == (meta["config"]["chunk"] == 1)


def test_validation_text_is_each_training_domains_text_after_the_validation_cut():
    """With byte tokens, each domain's piece is its text from 100 bytes after the split that
    ``domain_windows`` trains before: never a training window's text."""
    cfg = ranker.RankerConfig(domains=("prose", "math"), val_fraction=0.2)
    text = ranker.validation_text(ByteTokenizer(), cfg, windows=2, window=30).encode()
    assert len(text) == 2 * (2 * 30 + 40)
    for i, domain in enumerate(cfg.domains):
        full = domain_text(domain).encode()
        cut = int(len(full) * 0.8)
        assert text[i * 100 : (i + 1) * 100] == full[cut + 100 : cut + 200]


@pytest.mark.parametrize(
    "name", ["ranker_recall_attended_smollm2_cpu", "ranker_recall_tier_smollm2_cpu"]
)
def test_the_tiered_rankers_are_the_recall_rankers_params(name):
    params, meta = ranker_lib.load_ranker_params(checkpoint_path(name))
    src, _ = ranker_lib.load_ranker_params(checkpoint_path(meta["derived_from"]))
    assert meta["derived_from"] == "ranker_recall_smollm2_cpu"
    jax.tree.map(np.testing.assert_array_equal, params, src)


def test_reconstruction_features_are_kvzips_scores_at_each_slot():
    """log_recon is log(kvzip's score of the slot's prompt position); z_recon that, standardized
    over the row; both 0 on free slots, and an error without the reconstruction."""
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=24, stats=ranker_lib.STATS)
    _, cache = decoder.prefill(PARAMS, jnp.asarray(TOKENS[:, :16]), cache, config=CFG)
    recon = fidelity.prompt_reconstruction(PARAMS, TOKENS[:, :16], REPEAT, config=CFG)
    names = ("log_recon", "z_recon")
    f = np.asarray(ranker_lib.head_features(cache, names=names, reconstruction=recon))
    want = np.log(np.asarray(recon.scores) + 1e-6)
    np.testing.assert_allclose(f[..., :16, 0], want, rtol=1e-6)
    np.testing.assert_allclose(f[..., :16, 1].mean(-1), 0, atol=1e-4)
    np.testing.assert_allclose(f[..., :16, 1].std(-1), 1, atol=1e-3)
    assert np.all(f[..., 16:, :] == 0)
    with pytest.raises(ValueError, match="reconstruction"):
        ranker_lib.head_features(cache, names=names)


def test_collected_reconstruction_columns_score_each_points_prefix():
    cfg = dataclasses.replace(SMALL, features=RECON)
    sets = ranker.collect(PARAMS, CFG, TOKENS, cfg, rng=np.random.default_rng(0), repeat_R=REPEAT)
    col = ranker_lib.FEATURES.index("log_recon")
    for s in sets:
        recon = fidelity.prompt_reconstruction(PARAMS, TOKENS[:, : s.point], REPEAT, config=CFG)
        want = np.log(np.asarray(recon.scores) + 1e-6).reshape(-1, s.point)
        np.testing.assert_allclose(s.feats[..., col], want, rtol=2e-3, atol=2e-3)  # float16
    plain = ranker.collect(PARAMS, CFG, TOKENS, SMALL, rng=np.random.default_rng(0))
    for a, b in zip(sets, plain, strict=True):  # the other columns do not depend on it
        other = [i for i, n in enumerate(ranker_lib.FEATURES) if n not in ranker_lib.RECON_FEATURES]
        np.testing.assert_array_equal(a.feats[..., other], b.feats[..., other])
        np.testing.assert_array_equal(a.target, b.target)
    with pytest.raises(ValueError, match="repeat"):
        ranker.collect(PARAMS, CFG, TOKENS, cfg, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="prefill protocol"):
        dataclasses.replace(cfg, pruned_ratios=(0.5,))
    with pytest.raises(ValueError, match="kvzip_request must be one of"):
        dataclasses.replace(cfg, kvzip_request="json")


def test_a_ranker_reading_kvzips_scores_runs_only_where_they_exist(tmp_path):
    out = tmp_path / "rk"
    argv = ["ranker", "--model", "tiny", "--windows-per-domain", "2", "--steps", "3",
            "--points", "128", "--features", ",".join(RECON), "--kvzip-request", "chat",
            "--out", str(out)]  # fmt: skip
    assert train_cli.main(argv) == 0
    assert json.loads((out / "ranker.json").read_text())["config"]["kvzip_request"] == "chat"
    policy = get_policy(f"ranker:{out}")
    assert policy.window_input == "reconstruction" and policy.protocols == ("prefill",)
    with pytest.raises(ValueError, match="only the fidelity evaluation"):
        policy.init()
    common = ["--model", "tiny", "--policies", f"full,ranker:{out}", "--limit", "1",
              "--window", "96", "--prompt-len", "64", "--ratios", "0.5,1"]  # fmt: skip
    prefill = [*common, "--protocol", "prefill", "--granularity", "global"]
    assert eval_cli.main(["fidelity", *prefill, "--out", str(tmp_path / "ok")]) == 0
    assert eval_cli.main(["fidelity", *common, "--out", str(tmp_path / "decode")]) == 2
    assert eval_cli.main(["retrieval", *common[:4], "--out", str(tmp_path / "ret")]) == 2
    gen = ["generate", "--model", "tiny", "--prompt", "hi", "--policy", f"ranker:{out}"]
    assert eval_cli.main([*gen, "--protocol", "prefill"]) == 2
    assert not (tmp_path / "decode").exists() and not (tmp_path / "ret").exists()
    assert train_cli.main([*argv[:-1], str(tmp_path / "x"), "--points", "1,x"]) == 2


def test_the_cli_sets_the_target_horizon_and_refuses_one_off_the_chunk_grid(tmp_path):
    out = tmp_path / "h16"
    argv = ["ranker", "--model", "tiny", "--windows-per-domain", "2", "--steps", "2",
            "--points", "128,144", "--horizon", "16", "--chunk", "16", "--out", str(out)]  # fmt: skip
    assert train_cli.main(argv) == 0
    config = json.loads((out / "ranker.json").read_text())["config"]
    assert (config["horizon"], config["chunk"], config["points"]) == (16, 16, [128, 144])
    bad = [*argv[:-1], str(tmp_path / "bad")]
    assert train_cli.main([*bad[:-2], "--horizon", "24", *bad[-2:]]) == 2  # not a multiple of 16
    assert not (tmp_path / "bad").exists()


def test_a_fresh_residual_ranker_scores_exactly_its_base_feature():
    cache = _prefilled()
    names = ("log_attn", "log_attn_cum", "depth")
    feats = ranker_lib.head_features(cache, names=names)
    params = ranker_lib.init_params(key=jax.random.key(3), hidden=8, n_features=3, base=1)
    params = {**params, "mean": jnp.asarray([0.5, -1.0, 0.2]), "scale": jnp.full((3,), 2.0)}
    s = ranker_lib.scores_from_features(params, feats, cache.valid)
    want = jnp.where(cache.valid, feats[..., 1], -jnp.inf)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want))
    with pytest.raises(ValueError, match="base"):
        ranker_lib.init_params(key=jax.random.key(3), n_features=3, base=3)


def test_a_residual_ranker_trains_saves_and_adds_its_raw_base(tmp_path):
    out = tmp_path / "rk"
    argv = ["ranker", "--model", "tiny", "--windows-per-domain", "2", "--steps", "3",
            "--hidden", "8", "--features", "log_attn,log_attn_cum,depth", "--base",
            "log_attn_cum", "--out", str(out)]  # fmt: skip
    assert train_cli.main(argv) == 0
    params, meta = ranker_lib.load_ranker_params(out)
    assert meta["base"] == "log_attn_cum" and meta["config"]["base"] == "log_attn_cum"
    np.testing.assert_array_equal(np.asarray(params["base"]), [0, 1, 0])
    assert np.any(np.asarray(params["mlp"]["Dense_2"]["kernel"]) != 0)  # it trained
    policy = get_policy(f"ranker:{out}")
    cache = _prefilled()
    s = policy.score(policy.init(), cache, budget_B=jnp.full((2,), 8))
    feats = ranker_lib.head_features(cache, names=tuple(meta["features"]))
    plain = {k: v for k, v in params.items() if k != "base"}
    mlp = ranker_lib.scores_from_features(plain, feats, cache.valid)
    want = jnp.where(cache.valid, mlp + feats[..., 1], -jnp.inf)
    np.testing.assert_allclose(np.asarray(s), np.asarray(want), rtol=1e-6)
    bad = [*argv[:-3], "log_recon", "--out", str(tmp_path / "x")]
    assert train_cli.main(bad) == 2 and not (tmp_path / "x").exists()


def test_attended_tier_keeps_each_rows_top_tokens_by_the_latest_querys_attention():
    rng = np.random.default_rng(5)
    L, B, K, C = 2, 3, 2, 12
    pos = np.tile(np.arange(C), (L, B, K, 1))
    pos[..., 9:] = -1  # free slots never enter the tier
    attn = rng.random((L, B, K, C)).astype(np.float32)
    attn[..., 9:] = 3  # free slots' stale statistics outrank every occupied slot's
    attn[:, 1, :, 2] = attn[:, 1, :, 5] = 2  # a tie at the top: the lower slot is first
    cache = dataclasses.replace(
        kvcache.init_cache(CFG, batch_size=B, capacity=C, stats=("attn",)),
        pos=jnp.asarray(pos, jnp.int32),
    )
    cache = cache.replace(stats={**cache.stats, "attn": jnp.asarray(attn)})
    n_top = np.array([0, 3, 20])
    base = rng.random((L, B, K, C)).astype(np.float32)
    got = np.asarray(heuristics.protect_attended(jnp.asarray(base), cache, jnp.asarray(n_top)))
    for l, b, k in np.ndindex(L, B, K):
        valid = pos[l, b, k] >= 0
        order = sorted(np.flatnonzero(valid), key=lambda c: (-attn[l, b, k, c], c))
        top = set(order[: n_top[b]])
        for c in range(C):
            if c in top:
                assert got[l, b, k, c] >= TIER
            else:
                assert got[l, b, k, c] == base[l, b, k, c]
        ranked = sorted(top, key=lambda c: -got[l, b, k, c])
        assert [attn[l, b, k, c] for c in ranked] == sorted(attn[l, b, k, list(top)], reverse=True)


def test_a_ranker_whose_tier_is_the_whole_budget_keeps_tovas_tokens_and_zero_changes_nothing():
    params = ranker_lib.init_params(key=jax.random.key(3))
    cache = kvcache.init_cache(CFG, batch_size=2, capacity=40, stats=ranker_lib.STATS)
    _, cache = decoder.prefill(PARAMS, jnp.asarray(TOKENS), cache, config=CFG)
    budget = jnp.full((2,), 10)

    def kept(policy, state=None):
        comp = eviction.Compression(policy, budget=10, granularity="head")
        return np.asarray(eviction.evict(cache, comp, state, key=jax.random.key(0)).pos)

    tiered = ranker_lib.ranker_policy(params, attended_fraction=1.0)
    np.testing.assert_array_equal(kept(tiered, tiered.init()), kept(get_policy("tova")))
    plain, zero = (
        ranker_lib.ranker_policy(params),
        ranker_lib.ranker_policy(params, attended_fraction=0),
    )
    assert plain.spec == zero.spec
    np.testing.assert_array_equal(
        np.asarray(zero.score(zero.init(), cache, budget_B=budget)),
        np.asarray(plain.score(plain.init(), cache, budget_B=budget)),
    )
    half = ranker_lib.ranker_policy(params, attended_fraction=0.5)
    s = np.asarray(half.score(half.init(), cache, budget_B=budget))
    assert (np.sum(s >= TIER, axis=-1) == 5).all()  # floor(0.5 * 10) per row
    with pytest.raises(ValueError, match="attended_fraction must be in"):
        ranker_lib.ranker_policy(params, attended_fraction=1.5)


def test_retier_saves_the_same_params_with_the_tier_in_the_meta(tmp_path):
    out = ranker_lib.retier(
        "ranker_recall_smollm2_cpu", tmp_path / "tiered", attended_fraction=0.25
    )
    params, meta = ranker_lib.load_ranker_params(out)
    src, src_meta = ranker_lib.load_ranker_params(checkpoint_path("ranker_recall_smollm2_cpu"))
    jax.tree.map(np.testing.assert_array_equal, params, src)
    assert meta["attended_fraction"] == 0.25 and meta["derived_from"] == "ranker_recall_smollm2_cpu"
    assert {
        k: v for k, v in meta.items() if k not in ("attended_fraction", "derived_from")
    } == src_meta
    policy = get_policy(f"ranker:{out}")
    assert ("attended_fraction", 0.25) in policy.spec
    with pytest.raises(ValueError, match="not a ranker tier"):
        ranker_lib.retier("ranker_recall_smollm2_cpu", tmp_path / "bad", window=3)
    with pytest.raises(ValueError, match="attended_fraction must be in"):
        ranker_lib.retier("ranker_recall_smollm2_cpu", tmp_path / "bad", attended_fraction=-1)
    assert not (tmp_path / "bad").exists()
