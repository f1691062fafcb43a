"""jaxkv as a vLLM KV-offload cache policy (``jaxkv/kvlearn/integrations/``), against vLLM's own
classes. The tests marked ``vllm`` need ``.venv-vllm`` (``scripts/vllm_env.sh test`` runs them)
and skip where vLLM is not installed; the import-boundary test runs everywhere."""

import ast
import random
import subprocess
import sys
from pathlib import Path

import pytest

from jaxkv.kvlearn.integrations import JAXKV_POLICIES

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ROOT / "jaxkv" / "kvlearn" / "integrations"
ALL_POLICIES = ("lru", "arc", *JAXKV_POLICIES)  # vLLM's own pass the same contract tests


def _vllm():
    pytest.importorskip("vllm.v1.kv_offload.cpu.manager")
    from jaxkv.kvlearn.integrations import vllm_policy, vllm_replay

    return vllm_policy, vllm_replay


def _imports(file: Path) -> set[str]:
    tree = ast.parse(file.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_only_the_integrations_import_vllm():
    for file in (ROOT / "jaxkv").rglob("*.py"):
        if INTEGRATIONS in file.parents and file.name != "__init__.py":
            continue
        assert not any(m.split(".")[0] == "vllm" for m in _imports(file)), file
        assert not any("vllm_policy" in m or "vllm_replay" in m for m in _imports(file)), file
    code = "import sys, jaxkv.kvlearn, jaxkv.kvlearn.integrations; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the CachePolicy contract -------------------------------------------------------------------
def _key(n):
    _, vr = _vllm()
    return vr.block_key(n)


def _make(name, capacity):
    _, vr = _vllm()
    return vr.make_manager(name, pool_blocks=capacity)._policy


def _ctx(keys, rid=0):
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id=str(rid))
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, 512 * (j + 1))
    return ctx


def _store(policy, keys, rid=0, *, ready=True):
    """One request storing ``keys`` as vLLM's manager does (no eviction)."""
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    ctx = _ctx(keys, rid)
    policy.on_store_miss(keys, ctx)
    for k in keys:
        c = ChunkStatus(int.from_bytes(k[:8], "big"))
        policy.insert(k, c)
        if ready:
            c.ref_cnt = 0
            policy.mark_evictable(k)
    policy.on_request_finished((tuple(keys),), set(keys), set(), ctx)


def _reuse(policy, keys, rid):
    ctx = _ctx(keys, rid)
    policy.touch(keys, ctx)
    policy.on_request_finished((tuple(keys),), set(), set(keys), ctx)


def _script(policy, seed):
    """A deterministic mix of stores and reuses (no eviction needed: a large pool)."""
    rng = random.Random(seed)
    chains = []
    for rid in range(12):
        if chains and rng.random() < 0.5:
            _reuse(policy, rng.choice(chains)[: rng.randint(1, 4)], rid)
        else:
            keys = [_key(100 * rid + j) for j in range(rng.randint(1, 5))]
            _store(policy, keys, rid)
            chains.append(keys)
    return [k for c in chains for k in c]


def _drain(policy, keys):
    """Evicts one chunk at a time until nothing is evictable: the policy's whole order."""
    out = []
    while (got := policy.evict(1, set())) is not None:
        out += [k for k, _ in got]
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("name", ALL_POLICIES)
def test_evict_refusal_is_atomic(name):
    a, b = _make(name, 64), _make(name, 64)
    keys = _script(a, seed=1)
    _script(b, seed=1)
    protected = set(keys[:3])
    n_free = len(keys) - len(protected)
    assert a.evict(n_free + 1, protected) is None  # cannot be satisfied
    assert a.evict(0, protected) == []
    assert all(a.get(k) is not None for k in keys)
    assert _drain(a, keys) == _drain(b, keys)  # the refusal changed nothing


def _pin(pol, key):
    """A load in flight, as the manager's ``prepare_load`` marks it."""
    pol.get(key).ref_cnt = 1
    pol.mark_non_evictable(key)


@pytest.mark.vllm
@pytest.mark.parametrize("name", ALL_POLICIES)
def test_evict_respects_protected_and_pinned(name):
    pol = _make(name, 64)
    keys = _script(pol, seed=2)
    pinned = keys[1]
    _pin(pol, pinned)
    protected = set(keys[::3])
    n = len(set(keys) - protected - {pinned})
    got = pol.evict(n, protected)
    assert got is not None and len(got) == n
    evicted = {k for k, _ in got}
    assert not evicted & (protected | {pinned})
    assert all(pol.get(k) is None for k in evicted)
    assert pol.evict(1, protected) is None
    assert pol.evict(1, set()) is not None  # a protected one, now unprotected


