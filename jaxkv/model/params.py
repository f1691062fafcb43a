"""The parameter pytree: a plain nested dict of arrays, layer weights stacked on axis 0.

Layout (axis letters from ``jaxkv.config``)::

    embed       [V, D]
    layers/
      attn_norm [L, D]
      wq        [L, D, N, H]
      wk        [L, D, K, H]
      wv        [L, D, K, H]
      wo        [L, N, H, D]
      mlp_norm  [L, D]
      w_gate    [L, D, F]
      w_up      [L, D, F]
      w_down    [L, F, D]
    final_norm  [D]
    lm_head     [D, V]     (absent when embeddings are tied)

Query heads are ordered so that head ``n = k * G + g`` uses KV head ``k`` (HF order).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.config import ModelConfig

# Logical axis names of every parameter leaf; jaxkv.sharding maps them to mesh axes.
PARAM_AXES = {
    "embed": ("vocab", "embed"),
    "layers": {
        "attn_norm": ("layers", "embed"),
        "wq": ("layers", "embed", "q_heads", "head_dim"),
        "wk": ("layers", "embed", "kv_heads", "head_dim"),
        "wv": ("layers", "embed", "kv_heads", "head_dim"),
        "wo": ("layers", "q_heads", "head_dim", "embed"),
        "mlp_norm": ("layers", "embed"),
        "w_gate": ("layers", "embed", "mlp"),
        "w_up": ("layers", "embed", "mlp"),
        "w_down": ("layers", "mlp", "embed"),
    },
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}


def param_shapes(config: ModelConfig) -> dict:
    """Shapes of every parameter leaf for ``config`` (the canonical layout)."""
    c = config
    L, D, N, K, H, F, V = (
        c.n_layers,
        c.d_model,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.d_ff,
        c.vocab_size,
    )
    shapes = {
        "embed": (V, D),
        "layers": {
            "attn_norm": (L, D),
            "wq": (L, D, N, H),
            "wk": (L, D, K, H),
            "wv": (L, D, K, H),
            "wo": (L, N, H, D),
            "mlp_norm": (L, D),
            "w_gate": (L, D, F),
            "w_up": (L, D, F),
            "w_down": (L, F, D),
        },
        "final_norm": (D,),
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def param_axes(config: ModelConfig) -> dict:
    """Logical axis names, with the same tree structure as the params of ``config``."""
    axes = dict(PARAM_AXES)
    if config.tie_embeddings:
        axes.pop("lm_head")
    return axes


def init_params(config: ModelConfig, *, key: jax.Array, scale: float = 0.02) -> dict:
    """Random parameters (normal(0, scale) weights, unit norms) in ``config.dtype``."""
    names = dict(_flatten(param_shapes(config)))
    keys = jax.random.split(key, len(names))
    flat = {}
    for (name, shape), k in zip(names.items(), keys, strict=True):
        arr = jnp.ones(shape) if name.endswith("norm") else scale * jax.random.normal(k, shape)
        flat[name] = arr.astype(config.jnp_dtype)
    return _unflatten(flat)


def count_params(params) -> int:
    """Total number of scalars in a (possibly abstract) params tree."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(params))


def validate_params(params: dict, config: ModelConfig, *, source: str = "params") -> None:
    """Raises ValueError naming every missing, extra or mis-shaped tensor."""
    want = param_shapes(config)
    flat_want = dict(_flatten(want))
    flat_have = dict(_flatten(jax.tree.map(lambda x: tuple(x.shape), params)))
    problems = [f"missing {k} (want {v})" for k, v in flat_want.items() if k not in flat_have]
    problems += [f"unexpected {k}" for k in flat_have if k not in flat_want]
    problems += [
        f"{k}: shape {flat_have[k]} != expected {v}"
        for k, v in flat_want.items()
        if k in flat_have and flat_have[k] != v
    ]
    if problems:
        raise ValueError(f"{source} does not match config {config.name!r}: " + "; ".join(problems))


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}/")
        else:
            yield f"{prefix}{k}", v


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree
