"""Cost-Aware Retention Score: CARS = P̂·(R − T) − U, and the value density used for ranking.

CARS is in ms (expected time saved minus storage opportunity cost). Blocks are ranked, and
thresholded, by the *normalised value density*

    ν = CARS / (κ · |b|),    κ = (R − T)/|b| in the bandwidth-bound regime,

a dimensionless number: ν = P̂ − P* for bandwidth-bound blocks (P* = U/(R − T), the README's
optimal reuse threshold) and larger for compute-bound ones, whose recompute grows as L².
Eviction takes the lowest ν first; keep iff ν > θ (θ from the ATC). Ranking by ν is ranking
by value per byte.

Δt for U defaults to one mean inter-arrival time (1/λ): U is then the block's byte share of
one average recompute, R̄·|b|/M_S. With a long Δt such as the label horizon, γ·|b|·Δt (the
block's share of *all* recompute the pool could save in Δt) exceeds P̂·(R − T) for every block
and every CARS would be negative; the marginal price of space is what θ supplies instead.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.kvlearn.cost import CostModel, cars, storage_cost_ms


def score(cost: CostModel, *, p_hat, tokens, r_bar_ms, arrival_rate, capacity_bytes, dt_s):
    """Returns (CARS in ms, normalised density ν) for blocks of ``tokens`` tokens."""
    tokens = jnp.asarray(tokens, jnp.float32)
    nbytes = cost.footprint_bytes(tokens)
    u = storage_cost_ms(
        nbytes=nbytes,
        dt_s=dt_s,
        r_bar_ms=r_bar_ms,
        arrival_rate=arrival_rate,
        capacity_bytes=capacity_bytes,
    )
    value = cars(p_hat=p_hat, net_benefit_ms=cost.net_benefit_ms(tokens), storage_ms=u)
    return value, value / (cost.benefit_per_byte_ms * nbytes)


def keep(density, theta):
    """KEEP ⇔ ν > θ (equivalently CARS > θ·κ·|b|)."""
    return density > theta
