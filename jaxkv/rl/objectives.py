"""REINFORCE pieces: subset decisions, returns, baselines and the policy-gradient loss.

A *decision* keeps ``budget`` of the valid slots of one row, sampled from the policy's
scores with one of the estimators of ``jaxkv.rl.plackett_luce``. The loss recomputes the
scores from stored features, so gradients reach the policy and never the language model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.policies.learned import scores_from_features
from jaxkv.rl import plackett_luce as pl


@struct.dataclass
class Decisions:
    """Per-step records of K rollouts, each field [K, S, ...] (S decision steps).

    Attributes:
        features: [K, S, C, 5] raw token features before the decision.
        valid: [K, S, C] occupied slots.
        selected: [K, S, C] slots kept.
        order: [K, S, C] the Gumbel draw order (``ordered_pl``; zeros otherwise).
        budget: [K, S] B_t.
        active: [K, S] the decision dropped something (more valid slots than the budget).
        reward: [K, S] -KL(P_teacher || P_student) at the step after the decision.
    """

    features: jax.Array
    valid: jax.Array
    selected: jax.Array
    order: jax.Array
    budget: jax.Array
    active: jax.Array
    reward: jax.Array


def decide(scores_C, valid_C, budget, *, key, estimator: str, max_budget: int):
    """Samples the kept set: (selected [C] bool, order [C] int32)."""
    if estimator == "ordered_pl":
        order = pl._gumbel_order(scores_C, key=key, mask_L=valid_C)
        return pl._first_of_order(order, budget) & valid_C, order.astype(jnp.int32)
    selected, _ = pl.sample_and_log_prob(
        jax.lax.stop_gradient(scores_C),
        budget,
        key=key,
        estimator=estimator,
        mask_L=valid_C,
        max_budget=max_budget,
    )
    return selected, jnp.zeros(scores_C.shape, jnp.int32)


def log_prob(scores_C, valid_C, selected_C, order_C, budget, *, estimator, max_budget):
    """log π(action) under ``scores_C`` (differentiable), for a stored action."""
    if estimator == "ordered_pl":
        return pl.ordered_log_prob(scores_C, order_C, budget, mask_L=valid_C)
    return pl.subset_log_prob(scores_C, selected_C, budget, mask_L=valid_C, max_budget=max_budget)


def discounted_returns(rewards_KS: jax.Array, gamma: float) -> jax.Array:
    """G_t = sum_{k >= t} gamma^(k - t) r_k, along the last axis."""

    def step(acc, r):
        acc = r + gamma * acc
        return acc, acc

    _, out = jax.lax.scan(step, jnp.zeros(rewards_KS.shape[:-1]), rewards_KS.T[::-1])
    return out[::-1].T


def rloo_advantages(returns_KS: jax.Array) -> jax.Array:
    """G minus the leave-one-out mean of the other rollouts' returns (K >= 2)."""
    K = returns_KS.shape[0]
    total = jnp.sum(returns_KS, axis=0, keepdims=True)
    return returns_KS - (total - returns_KS) / (K - 1)


def reinforce_loss(
    policy_params,
    d: Decisions,
    advantages_KS: jax.Array,
    *,
    estimator: str,
    beta: float,
    exact_entropy: bool,
    max_budget: int,
):
    """-mean(A * log π(a)) - beta * entropy, over active decisions.

    The entropy bonus is the paper's single-sample surrogate -log π(a) (its gradient is
    that of E[-log π]), or with ``exact_entropy`` the exact H = log Z - Σ p_i s_i.

    Returns:
        (loss, aux dict with the mean log-prob and the exact entropy).
    """

    def one(features, valid, selected, order, budget):
        s = scores_from_features(policy_params, features, valid)
        lp = log_prob(s, valid, selected, order, budget, estimator=estimator, max_budget=max_budget)
        h = pl.entropy(s, budget, mask_L=valid, max_budget=max_budget)
        return lp, h

    lp_KS, h_KS = jax.vmap(jax.vmap(one))(d.features, d.valid, d.selected, d.order, d.budget)
    w = d.active.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    pg = -jnp.sum(jax.lax.stop_gradient(advantages_KS) * lp_KS * w) / n
    ent = jnp.sum((h_KS if exact_entropy else -lp_KS) * w) / n
    return pg - beta * ent, {"log_prob": jnp.sum(lp_KS * w) / n, "entropy": jnp.sum(h_KS * w) / n}
