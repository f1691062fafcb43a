"""KVLearn cost model: block footprint, recompute R, transfer T, storage U and CARS terms.

All formulas follow the KVLearn README, with one fix (see ``recompute_ms``):

    |b|  = 2 · ℓ · h_kv · d_h · L · δ          bytes of one block of L tokens
    R(L) = max(α_bw · L, α_flop · L²)           ms, continuous envelope of the two regimes
    T(b) = |b| / β                              ms to move the block over the fabric
    U(b) = γ · |b| · Δt,  γ = R̄ · λ / M_S      ms, opportunity cost of holding |b| bytes

Every function is written with ``jnp``/``np``-agnostic arithmetic so it works on Python floats,
numpy arrays (host-side metrics, float64) and traced JAX arrays alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

MIB = 1024**2
GIB = 1024**3
PRESETS = ("llama3-8b-a100", "mistral-7b-a100", "smollm2-135m-cpu")
"""Names ``CostModel.preset`` knows."""


@dataclasses.dataclass(frozen=True)
class KVShape:
    """What fixes the KV footprint of one token: layers ℓ, KV heads, head dim, bytes/element δ."""

    name: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def __post_init__(self):
        bad = [
            f
            for f in ("n_layers", "n_kv_heads", "head_dim", "dtype_bytes")
            if getattr(self, f) <= 0
        ]
        if bad:
            raise ValueError(f"KVShape {self.name!r}: fields must be positive: {bad}")

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) · ℓ · h_kv · d_h · δ."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_model_config(cls, model: Any, *, dtype_bytes: int | None = None) -> KVShape:
        """Footprint of a ``jaxkv.config.ModelConfig`` (δ from its dtype unless given)."""
        if dtype_bytes is None:
            dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[model.dtype]
        return cls(model.name, model.n_layers, model.n_kv_heads, model.head_dim, dtype_bytes)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Constants of the serving system; hashable, so it can be a static jit argument.

    Attributes:
        shape: KV footprint per token.
        alpha_bw_ms: ms per prefill token in the bandwidth-bound regime.
        alpha_flop_ms: ms per token² in the compute-bound regime.
        bandwidth_Bps: fabric bandwidth β in bytes/s (HDR 200 Gb/s = 25e9).
    """

    shape: KVShape
    alpha_bw_ms: float = 0.026
    alpha_flop_ms: float = 8e-6
    bandwidth_Bps: float = 25e9

    def __post_init__(self):
        if self.alpha_bw_ms <= 0 or self.alpha_flop_ms <= 0:
            raise ValueError("CostModel: alpha_bw_ms and alpha_flop_ms must be positive")
        if self.bandwidth_Bps <= 0:
            raise ValueError("CostModel: bandwidth_Bps must be positive")

    def replace(self, **changes) -> CostModel:
        return dataclasses.replace(self, **changes)

    # ---- presets ----------------------------------------------------------------------------
    @classmethod
    def llama3_8b_a100(cls) -> CostModel:
        """The README's calibration: A100 + LLaMA-3-8B (bf16), InfiniBand HDR 200 Gb/s."""
        return cls(KVShape("llama-3-8b", 32, 8, 128, 2))

    @classmethod
    def mistral_7b_a100(cls) -> CostModel:
        """Mistral-7B (32 layers, 8 KV heads, d_h 128, bf16): same footprint and size class as
        LLaMA-3-8B, so the A100 calibration is reused (an assumption, not a measurement)."""
        return cls(KVShape("mistral-7b", 32, 8, 128, 2))

    @classmethod
    def smollm2_135m_cpu(cls) -> CostModel:
        """SmolLM2-135M in float32 on a 2-core CPU (prefill ≈1.3 s / 512 tokens ≈ 2.5 ms/token,
        measured with PyTorch on the development machine); fabric left at 25 GB/s."""
        return cls(KVShape("smollm2-135m", 30, 3, 64, 4), alpha_bw_ms=2.5, alpha_flop_ms=1e-3)

    @classmethod
    def preset(cls, name: str) -> CostModel:
        build = (cls.llama3_8b_a100, cls.mistral_7b_a100, cls.smollm2_135m_cpu)
        presets = dict(zip(PRESETS, build, strict=True))
        if name not in presets:
            raise ValueError(f"unknown cost preset {name!r}; choose from {sorted(presets)}")
        return presets[name]()

    # ---- formulas ---------------------------------------------------------------------------
    @property
    def crossover_tokens(self) -> float:
        """L× where the two regimes meet: α_bw·L = α_flop·L²."""
        return self.alpha_bw_ms / self.alpha_flop_ms

    def footprint_bytes(self, tokens):
        """|b| = 2·ℓ·h_kv·d_h·L·δ bytes."""
        return tokens * self.shape.bytes_per_token

    def recompute_ms(self, tokens):
        """R(L) = max(α_bw·L, α_flop·L²): continuous and non-decreasing in L.

        The README's piecewise form switches regime at a fixed L× = 512 and so jumps there
        (13.3 ms → 2.1 ms with the A100 constants), making a longer prefix cheaper. The
        envelope switches where the regimes actually cross, at ``crossover_tokens``.
        """
        return _maximum(self.alpha_bw_ms * tokens, self.alpha_flop_ms * tokens * tokens)

    def transfer_ms(self, nbytes):
        """T(b) = |b| / β, in ms."""
        return nbytes / self.bandwidth_Bps * 1e3

    def net_benefit_ms(self, tokens):
        """R − T for a block of ``tokens`` tokens: what one reuse saves."""
        return self.recompute_ms(tokens) - self.transfer_ms(self.footprint_bytes(tokens))

    @property
    def benefit_per_byte_ms(self) -> float:
        """κ = (R − T)/|b| in the bandwidth-bound regime (ms/byte), the unit of value density."""
        return (self.alpha_bw_ms - self.shape.bytes_per_token / self.bandwidth_Bps * 1e3) / (
            self.shape.bytes_per_token
        )


def gamma(*, r_bar_ms, arrival_rate, capacity_bytes):
    """γ = R̄·λ / M_S: ms of recompute per byte-second the whole pool could save at most."""
    return r_bar_ms * arrival_rate / capacity_bytes


def storage_cost_ms(*, nbytes, dt_s, r_bar_ms, arrival_rate, capacity_bytes):
    """U(b, Δt) = γ·|b|·Δt."""
    g = gamma(r_bar_ms=r_bar_ms, arrival_rate=arrival_rate, capacity_bytes=capacity_bytes)
    return g * nbytes * dt_s


def cars(*, p_hat, net_benefit_ms, storage_ms):
    """CARS = P̂·(R − T) − U, in ms."""
    return p_hat * net_benefit_ms - storage_ms


def fit_calibration(tokens, measured_ms) -> tuple[float, float]:
    """Fits (α_bw, α_flop) of the envelope to measured prefill times (least squares per regime).

    Each point is assigned to the regime that explains it better; the two one-parameter fits
    are then redone on their points (a few alternations suffice for a max of two monomials).
    """
    n = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(measured_ms, dtype=np.float64)
    if n.shape != y.shape or n.size < 2 or np.any(n <= 0) or np.any(y <= 0):
        raise ValueError("fit_calibration: need ≥2 positive (tokens, ms) pairs of equal length")
    a_bw = float(np.sum(n * y) / np.sum(n * n))
    a_flop = float(np.sum(n**2 * y) / np.sum(n**4))
    for _ in range(20):
        bw = a_bw * n >= a_flop * n * n
        if bw.any():
            a_bw = float(np.sum(n[bw] * y[bw]) / np.sum(n[bw] ** 2))
        if (~bw).any():
            a_flop = float(np.sum(n[~bw] ** 2 * y[~bw]) / np.sum(n[~bw] ** 4))
    return a_bw, a_flop


def _maximum(a, b):
    if isinstance(a, jax.Array) or isinstance(b, jax.Array):
        return jnp.maximum(a, b)
    return np.maximum(a, b)
