"""A Python facade over the pure control plane, for a serving stack's KV-pool coordinator.

    coord = Coordinator(KVLearnConfig(), capacity_bytes=64 * GIB)
    if not coord.lookup("img/17", tokens=576, modality="image"):
        ...prefill...
        decision = coord.admit("img/17", tokens=576, modality="image")
        # move the block P → pool iff decision.admitted; drop decision.evicted from the pool
    coord.tick()   # periodically, off the request path

Keys are strings mapped to dense ids (at most ``cfg.max_keys`` distinct keys). Each call is one
jitted function on the state pytree, donated so the block table is updated in place. Tensor
movement stays in the caller's data plane: this object only decides keep vs discard.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kvlearn.core import control
from jaxkv.kvlearn.traces import MAX_TOKENS, MODALITIES

_lookup = jax.jit(control.lookup, static_argnames="cfg", donate_argnums=0)
_admit = jax.jit(control.admit, static_argnames="cfg", donate_argnums=0)
_tick = jax.jit(control.tick, static_argnames="cfg", donate_argnums=0)
_feed = jax.jit(control.feed_labels, donate_argnums=0)


@dataclasses.dataclass(frozen=True)
class Decision:
    """Result of ``Coordinator.admit``."""

    admitted: bool
    evicted: tuple[str, ...]
    n_evicted: int
    p_hat: float
    cars_ms: float
    theta: float


class Coordinator:
    """Stateful wrapper: owns a ``KVLearnState`` and the key ↔ id table."""

    def __init__(
        self,
        cfg: control.KVLearnConfig,
        *,
        capacity_bytes: float,
        seed: int = 0,
        prp_state=None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be ≥ 0, got {capacity_bytes}")
        self.cfg = cfg
        self._clock = clock
        self._t0 = clock()
        self._ids: dict[str, int] = {}
        self._names: list[str] = []
        self._last_lookup: tuple[str, float] | None = None
        self.state = control.init(
            cfg, capacity_bytes=capacity_bytes, key=jax.random.key(seed), prp_state=prp_state
        )

    def _id(self, key: str) -> int:
        k = self._ids.get(key)
        if k is None:
            if len(self._names) >= self.cfg.max_keys:
                raise RuntimeError(f"more than max_keys={self.cfg.max_keys} distinct keys")
            k = self._ids[key] = len(self._names)
            self._names.append(key)
        return k

    def _request(self, key: str, tokens: int, modality, now) -> control.Request:
        if not 0 < tokens <= MAX_TOKENS:
            raise ValueError(f"tokens must be in 1..{MAX_TOKENS:,} (int32), got {tokens}")
        if modality not in MODALITIES and modality not in range(len(MODALITIES)):
            raise ValueError(f"modality must be one of {MODALITIES} (or 0-2), got {modality!r}")
        mod = MODALITIES.index(modality) if isinstance(modality, str) else int(modality)
        t = (self._clock() - self._t0) if now is None else now
        return control.Request(
            key=jnp.int32(self._id(key)),
            tokens=jnp.int32(tokens),
            modality=jnp.int32(mod),
            time=jnp.float32(t),
        )

    def lookup(self, key: str, *, tokens: int, modality="text", now: float | None = None) -> bool:
        """Records the request; True iff the block is in the pool."""
        req = self._request(key, tokens, modality, now)
        self._last_lookup = (key, float(req.time))
        self.state, hit = _lookup(self.state, req, cfg=self.cfg)
        return bool(hit)

    def admit(
        self, key: str, *, tokens: int, modality="text", now: float | None = None
    ) -> Decision:
        """Keep-or-discard for a block just prefilled after a missed ``lookup``.

        Without ``now`` the decision is made at the time of that ``lookup`` (the request's
        arrival), so both calls see the same features.
        """
        if now is None and self._last_lookup is not None and self._last_lookup[0] == key:
            now = self._last_lookup[1]
        req = self._request(key, tokens, modality, now)
        self.state, res = _admit(self.state, req, cfg=self.cfg)
        ev = [self._names[k] for k in np.asarray(res.evicted_keys) if k >= 0]
        return Decision(
            admitted=bool(res.admitted),
            evicted=tuple(ev),
            n_evicted=int(res.n_evicted),
            p_hat=float(res.p_hat),
            cars_ms=float(res.cars_ms),
            theta=float(res.theta),
        )

    def tick(self, now: float | None = None) -> None:
        """Off-path maintenance: labels, re-scoring, ATC, PRP training."""
        t = (self._clock() - self._t0) if now is None else now
        self.state = _tick(self.state, jnp.float32(t), cfg=self.cfg)

    def feed_labels(self, x_BI, y_B) -> None:
        """Adds externally observed (features, label) pairs to the PRP's replay buffer."""
        y = jnp.asarray(y_B, jnp.float32)
        self.state = _feed(self.state, jnp.asarray(x_BI, jnp.float32), y, jnp.ones(y.shape, bool))

    def resident(self) -> list[str]:
        """Keys of the blocks in the pool."""
        keys = np.asarray(self.state.pool.key_Z)
        return [self._names[k] for k in keys[keys >= 0]]

    def stats(self) -> dict:
        c = self.state.counters
        out = {f.name: np.asarray(getattr(c, f.name)).item() for f in dataclasses.fields(c)}
        pool = self.state.pool
        out["used_bytes"] = int(pool.used_kib) * 1024
        out["capacity_bytes"] = int(pool.capacity_kib) * 1024
        out["theta"] = float(self.state.atc.theta)
        out["hit_rate_ema"] = float(self.state.atc.hit_rate)
        return out
