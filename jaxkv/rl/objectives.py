"""REINFORCE pieces: subset decisions, returns, baselines and the policy-gradient loss.

A *decision* keeps ``budget`` of the valid slots of one row, sampled from the policy's
scores with one of the estimators of ``jaxkv.rl.plackett_luce``; a step decides every row of
the cache (one for the shared policy, one per (layer, KV head) for a per-head one), and its
log-probability is the sum over the rows. The loss recomputes the scores from stored features,
so gradients reach the policy and never the language model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.policies import learned
from jaxkv.rl import plackett_luce as pl


@struct.dataclass
class Decisions:
    """Per-step records of K rollouts, each field [K, S, ...] (S decision steps, R rows).

    Attributes:
        features: [K, S, R, C, F] raw token features before the decision.
        valid: [K, S, R, C] occupied slots.
        selected: [K, S, R, C] slots kept.
        order: [K, S, R, C] the Gumbel draw order (``ordered_pl``; zeros otherwise).
        budget: [K, S] B_t (every row's).
        active: [K, S, R] the row's decision dropped something (more valid slots than B_t).
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


def decide_rows(scores_RC, valid_RC, budget, *, key, estimator: str, max_budget: int):
    """``decide`` for every row, independently: (selected [R, C], order [R, C]). One row uses
    ``key`` itself (so the shared policy samples as it always has), several one key each."""
    one = lambda s, v, k: decide(s, v, budget, key=k, estimator=estimator, max_budget=max_budget)
    if scores_RC.shape[0] == 1:
        return jax.tree.map(lambda x: x[None], one(scores_RC[0], valid_RC[0], key))
    return jax.vmap(one)(scores_RC, valid_RC, jax.random.split(key, scores_RC.shape[0]))


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
    scores_fn=learned.scores_from_features,
):
    """-mean(A * log π(a)) - beta * entropy, over steps where some row's decision is active.

    log π(a) of a step is the sum over its active rows (independent decisions), and so is the
    entropy. The entropy bonus is the paper's single-sample surrogate -log π(a) (its gradient
    is that of E[-log π]), or with ``exact_entropy`` the exact H = log Z - Σ p_i s_i.
    ``scores_fn(params, features, valid)`` is the policy's (``rollout.Rows.scores``).

    Returns:
        (loss, aux dict with the mean log-prob and the exact entropy).
    """

    def row(features, valid, selected, order, budget):
        s = scores_fn(policy_params, features, valid)
        lp = log_prob(s, valid, selected, order, budget, estimator=estimator, max_budget=max_budget)
        h = pl.entropy(s, budget, mask_L=valid, max_budget=max_budget)
        return lp, h

    def one(features, valid, selected, order, budget, active):
        if valid.shape[0] == 1:  # the shared policy: its one row, as it always was
            lp, h = row(features[0], valid[0], selected[0], order[0], budget)
            return lp * active[0], h * active[0]
        lp, h = jax.vmap(row, in_axes=(0, 0, 0, 0, None))(features, valid, selected, order, budget)
        return jnp.sum(lp * active), jnp.sum(h * active)

    active_RS = d.active.astype(jnp.float32)
    lp_KS, h_KS = jax.vmap(jax.vmap(one))(
        d.features, d.valid, d.selected, d.order, d.budget, active_RS
    )
    w = jnp.any(d.active, axis=-1).astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w), 1.0)
    pg = -jnp.sum(jax.lax.stop_gradient(advantages_KS) * lp_KS * w) / n
    ent = jnp.sum((h_KS if exact_entropy else -lp_KS) * w) / n
    return pg - beta * ent, {"log_prob": jnp.sum(lp_KS * w) / n, "entropy": jnp.sum(h_KS * w) / n}
