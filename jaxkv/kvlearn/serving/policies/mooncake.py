"""``mooncake``: the Mooncake-style prefix cache, LRU over leaves, admit every computed block."""

from __future__ import annotations

from jaxkv.kvlearn.serving.policies.base import BlockPolicy


class Mooncake(BlockPolicy):
    """The base policy's defaults: a prefix cache (leaf eviction) in LRU order."""

    name = "mooncake"
