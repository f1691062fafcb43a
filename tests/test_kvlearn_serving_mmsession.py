"""MM-Session generator: seeded, loadable as a Mooncake trace, prefixes that grow turn by turn,
system prompts and media shared across sessions."""

import numpy as np
import pytest

from jaxkv.kvlearn import mmsession as MM
from jaxkv.kvlearn import serving as SV
from jaxkv.kvlearn.cost import CostModel


@pytest.fixture(scope="module")
def records():
    return MM.generate(300, seed=3)


def test_seeded_and_loadable(records, tmp_path):
    assert MM.generate(300, seed=3) == records
    assert MM.generate(300, seed=4) != records
    path = tmp_path / "mm.jsonl"
    MM.write_jsonl(records, path)
    tr = SV.load_mooncake_trace(path)  # validates lengths, block counts, monotone times
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
            full = a["input_length"] // MM.BLOCK  # a's full blocks are b's leading blocks
            assert b["hash_ids"][:full] == a["hash_ids"][:full]
            multi += 1
    assert multi > 300


def test_hash_blocks_is_a_chained_prefix_hash():
    ids: dict = {}
    a = MM._hash_blocks([(("sys", 0), 600), (("img", 1), 576)], ids)
    b = MM._hash_blocks([(("sys", 0), 600), (("img", 2), 576)], ids)
    c = MM._hash_blocks([(("sys", 1), 600), (("img", 1), 576)], ids)
    assert len(a) == 3 and a[0] == b[0] and a[1:] != b[1:]  # diverge where the image starts
    assert not set(a) & set(c)  # same image behind another system prompt: nothing shared


def test_shared_prefixes_give_hits_and_bursty_arrivals(records, tmp_path):
    MM.write_jsonl(records, tmp_path / "mm.jsonl")
    tr = SV.load_mooncake_trace(tmp_path / "mm.jsonl")
    cost = CostModel.llama3_8b_a100()
    cfg = SV.ServingConfig(pool_blocks=tr.n_blocks, prefill_nodes=4)
    rec = SV.simulate(tr, "mooncake", cfg=cfg, cost=cost)
    assert SV.summarize("mooncake", rec, cost=cost, cfg=cfg)["hit_rate"] > 0.3
    bursty = MM.generate(300, seed=3, cfg=MM.MMSessionConfig(bursty=True))
    first = np.array(sorted(r["timestamp"] for r in bursty if r["turn"] == 0)) / 1e3
    plain = np.array(sorted(r["timestamp"] for r in records if r["turn"] == 0)) / 1e3
    cv = lambda t: np.std(np.diff(t)) / np.mean(np.diff(t))  # 1 for Poisson, > 1 when bursty
    assert 0.8 < cv(plain) < 1.2 and cv(first) > 1.5
