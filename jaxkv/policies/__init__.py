"""Token-eviction policies behind one interface, and their one registry.

``get_policy(name, **settings)`` builds a ``Policy`` by name: ``full``, ``random``,
``streaming_llm``, ``h2o``, ``snapkv``, ``tova``, ``keydiff``, ``knorm``,
``expected_attention`` (Expected Attention: ``jaxkv.policies.expected``), ``oracle`` (the
future-attention upper bound, fidelity only: ``jaxkv.policies.oracle``), ``kvzip`` (KVzip's
context-reconstruction scores, fidelity's prefill protocol only: ``jaxkv.policies.kvzip``),
``critical:<policy>`` (CriticalKV over any other policy: ``jaxkv.policies.critical``),
``ranker:<checkpoint>`` (the supervised per-head ranker: ``jaxkv.policies.ranker``),
``rerank:<policy>`` (kvzip's allocation across rows, the policy's order within each:
``jaxkv.policies.rerank``), ``rerank@<w>:<policy>`` (the same with a blend of the policy's
and kvzip's order, weight w on the policy's), ``blend@<w>:<a>+<b>`` (a's allocation, each row
ordered by a's and b's ranks, weight w on b's: ``jaxkv.policies.rerank``), ``tier@<q>:<a>+<b>``
(a's allocation and order, b's top fraction q of each row first), or
``learned:<checkpoint>`` (a folder written by ``python -m jaxkv.train distillcache``, or the
name of a checkpoint shipped in ``jaxkv/checkpoints/``, e.g. ``learned:distillcache_smollm2_cpu``).

No policy reads the model's weights: ``critical:`` and a ranker on ``log_wo_vnorm`` read the
projected value norms from the cache (``wo_vnorm``), which the decoder writes with each token.
"""

from collections.abc import Callable

from jaxkv.policies import (
    critical,
    expected,
    heuristics,
    kvzip,
    learned,
    oracle,
    ranker,
    rerank,
)
from jaxkv.policies.base import GRANULARITIES, TIER, Policy

LEARNED_PREFIX = "learned:"
CRITICAL_PREFIX = critical.PREFIX
RANKER_PREFIX = ranker.PREFIX
RERANK_PREFIX = rerank.PREFIX
RERANK_PREFIXES = (rerank.PREFIX, rerank.WEIGHTED)
BLEND_PREFIX = rerank.MIX

_REGISTRY: dict[str, Callable[..., Policy]] = {
    "full": heuristics.full,
    "random": heuristics.random,
    "streaming_llm": heuristics.streaming_llm,
    "h2o": heuristics.h2o,
    "snapkv": heuristics.snapkv,
    "tova": heuristics.tova,
    "keydiff": heuristics.keydiff,
    "knorm": heuristics.knorm,
    expected.NAME: expected.expected_attention,
    oracle.NAME: oracle.oracle,
    kvzip.NAME: kvzip.kvzip,
}


def policy_names() -> list[str]:
    """Every name ``get_policy`` accepts (``learned:<checkpoint>`` and ``critical:<policy>``
    stand for families)."""
    return sorted(_REGISTRY) + [
        CRITICAL_PREFIX + "<policy>",
        LEARNED_PREFIX + "<checkpoint>",
        RANKER_PREFIX + "<checkpoint>",
        RERANK_PREFIX + "<policy>",
        rerank.WEIGHTED + "<w>:<policy>",
        BLEND_PREFIX + "<w>:<a>+<b>",
        rerank.TIER_MIX + "<q>:<a>+<b>",
    ]


def get_policy(name: str, **settings) -> Policy:
    """A policy by registry name (``"h2o"``, ``"snapkv"``, ..., ``"critical:h2o"``,
    ``"learned:<checkpoint>"``). ``critical:`` settings (``epsilon``, ``first_stage_ratio``)
    go to the wrapper; its base policy gets its defaults.

    Raises:
        ValueError: unknown name, listing the valid ones; a ``critical:`` over a policy that
            does not evict or over the oracle; a ``learned:`` checkpoint that is missing or
            damaged (one line naming it).
    """
    if name.startswith(CRITICAL_PREFIX):
        inner = name.removeprefix(CRITICAL_PREFIX)
        if inner in (oracle.NAME, kvzip.NAME) or inner.startswith(CRITICAL_PREFIX):
            raise ValueError(f"{name!r}: critical: wraps a scoring policy, not {inner!r}")
        return critical.critical(get_policy(inner), **settings)
    if name.startswith(LEARNED_PREFIX):
        return learned.load_learned(name.removeprefix(LEARNED_PREFIX), **settings)
    if name.startswith(RANKER_PREFIX):
        return ranker.load_ranker(name.removeprefix(RANKER_PREFIX), **settings)
    if name.startswith(rerank.MIXES):
        prefix, weight, a, b = rerank.parse_mix(name)
        return rerank.mix(get_policy(a, **settings), get_policy(b), weight=weight, prefix=prefix)
    if name.startswith(RERANK_PREFIXES):
        weight, inner = rerank.parse(name)
        return rerank.rerank(get_policy(inner, **settings), weight=weight)
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; choose one of {policy_names()}")
    return _REGISTRY[name](**settings)


def needs_window(policy: Policy) -> bool:
    """True for the policies whose state only the fidelity evaluation computes, from each
    window it runs (``Policy.window_input``): the oracle reads the window's future; kvzip, and
    a ranker reading kvzip's scores, a reconstruction of its prompt."""
    return policy.window_input is not None


__all__ = [
    "BLEND_PREFIX",
    "CRITICAL_PREFIX",
    "GRANULARITIES",
    "RANKER_PREFIX",
    "RERANK_PREFIX",
    "TIER",
    "Policy",
    "get_policy",
    "needs_window",
    "policy_names",
]
