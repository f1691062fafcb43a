"""``oracle``: keeps the tokens that the queries still to come attend to most under the full
cache. It reads the future, so it is the upper bound a table reports beside the policies, never
a competitor; only a teacher-forced evaluation, whose token stream is fixed, can compute it
(``jaxkv.generate.full_cache_attention``: ``python -m jaxkv.eval fidelity``).

Score of a cached token at position i, per layer and KV head, when the sequence has processed
N tokens: ``sum over the stream's queries q >= N of a_q(i)``, with ``a_q`` query q's attention
in the full-cache run (mean over the KV group's G query heads, as the ``attn`` statistic). A
greedy bound, not a proven optimum: it ranks by the attention the full cache would give, not by
what the pruned cache's own (shifted) attention would need.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.policies.base import Policy

NAME = "oracle"


@struct.dataclass
class FutureAttention:
    """The oracle's state: full-cache attention still to come, by query.

    Attributes:
        suffix: [Q + 1, L, B, K, S] float32; ``suffix[j, ..., i]`` sums the attention that the
            stream's queries ``first_query + j ..`` give position i (row Q is zero).
        first_query: position of the stream's first future query (static).
    """

    suffix: jax.Array
    first_query: int = struct.field(pytree_node=False, default=0)


def future_attention(attn_QLBKS: jax.Array, *, first_query: int) -> FutureAttention:
    """The oracle's state from a full-cache run's attention rows.

    Args:
        attn_QLBKS: attention of the stream's queries ``first_query, first_query + 1, ...``
            over positions 0..S-1 (``jaxkv.generate.full_cache_attention``).
        first_query: the position of the first of those queries.
    """
    a = attn_QLBKS.astype(jnp.float32)
    suffix = jnp.cumsum(a[::-1], axis=0)[::-1]
    suffix = jnp.concatenate([suffix, jnp.zeros_like(a[:1])], axis=0)
    return FutureAttention(suffix=suffix, first_query=first_query)


def oracle() -> Policy:
    """The future-attention oracle (see the module docstring)."""

    def init(future: FutureAttention | None = None) -> FutureAttention:
        if future is None:
            raise ValueError(
                "the oracle policy needs the full-cache attention of the future tokens; only "
                "the fidelity evaluation (teacher forcing, python -m jaxkv.eval fidelity) "
                "computes it"
            )
        return future

    def score(state: FutureAttention, cache, **_):
        Q = state.suffix.shape[0] - 1
        j_B = jnp.clip(cache.length - state.first_query, 0, Q)
        # each sequence reads its own row j_B: [Q + 1, L, B, K, S] -> [L, B, K, S]
        ahead_LBKS = jax.vmap(lambda s, j: s[j], in_axes=(2, 0), out_axes=1)(state.suffix, j_B)
        idx = jnp.clip(cache.pos, 0, ahead_LBKS.shape[-1] - 1)
        return jnp.take_along_axis(ahead_LBKS, idx, axis=-1)

    return Policy(NAME, score=score, init=init, window_input="future")
