"""Serving-scale simulator: prefix hits on hand-made traces, queueing against closed forms,
Mooncake loader errors, the CLI."""

import json

import numpy as np
import pytest

from jaxkv.cli.kvlearn import eval_main
from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn.calibrate import cost_model_from
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine, metrics
from jaxkv.kvlearn.serving.policies import BLOCK_POLICIES
from jaxkv.kvlearn.serving.prefix import ROOT, PrefixCache
from jaxkv.kvlearn.traces import TraceError

COST = CostModel.llama3_8b_a100()
BT = 512


def _write(path, reqs):
    """reqs: (timestamp ms, input_length, hash_ids)."""
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": 1, "hash_ids": h})
        for t, n, h in reqs
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def _trace(tmp_path, hashes, *, gap_ms=1_000_000, last_tokens=BT):
    """Requests 1000 s apart (every admission lands before the next lookup), full blocks except
    the last, which has ``last_tokens``."""
    reqs = [(i * gap_ms, BT * (len(h) - 1) + last_tokens, h) for i, h in enumerate(hashes)]
    return traces_lib.load_mooncake_trace(_write(tmp_path / "t.jsonl", reqs))


def _hits(tr, policy, blocks, **kw):
    cfg = engine.ServingConfig(pool_blocks=blocks, prefill_nodes=1, **kw)
    return engine.simulate(tr, policy, cfg=cfg, cost=COST)


# ---- prefix hits ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["mooncake", "lru", "lfu"])
def test_shared_diverging_and_repeated_prefixes(tmp_path, policy):
    hashes = [
        [1, 2, 3],  # cold
        [1, 2, 4],  # shares two blocks, diverges at the third
        [1, 5, 6],  # shares one
        [1, 2, 3],  # repeats the first request
        [7, 2, 3],  # same later ids under another first block: chained ids are still equal ids,
        #             but block 7 is missing so nothing after it counts
        [9],
    ]
    rec = _hits(_trace(tmp_path, hashes, last_tokens=100), policy, 100)
    np.testing.assert_array_equal(rec["hit_blocks"], [0, 2, 1, 3, 0, 0])
    # hit tokens: full blocks, and the repeated request's partial last block (100 tokens)
    np.testing.assert_array_equal(rec["hit_tokens"], [0, 1024, 512, 1124, 0, 0])
    assert rec["evictions"] == 0


def test_resident_block_behind_a_missing_predecessor_is_not_a_hit(tmp_path):
    # LRU-Pool (blocks as independent keys), 2 slots: [1, 2] fills the pool; [3] evicts the
    # least recently used block, 1; then [1, 2] finds 2 resident but 1 missing: 0 hits.
    rec = _hits(_trace(tmp_path, [[1, 2], [3], [1, 2]]), "lru", 2)
    np.testing.assert_array_equal(rec["hit_blocks"], [0, 0, 0])
    # the prefix cache (Mooncake-style) evicts the leaf 2 instead and keeps a 1-block hit
    rec = _hits(_trace(tmp_path, [[1, 2], [3], [1, 2]]), "mooncake", 2)
    np.testing.assert_array_equal(rec["hit_blocks"], [0, 0, 1])


def test_prefix_cache_match_and_leaf_eviction_directly():
    c = PrefixCache(3, n_blocks=10, leaf_only=True)
    assert c.insert(0, ROOT, (1,)) and c.insert(1, 0, (2,)) and c.insert(2, 1, (3,))
    assert c.match([0, 1, 2, 5]) == 3 and c.match([5, 1, 2]) == 0 and c.match([0, 5, 2]) == 1
    # the oldest block (0) is not a leaf: the only leaf, 2, goes first, even though it is newest
    assert c.insert(3, ROOT, (4,))
    assert list(np.flatnonzero(c.resident)) == [0, 1, 3]
    # a block under a non-resident parent is refused by the prefix cache
    assert not c.insert(4, 2, (5,))
    # bypass: a candidate is refused rather than evicting a higher-priority victim
    assert not c.insert(5, ROOT, (0,), min_victim=(0,))
    assert c.size == 3 and c.evictions == 1
    c0 = PrefixCache(0, n_blocks=3)
    assert not c0.insert(0, ROOT, (1,)) and c0.match([0]) == 0


def test_transfer_and_admission_accounting(tmp_path):
    tr = _trace(tmp_path, [[1, 2], [1, 2, 3]], last_tokens=BT)
    cfg = engine.ServingConfig(pool_blocks=10, prefill_nodes=1)
    rec = engine.simulate(tr, "mooncake", cfg=cfg, cost=COST)
    s = metrics.summarize("mooncake", rec, cost=COST, cfg=cfg)
    # moved tokens: pool→P 1024 (request 2's hit); P→D 1024 + 1536; P→pool 1024 + 512
    moved = 1024 + 1024 + 1536 + 1024 + 512
    assert s["transfer_gib"] == pytest.approx(COST.footprint_bytes(moved) / 2**30)
    assert s["admits"] == 3 and s["discards"] == 0
    assert s["hit_rate"] == pytest.approx(2 / 5) and s["token_hit_rate"] == pytest.approx(
        1024 / 2560
    )
    # request 2: fetch 1024 tokens, prefill the suffix over the cached context, ship 1536 tokens
    svc = COST.transfer_ms(COST.footprint_bytes(1024)) + COST.recompute_ms(1536.0)
    svc -= COST.recompute_ms(1024.0)
    assert rec["service_ms"][1] == pytest.approx(svc)
    assert rec["ttft_ms"][1] == pytest.approx(svc + COST.transfer_ms(COST.footprint_bytes(1536)))