@pytest.mark.vllm
@pytest.mark.parametrize("name", ALL_POLICIES)
def test_write_pending_chunks_are_not_evicted(name):
    pol = _make(name, 64)
    _store(pol, [_key(1), _key(2)], ready=False)  # ref_cnt -1: the store is in flight
    assert pol.evict(1, set()) is None
    _store(pol, [_key(3)], rid=1)
    assert [k for k, _ in pol.evict(1, set())] == [_key(3)]


@pytest.mark.vllm
@pytest.mark.parametrize("name", ALL_POLICIES)
def test_clear_resets_everything(name):
    used, fresh = _make(name, 8), _make(name, 8)
    keys = _script(used, seed=3)
    used.evict(4, set())  # ghosts, adaptive targets, GreedyDual's L, clocks
    used.clear()
    assert all(used.get(k) is None for k in keys)
    assert used.evict(1, set()) is None
    assert _drain_after_script(used) == _drain_after_script(fresh)


@pytest.mark.vllm
@pytest.mark.parametrize("name", ALL_POLICIES)
def test_unpinned_chunks_are_evictable_again(name):
    pol = _make(name, 64)
    keys = _script(pol, seed=5)
    pinned = keys[0]
    _pin(pol, pinned)
    got = pol.evict(len(keys) - 1, set())
    assert got is not None and pinned not in {k for k, _ in got}
    assert pol.evict(1, set()) is None
    pol.get(pinned).ref_cnt = 0  # the load completed
    pol.mark_evictable(pinned)
    assert [k for k, _ in pol.evict(1, set())] == [pinned]


def _drain_after_script(policy):
    return _drain(policy, _script(policy, seed=4))


@pytest.mark.vllm
@pytest.mark.parametrize("name", JAXKV_POLICIES)
def test_vllm_loads_the_policy_by_module_path(name):
    vp, vr = _vllm()
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    from jaxkv.kvlearn.integrations import VLLM_POLICY_MODULE

    assert CachePolicyFactory.get_cache_policy_cls(name, VLLM_POLICY_MODULE) is getattr(vp, name)
    assert type(vr.make_manager(name, pool_blocks=4)._policy) is getattr(vp, name)


@pytest.mark.vllm
def test_lru_evicts_the_tail_of_the_oldest_prefix_first():
    pol = _make("JaxkvLRU", 16)
    a, b = [_key(j) for j in range(3)], [_key(10 + j) for j in range(2)]
    _store(pol, a, 0)
    _store(pol, b, 1)
    _reuse(pol, a[:1], 2)  # a's head is now the most recent
    assert [k for k, _ in pol.evict(5, set())] == [a[2], a[1], b[1], b[0], a[0]]


@pytest.mark.vllm
def test_kvlearn_grows_its_state_and_keeps_the_prefix_head():
    vp, _ = _vllm()

    class Small(vp.KVLearnCachePolicy):
        initial_ids = 4

    pol = Small(cache_capacity=64)
    keys = [_key(j) for j in range(10)]
    _store(pol, keys)  # 10 ids > 4: the state doubles twice
    assert len(pol.block_policy.state.count_P) == 16
    prios = [pol.priority(k) for k in keys]
    assert prios == sorted(prios, reverse=True)  # a head never goes before its tail
    assert [k for k, _ in pol.evict(1, set())] == [keys[-1]]


# ---- the cross-check and the replay -------------------------------------------------------------
def _trace(n):
    import jaxkv.data as data_lib
    from jaxkv.kvlearn.traces import load_mooncake_trace

    return load_mooncake_trace(data_lib.data_file(data_lib.MOONCAKE_EXAMPLE)).head(n)


def _cross(pairs, n=1200, frac=0.05):
    _, vr = _vllm()
    from jaxkv.kvlearn.cost import CostModel
    from jaxkv.kvlearn.serving.engine import ServingConfig

    cfg = ServingConfig(pool_blocks=int(frac * 43924), prefill_nodes=24)
    return vr.cross_check(_trace(n), cfg=cfg, cost=CostModel.llama3_8b_a100(), pairs=pairs)


