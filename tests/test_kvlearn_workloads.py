"""Synthetic workloads: the Zipf multimodal catalog and trace; MM-Session seeded, loadable as a
Mooncake trace, prefixes that grow turn by turn, system prompts and media shared across
sessions."""

import numpy as np
import pytest

from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.serving import engine, metrics


def test_catalog_matches_readme_workload():
    cat = workloads.zipf_catalog(1.1)
    assert len(cat.names) == 130
    text, image, video = (
        cat.tokens[cat.modality == m] for m in (traces_lib.TEXT, traces_lib.IMAGE, traces_lib.VIDEO)
    )
    assert text.min() == 64 and text.max() == 288 and len(text) == 40
    assert np.all(image == 576) and len(image) == 80
    assert video.min() == 720 and video.max() == 1440 and len(video) == 10
    assert cat.popularity.sum() == pytest.approx(1.0)
    # Zipf over ranks with modality factors 0.6 / 1.4 / 1.1
    w = np.array([0.6] * 40 + [1.4] * 80 + [1.1] * 10) / np.arange(1, 131) ** 1.1
    np.testing.assert_allclose(cat.popularity, w / w.sum())


def test_trace_is_seeded_and_follows_popularity():
    a = workloads.zipf_multimodal(20_000, 0.8, seed=3)
    b = workloads.zipf_multimodal(20_000, 0.8, seed=3)
    c = workloads.zipf_multimodal(20_000, 0.8, seed=4)
    np.testing.assert_array_equal(a.key, b.key)
    assert not np.array_equal(a.key, c.key)
    np.testing.assert_allclose(np.diff(a.time_s), 0.05)  # 20 requests/s
    freq = a.empirical_popularity()
    se = np.sqrt(a.popularity * (1 - a.popularity) / 20_000)
    assert np.all(np.abs(freq - a.popularity) < 5 * se + 1e-9)
    assert np.all(a.tokens == workloads.zipf_catalog(0.8).tokens[a.key])
    p = workloads.zipf_multimodal(2000, 0.8, seed=3, poisson=True)
    assert np.all(np.diff(p.time_s) > 0) and abs(p.time_s[-1] / 2000 - 0.05) < 0.01


@pytest.fixture(scope="module")
def records():
    return workloads.mm_session(300, seed=3)


def test_seeded_and_loadable(records, tmp_path):
    assert workloads.mm_session(300, seed=3) == records
    assert workloads.mm_session(300, seed=4) != records
    path = tmp_path / "mm.jsonl"
    traces_lib.save_mooncake_jsonl(records, path)
    tr = traces_lib.load_mooncake_trace(path)  # validates lengths, block counts, monotone times
    assert len(tr) == len(records) > 300
    assert np.all(np.diff(tr.time_s) >= 0)


def test_prefixes_grow_turn_by_turn(records):
    by_session: dict[int, list[dict]] = {}
    for r in records:
        by_session.setdefault(r["session"], []).append(r)
    multi = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == list(range(len(turns)))
        for a, b in zip(turns, turns[1:], strict=False):
            assert b["timestamp"] > a["timestamp"]
            assert b["input_length"] > a["input_length"] + a["output_length"]
            full = (
                a["input_length"] // traces_lib.BLOCK_TOKENS
            )  # a's full blocks are b's leading blocks
            assert b["hash_ids"][:full] == a["hash_ids"][:full]
            multi += 1
    assert multi > 300


def test_hash_blocks_is_a_chained_prefix_hash():
    ids: dict = {}
    a = workloads._hash_blocks([(("sys", 0), 600), (("img", 1), 576)], ids)
    b = workloads._hash_blocks([(("sys", 0), 600), (("img", 2), 576)], ids)
    c = workloads._hash_blocks([(("sys", 1), 600), (("img", 1), 576)], ids)
    assert len(a) == 3 and a[0] == b[0] and a[1:] != b[1:]  # diverge where the image starts
    assert not set(a) & set(c)  # same image behind another system prompt: nothing shared


def test_shared_prefixes_give_hits_and_bursty_arrivals(records, tmp_path):
    traces_lib.save_mooncake_jsonl(records, tmp_path / "mm.jsonl")
    tr = traces_lib.load_mooncake_trace(tmp_path / "mm.jsonl")
    cost = CostModel.llama3_8b_a100()
    cfg = engine.ServingConfig(pool_blocks=tr.n_blocks, prefill_nodes=4)
    rec = engine.simulate(tr, "mooncake", cfg=cfg, cost=cost)
    assert metrics.summarize("mooncake", rec, cost=cost, cfg=cfg)["hit_rate"] > 0.3
    bursty = workloads.mm_session(300, seed=3, cfg=workloads.MMSessionConfig(bursty=True))
    first = np.array(sorted(r["timestamp"] for r in bursty if r["turn"] == 0)) / 1e3
    plain = np.array(sorted(r["timestamp"] for r in records if r["turn"] == 0)) / 1e3
    cv = lambda t: np.std(np.diff(t)) / np.mean(np.diff(t))  # 1 for Poisson, > 1 when bursty
    assert 0.8 < cv(plain) < 1.2 and cv(first) > 1.5