def test_belady_bypasses_blocks_never_used_again(tmp_path):
    rec = _hits(_trace(tmp_path, [[1, 2], [3, 4], [1, 2]]), "belady", 2)
    np.testing.assert_array_equal(rec["hit_blocks"], [0, 0, 2])
    assert rec["admits"] == 2  # [3, 4] is never used again: not admitted


# ---- queueing -------------------------------------------------------------------------------
def _uniform_trace(times_s, tokens):
    n = len(times_s)
    return traces_lib.MooncakeTrace(
        time_s=np.asarray(times_s, np.float64),
        input_len=np.full(n, tokens, np.int64),
        output_len=np.ones(n, np.int64),
        blocks=tuple(np.array([i]) for i in range(n)),  # distinct blocks: no reuse
        n_blocks=n,
    )


@pytest.mark.parametrize("ratio", [1.5, 0.8])
def test_one_node_deterministic_arrivals(ratio):
    tokens = 400
    s_ms = float(COST.recompute_ms(float(tokens)))
    a_s = ratio * s_ms / 1e3  # inter-arrival time
    n = 50
    tr = _uniform_trace(np.arange(n) * a_s, tokens)
    rec = engine.simulate(tr, "no_cache", cfg=engine.ServingConfig(pool_blocks=0), cost=COST)
    expect = np.maximum(0.0, np.arange(n) * (s_ms - a_s * 1e3))  # linear backlog when a < s
    np.testing.assert_allclose(rec["wait_ms"], expect, rtol=1e-9, atol=1e-6)
    t_d = COST.transfer_ms(COST.footprint_bytes(tokens))
    np.testing.assert_allclose(rec["ttft_ms"], expect + s_ms + t_d, rtol=1e-9)


def test_md1_mean_wait_matches_pollaczek_khinchine():
    tokens, rho, n = 400, 0.6, 200_000
    s = float(COST.recompute_ms(float(tokens))) / 1e3
    lam = rho / s
    times = np.cumsum(np.random.default_rng(0).exponential(1 / lam, n))
    rec = engine.simulate(
        _uniform_trace(times, tokens),
        "no_cache",
        cfg=engine.ServingConfig(pool_blocks=0),
        cost=COST,
    )
    wq = lam * s * s / (2 * (1 - rho))
    assert rec["wait_ms"].mean() / 1e3 == pytest.approx(wq, rel=0.05)


def test_more_nodes_never_wait_longer():
    times = np.cumsum(np.random.default_rng(1).exponential(0.01, 2000))
    tr = _uniform_trace(times, 400)
    waits = [
        engine.simulate(
            tr, "no_cache", cfg=engine.ServingConfig(pool_blocks=0, prefill_nodes=k), cost=COST
        )["wait_ms"].mean()
        for k in (1, 2, 4)
    ]
    assert waits[0] > waits[1] > waits[2] >= 0


# ---- loader ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "second, message",
    [
        ('{"timestamp": 5, "input_length": 10, "hash_ids": [1]}', ":2: missing field.*output"),
        (
            '{"timestamp": 5, "input_length": -3, "output_length": 1, "hash_ids": []}',
            ":2: 'input_length' must be an integer > 0",
        ),
        (
            '{"timestamp": 5, "input_length": 10, "output_length": -1, "hash_ids": [1]}',
            ":2: 'output_length' must be an integer ≥ 0",
        ),
        (
            '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
            ":2: timestamp 1.0 goes backwards",
        ),
        (
            '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
            ":2: 1 hash_ids for input_length 600",
        ),
        ("not json", ":2: not valid JSON"),
    ],
)
def test_loader_errors_name_the_line(tmp_path, second, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 2, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n' + second
    )
    with pytest.raises(TraceError, match=message):
        traces_lib.load_mooncake_trace(path)


def test_loader_reads_the_shipped_format(tmp_path):
    tr = traces_lib.load_mooncake_trace(
        _write(tmp_path / "ok.jsonl", [(0, 1000, [10, 11]), (0, 512, [10]), (1500, 1, [12])])
    )
    assert len(tr) == 3 and tr.n_blocks == 3
    np.testing.assert_array_equal(tr.time_s, [0, 0, 1.5])
    np.testing.assert_array_equal(tr.block_tokens_of(0), [512, 488])
    np.testing.assert_array_equal(tr.scaled(2.0).time_s, [0, 0, 0.75])


