"""Logical axis names → mesh axes, in one table.

Tensor parallelism shards attention heads, the MLP hidden dim and the vocabulary over the
``model`` mesh axis; data parallelism shards the batch over ``data``. A dimension that does
not divide evenly by its mesh axis is replicated instead (e.g. SmolLM2's 3 KV heads on 4
devices), so every preset runs on every mesh.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxkv.config import ModelConfig
from jaxkv.model.params import param_axes

RULES: dict[str, str | None] = {
    "batch": "data",
    "layers": None,
    "vocab": "model",
    "embed": None,
    "q_heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    "slots": None,
}

CACHE_AXES = {
    "k": ("layers", "batch", "kv_heads", "slots", "head_dim"),
    "v": ("layers", "batch", "kv_heads", "slots", "head_dim"),
    "pos": ("layers", "batch", "kv_heads", "slots"),
    "stats": ("layers", "batch", "kv_heads", "slots"),
    "length": ("batch",),
    "overflow": (),
}
QUERY_STAT_AXES = {  # KVCache.query_stats (jaxkv.kvcache.init_query_stats)
    "weight": ("batch",),
    "q_sum": ("layers", "batch", "kv_heads", None, None),
    "q_outer": ("layers", "batch", "kv_heads", None, None, None),
}


def make_mesh(data: int = 1, model: int = 1) -> Mesh:
    """A ``(data, model)`` mesh over the first ``data * model`` devices (default: one)."""
    n = data * model
    if n > jax.device_count():
        raise ValueError(f"mesh {data}x{model} needs {n} devices, only {jax.device_count()} exist")
    devices = np.asarray(jax.devices()[:n]).reshape(data, model)
    return Mesh(devices, ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def spec(logical: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for one array: the rules table, replicating uneven dimensions (and those
    whose logical axis is None)."""
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {logical} do not match shape {shape}")
    out = []
    for name, dim in zip(logical, shape, strict=True):
        if name is None:
            out.append(None)
            continue
        if name not in RULES:
            raise KeyError(f"no sharding rule for logical axis {name!r}")
        axis = RULES[name]
        out.append(axis if axis is not None and dim % mesh.shape[axis] == 0 else None)
    return PartitionSpec(*out)


def param_shardings(params: dict, config: ModelConfig, mesh: Mesh):
    """NamedShardings for a params tree (concrete or abstract)."""
    axes = param_axes(config)
    return jax.tree.map(
        lambda ax, x: NamedSharding(mesh, spec(ax, x.shape, mesh)),
        axes,
        params,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def cache_shardings(cache, mesh: Mesh):
    """NamedShardings for a ``KVCache`` (stats share the ``pos`` layout)."""

    def one(field, x):
        return NamedSharding(mesh, spec(CACHE_AXES[field], x.shape, mesh))

    return cache.replace(
        k=one("k", cache.k),
        v=one("v", cache.v),
        pos=one("pos", cache.pos),
        stats={n: one("stats", a) for n, a in cache.stats.items()},
        k_scale=None if cache.k_scale is None else one("pos", cache.k_scale),
        v_scale=None if cache.v_scale is None else one("pos", cache.v_scale),
        query_stats={
            n: NamedSharding(mesh, spec(QUERY_STAT_AXES[n], a.shape, mesh))
            for n, a in cache.query_stats.items()
        },
        length=one("length", cache.length),
        overflow=one("overflow", cache.overflow),
    )


def shard_params(params: dict, config: ModelConfig, mesh: Mesh) -> dict:
    """Places params on the mesh according to the rules table."""
    return jax.device_put(params, param_shardings(params, config, mesh))
