"""``no_cache``: recompute every prefix (the Mooncake-style policy with an empty pool)."""

from __future__ import annotations

from jaxkv.kvlearn.serving.policies.base import BlockPolicy


class NoCache(BlockPolicy):
    """Runs with zero pool blocks, whatever the deployment's pool size."""

    name = "no_cache"
    uses_pool = False