@pytest.mark.vllm
def test_jaxkv_lru_matches_vllm_lru_on_every_evict_call():
    (row,) = _cross((("lru", "JaxkvLRU"),))
    assert row["calls"] > 500 and row["evicted"] > 5000
    assert row["matches"] == row["calls"] == row["jaxkv_calls"]


@pytest.mark.vllm
def test_jaxkv_arc_matches_vllm_arc_on_every_evict_call():
    (row,) = _cross((("arc", "JaxkvARC"),))
    assert row["calls"] > 500 and row["evicted"] > 5000
    assert row["matches"] == row["calls"] == row["jaxkv_calls"]


@pytest.mark.vllm
def test_short_replay_reports_hits_bytes_and_ttft():
    _, vr = _vllm()
    from jaxkv.kvlearn.cost import CostModel
    from jaxkv.kvlearn.serving.engine import ServingConfig

    tr = _trace(300)
    cfg = ServingConfig(pool_blocks=2000, prefill_nodes=8)
    rows = vr.run(
        tr, vr.VLLM_POLICIES + vr.JAXKV_POLICIES, cfg=cfg, cost=CostModel.llama3_8b_a100()
    )
    by = {r["policy"]: r for r in rows}
    total = sum(len(b) for b in tr.blocks)
    for r in rows:
        assert 0 < r["hit_rate"] < 1 and r["transfer_gib"] > 0 and r["ttft_ms_mean"] > 0
        assert r["admits"] - r["evictions"] <= cfg.pool_blocks
        assert r["admits"] + r["discards"] + round(r["hit_rate"] * total) == total
    keys = ("hit_rate", "ttft_ms_mean", "transfer_gib", "evictions", "evict_calls")
    assert all(by["lru"][k] == by["JaxkvLRU"][k] for k in keys)


# ---- the guard (KVLearnGuardCachePolicy) --------------------------------------------------------
def _forced(leader):
    vp, _ = _vllm()
    return type(f"Forced_{leader}", (vp.KVLearnGuardCachePolicy,), {"force_leader": leader})


@pytest.mark.vllm
@pytest.mark.parametrize("ref", ["lru", "arc"])
def test_guard_forced_to_follow_a_vllm_policy_evicts_what_it_evicts(ref):
    # the independent reference: vLLM's own lru / arc, every evict call (n, protected, keys)
    (row,) = _cross(((ref, _forced(ref)),))
    assert row["calls"] > 500 and row["evicted"] > 5000
    assert row["matches"] == row["calls"] == row["jaxkv_calls"]


@pytest.mark.vllm
@pytest.mark.parametrize(
    "leader, alone",
    [("cost_aware", "JaxkvCostAware"), ("gdsf", "JaxkvGDSF"), ("kvlearn", "KVLearnCachePolicy")],
)
def test_guard_forced_to_follow_a_jaxkv_policy_evicts_what_it_evicts(leader, alone):
    (row,) = _cross(((alone, _forced(leader)),), n=600)
    assert row["calls"] > 200 and row["evicted"] > 2000
    assert row["matches"] == row["calls"] == row["jaxkv_calls"]


@pytest.mark.vllm
def test_guard_follows_the_learner_only_while_strictly_ahead():
    pol = _make("KVLearnGuardCachePolicy", 8)
    names = [sh.name for sh in pol.shadows]
    assert names == [*pol.baselines, "kvlearn"] and pol.leader == 0  # lru first

    def lead(*scores):
        for sh, s in zip(pol.shadows, scores, strict=True):
            sh.saved = s
        pol._choose_leader()
        return names[pol.leader]

    assert lead(0, 0, 0, 0, 0) == "lru"
    assert lead(1, 2, 2, 0, 2) == "arc"  # a tie with the learner goes to the baseline; ties: order
    assert lead(1, 2, 3, 0, 3.0001) == "kvlearn"
    assert lead(1, 2, 3, 4, 3.5) == "gdsf"


def _shipped_leader(scores, slack=0.0):
    """Session 9's rule, as it was written in ``_choose_leader`` (the reference for h = 0)."""
    b = len(scores) - 1
    best = max(range(b), key=lambda k: (scores[k], -k))
    return b if scores[b] > (1.0 + slack) * scores[best] else best


