"""``kvzip``: KVzip-style context-reconstruction scoring (Kim et al., 2025, arXiv 2505.23416),
compress-once.

After the prompt (the context) is prefilled, the model reads a request to repeat it and then
the context itself again, teacher-forced, under the full cache. A context token's score, per
(layer, KV head), is the most attention any query of that reconstruction pass gives it: the
tokens the model must look at to reproduce its context are the ones worth keeping, whatever
the question that comes later. The first ``n_sink`` positions are always kept.

As kvpress's ``KVzipPress`` (0.5.5), with these departures:

* the attention is the mean over the KV group's G query heads before the max over queries
  (the ``attn`` statistic of ``jaxkv.generate.full_cache_attention``); KVzip takes the max
  over the group's heads too (tried in session 40: worse here, docs/distillcache.md);
* the repeat request, ``REPEAT_PROMPT`` and then a newline (``REQUESTS``' ``plain``), is
  kvpress's for a tokenizer without a chat template: the prompts here are raw text, not a
  user's turn. With a template kvpress puts the template's assistant header after the prompt
  (``chat``), as jaxkv did before session 40; on raw text that scored worse
  (docs/distillcache.md, session 40);
* the whole prompt is the context, in one chunk (kvpress reconstructs chunks of 2048 tokens
  and, with a chat template, leaves the template's prefix tokens unscored);
* the reconstruction queries attend over the whole cache; kvpress's over the sinks, the chunk
  and the repeat tokens, which is the same set when the context is one chunk;
* the budget is jaxkv's: per row (``head``), per layer (``adaptive``, AdaKV's pool over a
  layer's heads, kvpress's ``layerwise=True``), or shared; kvpress's default pools all layers.

Its state, ``Reconstruction``, is computed from the prompt by the fidelity evaluation
(``jaxkv.evals.fidelity``), the only caller that holds the prompt when it compresses; the
``prefill`` protocol only: tokens generated after the one eviction have no score.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.policies.base import TIER, Policy

NAME = "kvzip"
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."  # kvpress's first-chunk prompt
# What follows the repeat prompt (``jaxkv.evals.fidelity.repeat_ids``): ``plain``, a newline
# (kvpress without a chat template; the default), or ``chat``, the chat template's text between
# a user's message and the assistant's answer (kvpress with one; jaxkv before session 40).
REQUESTS = ("plain", "chat")
DEFAULT_REQUEST = "plain"
N_SINK = 4  # kvpress's default


@struct.dataclass
class Reconstruction:
    """kvzip's state: ``scores[L, B, K, S]``, the most attention any reconstruction query pays
    each prompt position (sinks not marked)."""

    scores: jax.Array

    def at(self, pos_LBKC: jax.Array) -> jax.Array:
        """The score of the prompt position each slot holds; 0 for positions past the
        prompt (and free slots)."""
        S = self.scores.shape[-1]
        idx = jnp.clip(pos_LBKC, 0, S - 1)
        got = jnp.take_along_axis(self.scores, idx, axis=-1)
        return jnp.where((pos_LBKC >= 0) & (pos_LBKC < S), got, 0.0)


def reconstruction(attn_QLBKT: jax.Array, prompt_len: int) -> Reconstruction:
    """kvzip's state from the reconstruction pass's attention rows.

    Args:
        attn_QLBKT: attention of the reconstruction queries (the repeat prompt and the copy of
            the context that follow the prompt) over positions, mean over each KV group
            (``jaxkv.generate.full_cache_attention`` of ``prompt + repeat + prompt + [any]``).
        prompt_len: S, the prompt tokens; positions ``>= S`` are the reconstruction's own.
    """
    return Reconstruction(scores=jnp.max(attn_QLBKT[..., :prompt_len].astype(jnp.float32), axis=0))


def check_request(request: str) -> None:
    """Raises ValueError unless ``request`` is one of ``REQUESTS``."""
    if request not in REQUESTS:
        raise ValueError(f"kvzip_request must be one of {REQUESTS}, got {request!r}")


def kvzip(*, n_sink: int = N_SINK) -> Policy:
    """KVzip's reconstruction scores (the module docstring), the first ``n_sink`` positions
    always kept; the state is ``reconstruction``'s."""

    def init(reconstruction: Reconstruction | None = None) -> Reconstruction:
        if reconstruction is None:
            raise ValueError(
                "the kvzip policy needs the prompt's reconstruction pass; only the fidelity "
                "evaluation computes it (python -m jaxkv.eval fidelity --protocol prefill "
                "--policies kvzip,...)"
            )
        return reconstruction

    def score(state: Reconstruction, cache, **_):
        S = state.scores.shape[-1]
        s = state.at(cache.pos)
        prompt = jnp.where(cache.pos < n_sink, TIER + s, s)
        return jnp.where(cache.pos >= S, 2 * TIER, prompt)  # later: generated after the eviction

    return Policy(
        NAME,
        score=score,
        init=init,
        protocols=("prefill",),
        window_input="reconstruction",
        spec=(("n_sink", n_sink),),
    )
