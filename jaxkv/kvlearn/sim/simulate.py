"""The jitted simulator: ``lax.scan`` over requests, ``vmap`` over runs (seeds × α × pool size).

Requests are scanned in chunks of ``tick_every``; the policy's ``tick`` runs after each chunk at
the time of the chunk's last request (a remainder shorter than a chunk is scanned without a
tick). The scan returns one ``Event`` per request; every metric is computed from events on the
host in float64, with the same charges for every policy:

* TTFT of a request: T(b) on a hit (pool → D), R(b) + T(b) on a miss (prefill, then P → D);
* transfer: |b| for every request (pool → D on a hit, P → D on a miss) plus |b| per admit
  (P → pool).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kvlearn.core import control
from jaxkv.kvlearn.core import prp as prp_lib
from jaxkv.kvlearn.core.pool import MAX_CAPACITY_KIB, block_kib, bytes_to_kib
from jaxkv.kvlearn.cost import GIB, CostModel
from jaxkv.kvlearn.sim import policies as policies_lib
from jaxkv.kvlearn.sim.policies import oracle_static
from jaxkv.kvlearn.sim.policies.base import (
    Event,
    PolicySetup,
    PoolPolicy,
    RunInputs,
    SimRequest,
)
from jaxkv.kvlearn.traces import Progress, Trace, next_use_index
from jaxkv.kvlearn.workloads import zipf_multimodal


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Simulator settings; ``kvlearn`` is KVLearn's config (its max_keys/max_blocks are set from
    the trace)."""

    kvlearn: control.KVLearnConfig = dataclasses.field(default_factory=control.KVLearnConfig)
    tick_every: int = 20
    p_admit: float = 0.1

    def __post_init__(self):
        if self.tick_every <= 0:
            raise ValueError(f"tick_every must be positive, got {self.tick_every}")
        if not 0 <= self.p_admit <= 1:
            raise ValueError(f"p_admit must be in [0, 1], got {self.p_admit}")

    @property
    def cost(self) -> CostModel:
        return self.kvlearn.cost


def sim_requests(trace: Trace, *, cost: CostModel, seed: int) -> SimRequest:
    """[R] numpy arrays of the request stream for one run (block sizes saturate at
    ``pool.MAX_KIB`` KiB, larger than any pool)."""
    n, bpt = len(trace), cost.shape.bytes_per_token
    return SimRequest(
        key=trace.key.astype(np.int32),
        tokens=trace.tokens.astype(np.int32),
        modality=trace.modality.astype(np.int32),
        time=trace.time_s.astype(np.float32),
        kib=block_kib(trace.tokens.astype(np.int64), bytes_per_token=bpt).astype(np.int32),
        index=np.arange(n, dtype=np.int32),
        next_use=next_use_index(trace.key),
        u=np.random.default_rng([seed, 1]).random(n).astype(np.float32),
    )


def scan_policy(policy: PoolPolicy, reqs: SimRequest, inputs: RunInputs, *, tick_every: int):
    """(events [R], final state) of one run; pure, jit/vmap-able."""
    n = reqs.key.shape[0]
    n_chunks, rem = divmod(n, tick_every)
    state = policy.init(inputs)
    head = jax.tree.map(lambda a: a[: n_chunks * tick_every].reshape(n_chunks, tick_every), reqs)

    def chunk(state, creqs):
        state, ev = jax.lax.scan(policy.step, state, creqs)
        return policy.tick(state, creqs.time[-1]), ev

    state, ev = jax.lax.scan(chunk, state, head)
    events = jax.tree.map(lambda a: a.reshape(n_chunks * tick_every), ev)
    if rem:
        tail = jax.tree.map(lambda a: a[n_chunks * tick_every :], reqs)
        state, ev_tail = jax.lax.scan(policy.step, state, tail)
        events = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), events, ev_tail)
    return events, state


