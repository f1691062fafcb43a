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

The norm of a slot never changes, so it is not recomputed at each eviction: the decoder writes
it once, with the token, as the cache statistic ``wo_vnorm`` (``jaxkv.kvcache.WEIGHT_STATS``),
which the policy lists in its ``stats``. (Recomputing it for every slot at every eviction made
an eviction at batch 8 x 4K cost 9.7 s.) A ranker's ``log_wo_vnorm`` feature reads the same
statistic.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv import kvcache
from jaxkv.policies.base import TIER, Policy, per_row
from jaxkv.policies.heuristics import unit_scale
from jaxkv.topn import top_n_mask

PREFIX = "critical:"
STAT = "wo_vnorm"  # the cache statistic of the projected value norms


def two_stage(base_LBKC, norm_LBKC, pos_LBKC, budget_B, *, epsilon, first_stage_ratio):
    """CriticalKV's scores from base scores and projected value norms (module docstring)."""
    valid = pos_LBKC >= 0
    base = base_LBKC.astype(jnp.float32)
    low = jnp.min(jnp.where(valid, base, jnp.inf), axis=-1, keepdims=True)
    base = base - jnp.minimum(low, 0.0)
    n_first = jnp.floor(first_stage_ratio * budget_B).astype(jnp.int32)
    # the n_first best base scores of each row (ties: the lower slot), without sorting it
    first = valid & top_n_mask(jnp.where(valid, base, -jnp.inf), n_first[None, :, None, None])
    second = unit_scale(jnp.where(valid, (base + epsilon) * norm_LBKC, 0.0), pos_LBKC)
    return jnp.where(first, TIER + second, second)


def critical(inner: Policy, *, epsilon: float = 1e-4, first_stage_ratio: float = 0.5) -> Policy:
    """CriticalKV's two-stage selection over ``inner``'s scores (module docstring).

    It reads the cache statistic ``wo_vnorm`` besides ``inner``'s; its state is ``inner``'s.

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

    def score(state, cache, *, budget_B, key):
        base = per_row(inner.score(state, cache, budget_B=budget_B, key=key), cache)
        return two_stage(
            base,
            cache.stats[STAT],
            cache.pos,
            budget_B,
            epsilon=epsilon,
            first_stage_ratio=first_stage_ratio,
        )

    return Policy(
        name,
        score=score,
        init=inner.init,
        granularities=inner.granularities,
        window=inner.window,
        stats=kvcache.stat_names((*inner.stats, STAT)),
        spec=(
            ("inner", (inner.name, inner.spec)),
            ("epsilon", epsilon),
            ("first_stage_ratio", first_stage_ratio),
        ),
    )
