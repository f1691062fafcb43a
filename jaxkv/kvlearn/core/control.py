"""The KVLearn control plane: one state pytree and pure ``lookup`` / ``admit`` / ``feed_labels`` /
``tick`` functions (jit them at the call site with ``cfg`` static; ``facade.Coordinator`` does).

Flow per request (README "Integrating into a serving stack"): ``lookup`` on every request
(records it in the per-key history, resolves its label window, refreshes a hit block's score);
on a miss, after prefill, ``admit`` decides keep vs discard and picks victims; ``tick``
periodically expires label windows, re-scores resident blocks, steps the ATC and trains the PRP.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.kvlearn.core import atc as atc_lib
from jaxkv.kvlearn.core import cars as cars_lib
from jaxkv.kvlearn.core import features as features_lib
from jaxkv.kvlearn.core import pool as pool_lib
from jaxkv.kvlearn.core import prp as prp_lib
from jaxkv.kvlearn.cost import GIB, CostModel


@dataclasses.dataclass(frozen=True)
class KVLearnConfig:
    """Static configuration (hashable: pass it as a static jit argument).

    Attributes:
        cost: the serving system's cost model.
        prp: the PRP; 8 Adam steps per training round (quality as with 32 on the tuning
            seeds, a quarter of the training time).
        max_blocks: block-table slots Z.   max_keys: key ids P with per-key history.
        horizon_s: label horizon H.        tau_fast_s, tau_slow_s: feature decay times.
        storage_dt_s: Δt of U; None = one mean inter-arrival time (see ``cars.py``).
        ema_decay: per-request decay of the R̄ and λ estimates.
        swap_margin: an admission that evicts must add (1 + margin) × the victims' value
            (0: more than the victims' value, a TinyLFU-style comparison once P̂ follows the
            counts; 0.25 before issue 15).
        max_victims: most blocks one admission may evict (bounds the victim search).
        count_prior_s: admission and eviction use the MLP's P̂ as the prior of a Gamma
            posterior on the key's request rate from its exact request count, with this many
            seconds of pseudo-exposure (``features.rate_posterior``): the MLP decides while
            counts are few, the count (LFU's order) once they are many; None uses the MLP
            alone. Issue 15 (key-level KVLearn ≤ the best classical policy, which is ``lfu``
            on the Zipf workload); 180 s since session 13 (with ``expected_reuses``; 120, 180
            and 240 s met the goal on trace seeds 0–4 and 7001–7005, 60 and 90 s missed it on
            7001–7005: results/kvlearn/core_s13_design.md); 60 s before.
        expected_reuses: with ``count_prior_s``, a block's P̂ in CARS is its expected number
            of requests within H, H·λ̂, instead of P(≥ 1 request) = 1 − exp(−H·λ̂). Every
            reuse is a hit, and the probability saturates at 1 for a key requested more than
            about once per H, so the admission's sum over victims undervalued a frequent block
            against larger or more numerous rarer ones. The eviction order (ν, monotone in
            λ̂) is unchanged; ν and P̂ may exceed 1. Issue 15 session 13 (False before).
        prior_labels: P̂ refined by the key's own decayed labels, (m·P̂ + Σ y)/(m + n) with
            m = prior_labels (``features.label_posterior``), applied after ``count_prior_s``;
            None (the default since issue 15; 50 before) skips it.
    """

    cost: CostModel = dataclasses.field(default_factory=CostModel.llama3_8b_a100)
    prp: prp_lib.PRPConfig = dataclasses.field(
        default_factory=lambda: prp_lib.PRPConfig(updates_per_round=8)
    )
    atc: atc_lib.ATCConfig = dataclasses.field(default_factory=atc_lib.ATCConfig)
    max_blocks: int = 4096
    max_keys: int = 1 << 16
    horizon_s: float = 5.0
    tau_fast_s: float = 30.0
    tau_slow_s: float = 600.0
    storage_dt_s: float | None = None
    ema_decay: float = 0.99
    swap_margin: float = 0.0
    max_victims: int = 32
    count_prior_s: float | None = 180.0
    expected_reuses: bool = True
    prior_labels: float | None = None

    def __post_init__(self):
        if self.max_blocks <= 0 or self.max_keys <= 0:
            raise ValueError("KVLearnConfig: max_blocks and max_keys must be positive")
        if min(self.horizon_s, self.tau_fast_s, self.tau_slow_s) <= 0:
            raise ValueError("KVLearnConfig: horizon_s and tau_*_s must be positive")
        if self.storage_dt_s is not None and self.storage_dt_s < 0:
            raise ValueError("KVLearnConfig.storage_dt_s must be ≥ 0 or None")
        if not 0 <= self.ema_decay < 1:
            raise ValueError("KVLearnConfig.ema_decay must be in [0, 1)")
        if self.count_prior_s is not None and not self.count_prior_s > 0:
            raise ValueError("KVLearnConfig.count_prior_s must be positive or None")
        if self.prior_labels is not None and not self.prior_labels > 0:
            raise ValueError("KVLearnConfig.prior_labels must be positive or None")

    def replace(self, **changes) -> KVLearnConfig:
        return dataclasses.replace(self, **changes)


@struct.dataclass
class Request:
    """One request ([] arrays): key id, prefix tokens, modality (0/1/2), arrival time (s)."""

    key: jax.Array
    tokens: jax.Array
    modality: jax.Array
    time: jax.Array


@struct.dataclass
class Counters:
    """Running totals ([] int32, transfer in float32 GiB with symmetric accounting)."""

    requests: jax.Array
    hits: jax.Array
    admits: jax.Array
    evictions: jax.Array
    discards: jax.Array
    transfer_gib: jax.Array


@struct.dataclass
class KVLearnState:
    """Everything that changes per request: pool, history, PRP, ATC, estimates, counters, key."""

    pool: pool_lib.Pool
    hist: features_lib.History
    prp: prp_lib.PRPState
    atc: atc_lib.ATCState
    r_bar_ms: jax.Array
    arrival_rate: jax.Array
    last_t: jax.Array
    first_t: jax.Array
    counters: Counters
    rng: jax.Array


@struct.dataclass
class AdmitResult:
    """Outcome of ``admit`` ([] arrays)."""

    admitted: jax.Array
    n_evicted: jax.Array
    evicted_keys: jax.Array  # [E] key ids of the victims in eviction order, -1 padded
    p_hat: jax.Array  # the P̂ decided with (count posterior, labels; H·λ̂ with expected_reuses)
    cars_ms: jax.Array
    density: jax.Array
    theta: jax.Array


def init(cfg: KVLearnConfig, *, capacity_bytes, key, prp_state=None) -> KVLearnState:
    """Empty pool of ``capacity_bytes`` (at most ``pool.MAX_CAPACITY_KIB`` KiB, 2047 GiB); a fresh
    PRP unless ``prp_state`` (pre-trained) is given."""
    if not isinstance(capacity_bytes, jax.core.Tracer):
        pool_lib.check_capacity_kib(np.asarray(capacity_bytes, np.float64) / 1024)
    cap_kib = pool_lib.bytes_to_kib(jnp.asarray(capacity_bytes, jnp.float32)).astype(jnp.int32)
    k_prp, k_run = jax.random.split(key)
    zi = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the state may be donated
    zf = lambda: jnp.zeros((), jnp.float32)
    return KVLearnState(
        pool=pool_lib.init_pool(
            max_blocks=cfg.max_blocks,
            max_keys=cfg.max_keys,
            capacity_kib=cap_kib,
            max_victims=cfg.max_victims,
        ),
        hist=features_lib.init_history(cfg.max_keys),
        prp=prp_state if prp_state is not None else prp_lib.init_prp(cfg.prp, key=k_prp),
        atc=atc_lib.init_atc(cfg.atc),
        r_bar_ms=zf(),
        arrival_rate=zf(),
        last_t=zf(),
        first_t=zf(),
        counters=Counters(zi(), zi(), zi(), zi(), zi(), zf()),
        rng=k_run,
    )


def _capacity_bytes(state: KVLearnState):
    return state.pool.capacity_kib.astype(jnp.float32) * 1024.0


def _signals(state: KVLearnState) -> features_lib.Signals:
    occ = state.pool.used_kib / jnp.maximum(state.pool.capacity_kib, 1)
    return features_lib.Signals(occupancy=occ.astype(jnp.float32), hit_rate=state.atc.hit_rate)


def _featurize(state: KVLearnState, keys, t, cfg: KVLearnConfig):
    return features_lib.featurize(
        state.hist,
        keys,
        t=t,
        signals=_signals(state),
        cost=cfg.cost,
        tau_fast_s=cfg.tau_fast_s,
        tau_slow_s=cfg.tau_slow_s,
    )


def _score(state: KVLearnState, keys, x_I, tokens, t, cfg: KVLearnConfig):
    """(P̂, CARS ms, ν) of ``keys`` at ``t`` from their features."""
    p_hat = prp_lib.predict(state.prp, x_I, cfg=cfg.prp)
    if cfg.count_prior_s is not None:
        p_hat = features_lib.rate_posterior(
            state.hist,
            keys,
            p_hat,
            t=t,
            t0=state.first_t,
            horizon_s=cfg.horizon_s,
            prior_s=cfg.count_prior_s,
            expected_reuses=cfg.expected_reuses,
        )
    if cfg.prior_labels is not None:
        p_hat = features_lib.label_posterior(
            state.hist, keys, p_hat, t=t, tau_s=cfg.tau_slow_s, prior_labels=cfg.prior_labels
        )
    dt = (
        1.0 / jnp.maximum(state.arrival_rate, 1e-6)
        if cfg.storage_dt_s is None
        else cfg.storage_dt_s
    )
    value, density = cars_lib.score(
        cfg.cost,
        p_hat=p_hat,
        tokens=tokens,
        r_bar_ms=state.r_bar_ms,
        arrival_rate=state.arrival_rate,
        capacity_bytes=_capacity_bytes(state),
        dt_s=dt,
    )
    return p_hat, value, density


def _update_estimates(state: KVLearnState, req: Request, cfg: KVLearnConfig) -> KVLearnState:
    """EMA of R̄ (ms per request) and λ (requests/s); the first request initialises both."""
    first = state.counters.requests == 0
    d = cfg.ema_decay
    r = cfg.cost.recompute_ms(req.tokens.astype(jnp.float32))
    inst = 1.0 / jnp.maximum(req.time - state.last_t, 1e-3)
    r_bar = jnp.where(first, r, d * state.r_bar_ms + (1 - d) * r)
    lam = jnp.where(
        first,
        1.0,
        jnp.where(state.counters.requests == 1, inst, d * state.arrival_rate + (1 - d) * inst),
    )
    first_t = jnp.where(first, req.time, state.first_t).astype(jnp.float32)
    return state.replace(
        r_bar_ms=r_bar, arrival_rate=lam.astype(jnp.float32), last_t=req.time, first_t=first_t
    )


def lookup(state: KVLearnState, req: Request, *, cfg: KVLearnConfig):
    """Looks ``req`` up and records it. Returns (state, hit: [] bool).

    A hit's block is re-scored with its updated history and its pool→D transfer is counted.
    """
    hit = pool_lib.lookup(state.pool, req.key) >= 0
    state = _update_estimates(state, req, cfg)
    state = state.replace(atc=atc_lib.observe_hit(state.atc, hit, cfg=cfg.atc))
    signals = _signals(state)
    hist, x_I, (x_lab, y_lab, emitted) = features_lib.record_request(
        state.hist,
        key=req.key,
        t=req.time,
        tokens=req.tokens,
        modality=req.modality,
        hit=hit,
        horizon_s=cfg.horizon_s,
        tau_fast_s=cfg.tau_fast_s,
        tau_slow_s=cfg.tau_slow_s,
        featurize_fn=lambda row: features_lib.featurize_rows(
            row,
            t=req.time,
            signals=signals,
            cost=cfg.cost,
            tau_fast_s=cfg.tau_fast_s,
            tau_slow_s=cfg.tau_slow_s,
        ),
    )
    prp = prp_lib.push_one(state.prp, x_lab, y_lab, emitted)
    state = state.replace(hist=hist, prp=prp_lib.observe(prp, x_I))
    _, value, density = _score(state, req.key, x_I, req.tokens, req.time, cfg)
    pool = pool_lib.set_entry(
        state.pool, slot=state.pool.slot_P[req.key], rank=density, value=value
    )
    c = state.counters
    gib = cfg.cost.footprint_bytes(req.tokens.astype(jnp.float32)) / GIB
    counters = c.replace(
        requests=c.requests + 1, hits=c.hits + hit, transfer_gib=c.transfer_gib + gib
    )
    return state.replace(pool=pool, counters=counters), hit


def admit(state: KVLearnState, req: Request, *, cfg: KVLearnConfig, active=True):
    """Keep-or-discard for a missed request (call after ``lookup``). Returns (state, AdmitResult).

    Keep iff ν > θ and, when victims are needed, CARS(candidate) > Σ CARS(victims), the
    victims being the lowest-ν blocks that free enough space. With ``active`` false ([] bool,
    e.g. ``~hit``) nothing changes and nothing is admitted: callers that run many requests
    at once (a vmapped simulator) use it instead of a ``lax.cond``, which ``vmap`` would turn
    into a select over the whole state.
    """
    x_I = _featurize(state, req.key, req.time, cfg)
    p_hat, value, density = _score(state, req.key, x_I, req.tokens, req.time, cfg)
    kib = pool_lib.block_kib(req.tokens, bytes_per_token=cfg.cost.shape.bytes_per_token)
    gate = active & cars_lib.keep(density, state.atc.theta)
    pool, admitted, victims = pool_lib.admit(
        state.pool,
        key=req.key,
        kib=kib,
        rank=density,
        value=value,
        allowed=gate,
        rule="value",
        margin=cfg.swap_margin,
    )
    evicted_E = victims.key_E
    hist = features_lib.count_evictions(state.hist, evicted_keys=evicted_E)
    n_ev = jnp.sum(evicted_E >= 0, dtype=jnp.int32)
    c = state.counters
    gib = cfg.cost.footprint_bytes(req.tokens.astype(jnp.float32)) / GIB
    counters = c.replace(
        admits=c.admits + admitted,
        evictions=c.evictions + n_ev,
        discards=c.discards + (active & ~admitted),
        transfer_gib=c.transfer_gib + jnp.where(admitted, gib, 0.0),
    )
    result = AdmitResult(admitted, n_ev, evicted_E, p_hat, value, density, state.atc.theta)
    return state.replace(pool=pool, hist=hist, counters=counters), result


def feed_labels(state: KVLearnState, x_BI, y_B, mask_B=None) -> KVLearnState:
    """Adds externally observed (features, reuse label) pairs to the PRP's replay buffer."""
    if mask_B is None:
        mask_B = jnp.ones(y_B.shape, bool)
    return state.replace(prp=prp_lib.push_labels(state.prp, x_BI, y_B.astype(jnp.float32), mask_B))


def _resident_features(state: KVLearnState, t, cfg: KVLearnConfig):
    keys_Z = jnp.maximum(state.pool.key_Z, 0)
    return keys_Z, _featurize(state, keys_Z, t, cfg)


def rescore_pool(state: KVLearnState, t, *, cfg: KVLearnConfig, x_ZI=None) -> KVLearnState:
    """Re-scores every resident block at time ``t`` (``x_ZI``: their features, if computed)."""
    keys_Z = jnp.maximum(state.pool.key_Z, 0)
    if x_ZI is None:
        x_ZI = _featurize(state, keys_Z, t, cfg)
    tokens_Z = state.hist.col(features_lib.TOKENS, keys_Z)
    _, value_Z, density_Z = _score(state, keys_Z, x_ZI, tokens_Z, t, cfg)
    return state.replace(pool=pool_lib.set_ranks(state.pool, rank_Z=density_Z, value_Z=value_Z))


def tick(state: KVLearnState, t, *, cfg: KVLearnConfig) -> KVLearnState:
    """Off-path maintenance at time ``t``: labels, re-scoring, ATC step, PRP training.

    Expired windows emit label 0; resident blocks due a window get one with the same
    features they are re-scored with.
    """
    state = tick_maintenance(state, t, cfg=cfg)
    k_train, k_next = jax.random.split(state.rng)
    prp = prp_lib.maybe_train(state.prp, key=k_train, cfg=cfg.prp)
    return state.replace(prp=prp, rng=k_next)


def tick_batch(state_B: KVLearnState, t_B, *, cfg: KVLearnConfig) -> KVLearnState:
    """``tick`` for B independent states (leading run axis on every leaf), e.g. a vmapped sweep:
    the maintenance is vmapped, and only the runs due a PRP training round train
    (``prp.maybe_train_batch``), instead of every run paying for one as under a plain ``vmap``."""
    state_B = jax.vmap(lambda s, t: tick_maintenance(s, t, cfg=cfg))(state_B, t_B)
    keys_B2 = jax.vmap(jax.random.split)(state_B.rng)
    prp = prp_lib.maybe_train_batch(state_B.prp, key_B=keys_B2[:, 0], cfg=cfg.prp)
    return state_B.replace(prp=prp, rng=keys_B2[:, 1])


def tick_maintenance(state: KVLearnState, t, *, cfg: KVLearnConfig) -> KVLearnState:
    """``tick`` without the PRP training round: labels, re-scoring and the ATC step."""
    hist, x_PI, mask_P = features_lib.expire_windows(
        state.hist, t=t, horizon_s=cfg.horizon_s, tau_s=cfg.tau_slow_s
    )
    prp = prp_lib.push_labels(state.prp, x_PI, jnp.zeros(mask_P.shape, jnp.float32), mask_P)
    state = state.replace(hist=hist, prp=prp)
    keys_Z, x_ZI = _resident_features(state, t, cfg)
    live_Z = pool_lib.resident(state.pool)
    hist = features_lib.open_windows(
        state.hist, t=t, keys_Z=keys_Z, x_ZI=x_ZI, live_Z=live_Z, horizon_s=cfg.horizon_s
    )
    state = rescore_pool(state.replace(hist=hist), t, cfg=cfg, x_ZI=x_ZI)
    p = state.pool
    rho = atc_lib.pressure(
        density_Z=p.rank_Z,
        kib_Z=p.kib_Z,
        live_Z=pool_lib.resident(p),
        theta=state.atc.theta,
        capacity_kib=p.capacity_kib,
    )
    return state.replace(atc=atc_lib.update(state.atc, rho=rho, cfg=cfg.atc))
