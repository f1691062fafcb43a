"""The learned DistillCache policy: a small Flax MLP over the five token features.

Architecture (paper App. D): Dense(128) -> LayerNorm -> ReLU -> Dense(128) -> LayerNorm ->
ReLU -> Dense(1). With 5 inputs that is 17,921 parameters (the paper says "~200K").

Inputs are ``jaxkv.stats.features`` after a fixed, parameter-free preprocessing: alpha and
sigma (attention masses spanning orders of magnitude) go through log(x + 1e-6), then every
feature is standardized across the sequence's cached tokens. The policy so sees relative
values, which transfer across sequence lengths and budgets.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv import stats
from jaxkv.policies.base import Policy

HIDDEN = 128


class ScoreMLP(nn.Module):
    """Per-token score from preprocessed features [..., 5] -> [...]."""

    hidden: int = HIDDEN

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.LayerNorm()(nn.Dense(self.hidden)(x)))
        return nn.Dense(1)(x)[..., 0]


def preprocess(features_BC5: jax.Array, valid_BC: jax.Array) -> jax.Array:
    """log-scales attention masses and standardizes each feature over the valid tokens."""
    f = features_BC5.at[..., 0].set(jnp.log(features_BC5[..., 0] + 1e-6))
    f = f.at[..., 2].set(jnp.log(features_BC5[..., 2] + 1e-6))
    w = valid_BC[..., None].astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w, axis=-2, keepdims=True), 1.0)
    mean = jnp.sum(f * w, axis=-2, keepdims=True) / n
    var = jnp.sum(((f - mean) * w) ** 2, axis=-2, keepdims=True) / n
    return jnp.where(w > 0, (f - mean) * jax.lax.rsqrt(var + 1e-6), 0.0)


def init_mlp(*, key: jax.Array, hidden: int = HIDDEN) -> dict:
    """Fresh MLP parameters (a plain pytree)."""
    return ScoreMLP(hidden).init(key, jnp.zeros((1, len(stats.FEATURE_NAMES))))["params"]


def scores_from_features(params: dict, features_C5: jax.Array, valid_C: jax.Array) -> jax.Array:
    """Scores [..., C] from raw features [..., C, 5] (free slots get -inf)."""
    hidden = params["Dense_0"]["kernel"].shape[-1]
    s = ScoreMLP(hidden).apply({"params": params}, preprocess(features_C5, valid_C))
    return jnp.where(valid_C, s, -jnp.inf)


def token_scores(params: dict, cache) -> jax.Array:
    """[B, C] scores of every slot of a cache (free slots get -inf)."""
    return scores_from_features(params, stats.features(cache), cache.pos[0, :, 0] >= 0)


def learned_policy(params: dict, *, name: str = "learned", spec: tuple = ()) -> Policy:
    """A Policy scoring with the MLP ``params`` (one token set shared by all layers/heads)."""
    return Policy(
        name=name,
        score=lambda state, cache, **_: token_scores(state, cache),
        init=lambda: params,
        granularities=("shared",),
        stats=stats.FEATURE_STATS,
        spec=spec,
    )


def load_learned(path: str, **_) -> Policy:
    """The policy saved at ``path`` by ``jaxkv.train distillcache`` (``jaxkv.checkpoint``)."""
    from jaxkv.checkpoint import load_policy

    params, meta = load_policy(path)
    return learned_policy(params, name=f"learned:{path}", spec=(("path", str(path)),))


def count(params: dict) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