def scan_policy_batch(
    policy: PoolPolicy, reqs_B: SimRequest, inputs_B: RunInputs, *, tick_every: int
):
    """``scan_policy`` for B runs at once (leading run axis on ``reqs_B`` and ``inputs_B``, except
    ``inputs_B.prp``, shared): (events [B, R], final states).

    Each request step (the policy's ``step_vmap`` if it has one) is vmapped over runs, and so
    is each tick unless the policy has a ``tick_batch`` (KVLearn: only the runs due a PRP
    training round train).
    """
    n = reqs_B.key.shape[1]
    n_chunks, rem = divmod(n, tick_every)
    axes = RunInputs(capacity_kib=0, keep_P=0, key=0, prp=None)
    state = jax.vmap(policy.init, in_axes=(axes,))(inputs_B)
    steps = jax.vmap(lambda s, r: jax.lax.scan(policy.step_vmap or policy.step, s, r))
    tick = policy.tick_batch or jax.vmap(policy.tick)
    # [B, R] → [chunks, B, tick_every]
    head = jax.tree.map(
        lambda a: a[:, : n_chunks * tick_every].reshape(-1, n_chunks, tick_every).swapaxes(0, 1),
        reqs_B,
    )

    def chunk(state, creqs):
        state, ev = steps(state, creqs)
        return tick(state, creqs.time[:, -1]), ev

    state, ev = jax.lax.scan(chunk, state, head)
    events = jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(a.shape[1], -1), ev)
    if rem:
        tail = jax.tree.map(lambda a: a[:, n_chunks * tick_every :], reqs_B)
        state, ev_tail = steps(state, tail)
        events = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), events, ev_tail)
    return events, state


def _scan_run(policy: PoolPolicy, reqs: SimRequest, inputs: RunInputs, *, tick_every: int):
    events, state = scan_policy(policy, reqs, inputs, tick_every=tick_every)
    return events, policy.diag(state)


def _scan_run_batch(policy: PoolPolicy, reqs_B, inputs_B, *, tick_every: int):
    events, state = scan_policy_batch(policy, reqs_B, inputs_B, tick_every=tick_every)
    return events, jax.vmap(policy.diag)(state)


