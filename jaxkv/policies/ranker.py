"""``ranker:<path>``: a supervised per-head eviction ranker (DistillCache's Table 10 ablation,
per (layer, KV head)).

A small MLP scores every cached token of every (layer, KV head) row from that row's own
features (``head_features``); it is trained without RL to rank tokens by what the queries still
to come take from them under the full cache (their attention, the ``oracle``'s quantity,
optionally times the token's value norm), on text of several domains (``jaxkv.rl.ranker``). One
network is shared by all rows; the layer enters as a feature (its depth in [0, 1]), so a
checkpoint does not depend on the model's shape.

Scores are per row, so every granularity works: ``head`` keeps each row's top B, ``layer`` and
``shared`` average a row's scores over the heads (and layers) they share. Training with a
per-row ListNet fixes scores only up to a constant per row, which changes neither a row's
ranking nor the ranking of an average over rows; the pooled granularities (``adaptive``,
``global``), which compare raw scores across rows, need a ranker trained with ``pool`` > 1
(its ``config.pool`` in the meta), whose scores share one constant across rows.

A *residual* ranker (``base`` in its meta) adds one raw feature to the MLP's output, e.g.
``log_recon``: it starts from kvzip's ranking and learns corrections to it.

A ranker checkpoint is a ``jaxkv.checkpoint`` directory whose meta file is ``ranker.json``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxkv import checkpoint as checkpoint_lib
from jaxkv.kvcache import WEIGHT_STATS, KVCache
from jaxkv.policies import kvzip as kvzip_lib
from jaxkv.policies.base import TIER, Policy
from jaxkv.policies.heuristics import protect_attended, protect_recent
from jaxkv.policies.learned import checkpoint_path

PREFIX = "ranker:"
META = "ranker.json"
KIND = "distillcache-ranker"
HIDDEN = 32
PROTECTION = ("recent_fraction", "sinks", "attended_fraction")  # tiers a checkpoint may set
FEATURES = (
    "log_attn",  # the latest pass's final query's mass (mean over the KV group)
    "log_attn_var",  # its variance over the group's query heads
    "log_attn_cum",  # mass summed over every query so far (H2O)
    "log_attn_mean",  # attn_cum over the number of queries that saw the token
    "log_recent",  # decayed sum over recent queries (SnapKV-like)
    "entropy",  # mean attention entropy of the recent queries that attended to it
    "log_vnorm",  # value norm
    "log_age",  # log(1 + tokens processed since it)
    "log_pos",  # log(1 + position): sinks sit at 0
    "pos_frac",  # position over tokens processed
    "depth",  # layer index over L - 1
    "z_attn_cum",  # log_attn_cum standardized over the row's tokens
    "z_recent",  # log_recent standardized over the row's tokens
    "log_wo_vnorm",  # ||W_o v||_1, mean over the KV group's query heads (CriticalKV's norm)
    "log_recon",  # kvzip's score: the most attention a query reconstructing the prompt pays
    "z_recon",  # log_recon standardized over the row's tokens
)
WEIGHT_FEATURES = ("log_wo_vnorm",)  # read the cache statistic ``wo_vnorm`` (``WEIGHT_STATS``)
RECON_FEATURES = ("log_recon", "z_recon")  # read kvzip's reconstruction pass (prefill only)
DEFAULT_FEATURES = tuple(  # the shipped rankers'
    n for n in FEATURES if n not in WEIGHT_FEATURES + RECON_FEATURES
)
STATS = ("attn", "attn_sq", "attn_cum", "recent", "recent_ent", "vnorm")
_EPS = 1e-6


def _log(x: jax.Array) -> jax.Array:
    return jnp.log(jnp.maximum(x, 0.0) + _EPS)


def _row_z(x_LBKC: jax.Array, valid_LBKC: jax.Array) -> jax.Array:
    w = valid_LBKC.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1.0)
    mean = jnp.sum(x_LBKC * w, axis=-1, keepdims=True) / n
    var = jnp.sum(((x_LBKC - mean) * w) ** 2, axis=-1, keepdims=True) / n
    return (x_LBKC - mean) * jax.lax.rsqrt(var + 1e-6)


def stats_for(names: tuple[str, ...]) -> tuple[str, ...]:
    """The cache statistics the features ``names`` read: ``STATS``, and ``wo_vnorm``
    (``WEIGHT_STATS``, written by the decoder) for ``WEIGHT_FEATURES``."""
    return STATS + (WEIGHT_STATS if any(n in WEIGHT_FEATURES for n in names) else ())


def _check_inputs(cache, names, reconstruction) -> None:
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise ValueError(f"unknown ranker features {unknown}; valid: {FEATURES}")
    missing = [n for n in stats_for(names) if n not in cache.stats]
    if missing:
        raise ValueError(
            f"the ranker's features {names} read the cache statistics {missing}, which this "
            "cache does not carry: init_cache(..., stats=ranker.stats_for(features))"
        )
    if reconstruction is None and any(n in RECON_FEATURES for n in names):
        raise ValueError(
            "the ranker's features log_recon / z_recon read kvzip's reconstruction pass, which "
            "only the fidelity evaluation computes (--protocol prefill)"
        )


def _layer_inputs(cache, names, reconstruction) -> dict[str, Any]:
    """What the features read, every leaf with a leading layer axis L: the statistics, the
    slots' positions, the layer's depth in [0, 1], and kvzip's per-slot scores when ``names``
    read them."""
    L = cache.pos.shape[0]
    inputs = {
        "stats": dict(cache.stats),
        "pos": cache.pos,
        "depth": jnp.arange(L, dtype=jnp.float32) / max(L - 1, 1),
    }
    if any(n in RECON_FEATURES for n in names):
        inputs["recon"] = reconstruction.at(cache.pos)
    return inputs


def _features(inputs: dict[str, Any], length_B: jax.Array, names: tuple[str, ...]) -> jax.Array:
    """Features [..., B, K, C, F] of ``_layer_inputs`` for all layers ([L, B, K, C] leaves,
    depth [L]) or one ([B, K, C], depth [])."""
    st, pos_i = inputs["stats"], inputs["pos"]
    valid = pos_i >= 0
    length = length_B[:, None, None].astype(jnp.float32)
    pos = pos_i.astype(jnp.float32)
    seen = jnp.maximum(length - pos, 1.0)  # queries that saw the token (itself included)
    recent = jnp.maximum(st["recent"], 0.0)
    log_cum, log_recent = _log(st["attn_cum"]), _log(recent)
    log_recon = functools.cache(lambda: _log(inputs["recon"]))
    cols = {  # lazily: only the named columns are computed
        "log_attn": lambda: _log(st["attn"]),
        "log_attn_var": lambda: _log(st["attn_sq"] - st["attn"] ** 2),
        "log_attn_cum": lambda: log_cum,
        "log_attn_mean": lambda: _log(st["attn_cum"] / seen),
        "log_recent": lambda: log_recent,
        "entropy": lambda: jnp.where(
            recent > 0, st["recent_ent"] / jnp.maximum(recent, 1e-30), 0.0
        ),
        "log_vnorm": lambda: _log(st["vnorm"]),
        "log_age": lambda: jnp.log(seen),
        "log_pos": lambda: jnp.log1p(jnp.maximum(pos, 0.0)),
        "pos_frac": lambda: pos / jnp.maximum(length, 1.0),
        "depth": lambda: jnp.broadcast_to(inputs["depth"][..., None, None, None], pos.shape),
        "z_attn_cum": lambda: _row_z(log_cum, valid),
        "z_recent": lambda: _row_z(log_recent, valid),
        "log_wo_vnorm": lambda: _log(st["wo_vnorm"]),
        "log_recon": log_recon,
        "z_recon": lambda: _row_z(log_recon(), valid),
    }
    feats = jnp.stack([cols[n]() for n in names], axis=-1)
    return jnp.where(valid[..., None], feats, 0.0)


def head_features(
    cache: KVCache,
    *,
    names: tuple[str, ...] = FEATURES,
    reconstruction: kvzip_lib.Reconstruction | None = None,
) -> jax.Array:
    """Per-row features of every slot, [L, B, K, C, F] in ``names`` order (0 on free slots),
    from a cache carrying ``stats_for(names)``; ``RECON_FEATURES`` need kvzip's reconstruction
    scores of the prompt (0 past the prompt)."""
    _check_inputs(cache, names, reconstruction)
    inputs = _layer_inputs(cache, names, reconstruction)
    return _features(inputs, cache.length, names)


def head_scores(
    params: dict,
    cache: KVCache,
    *,
    names: tuple[str, ...],
    reconstruction: kvzip_lib.Reconstruction | None = None,
) -> jax.Array:
    """``scores_from_features(params, head_features(cache, ...), cache.valid)``, [L, B, K, C],
    one layer at a time, so that a layer's features and [B, K, C, hidden] activations stay in
    the processor's caches: all layers' at once (0.1 GB per activation at batch 8 x 4K) go to
    memory and back between every two of the MLP's ops, several times the cost of its
    arithmetic (``scripts/bench_eviction.py``)."""
    _check_inputs(cache, names, reconstruction)

    def layer(inputs):
        feats = _features(inputs, cache.length, names)
        return scores_from_features(params, feats, inputs["pos"] >= 0)

    return jax.lax.map(layer, _layer_inputs(cache, names, reconstruction))


class RankMLP(nn.Module):
    """Score from standardized features [..., F] -> [...]."""

    hidden: int = HIDDEN

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(1)(x)[..., 0]


def init_params(
    *,
    key: jax.Array,
    hidden: int = HIDDEN,
    n_features: int = len(DEFAULT_FEATURES),
    base: int | None = None,
) -> dict:
    """Fresh parameters: the MLP's and the feature standardization (mean 0, scale 1). With
    ``base`` (a feature's column) the ranker is residual: its score is that raw feature plus
    the MLP's output (``scores_from_features``), and the output layer starts at zero, so a
    fresh residual ranker ranks exactly by the base feature."""
    mlp = RankMLP(hidden).init(key, jnp.zeros((1, n_features)))["params"]
    params = {"mlp": mlp, "mean": jnp.zeros((n_features,)), "scale": jnp.ones((n_features,))}
    if base is None:
        return params
    if not 0 <= base < n_features:
        raise ValueError(f"base must be a feature column in [0, {n_features}), got {base}")
    out = jax.tree.map(jnp.zeros_like, mlp["Dense_2"])
    return {**params, "mlp": {**mlp, "Dense_2": out}, "base": jax.nn.one_hot(base, n_features)}


def scores_from_features(params: dict, feats: jax.Array, valid: jax.Array) -> jax.Array:
    """Scores [...] of features [..., F]; invalid slots get -inf. A residual ranker (a
    ``base`` in its params: a fixed one-hot over the columns) adds its base feature, raw."""
    hidden = params["mlp"]["Dense_0"]["kernel"].shape[-1]
    x = (feats - params["mean"]) / params["scale"]
    s = RankMLP(hidden).apply({"params": params["mlp"]}, x)
    if "base" in params:
        s = s + feats @ params["base"]
    return jnp.where(valid, s, -jnp.inf)


def ranker_policy(
    params: dict,
    *,
    features: tuple[str, ...] = DEFAULT_FEATURES,
    recent_fraction: float = 0.0,
    sinks: int = 0,
    attended_fraction: float = 0.0,
    name: str = "ranker",
    spec: tuple = (),
) -> Policy:
    """A Policy scoring every (layer, KV head) row with the ranker ``params`` over
    ``features``. Always kept: the first ``sinks`` positions (attention sinks), the newest
    ``floor(recent_fraction * B)`` tokens of each sequence (as H2O's window), and in each row
    the ``floor(attended_fraction * B)`` tokens the latest query attends to most (TOVA's
    choice: what a look-up query needs, which a ranker trained on future attention
    underweights; ``heuristics.protect_attended``).

    The state is ``(params, reconstruction)``: ``init(reconstruction=None)`` takes kvzip's
    reconstruction scores of the prompt, needed (and then required) only by
    ``RECON_FEATURES`` (such a ranker compresses once, ``prefill`` protocol, and only the
    fidelity evaluation computes its state: ``Policy.window_input``). ``WEIGHT_FEATURES`` read
    the cache statistic ``wo_vnorm``, which the policy lists in its ``stats``."""
    for what, share in (
        ("recent_fraction", recent_fraction),
        ("attended_fraction", attended_fraction),
    ):
        if not 0 <= share <= 1:
            raise ValueError(f"{what} must be in [0, 1], got {share}")
    features = tuple(features)
    if params["mean"].shape != (len(features),):
        raise ValueError(f"params for {params['mean'].shape[0]} features, got {features}")
    needs_recon = any(n in RECON_FEATURES for n in features)

    def init(reconstruction=None):
        if needs_recon and reconstruction is None:
            raise ValueError(
                f"{name} reads kvzip's reconstruction pass over the prompt; only the fidelity "
                "evaluation computes it (python -m jaxkv.eval fidelity --protocol prefill)"
            )
        return params, reconstruction if needs_recon else None

    def score(state, cache, *, budget_B, **_):
        weights, recon = state
        s = head_scores(weights, cache, names=features, reconstruction=recon)
        if not (recent_fraction or sinks or attended_fraction):
            return s  # the raw log-odds (module docstring)
        # squashed into [0, 1) under the protected tier (ranking unchanged), as the
        # heuristics' scores are: raw scores above TIER would outrank protected tokens
        s = 0.999 * jax.nn.sigmoid(s)
        if recent_fraction:  # (0 protects nothing)
            s = protect_recent(s, cache, jnp.floor(recent_fraction * budget_B).astype(jnp.int32))
        if attended_fraction:
            n_top = jnp.floor(attended_fraction * budget_B).astype(jnp.int32)
            s = protect_attended(s, cache, n_top)
        s = jnp.where(cache.pos < sinks, TIER + 1.0, s)  # sinks above everything
        return jnp.where(cache.valid, s, -jnp.inf)

    spec = (*spec, ("features", features), ("recent_fraction", recent_fraction), ("sinks", sinks))
    # attended_fraction 0 stays out of the spec: the specs (jit caches) of older rankers stay
    if attended_fraction:
        spec = (*spec, ("attended_fraction", attended_fraction))
    return Policy(
        name=name,
        score=score,
        init=init,
        stats=stats_for(features),
        spec=spec,
        **({"protocols": ("prefill",), "window_input": "reconstruction"} if needs_recon else {}),
    )


def save_ranker(
    path: str | Path,
    params: dict,
    meta: dict[str, Any],
    *,
    features: tuple[str, ...] = DEFAULT_FEATURES,
) -> Path:
    """Writes a ranker checkpoint over ``features`` (atomically replacing one at ``path``); a
    residual ranker's base feature is named in the meta (``base``)."""
    hidden = params["mlp"]["Dense_0"]["kernel"].shape[-1]
    meta = {"kind": KIND, "hidden": hidden, "features": list(features), **meta}
    if "base" in params:
        meta["base"] = features[int(jnp.argmax(params["base"]))]
    return checkpoint_lib.save(path, params, meta, meta_name=META)


def retier(src: str | Path, dst: str | Path, **tiers) -> Path:
    """Saves the ranker at ``src`` (a path or a shipped name) as ``dst`` with other protected
    tiers (``PROTECTION``: e.g. ``attended_fraction=0.125``) in its meta; the params, and so
    every unprotected score, are unchanged. ``derived_from`` in the meta names ``src``.

    Raises:
        ValueError: a setting that is not a tier, or a share outside [0, 1].
        jaxkv.checkpoint.CheckpointError: no ranker at ``src``.
    """
    unknown = sorted(set(tiers) - set(PROTECTION))
    if unknown:
        raise ValueError(f"not a ranker tier: {unknown}; valid: {PROTECTION}")
    params, meta = load_ranker_params(checkpoint_path(src))
    meta = {**meta, **tiers, "derived_from": str(src)}
    features = tuple(meta["features"])
    ranker_policy(params, features=features, **{k: meta[k] for k in PROTECTION if k in meta})
    return save_ranker(dst, params, meta, features=features)


def load_ranker_params(path: str | Path) -> tuple[dict, dict]:
    """Reads and verifies a ranker checkpoint: (params, meta); ``meta["features"]`` names the
    columns the params read.

    Raises:
        jaxkv.checkpoint.CheckpointError: no ranker checkpoint there, a damaged one, or one
            trained on other features (one line naming ``path``).
    """
    path = Path(path).absolute()
    try:
        meta = checkpoint_lib.read_meta(path, meta_name=META)
        hidden = meta.get("hidden")
        if meta.get("kind") != KIND or type(hidden) is not int or hidden < 1:
            raise checkpoint_lib.CheckpointError(path, f"{META} does not describe a ranker")
        features = meta.get("features")
        if not isinstance(features, list) or not features or not set(features) <= set(FEATURES):
            raise checkpoint_lib.CheckpointError(
                path, f"trained on features {features}, this jaxkv has {FEATURES}"
            )
        base = meta.get("base")
        if base is not None and base not in features:
            raise checkpoint_lib.CheckpointError(path, f"base {base!r} is not one of {features}")
        abstract = jax.eval_shape(
            lambda: init_params(
                key=jax.random.key(0),
                hidden=hidden,
                n_features=len(features),
                base=None if base is None else features.index(base),
            )
        )
        return checkpoint_lib.restore(path, abstract, meta_name=META)
    except checkpoint_lib.CheckpointError as e:
        raise checkpoint_lib.CheckpointError(e.path, e.reason, what="ranker") from None


def load_ranker(path: str, **settings) -> Policy:
    """``ranker:<path>``: the ranker saved at ``path`` (or shipped under that name), with the
    ``recent_fraction``, ``sinks`` and ``attended_fraction`` it was saved with unless
    ``settings`` give them."""
    params, meta = load_ranker_params(checkpoint_path(path))
    saved = {k: meta[k] for k in PROTECTION if k in meta}
    settings = {**saved, **settings}
    return ranker_policy(
        params,
        features=tuple(meta["features"]),
        name=f"{PREFIX}{path}",
        spec=(("path", str(path)),),
        **settings,
    )
