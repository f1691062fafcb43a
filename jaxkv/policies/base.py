"""The policy interface: an ``(init, score)`` pair (the registry is ``jaxkv.policies``).

``score(state, cache, *, budget_B, key)`` returns a keep-score per slot, either
``[L, B, K, C]`` (per layer and KV head) or ``[B, C]`` (one per token); higher means keep.
Policies only score: budgets, top-B selection and freeing slots live in ``jaxkv.eviction``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from jaxkv.kvcache import stat_names

GRANULARITIES = ("shared", "layer", "head")
PROTOCOLS = ("decode", "prefill")  # when eviction runs (``jaxkv.eviction``)
WINDOW_INPUTS = (None, "future", "reconstruction")  # see Policy.window_input
TIER = 2.0  # added to the [0, 1) scores of protected slots (sinks, recent windows)


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """A KV eviction policy.

    Attributes:
        name: registry name.
        score: ``(state, cache, *, budget_B, key) -> scores``.
        init: ``() -> state`` (a pytree, e.g. learned weights; None for heuristics).
        granularities: selection granularities it supports (see ``GRANULARITIES``).
        protocols: the eviction protocols it supports (see ``PROTOCOLS``).
        window: time constant of the cache's ``recent`` statistics it reads.
        stats: the cache statistics it reads (``jaxkv.kvcache.STAT_NAMES`` and
            ``WEIGHT_STATS``, and ``jaxkv.kvcache.QUERIES`` for the query moments); the decoder
            computes only these, so a policy that reads none pays nothing for them.
        evicts: False for ``full`` (the engine then keeps everything).
        window_input: what the policy reads of the window it runs, that only a teacher-forced
            evaluation computes (``jaxkv.evals.fidelity``): ``"future"``, the full-cache
            attention of the queries to come (the oracle), or ``"reconstruction"``, kvzip's
            reconstruction pass over the prompt; ``init`` then takes it by that name. None
            for a policy that reads only the cache.
        spec: hashable identity (name and settings): equal specs are the same policy, so
            jit caches compiled code across equal policies.
    """

    name: str
    score: Callable[..., Any]
    init: Callable[[], Any] = lambda: None
    granularities: tuple[str, ...] = GRANULARITIES
    protocols: tuple[str, ...] = PROTOCOLS
    window: int = 64
    stats: tuple[str, ...] = ()
    evicts: bool = True
    window_input: str | None = None
    spec: tuple = ()

    def __post_init__(self):
        stat_names(self.stats)  # raises on unknown names
        if self.window_input not in WINDOW_INPUTS:
            raise ValueError(
                f"window_input must be one of {WINDOW_INPUTS}, got {self.window_input!r}"
            )

    def _identity(self):
        return self.name, self.spec, self.stats

    def __hash__(self):
        return hash(self._identity())

    def __eq__(self, other):
        return isinstance(other, Policy) and self._identity() == other._identity()

    def __repr__(self):
        return f"Policy({self.name}{dict(self.spec) if self.spec else ''})"


def per_row(scores, cache):
    """A policy's scores as [L, B, K, C]: one score per token ([B, C]) is repeated in every
    (layer, KV head) row of the cache; per-row scores come back as they are."""
    if scores.ndim == 2:  # one score per token
        scores = scores[None, :, None, :]
    return jnp.broadcast_to(scores, cache.pos.shape)