# ---- CLI ------------------------------------------------------------------------------------
def test_cli_on_a_mooncake_trace_writes_the_core_schema_plus_serving_fields(tmp_path, capsys):
    rng = np.random.default_rng(0)
    reqs, t = [], 0
    for _ in range(200):
        t += int(rng.integers(0, 400))
        shared = [int(x) for x in range(int(rng.integers(1, 4)))]  # a shared system prompt
        own = [1000 + int(x) for x in rng.integers(0, 60, size=int(rng.integers(1, 4)))]
        h = shared + list(dict.fromkeys(own))
        reqs.append((t, 512 * len(h), h))
    path = _write(tmp_path / "mc.jsonl", reqs)
    out = tmp_path / "r.json"
    argv = ["serve", "--trace", str(path), "--pool-gib", "2", "--prefill-nodes", "2"]
    argv += ["--json", str(out)]
    assert eval_main(argv + ["--load-scale", "2"]) == 0
    text = capsys.readouterr().out
    for name in BLOCK_POLICIES:
        assert f"\n{name} " in text
    data = json.loads(out.read_text())
    assert data["config"]["prefill_nodes"] == 2 and data["config"]["pool_blocks"] == 32
    assert [r["policy"] for r in data["results"]] == list(BLOCK_POLICIES)
    core = {"policy", "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "hit_rate", "transfer_gib"}
    for r in data["results"]:
        assert core | {"admits", "evictions", "token_hit_rate", "throughput_rps"} <= r.keys()
    res = {r["policy"]: r for r in data["results"]}
    assert res["no_cache"]["hit_rate"] == 0.0
    assert res["mooncake"]["ttft_ms_mean"] < res["no_cache"]["ttft_ms_mean"]
    assert res["belady"]["hit_rate"] >= res["mooncake"]["hit_rate"]


def test_cli_serving_errors(tmp_path, capsys):
    path = _write(tmp_path / "mc.jsonl", [(0, 10, [1]), (-5, 10, [2])])
    assert eval_main(["serve", "--trace", str(path), "--pool-gib", "1"]) == 2
    assert "mc.jsonl:2: 'timestamp' must be a finite number ≥ 0" in capsys.readouterr().err
    ok = _write(tmp_path / "ok.jsonl", [(0, 10, [1])])
    assert eval_main(["serve", "--trace", str(ok)]) == 2
    assert "serve needs the pool size: --pool-gib G or --pool-frac F" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        eval_main(["3", "--policies", "mooncake"])
    assert e.value.code == 2
    assert "(mooncake: policies of `kvlearn serve`)" in capsys.readouterr().err


def test_block_kvlearn_learns_to_refuse_one_off_tails(tmp_path):
    # every request: a shared 2-block system prompt, then a block never seen again
    hashes = [[0, 1, 100 + i] for i in range(900)]
    tr = _trace(tmp_path, hashes, gap_ms=1000)
    cfg = engine.ServingConfig(pool_blocks=50, prefill_nodes=1)
    base = engine.simulate(tr, "mooncake", cfg=cfg, cost=COST)
    learned = engine.simulate(tr, "kvlearn", cfg=cfg, cost=COST)
    assert base["admits"] == 2 + 900  # Mooncake-style admits every computed block
    assert learned["admits"] < 2 + 450  # the PRP learns that tails are not reused
    np.testing.assert_array_equal(learned["hit_blocks"][1:], 2)  # the shared prefix stays


def test_calibrate_fits_the_decoder_and_feeds_the_simulator(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    argv = ["calibrate", "--model", "tiny", "--lengths", "32,64,128", "--repeats", "2"]
    assert eval_main(argv + ["--json", str(cal), "--plot", str(tmp_path / "c.png")]) == 0
    data = json.loads(cal.read_text())
    assert data["alpha_bw_ms"] > 0 and data["alpha_flop_ms"] > 0 and len(data["prefill_ms"]) == 3
    assert data["crossover_tokens"] == pytest.approx(data["alpha_bw_ms"] / data["alpha_flop_ms"])
    cost = cost_model_from(cal)
    assert cost.shape.bytes_per_token == 2 * 2 * 2 * 16 * 4  # tiny: 2 layers, 2 KV heads, f32
    assert (tmp_path / "c.png").stat().st_size > 0
    trace = _write(tmp_path / "mc.jsonl", [(0, 600, [1, 2]), (100_000, 600, [1, 2])])
    out = tmp_path / "r.json"
    argv = ["serve", "--trace", str(trace), "--pool-frac", "1", "--calibration", str(cal)]
    assert eval_main(argv + ["--policies", "mooncake", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    fit = max(cost.alpha_bw_ms * 600, cost.alpha_flop_ms * 600**2)
    t_d = cost.transfer_ms(cost.footprint_bytes(600))
    assert r["ttft_ms_p99"] <= fit + t_d + 1e-9  # both requests are charged the calibrated R
    assert r["hit_rate"] == pytest.approx(0.5)
    assert eval_main(["calibrate", "--lengths", "64"]) == 2
    assert "need ≥ 2 positive --lengths" in capsys.readouterr().err
