"""Adaptive Threshold Controller: a PI controller on a signal the threshold actually moves.

θ is a threshold on the normalised value density ν (see ``cars.py``): a block is kept iff
ν > θ. The regulated signal is the *pressure at θ*,

    ρ(θ) = (bytes of resident blocks with ν > θ) / capacity,

the share of the pool that θ would still keep. ρ falls as θ rises, so the loop is well posed
(unlike raw occupancy, which evict-on-admit pins near 100 % whatever θ is). At equilibrium
ρ = ρ* = 0.85: θ sits at the value density of the block at the pool's 15 % byte quantile, and a
candidate must beat that (hysteresis against churn from noisy predictions). When the pool has
room, ρ ≤ occupancy < ρ* and θ falls to its floor: everything worth anything is admitted.

Control law (positional PI with conditional-integration anti-windup)::

    e = ρ − ρ*;   if hit_rate < h_floor: e = min(e, 0)   (a low hit rate never tightens)
    θ = clip(θ0 + Kp·e + Ki·I, θ_min, θ_max),   I += e unless that pushes θ past a clamp

The integrator is also clipped so that Ki·I alone never exceeds the clamp range.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class ATCConfig:
    """README defaults: ρ* = 0.85, Kp = 2e-2, Ki = 5e-4, h_floor = 0.55."""

    rho_star: float = 0.85
    kp: float = 2e-2
    ki: float = 5e-4
    h_floor: float = 0.55
    theta0: float = 0.0
    theta_min: float = -0.5
    theta_max: float = 1.5
    hit_decay: float = 0.995

    def __post_init__(self):
        if not 0 < self.rho_star <= 1:
            raise ValueError(f"ATCConfig.rho_star must be in (0, 1], got {self.rho_star}")
        if self.kp < 0 or self.ki <= 0:
            raise ValueError("ATCConfig: kp must be ≥ 0 and ki > 0")
        if not self.theta_min <= self.theta0 <= self.theta_max:
            raise ValueError("ATCConfig: need theta_min ≤ theta0 ≤ theta_max")
        if not 0 <= self.hit_decay < 1:
            raise ValueError("ATCConfig.hit_decay must be in [0, 1)")


@struct.dataclass
class ATCState:
    """θ, the integrator I and the windowed (EMA) hit rate, all [] float32."""

    theta: jax.Array
    integral: jax.Array
    hit_rate: jax.Array


def init_atc(cfg: ATCConfig) -> ATCState:
    f = lambda v: jnp.asarray(v, jnp.float32)
    return ATCState(theta=f(cfg.theta0), integral=f(0.0), hit_rate=f(0.0))


def observe_hit(state: ATCState, hit, *, cfg: ATCConfig) -> ATCState:
    """Updates the windowed hit rate with one request's outcome."""
    h = cfg.hit_decay * state.hit_rate + (1.0 - cfg.hit_decay) * hit.astype(jnp.float32)
    return state.replace(hit_rate=h)


def pressure(*, density_Z, kib_Z, live_Z, theta, capacity_kib):
    """ρ(θ): share of capacity held by resident blocks with ν > θ."""
    kept = jnp.sum(jnp.where(live_Z & (density_Z > theta), kib_Z, 0).astype(jnp.float32))
    return kept / jnp.maximum(capacity_kib.astype(jnp.float32), 1.0)


def update(state: ATCState, *, rho, cfg: ATCConfig) -> ATCState:
    """One PI step on e = ρ − ρ* (see the module docstring)."""
    e = rho - cfg.rho_star
    e = jnp.where(state.hit_rate < cfg.h_floor, jnp.minimum(e, 0.0), e)
    i_lo, i_hi = (cfg.theta_min - cfg.theta0) / cfg.ki, (cfg.theta_max - cfg.theta0) / cfg.ki
    integral = jnp.clip(state.integral + e, i_lo, i_hi)
    raw = cfg.theta0 + cfg.kp * e + cfg.ki * integral
    windup = ((raw > cfg.theta_max) & (e > 0)) | ((raw < cfg.theta_min) & (e < 0))
    integral = jnp.where(windup, state.integral, integral)
    theta = jnp.clip(cfg.theta0 + cfg.kp * e + cfg.ki * integral, cfg.theta_min, cfg.theta_max)
    return state.replace(theta=theta.astype(jnp.float32), integral=integral.astype(jnp.float32))