def _random_scores(rng, n):
    # small integers: many exact ties, and leads just above or below a relative margin
    return [float(rng.choice([0, 1000, 1000, 1001, 1002, 1005, 1010, 1100])) for _ in range(n)]


@pytest.mark.vllm
def test_guard_leader_without_hysteresis_is_the_shipped_rule():
    vp, _ = _vllm()
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(2, 6)
        scores, inc = _random_scores(rng, n), rng.randrange(n)
        assert vp.guard_leader(scores, inc) == _shipped_leader(scores)
        assert vp.guard_leader(scores, inc, slack=0.004) == _shipped_leader(scores, 0.004)


@pytest.mark.vllm
def test_guard_leader_with_hysteresis_against_a_brute_force_reference():
    vp, _ = _vllm()
    rng = random.Random(1)
    for _ in range(3000):
        n, h = rng.randint(2, 6), rng.choice([0.001, 0.005, 0.05])
        scores, inc = _random_scores(rng, n), rng.randrange(n)
        got = vp.guard_leader(scores, inc, hysteresis=h)
        cand = _shipped_leader(scores)
        # every leader the rule may name, and the one it must: the candidate on a clear lead,
        # else the incumbent unless it is behind lru, else lru
        clear = [k for k in range(n) if k == cand and scores[k] > (1 + h) * scores[inc]]
        keep = [inc] if scores[inc] >= scores[0] else []
        assert got == (clear or keep or [0])[0]
        assert scores[got] >= scores[0]  # never a leader behind lru
        if got not in (inc, 0):
            assert got == cand and scores[got] > (1 + h) * scores[inc]


@pytest.mark.vllm
def test_guard_ignores_a_lead_of_noise_size_and_backs_off_to_lru_at_once():
    # the diagnosed losses (MM-Session 50 %): cost_aware ahead of lru by 0.007 %, then behind
    pol = type("Hyst", (_vllm()[0].KVLearnGuardCachePolicy,), {"hysteresis": 0.001})(8)
    names = [sh.name for sh in pol.shadows]

    def lead(*scores):
        for sh, s in zip(pol.shadows, scores, strict=True):
            sh.saved = s
        pol._choose_leader()
        return names[pol.leader]

    assert lead(2496587, 2493408, 2496760, 2487010, 2486911) == "lru"  # 0.007 %: stays
    assert lead(1000, 990, 1000.9, 900, 1000) == "lru"  # 0.09 %: below the margin of 0.1 %
    assert lead(1000, 990, 1011, 900, 1000) == "cost_aware"  # a clear lead (1.1 %)
    assert lead(1000, 990, 1010.5, 900, 1011) == "cost_aware"  # learner ahead by 0.005 %: stays
    assert lead(1020, 990, 1019, 900, 1011) == "lru"  # cost_aware fell behind lru: at once
    assert lead(1020, 990, 1019, 900, 1030.3) == "kvlearn"  # 1.01 % over the incumbent
    assert pol.leader_changes == 3


@pytest.mark.vllm
def test_guard_evicts_first_what_the_new_leaders_shadow_does_not_hold():
    pol, twin = _make("KVLearnGuardCachePolicy", 64), _make("KVLearnGuardCachePolicy", 64)
    keys = _script(pol, seed=6)
    _script(twin, seed=6)
    assert all(sh.policy.get(k) is not None for sh in pol.shadows for k in keys)
    (lru_first,) = [k for k, _ in twin.evict(1, set())]  # what the LRU order takes first
    victim = keys[-1] if keys[-1] != lru_first else keys[-2]
    arc = pol.shadows[1]
    arc.policy.remove(victim)  # arc's shadow no longer holds ``victim``: an orphan
    arc.used -= 1
    pol._shadow_evicted(arc, victim)
    pol.leader = 0  # lru's shadow holds everything: the LRU order decides
    assert [k for k, _ in pol.evict(1, set())] == [lru_first] and pol.orphan_evictions == 0
    pol.leader = 1
    assert [k for k, _ in pol.evict(1, set())] == [victim] and pol.orphan_evictions == 1


@pytest.mark.vllm
def test_guard_is_its_baseline_while_the_learner_is_never_ahead():
    vp, _ = _vllm()
    never = type("NeverAhead", (vp.KVLearnGuardCachePolicy,), {"baselines": ("lru",), "slack": 1e9})
    (row,) = _cross((("lru", never),), n=600)
    assert row["calls"] > 200 and row["matches"] == row["calls"] == row["jaxkv_calls"]


