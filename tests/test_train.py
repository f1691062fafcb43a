"""DistillCache training: steps, a toy task, checkpoints, exact resume, data parallelism."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from jaxkv.checkpoint import CheckpointError
from jaxkv.cli import train as train_cli
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression
from jaxkv.generate import generate_tokens
from jaxkv.model.params import init_params
from jaxkv.policies import get_policy
from jaxkv.policies import ranker as ranker_lib
from jaxkv.policies.learned import (
    checkpoint_path,
    count,
    init_mlp,
    learned_policy,
    load_policy,
    save_policy,
    scores_from_features,
)
from jaxkv.rl import loop
from jaxkv.rl.config import TrainConfig
from jaxkv.rl.loop import init_policy, run
from jaxkv.rl.objectives import (
    Decisions,
    decide,
    decide_rows,
    discounted_returns,
    reinforce_loss,
    rloo_advantages,
)
from jaxkv.rl.step import init_state, train_step

REPO = Path(__file__).resolve().parents[1]
LM_CFG = ModelConfig.tiny()
LM = init_params(LM_CFG, key=jax.random.key(0), scale=0.2)
TINY = dict(
    model="tiny",
    prompt_len=16,
    decode_steps=8,
    min_budget=4,
    warmup_steps=0,
    steps=4,
    checkpoint_every=2,
)


def test_policy_has_the_true_parameter_count():
    assert (
        count(init_mlp(key=jax.random.key(0))) == 17_921
    )  # 5*128+128 + 2*128 + 128*128+128 + 2*128 + 129


def test_one_training_step_changes_params_and_keeps_state_shapes():
    cfg = TrainConfig(**TINY)
    state = init_state(cfg, init_mlp(key=jax.random.key(1)))
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    p0 = jax.tree.map(np.asarray, state.params)
    tokens = jax.random.randint(jax.random.key(2), (cfg.stream_len,), 0, 256)
    state, m = train_step(
        LM, state, tokens, jax.random.split(jax.random.key(3), 4), cfg=cfg, config=LM_CFG
    )
    assert all(np.isfinite(float(v)) for v in m.values())
    assert m["kl"] >= 0 and m["entropy"] > 0
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == before
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), p0, state.params)
    assert all(jax.tree.leaves(changed))
    assert int(state.step) == 1


def test_returns_and_rloo_baseline():
    r = jnp.array([[1.0, 0.0, 2.0], [0.0, 1.0, 0.0]])
    g = discounted_returns(r, 0.5)
    np.testing.assert_allclose(g, [[1.5, 1.0, 2.0], [0.5, 1.0, 0.0]])
    np.testing.assert_allclose(rloo_advantages(g), [[1.0, 0.0, 2.0], [-1.0, 0.0, -2.0]])


@pytest.mark.parametrize("estimator", ["exact", "ordered_pl"])
def test_policy_learns_to_keep_the_sink_and_the_needle(estimator):
    """Toy task: 16 tokens with random features; the sink (token 0) and a needle (marked
    by a high value norm) must be kept within a budget of 4. Reward = both kept."""
    L, B, K = 16, 4, 16
    params = init_mlp(key=jax.random.key(0))
    opt = optax.adam(1e-2)
    opt_state = opt.init(params)

    def episode(key):
        f = jax.random.normal(key, (L, 5))
        needle = jax.random.randint(jax.random.fold_in(key, 1), (), 1, L)
        f = f.at[:, 1].set(jnp.where(jnp.arange(L) == needle, 3.0, f[:, 1]))
        f = f.at[:, 4].set(jnp.arange(L) / L)  # position: the sink is at 0
        f = f.at[:, 0].set(jnp.exp(f[:, 0])).at[:, 2].set(jnp.exp(f[:, 2]))  # masses > 0
        return f, needle

    @jax.jit
    def step(params, opt_state, key):
        keys = jax.random.split(key, K)
        f, needle = jax.vmap(episode)(keys)
        valid = jnp.ones((K, L), bool)
        s = jax.vmap(lambda x, v: scores_from_features(params, x, v))(f, valid)
        sel, order = jax.vmap(
            lambda sc, k: decide(sc, jnp.ones(L, bool), B, key=k, estimator=estimator, max_budget=B)
        )(s, keys)
        reward = (sel[:, 0] & sel[jnp.arange(K), needle]).astype(jnp.float32)
        d = Decisions(  # one step, one row (the shared policy's)
            f[:, None, None],
            valid[:, None, None],
            sel[:, None, None],
            order[:, None, None],
            jnp.full((K, 1), B),
            jnp.ones((K, 1, 1), bool),
            reward[:, None],
        )
        adv = rloo_advantages(reward[:, None])
        grads = jax.grad(
            lambda p: reinforce_loss(
                p, d, adv, estimator=estimator, beta=0.0, exact_entropy=False, max_budget=B
            )[0]
        )(params)
        updates, opt_state = opt.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, jnp.mean(reward)

    for i in range(300):
        params, opt_state, _ = step(params, opt_state, jax.random.key(i))
    f, needle = jax.vmap(episode)(jax.random.split(jax.random.key(10_000), 200))
    s = jax.vmap(lambda x: scores_from_features(params, x, jnp.ones(L, bool)))(f)
    top = jax.lax.top_k(s, B)[1]
    hit = jnp.any(top == 0, axis=1) & jnp.any(top == needle[:, None], axis=1)
    assert float(jnp.mean(hit)) >= 0.9  # random keeps both with probability 1/20


def test_policy_checkpoint_round_trip_and_errors(tmp_path):
    params = init_mlp(key=jax.random.key(4))
    save_policy(tmp_path / "p", params, {"note": "test"})
    back, meta = load_policy(tmp_path / "p")
    assert meta["n_params"] == 17_921 and meta["note"] == "test"
    jax.tree.map(np.testing.assert_array_equal, params, back)
    with pytest.raises(CheckpointError, match="no such directory"):
        load_policy(tmp_path / "missing")
    (tmp_path / "p" / "policy.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable policy.json"):
        load_policy(tmp_path / "p")
    save_policy(tmp_path / "q", params, {})
    for f in (tmp_path / "q" / "params").rglob("*"):
        if f.is_file() and f.stat().st_size > 100:
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_policy(tmp_path / "q")


def test_learned_policy_plugs_into_generation(tmp_path):
    save_policy(tmp_path / "p", init_mlp(key=jax.random.key(5)), {})
    comp = Compression.make(f"learned:{tmp_path / 'p'}", ratio=0.25, min_budget=4)
    out = generate_tokens(
        LM, [list(range(1, 40)), [3, 4, 5]], config=LM_CFG, max_new_tokens=5, compression=comp
    )
    assert [len(o) for o in out] == [5, 5]
    with pytest.raises(ValueError, match="does not support granularity 'head'"):
        Compression(get_policy(f"learned:{tmp_path / 'p'}"), ratio=0.5, granularity="head")
    full = generate_tokens(LM, [list(range(1, 40))], config=LM_CFG, max_new_tokens=5)
    same = generate_tokens(
        LM,
        [list(range(1, 40))],
        config=LM_CFG,
        max_new_tokens=5,
        compression=Compression(learned_policy(init_mlp(key=jax.random.key(6))), ratio=1.0),
    )
    assert same == full


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    cfg = TrainConfig(**TINY)
    whole = run(cfg, tmp_path / "a")
    run(cfg, tmp_path / "b", stop_after=2)  # "killed" after the checkpoint at step 2
    resumed = run(cfg, tmp_path / "b")
    jax.tree.map(np.testing.assert_array_equal, whole.params, resumed.params)
    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert strip(rows(tmp_path / "a")) == strip(rows(tmp_path / "b"))
    assert (tmp_path / "b" / "policy" / "policy.json").exists()
    assert (tmp_path / "b" / "training.png").stat().st_size > 0
    with pytest.raises(ValueError, match="different config"):
        run(TrainConfig(**{**TINY, "seed": 1}), tmp_path / "b")


def test_shipped_configs_parse_and_bad_settings_fail():
    for path in (REPO / "configs").glob("distillcache_*.yaml"):
        TrainConfig.from_yaml(path)
    with pytest.raises(ValueError, match="unknown settings"):
        TrainConfig.from_dict({"ratoi": 0.5})
    with pytest.raises(ValueError, match="estimator"):
        TrainConfig(estimator="magic")
    with pytest.raises(ValueError, match="not key=value"):
        TrainConfig.from_yaml(REPO / "configs" / "distillcache_cpu.yaml", ["ratio"])
    cfg = TrainConfig.from_yaml(REPO / "configs" / "distillcache_cpu.yaml", ["ratio=0.5"])
    assert cfg.ratio == 0.5


def test_settings_are_checked_against_their_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-3\nratio: 1\nexact_entropy: yes\n")  # PyYAML: str, int
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.learning_rate, cfg.ratio, cfg.exact_entropy) == (1e-3, 1.0, True)
    assert type(cfg.ratio) is float
    bad = {
        "steps=30.5": r"steps must be an integer, got 30.5 \(float\)",
        "ratio=quarter": r"ratio must be a number, got 'quarter' \(str\)",
        "rollouts=2.5": r"rollouts must be an integer, got 2.5",
        "steps=true": r"steps must be an integer, got True \(bool\)",
        "exact_entropy='yes'": r"exact_entropy must be true or false, got 'yes' \(str\)",
        "exact_entropy=1": r"exact_entropy must be true or false, got 1 \(int\)",
        "model=7": r"model must be a string, got 7 \(int\)",
        "learning_rate=.nan": r"learning_rate must be a number, got nan",
        "data_parallel=0": r"data_parallel >= 1",
    }
    for override, message in bad.items():
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_yaml(path, [override])


def _cli(tmp_path, *args: str) -> int:
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    return train_cli.distillcache_main(
        ["--config", str(config), "--workdir", str(tmp_path / "run"), *args]
    )


def test_bad_arguments_fail_before_anything_is_written(tmp_path, capsys):
    for stop_after in ("-1", "0"):
        assert _cli(tmp_path, "--stop-after", stop_after) == 2
        assert "--stop-after must be a positive number" in capsys.readouterr().err
    assert _cli(tmp_path, "steps=30.5") == 2
    assert "steps must be an integer, got 30.5" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_crashed_first_run_does_not_block_the_corrected_command(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop, "train_step", crash)
    with pytest.raises(RuntimeError):
        run(TrainConfig(**{**TINY, "seed": 7}), tmp_path)
    monkeypatch.undo()
    state = run(TrainConfig(**TINY), tmp_path, stop_after=2)  # another config: accepted
    assert int(state.step) == 2
    with pytest.raises(ValueError, match="different config"):  # now it has a checkpoint
        run(TrainConfig(**{**TINY, "seed": 7}), tmp_path)


DP_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from jaxkv import sharding
    from jaxkv.config import ModelConfig
    from jaxkv.model import decoder
    from jaxkv.model.params import init_params
    from jaxkv.policies.learned import init_mlp
    from jaxkv.rl.config import TrainConfig
    from jaxkv.rl.step import init_state, train_step

    cfg_m = ModelConfig.tiny()
    lm = init_params(cfg_m, key=jax.random.key(0), scale=0.2)
    cfg = TrainConfig(model="tiny", prompt_len=16, decode_steps=8, min_budget=4, rollouts=8,
                      warmup_steps=1, steps=4, data_parallel=8)
    tokens = jax.random.randint(jax.random.key(2), (cfg.stream_len,), 0, 256)
    keys = jax.random.split(jax.random.key(3), 8)
    single, m1 = train_step(lm, init_state(cfg, init_mlp(key=jax.random.key(1))), tokens, keys,
                            cfg=cfg, config=cfg_m)
    mesh = sharding.make_mesh(data=8)
    skeys = jax.device_put(keys, NamedSharding(mesh, PartitionSpec("data")))
    multi, m8 = train_step(lm, init_state(cfg, init_mlp(key=jax.random.key(1))), tokens, skeys,
                           cfg=cfg, config=cfg_m)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 single.params, multi.params)
    np.testing.assert_allclose(float(m1["kl"]), float(m8["kl"]), rtol=1e-5)
    print("DP_OK", len(skeys.sharding.device_set))
    """
)


