"""Token-eviction policies behind one interface: ``get_policy(name, **settings)``.

Names: ``full``, ``random``, ``streaming_llm``, ``h2o``, ``snapkv``, ``tova``, ``keydiff``,
``knorm`` and ``learned:<checkpoint>`` (``policy_names()`` lists them).
"""

from jaxkv.policies.base import GRANULARITIES, Policy, get_policy, policy_names

__all__ = ["GRANULARITIES", "Policy", "get_policy", "policy_names"]
