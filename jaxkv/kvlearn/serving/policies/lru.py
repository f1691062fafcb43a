"""``lru``: LRU-Pool, blocks as independent keys: LRU over all blocks, admit every computed block.

Eviction may strand a block's resident descendants (they stop being hits). The Zipf simulator's
``lru`` is the same rule on whole prefixes; ``mooncake`` is LRU over the leaves of the prefix
tree.
"""

from __future__ import annotations

from jaxkv.kvlearn.serving.policies.base import BlockPolicy


class LRUPool(BlockPolicy):
    """LRU order (the base priorities) over every resident block."""

    name = "lru"
    leaf_only = False