@pytest.mark.slow
def test_data_parallel_rollouts_over_8_devices_equal_single_device():
    flags = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    res = subprocess.run(
        [sys.executable, "-c", DP_SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "DP_OK 8" in res.stdout


# ---- per-head decisions (decisions: head): a ranker trained by REINFORCE ----------------------
HEAD = {**TINY, "decisions": "head", "hidden": 8}
HEAD_TOKENS = jax.random.randint(
    jax.random.key(2), (TINY["prompt_len"] + TINY["decode_steps"],), 0, 256
)


def _head_step(params, **settings):
    """One per-head training step from (numpy) ``params``: (new state, metrics)."""
    cfg = TrainConfig(**{**HEAD, **settings})
    keys = jax.random.split(jax.random.key(3), 4)
    return train_step(LM, init_state(cfg, params), HEAD_TOKENS, keys, cfg=cfg, config=LM_CFG)


def test_row_decisions_are_independent_draws_and_one_row_is_the_shared_draw():
    scores = jax.random.normal(jax.random.key(0), (3, 12))
    valid = jnp.arange(12)[None, :] < jnp.array([[12], [10], [7]])
    key = jax.random.key(1)
    for est in ("paper", "exact", "ordered_pl"):
        sel, order = decide_rows(scores, valid, 5, key=key, estimator=est, max_budget=5)
        for r, k in enumerate(jax.random.split(key, 3)):
            one = decide(scores[r], valid[r], 5, key=k, estimator=est, max_budget=5)
            np.testing.assert_array_equal(sel[r], one[0])
            np.testing.assert_array_equal(order[r], one[1])
        assert (np.asarray(sel).sum(-1) == 5).all() and not (sel & ~valid).any()
        sel1, _ = decide_rows(scores[:1], valid[:1], 5, key=key, estimator=est, max_budget=5)
        np.testing.assert_array_equal(
            sel1[0], decide(scores[0], valid[0], 5, key=key, estimator=est, max_budget=5)[0]
        )


def test_a_steps_log_prob_is_the_sum_over_its_active_rows():
    """Two rows decided independently: the loss's log π is the sum of the rows' subset
    log-probabilities (the inactive row adds nothing), checked against the closed form
    Σ_{i∈a} s_i − log e_B(exp s) by brute force over all subsets."""
    import itertools

    params = init_mlp(key=jax.random.key(2), hidden=8)
    feats = jax.random.uniform(jax.random.key(3), (2, 6, 5))
    valid = jnp.ones((2, 6), bool)
    selected = jnp.array([[1, 1, 0, 0, 1, 0], [0, 1, 1, 0, 0, 1]], bool)

    def brute(s, sel):
        logz = jnp.log(
            sum(jnp.exp(s[jnp.array(c)].sum()) for c in itertools.combinations(range(6), 3))
        )
        return float(jnp.sum(jnp.where(sel, s, 0.0)) - logz)

    s = scores_from_features(params, feats, valid)
    for active, want in (
        ([True, True], brute(s[0], selected[0]) + brute(s[1], selected[1])),
        ([True, False], brute(s[0], selected[0])),
    ):
        d = Decisions(
            feats[None, None],
            valid[None, None],
            selected[None, None],
            jnp.zeros((1, 1, 2, 6), jnp.int32),
            jnp.full((1, 1), 3),
            jnp.array(active)[None, None],
            jnp.zeros((1, 1)),
        )
        _, aux = reinforce_loss(
            params,
            d,
            jnp.ones((1, 1)),
            estimator="exact",
            beta=0.0,
            exact_entropy=False,
            max_budget=3,
        )
        np.testing.assert_allclose(float(aux["log_prob"]), want, rtol=1e-5)


def test_a_per_head_step_trains_the_ranker_mlp_and_keeps_its_standardization():
    cfg = TrainConfig(**HEAD)
    params = init_policy(cfg)
    params = {**params, "mean": params["mean"] + 0.5, "scale": params["scale"] * 2.0}
    params = jax.tree.map(np.asarray, params)  # the step donates its state's arrays
    state = init_state(cfg, params)
    before = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for est in ("paper", "exact", "ordered_pl"):
        new, m = _head_step(params, estimator=est)
        assert all(np.isfinite(float(v)) for v in m.values()) and m["entropy"] > 0
        assert jax.tree.map(lambda x: (x.shape, x.dtype), new) == before
        for k in ("mean", "scale"):
            np.testing.assert_array_equal(new.params[k], params[k])
        changed = jax.tree.map(
            lambda a, b: not np.array_equal(a, b), params["mlp"], new.params["mlp"]
        )
        assert all(jax.tree.leaves(changed))


def test_warm_start_reads_a_ranker_over_the_default_features(tmp_path):
    params = init_policy(TrainConfig(**{**HEAD, "warm_start": "ranker_smollm2_cpu"}))
    shipped, _ = ranker_lib.load_ranker_params(checkpoint_path("ranker_smollm2_cpu"))
    jax.tree.map(np.testing.assert_array_equal, params, shipped)
    for name, why in (
        ("ranker_kvzipres_smollm2_cpu", "with base log_recon"),
        ("ranker_kvzip_smollm2_cpu", "log_recon"),
    ):
        with pytest.raises(ValueError, match=why):
            init_policy(TrainConfig(**{**HEAD, "warm_start": name}))
    with pytest.raises(CheckpointError, match="ranker"):
        init_policy(TrainConfig(**{**HEAD, "warm_start": str(tmp_path / "none")}))
    with pytest.raises(ValueError, match="warm_start only with decisions: head"):
        TrainConfig(warm_start="ranker_smollm2_cpu")
    with pytest.raises(ValueError, match="decisions in"):
        TrainConfig(decisions="layer")


@pytest.mark.slow
def test_a_per_head_run_saves_a_ranker_the_evaluation_loads(tmp_path):
    cfg = TrainConfig(**{**HEAD, "warm_start": "ranker_smollm2_cpu", "steps": 2})
    state = run(cfg, tmp_path / "run")
    policy = get_policy(f"ranker:{tmp_path / 'run' / 'policy'}")
    back, meta = ranker_lib.load_ranker_params(tmp_path / "run" / "policy")
    jax.tree.map(np.testing.assert_array_equal, state.params, back)
    assert meta["train_config"]["decisions"] == "head" and meta["steps"] == 2
    out = generate_tokens(
        LM,
        [list(range(1, 40))],
        config=LM_CFG,
        max_new_tokens=4,
        compression=Compression(policy, ratio=0.25, min_budget=4, granularity="head"),
    )
    assert len(out[0]) == 4


def test_a_run_saved_before_a_setting_existed_resumes(tmp_path):
    cfg = TrainConfig(**TINY)
    run(cfg, tmp_path, stop_after=2)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["decisions"], saved["warm_start"]  # as an older jaxkv wrote it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert int(run(cfg, tmp_path, stop_after=3).step) == 3


def test_a_score_scale_sharpens_the_rollouts_and_must_be_positive():
    params = jax.tree.map(np.asarray, init_policy(TrainConfig(**HEAD)))
    entropy = {s: float(_head_step(params, score_scale=s)[1]["entropy"]) for s in (1.0, 8.0)}
    assert 0 < entropy[8.0] < entropy[1.0]
    with pytest.raises(ValueError, match="score_scale > 0"):
        TrainConfig(score_scale=0.0)


def test_train_cli_lists_subcommands_and_names_a_bad_one(capsys):
    assert train_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"    {c} " in out for c in train_cli.COMMANDS)  # each with its one-line summary
    assert train_cli.main(["--steps", "0"]) == 2
    assert (
        "error: unknown subcommand '--steps'; choose one of distillcache" in capsys.readouterr().err
    )
    assert train_cli.main([]) == 2
    assert "error: a subcommand is required" in capsys.readouterr().err
