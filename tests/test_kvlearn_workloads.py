"""Synthetic workloads: the Zipf multimodal catalog and trace; MM-Session seeded, loadable as a
Mooncake trace, prefixes that grow turn by turn, system prompts and media shared across
sessions; chat, agent and rag seeded, loadable, windowed, with their structure (chat turns
extend the previous turn, agent steps share the tool prompt and grow, rag documents recur with
Zipf frequency in varying order); the ``workload`` CLI."""

import json

import numpy as np
import pytest

from jaxkv.cli.kvlearn import eval_main
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


# ---- chat, agent, rag -------------------------------------------------------------------------
BT = traces_lib.BLOCK_TOKENS
SIZES = {"chat": 1500, "agent": 800, "rag": 1500}


@pytest.fixture(scope="module")
def synthetic():
    return {k: workloads.WORKLOADS[k][0](n, seed=5) for k, n in SIZES.items()}


def _by(records, unit: str, step: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for r in records:
        out.setdefault(r[unit], []).append(r)
    for rs in out.values():
        assert [r[step] for r in rs] == list(range(len(rs)))  # time order = step order
    return out


@pytest.mark.parametrize("kind", list(SIZES))
def test_synthetic_is_seeded_loadable_and_ordered(kind, synthetic, tmp_path):
    generate, _ = workloads.WORKLOADS[kind]
    recs = synthetic[kind]
    assert len(recs) == SIZES[kind]
    assert generate(SIZES[kind], seed=5) == recs
    assert generate(SIZES[kind], seed=6) != recs
    t = [r["timestamp"] for r in recs]
    assert t == sorted(t) and t[-1] > t[0]
    traces_lib.save_mooncake_jsonl(recs, tmp_path / f"{kind}.jsonl")
    tr = traces_lib.load_mooncake_trace(tmp_path / f"{kind}.jsonl")  # the validating loader
    assert len(tr) == len(recs) and np.all(np.diff(tr.time_s) >= 0)
    np.testing.assert_array_equal(tr.input_len, [r["input_length"] for r in recs])
    # a window of a stream: the first n requests do not depend on how many are generated
    assert generate(SIZES[kind] // 3, seed=5) == recs[: SIZES[kind] // 3]


def test_chat_turns_extend_the_previous_turn(synthetic):
    cfg = workloads.ChatConfig()
    sessions = _by(synthetic["chat"], "session", "turn")
    pairs = 0
    for turns in sessions.values():
        for a, b in zip(turns, turns[1:], strict=False):
            assert (
                b["hash_ids"][: a["input_length"] // BT] == a["hash_ids"][: a["input_length"] // BT]
            )
            assert b["input_length"] > a["input_length"] + a["output_length"]
            think_ms = (
                b["timestamp"] - a["timestamp"] - 1e3 * a["output_length"] / cfg.decode_tok_per_s
            )
            assert think_ms > -1e-3  # the answer is streamed before the user replies
            pairs += 1
    assert pairs > 500
    # geometric session lengths: P(one more turn) = 1 − 1/mean_turns (first turns are all here)
    n_turns = np.array([len(t) for t in sessions.values()])
    assert np.mean(n_turns >= 2) == pytest.approx(1 - 1 / cfg.mean_turns, abs=0.08)
    # a few system prompts shared by many sessions: with prompts of ≥ 1 block, their first
    # block is shared (a shorter prompt's first block also holds the session's own text)
    first: dict[int, set] = {}
    long_sys = workloads.ChatConfig(system_tokens=(600, 1500))
    for r in workloads.chat(300, seed=5, cfg=long_sys):
        first.setdefault(r["system"], set()).add(r["hash_ids"][0])
    assert len(first) == cfg.n_system and all(len(v) == 1 for v in first.values())


def test_agent_steps_share_the_tool_prompt_and_grow(synthetic):
    recs = synthetic["agent"]
    agents = _by(recs, "agent", "step")
    shared: dict[int, list[int]] = {}
    for steps in agents.values():
        k = steps[0]["system"]
        sys_blocks = min(r["input_length"] for r in recs if r["system"] == k) // BT
        ref = shared.setdefault(k, steps[0]["hash_ids"][:sys_blocks])
        assert len(ref) >= workloads.AgentConfig().system_tokens[0] // BT
        for a, b in zip(steps, steps[1:], strict=False):
            assert b["hash_ids"][: len(ref)] == ref  # every step of every agent of framework k
            full = a["input_length"] // BT
            assert b["hash_ids"][:full] == a["hash_ids"][:full]
            assert b["input_length"] > a["input_length"] + a["output_length"]
    assert max(len(s) for s in agents.values()) >= 10
    # several agents run concurrently: their steps interleave in time
    span = {a: (s[0]["timestamp"], s[-1]["timestamp"]) for a, s in agents.items()}
    t_mid = recs[len(recs) // 2]["timestamp"]
    assert sum(lo <= t_mid <= hi for lo, hi in span.values()) >= 5


def test_rag_documents_recur_with_zipf_frequency_in_varying_order(synthetic):
    cfg = workloads.RAGConfig()
    recs = synthetic["rag"]
    docs = [r["docs"] for r in recs]
    assert all(len(d) == len(set(d)) == cfg.docs_per_query for d in docs)
    count = np.bincount(np.concatenate(docs), minlength=cfg.n_docs)
    # log-binned rank-frequency slope ≈ −α (ranks 3..300; the top few saturate without
    # replacement, the tail is too sparse at this size)
    edges = np.unique(np.geomspace(3, 300, 12).astype(int))
    mid = np.sqrt(edges[:-1] * edges[1:])
    freq = [count[a:b].mean() for a, b in zip(edges[:-1], edges[1:], strict=False)]
    slope = np.polyfit(np.log(mid), np.log(freq), 1)[0]
    assert slope == pytest.approx(-cfg.zipf_alpha, abs=0.15)
    assert count[0] > 0.1 * len(recs)  # the most popular document is in >10 % of prompts
    # order varies: the two most popular documents appear in both orders; in a prefix cache
    # the second position of such a pair then shares nothing with the other order
    both = [d for d in docs if 0 in d and 1 in d]
    assert {d.index(0) < d.index(1) for d in both} == {True, False}

    # different first documents share exactly the system prompt's full blocks, whatever
    # documents follow; the same first document shares at least as much
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for k in range(cfg.n_system):
        rs = [r for r in recs if r["system"] == k][:60]
        diff = {
            common(a["hash_ids"], b["hash_ids"])
            for a in rs
            for b in rs
            if a["docs"][0] != b["docs"][0]
        }
        same = [
            common(a["hash_ids"], b["hash_ids"])
            for a in rs
            for b in rs
            if a["docs"][0] == b["docs"][0]
        ]
        assert len(diff) == 1 and min(same) >= diff.pop()
    ordered = workloads.rag(300, seed=5, cfg=workloads.RAGConfig(shuffle=False))
    assert all(r["docs"] == sorted(r["docs"]) for r in ordered)


def test_synthetic_configs_are_validated():
    with pytest.raises(ValueError, match="mean_turns"):
        workloads.ChatConfig(mean_turns=0.5)
    with pytest.raises(ValueError, match="docs_per_query"):
        workloads.RAGConfig(docs_per_query=0)
    with pytest.raises(ValueError, match="system_tokens"):
        workloads.AgentConfig(system_tokens=(10, 5))
    with pytest.raises(ValueError, match="LogNormal"):
        workloads.LogNormal(0, 1, 1, 2)
    with pytest.raises(ValueError, match="n_requests"):
        workloads.chat(0, seed=0)


@pytest.mark.parametrize("kind", ["chat", "agent", "rag"])
def test_workload_cli_writes_the_generator_trace(kind, tmp_path, capsys):
    out = tmp_path / f"{kind}.jsonl"
    args = ["workload", kind, "--requests", "40", "--seed", "3", "--rate", "2", "--out", str(out)]
    assert eval_main(args) == 0
    generate, config = workloads.WORKLOADS[kind]
    want = generate(40, seed=3, cfg=config(rate_per_s=2.0))
    assert [json.loads(x) for x in out.read_text().splitlines()] == want
    assert f"wrote 40 {kind} requests" in capsys.readouterr().out
    assert eval_main(["workload", kind, "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
