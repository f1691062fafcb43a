"""The learned DistillCache policy: a small Flax MLP over the five token features.

Architecture (paper App. D): Dense(128) -> LayerNorm -> ReLU -> Dense(128) -> LayerNorm ->
ReLU -> Dense(1). With 5 inputs that is 17,921 parameters (the paper says "~200K").

Inputs are ``jaxkv.stats.features`` after a fixed, parameter-free preprocessing: alpha and
sigma (attention masses spanning orders of magnitude) go through log(x + 1e-6), then every
feature is standardized across the sequence's cached tokens. The policy so sees relative
values, which transfer across sequence lengths and budgets.

A policy checkpoint is a ``jaxkv.checkpoint`` directory whose meta file is ``policy.json``.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv import checkpoint as checkpoint_lib
from jaxkv import stats
from jaxkv.policies.base import Policy

HIDDEN = 128
POLICY_META = "policy.json"
SHIPPED = "jaxkv.checkpoints"
"""Package holding the policy checkpoints that ship with jaxkv (one folder each)."""


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


def shipped_checkpoints() -> Path:
    """The folder of the policy checkpoints shipped inside the package."""
    return Path(str(importlib.resources.files(SHIPPED)))


def checkpoint_path(spec: str | Path) -> Path:
    """The checkpoint folder ``spec`` names: a path if one exists there, else a shipped name.

    ``"distillcache_smollm2_cpu"`` names the policy shipped in ``jaxkv/checkpoints/``; any
    existing path (relative to the working directory, or absolute) wins over it.

    Raises:
        jaxkv.checkpoint.CheckpointError: neither exists (one line naming both places).
    """
    path = Path(spec).expanduser()
    if path.exists() or path.is_absolute():
        return path
    shipped = shipped_checkpoints() / path
    if shipped.exists():
        return shipped
    names = sorted(p.name for p in shipped_checkpoints().iterdir() if p.is_dir())
    raise checkpoint_lib.CheckpointError(
        path.absolute(),
        f"no such folder, and no shipped checkpoint of that name ({names})",
        what="learned policy",
    )


def load_learned(path: str, **_) -> Policy:
    """The policy saved at ``path`` by ``jaxkv.train distillcache`` (``save_policy``), or the
    shipped checkpoint of that name (``checkpoint_path``)."""
    params, _ = load_policy(checkpoint_path(path))
    return learned_policy(params, name=f"learned:{path}", spec=(("path", str(path)),))


def save_policy(path: str | Path, params: dict, meta: dict[str, Any]) -> Path:
    """Writes a policy checkpoint (atomically replacing one at ``path``).

    Raises:
        jaxkv.checkpoint.CheckpointError: non-finite parameters (nothing is written).
    """
    hidden = params["Dense_0"]["kernel"].shape[-1]
    meta = {"kind": "distillcache-policy", "hidden": hidden, "n_params": count(params), **meta}
    return checkpoint_lib.save(path, params, meta, meta_name=POLICY_META)


def load_policy(path: str | Path) -> tuple[dict, dict]:
    """Reads and verifies a policy checkpoint: (params, meta).

    Raises:
        jaxkv.checkpoint.CheckpointError: (a ValueError, one line naming ``path``) no policy
            checkpoint there, or a damaged one.
    """
    path = Path(path).absolute()
    try:
        meta = checkpoint_lib.read_meta(path, meta_name=POLICY_META)
        hidden = meta.get("hidden")
        if meta.get("kind") != "distillcache-policy" or type(hidden) is not int or hidden < 1:
            raise checkpoint_lib.CheckpointError(path, f"{POLICY_META} does not describe a policy")
        abstract = jax.eval_shape(lambda: init_mlp(key=jax.random.key(0), hidden=hidden))
        return checkpoint_lib.restore(path, abstract, meta_name=POLICY_META)
    except checkpoint_lib.CheckpointError as e:
        raise checkpoint_lib.CheckpointError(e.path, e.reason, what="learned policy") from None


def count(params: dict) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