@pytest.mark.vllm
def test_guard_with_a_margin_no_lead_clears_is_vllm_lru_call_for_call():
    # every shadow (lru, arc, cost_aware, gdsf, the learner) runs and is scored, but with
    # hysteresis anchored at lru the real pool never leaves lru's: vLLM's lru, every evict call
    vp, _ = _vllm()
    stay = type("Anchored", (vp.KVLearnGuardCachePolicy,), {"hysteresis": 1e9})
    (row,) = _cross((("lru", stay),), n=600)
    assert row["calls"] > 200 and row["matches"] == row["calls"] == row["jaxkv_calls"]


@pytest.mark.vllm
def test_guard_floor_is_the_anchors_mean_saving_per_request():
    vp, _ = _vllm()
    assert vp.guard_floor(20.0, 1000.0, 4) == 5000.0  # 20 requests of 250 ms
    assert vp.guard_floor(20.0, 1000.0, 0) == 0.0  # before any request: the relative margin
    assert vp.guard_floor(20.0, -5.0, 3) == 0.0  # lru has saved nothing (or less)
    assert vp.guard_floor(0.0, 1000.0, 4) == 0.0


@pytest.mark.vllm
def test_guard_leader_with_a_floor_against_a_brute_force_reference():
    # every leader the rule may name (the candidate on a lead above both margins, else the
    # incumbent unless behind lru, else lru), checked on scores around each margin
    vp, _ = _vllm()
    rng = random.Random(2)
    for _ in range(3000):
        n, h, f = rng.randint(2, 6), rng.choice([0.0, 0.001, 0.05]), rng.choice([0, 1, 5, 50])
        scores, inc = _random_scores(rng, n), rng.randrange(n)
        got = vp.guard_leader(scores, inc, hysteresis=h, floor=f)
        cand = _shipped_leader(scores)
        lead = scores[cand] - scores[inc]
        if h == 0.0 and f == 0:
            assert got == cand
        elif scores[cand] > (1 + h) * scores[inc] and lead > f:
            assert got == cand
        elif scores[inc] < scores[0]:
            assert got == 0
        else:
            assert got == inc
    # a floor only adds to the margin: where the shipped rule keeps the incumbent, so does it
    for _ in range(3000):
        n = rng.randint(2, 6)
        scores, inc = _random_scores(rng, n), rng.randrange(n)
        if vp.guard_leader(scores, inc, hysteresis=0.001) == inc:
            assert vp.guard_leader(scores, inc, hysteresis=0.001, floor=7) == inc


@pytest.mark.vllm
def test_guard_with_a_floor_follows_a_hand_worked_switch_sequence():
    # lru, arc, kvlearn; floor 20 requests of lru's mean saving, hysteresis 0.1 %
    pol = _make("KVLearnGuardFloorCachePolicy", 8)
    names = [sh.name for sh in pol.shadows]
    assert names == ["lru", "arc", "kvlearn"] and pol.floor == 20.0

    def lead(*scores):
        for sh, s in zip(pol.shadows, scores, strict=True):
            sh.saved = s
        pol._choose_leader()
        return names[pol.leader]

    # request 1: mean 1000, floor 20,000: arc's lead of 5,000 (500 %) does not move it
    assert lead(1000, 6000, 0) == "lru"
    # request 2: mean 1000, floor 20,000; arc ahead by exactly 20,000: still lru
    assert lead(2000, 22000, 0) == "lru"
    # request 3: mean 1000: arc ahead by 20,001, above both margins
    assert lead(3000, 23001, 0) == "arc"
    # request 4: floor 20 × 1000; the learner 19,000 ahead of the incumbent: arc stays
    assert lead(4000, 24000, 43000) == "arc"
    # request 5: floor 20,000; the learner 20,001 ahead (0.1 % of arc's 25,000 is only 25)
    assert lead(5000, 25000, 45001) == "kvlearn"
    # request 6: the learner falls behind lru: lru at once, whatever the floor
    assert lead(47000, 25000, 46000) == "lru"
    assert pol.leader_changes == 3 and pol.requests == 6


@pytest.mark.vllm
def test_guard_with_a_huge_floor_is_vllm_lru_call_for_call():
    vp, _ = _vllm()
    stay = type("Floored", (vp.KVLearnGuardCachePolicy,), {"hysteresis": 0.0, "floor": 1e9})
    (row,) = _cross((("lru", stay),), n=600)
    assert row["calls"] > 200 and row["matches"] == row["calls"] == row["jaxkv_calls"]


