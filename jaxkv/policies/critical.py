"""``critical:<policy>``: CriticalKV (Feng et al., 2025, arXiv 2502.03805) over any scorer.

The two-stage selection of kvpress's ``CriticalKVPress``, per row (layer, sequence, KV head):

1. the ``floor(first_stage_ratio * B)`` slots with the best base scores are kept outright;
2. every other slot is ranked by ``(s + epsilon) * ||W_o v||_1``, the L1 norm of the value
   after the output projection of each of the KV group's G query heads, mean over them (the
   bound of the output perturbation that dropping the token can cause).

The base scores ``s`` are the inner policy's, shifted up by their row minimum when that is
negative (K-norm and KeyDiff score below zero; a product with a norm needs ``s >= 0``; for
non-negative scores, attention masses, nothing changes). Stage-1 slots score ``TIER`` plus
their stage-2 score scaled into [0, 1), the others that scaled score alone, so any
granularity's averaging still sees one scale. kvpress applies the press once to the prompt;
here it rescores at every eviction like every jaxkv policy.

The policy reads the model's W_o: its state is ``(inner_state, wo_LNHD)``, which only a policy
bound to the model's parameters can build (``jaxkv.policies.with_model``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.policies.base import TIER, Policy, per_row
from jaxkv.policies.heuristics import unit_scale

PREFIX = "critical:"


def projected_norms(v_LBKCH: jax.Array, wo_LNHD: jax.Array) -> jax.Array:
    """``||v W_o^(n)||_1`` per slot, mean over each KV head's G query heads: [L, B, K, C].

    ``wo_LNHD`` is the stacked output projection (query head n = k * G + g); layers are
    mapped one at a time so the [B, K, C, G, D] products of one layer exist at once only.
    """
    L, B, K, C, H = v_LBKCH.shape
    D = wo_LNHD.shape[-1]
    wo_LKGHD = wo_LNHD.reshape(L, K, -1, H, D).astype(jnp.float32)

    def layer(args):
        v_BKCH, wo_KGHD = args
        out = jnp.einsum("bkch,kghd->bkcgd", v_BKCH.astype(jnp.float32), wo_KGHD)
        return jnp.mean(jnp.sum(jnp.abs(out), axis=-1), axis=-1)

    return jax.lax.map(layer, (v_LBKCH, wo_LKGHD))


def two_stage(base_LBKC, norm_LBKC, pos_LBKC, budget_B, *, epsilon, first_stage_ratio):
    """CriticalKV's scores from base scores and projected value norms (module docstring)."""
    valid = pos_LBKC >= 0
    base = base_LBKC.astype(jnp.float32)
    low = jnp.min(jnp.where(valid, base, jnp.inf), axis=-1, keepdims=True)
    base = base - jnp.minimum(low, 0.0)
    order = jnp.argsort(-jnp.where(valid, base, -jnp.inf), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)  # 0 = best base score (ties: lower slot)
    n_first = jnp.floor(first_stage_ratio * budget_B).astype(jnp.int32)
    first = valid & (rank < n_first[None, :, None, None])
    second = unit_scale(jnp.where(valid, (base + epsilon) * norm_LBKC, 0.0), pos_LBKC)
    return jnp.where(first, TIER + second, second)


def critical(inner: Policy, *, epsilon: float = 1e-4, first_stage_ratio: float = 0.5) -> Policy:
    """CriticalKV's two-stage selection over ``inner``'s scores (module docstring).

    The policy's ``init(wo_LNHD=None)`` takes the model's stacked output projection
    ``params["layers"]["wo"]`` and raises without it; ``jaxkv.policies.with_model`` binds it.

    Args:
        inner: the base scorer (any policy that evicts, except the oracle).
        epsilon: added to the base scores before the rescaling (kvpress: 1e-4).
        first_stage_ratio: share of the budget chosen by the base scores alone (kvpress: 0.5).
    """
    if not inner.evicts:
        raise ValueError(f"critical: needs an evicting base policy, got {inner.name!r}")
    if not 0 <= first_stage_ratio <= 1:
        raise ValueError(f"first_stage_ratio must be in [0, 1], got {first_stage_ratio}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    name = PREFIX + inner.name

    def init(wo_LNHD=None):
        if wo_LNHD is None:
            raise ValueError(
                f"{name} reads the model's output projection W_o; bind it to the model with "
                "jaxkv.policies.with_model(policy, params)"
            )
        return inner.init(), wo_LNHD

    def score(state, cache, *, budget_B, key):
        inner_state, wo = state
        base = per_row(inner.score(inner_state, cache, budget_B=budget_B, key=key), cache)
        norm = projected_norms(cache.values(), wo)
        return two_stage(
            base,
            norm,
            cache.pos,
            budget_B,
            epsilon=epsilon,
            first_stage_ratio=first_stage_ratio,
        )

    return Policy(
        name,
        score=score,
        init=init,
        granularities=inner.granularities,
        window=inner.window,
        stats=inner.stats,
        spec=(
            ("inner", (inner.name, inner.spec)),
            ("epsilon", epsilon),
            ("first_stage_ratio", first_stage_ratio),
        ),
    )
