"""Simulator policies: the baselines and KVLearn, all as ``(init, step, tick)`` on one pool type.

Every policy sees the same per-request stream (``SimRequest``) and returns the same ``Event``;
transfer and TTFT are charged by the simulator from events, identically for every policy.

Baselines:
    no_cache       recompute every request, keep nothing.
    lru            LRU-Pool: admit every miss, evict least recently used (Mooncake-style pool).
    random_lru     admit a miss with probability ``p_admit`` (default 0.1), evict LRU.
    lfu            admit every miss, evict the block with the fewest requests so far (perfect
                   per-key counts, ties to the lowest slot).
    oracle_static  knows the true popularity p_k; keeps the best set by p_k·(R−T)/|b| (greedy
                   knapsack) that fits; admits a miss iff it is in that set; never evicts.
    belady         future knowledge: rank = −(next use); admit a miss only if it is reused later
                   and sooner than every victim it needs (Belady with bypass; a heuristic
                   bound, not exactly optimal for variable block sizes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.kvlearn import control
from jaxkv.kvlearn import pool as pool_lib
from jaxkv.kvlearn.cost import CostModel

POLICIES = ("no_cache", "lru", "random_lru", "lfu", "oracle_static", "belady", "kvlearn")


@struct.dataclass
class SimRequest:
    """One request as the simulator feeds it ([] arrays)."""

    key: jax.Array
    tokens: jax.Array
    modality: jax.Array
    time: jax.Array
    kib: jax.Array
    index: jax.Array
    next_use: jax.Array
    u: jax.Array  # uniform [0, 1) draw for random admission


@struct.dataclass
class Event:
    """What happened to one request."""

    hit: jax.Array
    admitted: jax.Array
    n_evicted: jax.Array


@struct.dataclass
class RunInputs:
    """Per-run (vmappable) inputs to ``init``."""

    capacity_kib: jax.Array
    keep_K: jax.Array  # oracle_static's set
    key: jax.Array
    prp: Any = None  # pre-trained PRP state for kvlearn (shared, not batched)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A simulator policy: ``init(inputs) -> state``, ``step(state, req) -> (state, Event)``,
    ``tick(state, t) -> state`` (identity for baselines), and for batched runs optionally
    ``step_vmap``, a ``step`` without ``lax.cond`` (which ``vmap`` turns into a select that
    runs both branches over the whole state; default: ``step``), and ``tick_batch``, the tick
    of B runs at once (leading run axis; default: ``vmap(tick)``)."""

    name: str
    init: Callable[[RunInputs], Any]
    step: Callable[[Any, SimRequest], tuple[Any, Event]]
    tick: Callable[[Any, jax.Array], Any] = lambda state, t: state
    diag: Callable[[Any], dict] = lambda state: {}
    tick_batch: Callable[[Any, jax.Array], Any] | None = None
    step_vmap: Callable[[Any, SimRequest], tuple[Any, Event]] | None = None


def _event(hit, admitted, n_evicted) -> Event:
    return Event(jnp.asarray(hit), jnp.asarray(admitted), jnp.asarray(n_evicted, jnp.int32))


def no_cache() -> Policy:
    init = lambda inp: jnp.zeros((), jnp.int32)
    step = lambda s, r: (s, _event(False, False, 0))
    return Policy("no_cache", init, step)


def _init_pool(inp: RunInputs, *, max_keys: int, max_victims: int) -> pool_lib.Pool:
    return pool_lib.init_pool(
        max_blocks=max_keys,
        max_keys=max_keys,
        capacity_kib=inp.capacity_kib,
        max_victims=max_victims,
    )


def _ranked_pool_policy(name, *, max_keys, max_victims, rank_fn, allowed_fn, rule) -> Policy:
    """A policy whose state is just the pool; ``rank_fn(state, req)`` ranks on access."""

    def init(inp: RunInputs):
        return _init_pool(inp, max_keys=max_keys, max_victims=max_victims)

    def step(pool, req: SimRequest):
        slot = pool_lib.lookup(pool, req.key)
        hit = slot >= 0
        rank = rank_fn(req)
        pool = pool_lib.set_entry(pool, slot=slot, rank=rank, value=0.0)
        pool, admitted, victims = pool_lib.admit(
            pool,
            key=req.key,
            kib=req.kib,
            rank=rank,
            value=0.0,
            allowed=~hit & allowed_fn(req),
            rule=rule,
        )
        return pool, _event(hit, admitted, jnp.sum(victims.valid_V))

    return Policy(name, init, step)


def lru(*, max_keys: int, max_victims: int = 128) -> Policy:
    rank = lambda r: r.index.astype(jnp.float32)
    return _ranked_pool_policy(
        "lru",
        max_keys=max_keys,
        max_victims=max_victims,
        rank_fn=rank,
        allowed_fn=lambda r: True,
        rule="all",
    )


def random_lru(*, max_keys: int, p_admit: float = 0.1, max_victims: int = 128) -> Policy:
    rank = lambda r: r.index.astype(jnp.float32)
    allowed = lambda r: r.u < p_admit
    return _ranked_pool_policy(
        "random_lru",
        max_keys=max_keys,
        max_victims=max_victims,
        rank_fn=rank,
        allowed_fn=allowed,
        rule="all",
    )


def belady(*, max_keys: int, n_requests: int, max_victims: int = 128) -> Policy:
    rank = lambda r: -r.next_use.astype(jnp.float32)
    allowed = lambda r: r.next_use < n_requests
    return _ranked_pool_policy(
        "belady",
        max_keys=max_keys,
        max_victims=max_victims,
        rank_fn=rank,
        allowed_fn=allowed,
        rule="rank",
    )