def _mm_session_trace(tmp_path, *, sessions, seed, load):
    """A small MM-Session trace (issue 15's heavy tuning configuration) at ``load``."""
    from jaxkv.kvlearn import workloads
    from jaxkv.kvlearn.traces import load_mooncake_trace, save_mooncake_jsonl

    cfg = workloads.MMSessionConfig(**workloads.MM_HEAVY)
    save_mooncake_jsonl(workloads.mm_session(sessions, seed=seed, cfg=cfg), tmp_path / "mm.jsonl")
    return load_mooncake_trace(tmp_path / "mm.jsonl").scaled(load)


@pytest.mark.vllm
def test_guard_with_hysteresis_keeps_lru_where_the_unguarded_switch_lost(tmp_path):
    # found by a search over small MM-Session traces (seed 104, 60 sessions, 351 requests,
    # deployed at the protocol's load: 2 nodes, half the distinct blocks): session 9's guard
    # (no hysteresis) switched on small leads and ends below vLLM's lru; the shipped one does not
    vp, vr = _vllm()
    from jaxkv.kvlearn.cost import CostModel
    from jaxkv.kvlearn.serving.engine import ServingConfig

    tr = _mm_session_trace(tmp_path, sessions=60, seed=104, load=1.8407033597451197)
    cfg = ServingConfig(pool_blocks=998, prefill_nodes=2)
    unguarded = type("NoHysteresis", (vp.KVLearnGuardCachePolicy,), {"hysteresis": 0.0})
    policies = ("lru", unguarded, "KVLearnGuardCachePolicy")
    rows = {r["policy"]: r for r in vr.run(tr, policies, cfg=cfg, cost=CostModel.llama3_8b_a100())}
    lru, old, new = (rows[p]["hit_saving_ms_mean"] for p in rows)
    assert len(tr) == 351 and old < lru <= new


@pytest.mark.vllm
def test_guard_short_replay_scores_every_pool():
    _, vr = _vllm()
    from jaxkv.kvlearn.cost import CostModel
    from jaxkv.kvlearn.serving.engine import ServingConfig

    cost = CostModel.llama3_8b_a100()
    tr = _trace(600)
    cfg = ServingConfig(pool_blocks=1500, prefill_nodes=8)
    rows = vr.run(tr, ("lru", "KVLearnGuardCachePolicy"), cfg=cfg, cost=cost)
    r = rows[1]
    g = r["guard"]
    assert set(g["saved"]) == {"lru", "arc", "cost_aware", "gdsf", "kvlearn"}
    assert all(v > 0 for v in g["saved"].values()) and g["saved_real"] > 0
    assert 0 <= g["learner_requests"] <= len(tr) and g["orphan_evictions"] <= r["evictions"]
    assert r["admits"] - r["evictions"] <= cfg.pool_blocks
    assert 0 < r["hit_rate"] < 1 and r["hit_saving_ms_mean"] > 0


@pytest.mark.vllm
def test_guard_with_a_floor_keeps_lru_where_the_shipped_guard_lost(tmp_path):
    # session 11's diagnosed cell (results/kvlearn/vllm_guard_rule_s11.md): seed 111, 60
    # sessions, 344 requests, one node, a quarter of the distinct blocks; the shipped guard made
    # 17 leader changes and ends below vLLM's lru, the floor candidate never leaves it
    vp, vr = _vllm()
    from jaxkv.kvlearn.cost import CostModel
    from jaxkv.kvlearn.serving.engine import ServingConfig

    tr = _mm_session_trace(tmp_path, sessions=60, seed=111, load=1.0168165692539413)
    cfg = ServingConfig(pool_blocks=500, prefill_nodes=1)
    policies = ("lru", "KVLearnGuardCachePolicy", "KVLearnGuardFloorCachePolicy")
    rows = vr.run(tr, policies, cfg=cfg, cost=CostModel.llama3_8b_a100())
    lru, shipped, floored = (r["hit_saving_ms_mean"] for r in rows)
    assert len(tr) == 344 and shipped < lru == floored
    assert rows[1]["guard"]["leader_changes"] > 0 == rows[2]["guard"]["leader_changes"]
