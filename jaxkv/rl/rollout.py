"""Teacher/student rollouts over one token stream (paper §3.1.3).

The teacher's next-token distributions for the whole stream come from one parallel forward
pass (its cache is never pruned). Each of K student rollouts (vmapped) prefills the prompt,
then at every step scores its cache with the policy, samples the kept set, frees the rest,
and decodes the next stream token on the pruned cache; its reward is -KL(P_t || P̂_t).

A decision is made per *row* of the cache (``Rows``): one row for the paper's shared policy
(one token set for all layers and heads), L·K rows for a per-head ranker (each (layer, KV
head) keeps its own B_t tokens, sampled independently from its own scores), so the action's
log-probability is the sum of the rows' Plackett-Luce log-probabilities.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxkv import kvcache, stats
from jaxkv.config import ModelConfig
from jaxkv.model import decoder
from jaxkv.policies import learned
from jaxkv.policies import ranker as ranker_lib
from jaxkv.rl.objectives import Decisions, decide_rows

FROZEN = ("mean", "scale")
"""A per-head ranker's parameters that RL leaves as they are."""


@dataclasses.dataclass(frozen=True)
class Rows:
    """How a trained policy reads a batch-1 cache: rows of slot features, their scores, and the
    cache slots a row's dropped tokens free."""

    stats: tuple[str, ...]
    """The cache statistics the features read."""
    features: Callable[[kvcache.KVCache], tuple[jax.Array, jax.Array]]
    """cache -> (features [R, C, F], valid [R, C])."""
    scores: Callable[[dict, jax.Array, jax.Array], jax.Array]
    """(params, features [..., C, F], valid [..., C]) -> scores [..., C] (-inf on free slots)."""
    drop_mask: Callable[[kvcache.KVCache, jax.Array], jax.Array]
    """(cache, drop [R, C]) -> a mask broadcasting to the cache's [L, 1, K, C]."""


def _shared_features(cache):
    return stats.features(cache)[0][None], (cache.pos[0, 0, 0] >= 0)[None]


def _head_features(cache):
    L, _, K, C = cache.pos.shape
    feats = ranker_lib.head_features(cache, names=ranker_lib.DEFAULT_FEATURES)[:, 0]
    return feats.reshape(L * K, C, -1), cache.valid[:, 0].reshape(L * K, C)


def _head_scores(params, feats, valid):
    """The ranker's scores, its feature standardization (``mean``, ``scale``: fitted to the
    supervised training's data) held fixed: RL trains the MLP only (``step.make_optimizer``)."""
    fixed = {k: jax.lax.stop_gradient(params[k]) for k in FROZEN}
    return ranker_lib.scores_from_features({**params, **fixed}, feats, valid)


def _head_drop(cache, drop_RC):
    L, _, K, C = cache.pos.shape
    return drop_RC.reshape(L, 1, K, C)


ROWS = {
    "shared": Rows(
        stats=stats.FEATURE_STATS,
        features=_shared_features,
        scores=learned.scores_from_features,
        drop_mask=lambda cache, drop_RC: drop_RC[0][None, None, None, :],
    ),
    "head": Rows(
        stats=ranker_lib.STATS,
        features=_head_features,
        scores=_head_scores,
        drop_mask=_head_drop,
    ),
}
"""``TrainConfig.decisions`` -> its rows."""


def teacher_log_probs(lm_params, tokens_T, *, config: ModelConfig, prompt_len: int):
    """log P_t for the predictions made after feeding tokens prompt_len .. T-1: [T - P, V]."""
    logits = decoder.forward(lm_params, tokens_T[None], config=config)[0, prompt_len:]
    return jax.nn.log_softmax(logits, axis=-1)


def kl_rows(logp_p, logp_q):
    """KL(p || q) per row from log-probabilities."""
    return jnp.sum(jnp.exp(logp_p) * (logp_p - logp_q), axis=-1)


def rows_for(decisions: str, score_scale: float = 1.0) -> Rows:
    """``ROWS[decisions]`` with its scores times ``score_scale`` (the sampling temperature's
    inverse); the rows themselves when the scale is 1, so default runs compute what they
    always have."""
    rows = ROWS[decisions]
    if score_scale == 1.0:
        return rows
    score = rows.scores
    return dataclasses.replace(rows, scores=lambda p, f, v: score_scale * score(p, f, v))


def max_budget(n_tokens: int, *, ratio: float, min_budget: int) -> int:
    """Largest B_t of a stream of ``n_tokens`` (static width of the subset DP)."""
    return min(n_tokens, max(int(ratio * n_tokens), min_budget))


def student_rollout(
    lm_params,
    policy_params,
    tokens_T: jax.Array,
    teacher_logp_SV: jax.Array,
    *,
    key: jax.Array,
    config: ModelConfig,
    prompt_len: int,
    ratio: float,
    min_budget: int,
    estimator: str,
    rows: Rows = ROWS["shared"],
) -> Decisions:
    """One student rollout; fields of the result have a leading step axis S = T - P and a
    row axis R after it (``Rows``)."""
    T = tokens_T.shape[0]
    cache = kvcache.init_cache(config, batch_size=1, capacity=T, stats=rows.stats)
    _, cache = decoder.prefill(lm_params, tokens_T[None, :prompt_len], cache, config=config)

    def step(cache, xs):
        i, token, teacher_logp = xs
        feats, valid = rows.features(cache)
        budget = jnp.maximum(jnp.floor(ratio * cache.length[0]).astype(jnp.int32), min_budget)
        scores = rows.scores(policy_params, feats, valid)
        selected, order = decide_rows(
            scores,
            valid,
            budget,
            key=jax.random.fold_in(key, i),
            estimator=estimator,
            max_budget=max_budget(T, ratio=ratio, min_budget=min_budget),
        )
        active = jnp.sum(valid, axis=-1) > budget
        drop = valid & ~selected & active[:, None]
        cache = kvcache.free_slots(cache, rows.drop_mask(cache, drop))
        logits, cache = decoder.decode_step(lm_params, token[None], cache, config=config)
        reward = -kl_rows(teacher_logp, jax.nn.log_softmax(logits[0]))
        return cache, Decisions(feats, valid, selected, order, budget, active, reward)

    S = T - prompt_len
    xs = (jnp.arange(S), tokens_T[prompt_len:], teacher_logp_SV)
    _, out = jax.lax.scan(step, cache, xs)
    return out


def rollouts(lm_params, policy_params, tokens_T, *, keys_K, **kwargs) -> Decisions:
    """K student rollouts of one stream (vmapped), with the teacher pass shared."""
    teacher = teacher_log_probs(
        lm_params, tokens_T, config=kwargs["config"], prompt_len=kwargs["prompt_len"]
    )
    one = lambda k: student_rollout(lm_params, policy_params, tokens_T, teacher, key=k, **kwargs)
    return jax.vmap(one)(keys_K)
