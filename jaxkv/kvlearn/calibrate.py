"""Calibration of the cost model from jaxkv's own decoder on this machine.

``measure_prefill`` times ``jaxkv.model.decoder.prefill`` (jitted, batch 1, into an empty cache of
exactly T slots) over a range of prompt lengths: one warm-up call per length (compilation), then
the median of ``repeats`` timed calls. Parameters are random (``init_params``): prefill time
depends only on shapes, so the embedded model's preset gives the same timings as its real
weights without loading the GGUF. ``calibrate`` fits the envelope R(L) = max(α_bw·L, α_flop·L²)
with ``cost.fit_calibration`` and reports the crossover α_bw/α_flop.

``python -m jaxkv.eval kvlearn calibrate [--model smollm2-135m] [--lengths 128,256,...]
[--json OUT] [--plot PNG]`` runs it; both simulators then take ``--calibration OUT`` instead of a
preset.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import kvcache
from jaxkv.kvlearn.cost import CostModel, KVShape, fit_calibration
from jaxkv.model import decoder
from jaxkv.model.params import init_params


def measure_prefill(config, lengths, *, repeats: int = 3, seed: int = 0) -> list[float]:
    """Median wall time (ms) of one jitted prefill per prompt length (compile excluded)."""
    params = init_params(config, key=jax.random.key(seed))
    fn = jax.jit(lambda p, t, c: decoder.prefill(p, t, c, config=config)[0])
    out = []
    for n in lengths:
        tokens = jnp.asarray(np.random.default_rng(n).integers(0, config.vocab_size, (1, n)))
        cache = kvcache.init_cache(config, batch_size=1, capacity=int(n))
        fn(params, tokens, cache).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(params, tokens, cache).block_until_ready()
            times.append((time.perf_counter() - t0) * 1e3)
        out.append(float(np.median(times)))
    return out


def calibrate(config, lengths, *, repeats: int = 3, bandwidth_Bps: float = 25e9) -> dict:
    """Measured points, the fitted (α_bw, α_flop), the crossover and the KV shape, as a dict
    that ``cost_model_from`` turns into a ``CostModel``."""
    ms = measure_prefill(config, lengths, repeats=repeats)
    a_bw, a_flop = fit_calibration(lengths, ms)
    shape = KVShape.from_model_config(config)
    fit = np.maximum(a_bw * np.asarray(lengths, float), a_flop * np.asarray(lengths, float) ** 2)
    return {
        "model": config.name,
        "kv_shape": {
            "n_layers": shape.n_layers,
            "n_kv_heads": shape.n_kv_heads,
            "head_dim": shape.head_dim,
            "dtype_bytes": shape.dtype_bytes,
        },
        "lengths": [int(x) for x in lengths],
        "prefill_ms": ms,
        "fit_ms": [float(x) for x in fit],
        "alpha_bw_ms": a_bw,
        "alpha_flop_ms": a_flop,
        "crossover_tokens": a_bw / a_flop,
        "bandwidth_Bps": bandwidth_Bps,
        "repeats": repeats,
    }


def cost_model_from(cal: dict | str | Path) -> CostModel:
    """A ``CostModel`` from a ``calibrate`` result (dict or JSON path)."""
    if not isinstance(cal, dict):
        cal = json.loads(Path(cal).read_text())
    try:
        shape = KVShape(cal["model"], **cal["kv_shape"])
        return CostModel(
            shape,
            alpha_bw_ms=float(cal["alpha_bw_ms"]),
            alpha_flop_ms=float(cal["alpha_flop_ms"]),
            bandwidth_Bps=float(cal.get("bandwidth_Bps", 25e9)),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"not a calibration result: missing or bad {e}") from None


def plot(cal: dict, path) -> None:
    """Measured points, the fitted envelope and the crossover, as a PNG at ``path``."""
    import matplotlib  # lazy: a heavy import only plots need

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = np.asarray(cal["lengths"], float)
    grid = np.linspace(lengths.min(), lengths.max(), 200)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    ax.plot(lengths, cal["prefill_ms"], "o", label="measured (median)")
    env = np.maximum(cal["alpha_bw_ms"] * grid, cal["alpha_flop_ms"] * grid**2)
    ax.plot(grid, env, "-", label="fit max(α_bw·L, α_flop·L²)")
    ax.axvline(cal["crossover_tokens"], color="gray", ls=":", label="crossover")
    ax.set_xlabel("prompt tokens L")
    ax.set_ylabel("prefill (ms)")
    ax.set_title(f"{cal['model']} prefill on this machine")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
