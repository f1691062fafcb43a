"""Serving simulator: the static popularity oracle against brute force, the max-sustainable-rate
search against a closed form, the decode queue against a closed form."""

import itertools
import json
import math

import numpy as np
import pytest

from jaxkv.cli.kvlearn import eval_main
from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine, metrics, oracle, rate
from jaxkv.kvlearn.serving.prefix import ROOT

COST = CostModel.llama3_8b_a100()
BT = 512


def _write_trace(path, reqs):
    """reqs: (timestamp ms, input_length, hash_ids, output_length)."""
    lines = [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h})
        for t, n, h, o in reqs
    ]
    path.write_text("\n".join(lines) + "\n")
    return traces_lib.load_mooncake_trace(path)


def _random_tree_trace(tmp_path, rng, n_nodes=9, n_req=30):
    """Requests are root-to-node paths of a random forest (chained ids, full blocks), 1000 s
    apart so every admission lands before the next lookup."""
    parent = [-1] + [int(rng.integers(-1, i)) for i in range(1, n_nodes)]
    paths = []
    for v in range(n_nodes):
        p, u = [], v
        while u != -1:
            p.append(u)
            u = parent[u]
        paths.append(p[::-1])
    w = rng.random(n_nodes) ** 2 + 0.05
    reqs = []
    for i, v in enumerate(rng.choice(n_nodes, size=n_req, p=w / w.sum())):
        reqs.append((i * 1_000_000, BT * len(paths[v]), paths[v], 1))
    return _write_trace(tmp_path / "tree.jsonl", reqs)


def _closed(sel, parent):
    return all(parent[b] < 0 or sel[parent[b]] for b in np.nonzero(sel)[0])


def _brute_force(parent, value, k):
    n = len(value)
    best = 0.0
    for r in range(1, k + 1):
        for s in itertools.combinations(range(n), r):
            sel = np.zeros(n, bool)
            sel[list(s)] = True
            if _closed(sel, parent):
                best = max(best, float(value[sel].sum()))
    return best


def test_static_oracle_matches_brute_force_on_tiny_traces(tmp_path):
    rng = np.random.default_rng(0)
    checked = total = 0
    for _ in range(6):
        tr = _random_tree_trace(tmp_path, rng)
        parent, depth, _, count = oracle.block_tree(tr)
        value = oracle.static_values(tr, COST)
        for k in range(0, tr.n_blocks + 1):
            sel, exact = oracle.static_oracle_set(parent, depth, value, k)
            assert sel.sum() <= k and _closed(sel, parent)
            total += 1
            best = _brute_force(parent, value, k)
            assert value[sel].sum() <= best + 1e-6
            if exact:
                checked += 1
                assert value[sel].sum() == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert checked >= total // 2  # the exact branch is exercised, not just the greedy fill


def test_oracle_static_simulation_hits_its_set_after_the_first_request(tmp_path):
    rng = np.random.default_rng(1)
    tr = _random_tree_trace(tmp_path, rng, n_nodes=9, n_req=40)
    parent, depth, _, count = oracle.block_tree(tr)
    value = oracle.static_values(tr, COST)
    for k in (2, 4, 6):
        sel, _ = oracle.static_oracle_set(parent, depth, value, k)
        cfg = engine.ServingConfig(pool_blocks=k, prefill_nodes=1)
        rec = engine.simulate(tr, "oracle_static", cfg=cfg, cost=COST)
        # a kept block misses once (compulsory) and hits in every later request that holds it
        assert rec["hit_blocks"].sum() == (count[sel] - 1).sum()
        assert rec["evictions"] == 0 and rec["admits"] == sel.sum()


def test_block_tree_parents_depths_and_counts(tmp_path):
    tr = _write_trace(
        tmp_path / "t.jsonl",
        [(0, 1024, [5, 6], 1), (1, 1500, [5, 6, 7], 1), (2, 512, [8], 1), (3, 1024, [5, 9], 1)],
    )
    parent, depth, tokens, count = oracle.block_tree(tr)
    # dense ids in order of first appearance: 5→0, 6→1, 7→2, 8→3, 9→4
    np.testing.assert_array_equal(parent, [ROOT, 0, 1, ROOT, 0])
    np.testing.assert_array_equal(depth, [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(tokens, [512, 512, 476, 512, 512])
    np.testing.assert_array_equal(count, [3, 2, 1, 1, 1])


# ---- rate search ----------------------------------------------------------------------------
def _even_trace(tmp_path, n, gap_ms, tokens):
    reqs = [
        (i * gap_ms, tokens, list(range(i * 10, i * 10 + -(-tokens // BT))), 1) for i in range(n)
    ]
    return _write_trace(tmp_path / "even.jsonl", reqs)


@pytest.mark.parametrize("attainment", [0.5, 0.9])
def test_rate_search_matches_the_closed_form_on_one_node(tmp_path, attainment):
    n, gap_ms, tokens = 200, 1000.0, 4096
    tr = _even_trace(tmp_path, n, gap_ms, tokens)
    s = float(COST.recompute_ms(float(tokens)))  # no cache: every request pays the full prefill
    t = float(COST.transfer_ms(COST.footprint_bytes(tokens)))
    slo = 20 * s
    cfg = engine.ServingConfig(pool_blocks=0, prefill_nodes=1, slo_ms=slo)
    # request i waits i·(s − g/x) at load x > g/s; it meets the SLO iff that is ≤ slo − s − t.
    # ≥ K = ⌈q·n⌉ requests meet it iff (K − 1)·(s − g/x) ≤ slo − s − t.
    k = math.ceil(attainment * n)
    x_star = gap_ms / (s - (slo - s - t) / (k - 1))
    out = rate.max_sustainable_rate(tr, "no_cache", cfg=cfg, cost=COST, attainment=attainment)
    x = out["max_load_scale"]
    assert x_star / 1.02 <= x <= x_star
    assert out["throughput_rps"] == pytest.approx(x * n / ((n - 1) * gap_ms / 1e3))


def test_more_prefill_nodes_sustain_at_least_the_rate(tmp_path):
    rng = np.random.default_rng(2)
    reqs, t = [], 0.0
    for i in range(300):
        t += float(rng.exponential(400.0))
        nb = int(rng.integers(1, 12))
        reqs.append((t, nb * BT, list(range(i * 20, i * 20 + nb)), 1))
    tr = _write_trace(tmp_path / "p.jsonl", reqs)
    rates = []
    for nodes in (1, 2, 4):
        cfg = engine.ServingConfig(pool_blocks=0, prefill_nodes=nodes, slo_ms=500.0)
        rates.append(
            rate.max_sustainable_rate(tr, "no_cache", cfg=cfg, cost=COST)["max_load_scale"]
        )
    # more nodes never wait longer at any load, so the boundary moves out (up to the tolerance)
    assert rates[1] >= rates[0] / 1.02 and rates[2] >= rates[1] / 1.02
    assert rates[2] > 1.5 * rates[0]


def test_rate_search_rejects_bad_arguments(tmp_path):
    tr = _even_trace(tmp_path, 3, 1000.0, 512)
    cfg = engine.ServingConfig(pool_blocks=0)
    with pytest.raises(ValueError, match="attainment"):
        rate.max_sustainable_rate(tr, "no_cache", cfg=cfg, cost=COST, attainment=0.0)
    with pytest.raises(ValueError, match="two requests"):
        rate.max_sustainable_rate(tr.head(1), "no_cache", cfg=cfg, cost=COST)


# ---- decode ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.5, 2.0])
def test_decode_queue_one_slot_deterministic(ratio):
    # KV ready every a s, each sequence decodes for d = ratio·a s on the only slot
    a, n, out_len, tpot = 1.0, 50, 40, 25.0
    d = out_len * tpot / 1e3
    a = d / ratio
    ready = np.arange(n) * a
    res = engine.decode_queue(ready, np.full(n, out_len), slots=1, tpot_ms=tpot)
    wait = np.maximum(0.0, np.arange(n) * (d - a)) * 1e3
    np.testing.assert_allclose(res["decode_wait_ms"], wait, atol=1e-6)
    np.testing.assert_allclose(res["done_s"], ready + wait / 1e3 + d, atol=1e-9)


def test_decode_slots_do_not_change_ttft_but_change_completion(tmp_path):
    rng = np.random.default_rng(3)
    reqs, t = [], 0.0
    for i in range(200):
        t += float(rng.exponential(50.0))
        nb = int(rng.integers(1, 6))
        reqs.append((t, nb * BT, [0] + list(range(i * 10 + 1, i * 10 + nb)), 400))
    tr = _write_trace(tmp_path / "d.jsonl", reqs)
    few = engine.ServingConfig(pool_blocks=20, prefill_nodes=2, decode_nodes=1, decode_slots=2)
    many = engine.ServingConfig(pool_blocks=20, prefill_nodes=2, decode_nodes=8, decode_slots=32)
    r_few = engine.simulate(tr, "mooncake", cfg=few, cost=COST)
    r_many = engine.simulate(tr, "mooncake", cfg=many, cost=COST)
    np.testing.assert_array_equal(r_few["ttft_ms"], r_many["ttft_ms"])
    np.testing.assert_allclose(r_many["decode_wait_ms"], 0.0)
    assert r_few["decode_wait_ms"].mean() > 1000.0
    assert (r_few["e2e_ms"] >= r_few["ttft_ms"] + 400 * few.tpot_ms - 1e-6).all()
    s = metrics.summarize("mooncake", r_few, cost=COST, cfg=few)
    assert (
        s["e2e_ms_mean"] > metrics.summarize("mooncake", r_many, cost=COST, cfg=many)["e2e_ms_mean"]
    )


def test_cli_rate_search_fills_throughput(tmp_path, capsys):
    rng = np.random.default_rng(4)
    reqs, t = [], 0.0
    for i in range(120):
        t += float(rng.exponential(300.0))
        nb = int(rng.integers(1, 8))
        reqs.append((t, (nb + 2) * BT, [0, 1] + list(range(i * 10 + 2, i * 10 + nb + 2)), 50))
    path = tmp_path / "r.jsonl"
    _write_trace(path, reqs)
    out = tmp_path / "r.json"
    argv = ["serve", "--trace", str(path), "--pool-gib", "1", "--prefill-nodes", "1"]
    argv += ["--slo-ms", "400"]
    argv += ["--policies", "no_cache,mooncake", "--rate-search", "--json", str(out)]
    assert eval_main(argv) == 0
    res = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    for r in res.values():
        assert r["throughput_rps"] > 0 and r["max_load_scale"] > 0 and r["goodput_rps"] > 0
    # caching shortens prefills, so the cached deployment sustains a higher rate
    assert res["mooncake"]["throughput_rps"] > res["no_cache"]["throughput_rps"]
    assert "max rps" in capsys.readouterr().out