def lfu(*, max_keys: int, max_victims: int = 128) -> Policy:
    def init(inp: RunInputs):
        pool = _init_pool(inp, max_keys=max_keys, max_victims=max_victims)
        return pool, jnp.zeros((max_keys,), jnp.int32)

    def step(state, req: SimRequest):
        pool, count_K = state
        count_K = count_K.at[req.key].add(1)
        rank = count_K[req.key].astype(jnp.float32)
        slot = pool_lib.lookup(pool, req.key)
        pool = pool_lib.set_entry(pool, slot=slot, rank=rank, value=0.0)
        pool, admitted, victims = pool_lib.admit(
            pool, key=req.key, kib=req.kib, rank=rank, value=0.0, allowed=slot < 0, rule="all"
        )
        return (pool, count_K), _event(slot >= 0, admitted, jnp.sum(victims.valid_V))

    return Policy("lfu", init, step)


def oracle_static(*, max_keys: int, max_victims: int = 128) -> Policy:
    def init(inp: RunInputs):
        pool = _init_pool(inp, max_keys=max_keys, max_victims=max_victims)
        return pool, inp.keep_K

    def step(state, req: SimRequest):
        pool, keep_K = state
        slot = pool_lib.lookup(pool, req.key)
        pool, admitted, victims = pool_lib.admit(
            pool,
            key=req.key,
            kib=req.kib,
            rank=0.0,
            value=0.0,
            allowed=(slot < 0) & keep_K[req.key],
            rule="all",
        )
        return (pool, keep_K), _event(slot >= 0, admitted, jnp.sum(victims.valid_V))

    return Policy("oracle_static", init, step)


def static_oracle_set(
    *, popularity_K, tokens_K, cost: CostModel, capacity_bytes: float, max_blocks: int
) -> np.ndarray:
    """[K] bool: the greedy value-per-byte set p_k·(R−T)/|b| that fits in the pool."""
    tokens = np.asarray(tokens_K, np.float64)
    kib = pool_lib.bytes_to_kib(cost.footprint_bytes(np.asarray(tokens_K, np.int64)))
    density = np.asarray(popularity_K) * cost.net_benefit_ms(tokens) / cost.footprint_bytes(tokens)
    keep = np.zeros(tokens.shape, bool)
    used, cap = 0, int(pool_lib.bytes_to_kib(int(capacity_bytes)))
    for k in np.argsort(-density, kind="stable"):
        if density[k] <= 0 or keep.sum() >= max_blocks:
            break
        if used + kib[k] <= cap:
            keep[k], used = True, used + kib[k]
    return keep


def kvlearn(*, cfg: control.KVLearnConfig) -> Policy:
    """KVLearn through its control-plane API: ``lookup``, then ``admit`` on a miss. Starts from
    ``RunInputs.prp`` when given (an offline pre-trained PRP)."""

    def init(inp: RunInputs):
        cap = inp.capacity_kib.astype(jnp.float32) * 1024.0
        return control.init(cfg, capacity_bytes=cap, key=inp.key, prp_state=inp.prp)

    def lookup(state, req: SimRequest):
        creq = control.Request(key=req.key, tokens=req.tokens, modality=req.modality, time=req.time)
        state, hit = control.lookup(state, creq, cfg=cfg)
        return state, creq, hit

    def step(state, req: SimRequest):
        state, creq, hit = lookup(state, req)

        def on_miss(s):
            s, res = control.admit(s, creq, cfg=cfg)
            return s, res.admitted, res.n_evicted

        def on_hit(s):
            return s, jnp.asarray(False), jnp.zeros((), jnp.int32)

        state, admitted, n_ev = jax.lax.cond(hit, on_hit, on_miss, state)
        return state, _event(hit, admitted, n_ev)

    def step_vmap(state, req: SimRequest):
        state, creq, hit = lookup(state, req)
        state, res = control.admit(state, creq, cfg=cfg, active=~hit)  # masked, not a cond
        return state, _event(hit, res.admitted, res.n_evicted)

    def diag(state):
        return {
            "theta": state.atc.theta,
            "labels": state.prp.n_labels,
            "prp_updates": state.prp.n_updates,
            "hit_rate_ema": state.atc.hit_rate,
        }

    tick = lambda state, t: control.tick(state, t, cfg=cfg)
    tick_batch = lambda state_B, t_B: control.tick_batch(state_B, t_B, cfg=cfg)
    return Policy("kvlearn", init, step, tick, diag, tick_batch, step_vmap)


def make_policy(
    name: str, *, max_keys: int, n_requests: int, kvlearn_cfg=None, p_admit=0.1, max_victims=128
):
    """Policy by name (one of ``POLICIES``); ``max_victims`` bounds the baselines' evictions per
    admission (KVLearn's comes from ``kvlearn_cfg``)."""
    mv = {"max_keys": max_keys, "max_victims": max_victims}
    if name == "no_cache":
        return no_cache()
    if name == "lru":
        return lru(**mv)
    if name == "random_lru":
        return random_lru(p_admit=p_admit, **mv)
    if name == "lfu":
        return lfu(**mv)
    if name == "oracle_static":
        return oracle_static(**mv)
    if name == "belady":
        return belady(n_requests=n_requests, **mv)
    if name == "kvlearn":
        if kvlearn_cfg is None:
            raise ValueError("kvlearn policy needs kvlearn_cfg")
        return kvlearn(cfg=kvlearn_cfg)
    raise ValueError(f"unknown policy {name!r}; choose from {POLICIES}")