def victim_bound(traces: list[Trace], *, cost: CostModel, cap: int = 128) -> int:
    """Most victims any admission in ``traces`` can need: ⌈largest block / smallest block⌉ KiB.

    An admission needs at most its own size (and one slot), and every victim frees at least
    the smallest block, so a pool with ``max_victims`` ≥ this bound behaves exactly as with
    any larger one. Padding victim arrays to the bound instead of ``cap`` makes each request
    step cheaper, which matters most for batched runs.
    """
    kib = np.concatenate(
        [bytes_to_kib(cost.footprint_bytes(t.tokens.astype(np.int64))) for t in traces]
    )
    return int(min(cap, max(1, -(-int(kib.max()) // int(kib.min())))))


@functools.lru_cache(maxsize=64)
def _runner(
    name: str,
    *,
    max_keys: int,
    n_requests: int,
    sim_cfg: SimConfig,
    batched: bool,
    max_victims: int = 128,
):
    kv_cfg = sim_cfg.kvlearn.replace(
        max_keys=max_keys,
        max_blocks=max_keys,
        max_victims=min(sim_cfg.kvlearn.max_victims, max_victims),
    )
    setup = PolicySetup(
        max_keys=max_keys,
        n_requests=n_requests,
        max_victims=max_victims,
        p_admit=sim_cfg.p_admit,
        kvlearn=kv_cfg,
    )
    policy = policies_lib.make_policy(name, setup)
    scan_run = _scan_run_batch if batched else _scan_run
    return jax.jit(functools.partial(scan_run, policy, tick_every=sim_cfg.tick_every))


def _inputs(trace: Trace, *, capacity_bytes: float, seed: int, cost: CostModel, prp=None):
    if not 0 <= capacity_bytes <= MAX_CAPACITY_KIB * 1024:
        raise ValueError(
            f"pool capacity must be ≥ 0 and ≤ {MAX_CAPACITY_KIB * 1024} bytes (2047 GiB), "
            f"got {capacity_bytes}"
        )
    popularity = trace.popularity if trace.popularity is not None else trace.empirical_popularity()
    tokens_P = np.ones(trace.n_keys, np.int64)
    tokens_P[trace.key] = trace.tokens
    keep = oracle_static.static_oracle_set(
        popularity_P=popularity,
        tokens_P=tokens_P,
        cost=cost,
        capacity_bytes=capacity_bytes,
        max_blocks=trace.n_keys,
    )
    return RunInputs(
        capacity_kib=np.int32(bytes_to_kib(int(capacity_bytes))),
        keep_P=keep,
        key=jax.random.key_data(jax.random.key(seed)),
        prp=prp,
    )


def run(
    name: str,
    trace: Trace,
    *,
    capacity_bytes: float,
    seed: int = 0,
    sim_cfg: SimConfig | None = None,
    prp=None,
) -> dict:
    """Simulates one policy on one trace; returns its metrics (see ``metrics``)."""
    sim_cfg = sim_cfg or SimConfig()
    fn = _runner(
        name,
        max_keys=trace.n_keys,
        n_requests=len(trace),
        sim_cfg=sim_cfg,
        batched=False,
        max_victims=victim_bound([trace], cost=sim_cfg.cost),
    )
    reqs = sim_requests(trace, cost=sim_cfg.cost, seed=seed)
    inputs = _inputs(trace, capacity_bytes=capacity_bytes, seed=seed, cost=sim_cfg.cost, prp=prp)
    inputs = inputs.replace(key=jax.random.wrap_key_data(inputs.key))
    events, diag = fn(reqs, inputs)
    return metrics(name, trace, events, cost=sim_cfg.cost) | _host(diag)


def run_batch(
    name: str,
    traces: list[Trace],
    *,
    capacities_bytes: list[float],
    seeds: list[int],
    sim_cfg: SimConfig | None = None,
    prp=None,
) -> list[dict]:
    """Simulates one policy on many (trace, capacity, seed) runs at once
    (``scan_policy_batch``: one scan whose steps are vmapped over runs).

    All traces must have the same length and key table size.
    """
    sim_cfg = sim_cfg or SimConfig()
    if not (len(traces) == len(capacities_bytes) == len(seeds)) or not traces:
        raise ValueError("run_batch: traces, capacities_bytes and seeds must be equal, non-empty")
    if len({(len(t), t.n_keys) for t in traces}) != 1:
        raise ValueError("run_batch: traces must share length and key table size")
    n, k = len(traces[0]), traces[0].n_keys
    mv = victim_bound(traces, cost=sim_cfg.cost)
    fn = _runner(name, max_keys=k, n_requests=n, sim_cfg=sim_cfg, batched=True, max_victims=mv)
    stack = lambda xs: jax.tree.map(lambda *a: np.stack(a), *xs)
    reqs = stack(
        [sim_requests(t, cost=sim_cfg.cost, seed=s) for t, s in zip(traces, seeds, strict=True)]
    )
    runs = zip(traces, capacities_bytes, seeds, strict=True)
    inputs = [_inputs(t, capacity_bytes=c, seed=s, cost=sim_cfg.cost) for t, c, s in runs]
    batch = stack([i.replace(prp=None) for i in inputs]).replace(prp=prp)
    batch = batch.replace(key=jax.random.wrap_key_data(batch.key))
    events, diag = fn(reqs, batch)
    out = []
    for i, t in enumerate(traces):
        ev_i = jax.tree.map(lambda a, i=i: a[i], events)
        d_i = jax.tree.map(lambda a, i=i: a[i], diag)
        out.append(metrics(name, t, ev_i, cost=sim_cfg.cost) | _host(d_i))
    return out


def _host(diag: dict) -> dict:
    return {k: np.asarray(v).item() for k, v in diag.items()}


def metrics(name: str, trace: Trace, events: Event, *, cost: CostModel) -> dict:
    """TTFT mean/p50/p99 (ms), request and byte hit rate, transfer (GiB), admits, evictions,
    discards (misses not admitted), from per-request events."""
    hit = np.asarray(events.hit, bool)
    admitted = np.asarray(events.admitted, bool)
    tokens = trace.tokens.astype(np.float64)
    nbytes = cost.footprint_bytes(tokens)
    ttft = cost.transfer_ms(nbytes) + np.where(hit, 0.0, cost.recompute_ms(tokens))
    return {
        "policy": name,
        "ttft_ms_mean": float(ttft.mean()),
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "hit_rate": float(hit.mean()),
        "byte_hit_rate": float(nbytes[hit].sum() / nbytes.sum()),
        "transfer_gib": float((nbytes.sum() + nbytes[admitted].sum()) / GIB),
        "admits": int(admitted.sum()),
        "evictions": int(np.asarray(events.n_evicted).sum()),
        "discards": int((~hit & ~admitted).sum()),
    }


def compare(
    trace: Trace,
    *,
    capacity_bytes: float,
    seed: int = 0,
    policies=policies_lib.POOL_POLICIES,
    sim_cfg: SimConfig | None = None,
    prp=None,
    progress: Progress | None = None,
) -> list[dict]:
    """Metrics of every policy on one trace; ``progress`` (optional) is told len(trace) requests
    after each policy's run (a run is one jitted scan, so there is nothing finer to report)."""
    out = []
    for p in policies:
        out.append(
            run(p, trace, capacity_bytes=capacity_bytes, seed=seed, sim_cfg=sim_cfg, prp=prp)
        )
        if progress is not None:
            progress(len(trace))
    return out


def sweep(
    *,
    n_requests: int,
    alphas,
    pools_gib,
    seeds,
    policies=policies_lib.POOL_POLICIES,
    sim_cfg: SimConfig | None = None,
    prp=None,
    mode: str = "vmap",
) -> tuple[list[dict], dict]:
    """Every policy on the Zipf workload over alphas × pool sizes × seeds.

    ``mode="vmap"`` runs each policy's cells as one batch (``run_batch``); ``mode="loop"`` runs
    them one after another through the single-run function (compiled once). The batch is the
    faster of the two once compiled (``scripts/bench_kvlearn_speed.py``); it compiles about
    twice as long as a single run.

    Returns (rows, seconds): one metrics row per (policy, alpha, pool, seed) with those keys
    added, and the wall time of each policy's runs (including compilation).
    """
    if mode not in ("vmap", "loop"):
        raise ValueError(f"sweep mode must be 'vmap' or 'loop', got {mode!r}")
    cells = [(a, g, s) for a in alphas for g in pools_gib for s in seeds]
    if not cells:
        raise ValueError("sweep: empty grid")
    traces = {(a, s): zipf_multimodal(n_requests, a, seed=s) for a in alphas for s in seeds}
    rows, seconds = [], {}
    for name in policies:
        t0 = time.perf_counter()
        trs = [traces[(a, s)] for a, _, s in cells]
        caps = [g * GIB for _, g, _ in cells]
        seeds_run = list(range(len(cells)))
        if mode == "vmap":
            out = run_batch(
                name, trs, capacities_bytes=caps, seeds=seeds_run, sim_cfg=sim_cfg, prp=prp
            )
        else:
            out = [
                run(name, t, capacity_bytes=c, seed=s, sim_cfg=sim_cfg, prp=prp)
                for t, c, s in zip(trs, caps, seeds_run, strict=True)
            ]
        seconds[name] = time.perf_counter() - t0
        rows += [
            m | {"alpha": a, "pool_gib": g, "seed": s}
            for (a, g, s), m in zip(cells, out, strict=True)
        ]
    return rows, seconds


def summarize(rows: list[dict], *, keys=("ttft_ms_mean", "hit_rate", "transfer_gib")) -> list[dict]:
    """Median (and min/max) over seeds of each metric per (policy, alpha, pool)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["policy"], r["alpha"], r["pool_gib"]), []).append(r)
    out = []
    for (policy, alpha, pool), rs in groups.items():
        row = {"policy": policy, "alpha": alpha, "pool_gib": pool, "seeds": len(rs)}
        for k in keys:
            v = np.array([r[k] for r in rs])
            row |= {
                f"{k}_median": float(np.median(v)),
                f"{k}_min": float(v.min()),
                f"{k}_max": float(v.max()),
            }
        out.append(row)
    return out


def collect_labels(
    trace: Trace, *, capacity_bytes: float, seed: int, sim_cfg: SimConfig, prp=None
) -> tuple[prp_lib.PRPState, Event]:
    """Replays ``trace`` through online KVLearn (``core.pretrain`` fits the MLP on the result);
    returns its final ``PRPState`` (labels in the replay buffer, whitening statistics) and the
    run's events."""
    kv_cfg = sim_cfg.kvlearn.replace(max_keys=trace.n_keys, max_blocks=trace.n_keys)
    setup = PolicySetup(max_keys=trace.n_keys, n_requests=len(trace), kvlearn=kv_cfg)
    policy = policies_lib.make_policy("kvlearn", setup)
    inputs = _inputs(trace, capacity_bytes=capacity_bytes, seed=seed, cost=sim_cfg.cost, prp=prp)
    inputs = inputs.replace(key=jax.random.wrap_key_data(inputs.key))
    reqs = sim_requests(trace, cost=sim_cfg.cost, seed=seed)
    run = jax.jit(lambda r, i: scan_policy(policy, r, i, tick_every=sim_cfg.tick_every))
    events, state = run(reqs, inputs)
    return state.prp, events
