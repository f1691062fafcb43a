"""Token-eviction policies behind one interface, and their one registry.

``get_policy(name, **settings)`` builds a ``Policy`` by name: ``full``, ``random``,
``streaming_llm``, ``h2o``, ``snapkv``, ``tova``, ``keydiff``, ``knorm``, or
``learned:<checkpoint>`` (a folder written by ``python -m jaxkv.train distillcache``, or the
name of a checkpoint shipped in ``jaxkv/checkpoints/``, e.g. ``learned:distillcache_smollm2_cpu``).
"""

from collections.abc import Callable

from jaxkv.policies import heuristics, learned
from jaxkv.policies.base import GRANULARITIES, TIER, Policy

LEARNED_PREFIX = "learned:"

_REGISTRY: dict[str, Callable[..., Policy]] = {
    "full": heuristics.full,
    "random": heuristics.random,
    "streaming_llm": heuristics.streaming_llm,
    "h2o": heuristics.h2o,
    "snapkv": heuristics.snapkv,
    "tova": heuristics.tova,
    "keydiff": heuristics.keydiff,
    "knorm": heuristics.knorm,
}


def policy_names() -> list[str]:
    """Every name ``get_policy`` accepts (``learned:<checkpoint>`` stands for a family)."""
    return sorted(_REGISTRY) + [LEARNED_PREFIX + "<checkpoint>"]


def get_policy(name: str, **settings) -> Policy:
    """A policy by registry name (``"h2o"``, ``"snapkv"``, ..., ``"learned:<checkpoint>"``).

    Raises:
        ValueError: unknown name, listing the valid ones; a ``learned:`` checkpoint that is
            missing or damaged (one line naming it).
    """
    if name.startswith(LEARNED_PREFIX):
        return learned.load_learned(name.removeprefix(LEARNED_PREFIX), **settings)
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; choose one of {policy_names()}")
    return _REGISTRY[name](**settings)


__all__ = ["GRANULARITIES", "TIER", "Policy", "get_policy", "policy_names"]
