"""What every pool policy of the Zipf simulator shares: the ``PoolPolicy`` type, the request
stream it sees and the events it returns, and the pool helpers the baselines are built from.

A pool policy is ``(init, step, tick)`` on one pool type (``core.pool``): every policy sees the
same per-request stream (``SimRequest``) and returns the same ``Event``; transfer and TTFT are
charged by the simulator from events, identically for every policy. The policies themselves are
one module each under ``sim/policies/``; ``sim/policies/__init__.py`` is their registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.kvlearn.core import control
from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.cost import CostModel


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
    keep_P: jax.Array  # oracle_static's set
    key: jax.Array
    prp: Any = None  # pre-trained PRP state for kvlearn (shared, not batched)


@dataclasses.dataclass(frozen=True)
class PolicySetup:
    """What building a pool policy may use (static: it fixes shapes of the compiled run).

    Attributes:
        max_keys: size P of the trace's key table (and of the pool's slot table).
        n_requests: requests R in the trace (Belady's "never used again").
        max_victims: most evictions of one baseline admission (KVLearn's is in ``kvlearn``).
        p_admit: ``random_lru``'s admission probability.
        kvlearn: KVLearn's configuration (required by ``kvlearn``).
    """

    max_keys: int
    n_requests: int
    max_victims: int = 128
    p_admit: float = 0.1
    kvlearn: control.KVLearnConfig | None = None


@dataclasses.dataclass(frozen=True)
class PoolPolicy:
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


def event(hit, admitted, n_evicted) -> Event:
    """An ``Event`` of [] arrays (``n_evicted`` int32)."""
    return Event(jnp.asarray(hit), jnp.asarray(admitted), jnp.asarray(n_evicted, jnp.int32))


def init_pool(inp: RunInputs, *, setup: PolicySetup) -> pool_lib.Pool:
    """An empty pool of the run's capacity with one slot per key."""
    return pool_lib.init_pool(
        max_blocks=setup.max_keys,
        max_keys=setup.max_keys,
        capacity_kib=inp.capacity_kib,
        max_victims=setup.max_victims,
    )


def value_density(cost: CostModel, tokens) -> jax.Array:
    """ν = (R − T)/(κ·|b|) of blocks of ``tokens`` tokens (float32): recompute saved per byte,
    in units of the bandwidth regime's κ (the core's value density; 1 for every bandwidth-bound
    block, more for compute-bound ones). Rounded to a multiple of 1/1024, so that float32
    rounding (which differs between a jitted scan and eager steps) cannot order blocks worth
    the same."""
    t = jnp.asarray(tokens, jnp.float32)
    nu = cost.net_benefit_ms(t) / (cost.benefit_per_byte_ms * cost.footprint_bytes(t))
    return jnp.round(nu * 1024.0) / 1024.0


def ranked_pool_policy(name, *, setup: PolicySetup, rank_fn, allowed_fn, rule) -> PoolPolicy:
    """A policy whose state is just the pool: ``rank_fn(req)`` ranks a block on every access,
    ``allowed_fn(req)`` gates a miss's admission, ``rule`` is ``pool.admit``'s rule."""

    def init(inp: RunInputs):
        return init_pool(inp, setup=setup)

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
        return pool, event(hit, admitted, jnp.sum(victims.valid_E))

    return PoolPolicy(name, init, step)


# ---- helpers of the list- and queue-based policies (arc, s3fifo, wtinylfu, slru) ---------------
# These keep their own per-key lists ([P] arrays: which list a key is in and a stamp that orders
# each list, oldest first) and choose victims themselves (``oldest``), one at a time in a
# ``lax.while_loop``; the pool only holds the blocks and counts KiB (``pool.remove``, ``store``).

NEVER = np.iinfo(np.int32).max
"""Stamp of no key (``oldest`` masks with it)."""


def oldest(mask_P, stamp_P) -> jax.Array:
    """The key of lowest stamp among ``mask_P`` (stamps are distinct; an empty mask gives 0)."""
    return jnp.argmin(jnp.where(mask_P, stamp_P, NEVER)).astype(jnp.int32)


def frac_of(total, num: int, den: int) -> jax.Array:
    """⌊total · num / den⌋ for int32 ``total`` without int32 overflow (segment sizes in KiB)."""
    total = jnp.asarray(total, jnp.int32)
    return (total // den) * num + (total % den) * num // den


def store(pool: pool_lib.Pool, req: SimRequest, ok) -> tuple[pool_lib.Pool, jax.Array]:
    """Inserts ``req``'s block iff ``ok``, into room the caller has made (nothing is evicted):
    (pool, admitted)."""
    pool, admitted, _ = pool_lib.admit(
        pool, key=req.key, kib=req.kib, rank=0.0, value=0.0, allowed=ok, rule="all"
    )
    return pool, admitted
