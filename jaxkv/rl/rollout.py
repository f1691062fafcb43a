"""Teacher/student rollouts over one token stream (paper §3.1.3).

The teacher's next-token distributions for the whole stream come from one parallel forward
pass (its cache is never pruned). Each of K student rollouts (vmapped) prefills the prompt,
then at every step scores its cache with the policy, samples the kept set, frees the rest,
and decodes the next stream token on the pruned cache; its reward is -KL(P_t || P̂_t).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv import kvcache, stats
from jaxkv.config import ModelConfig
from jaxkv.model import decoder
from jaxkv.policies.learned import scores_from_features
from jaxkv.rl.objectives import Decisions, decide


def teacher_log_probs(lm_params, tokens_T, *, config: ModelConfig, prompt_len: int):
    """log P_t for the predictions made after feeding tokens prompt_len .. T-1: [T - P, V]."""
    logits = decoder.forward(lm_params, tokens_T[None], config=config)[0, prompt_len:]
    return jax.nn.log_softmax(logits, axis=-1)


def kl_rows(logp_p, logp_q):
    """KL(p || q) per row from log-probabilities."""
    return jnp.sum(jnp.exp(logp_p) * (logp_p - logp_q), axis=-1)


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
) -> Decisions:
    """One student rollout; fields of the result have a leading step axis S = T - P."""
    T = tokens_T.shape[0]
    cache = kvcache.init_cache(config, batch_size=1, capacity=T, stats=stats.FEATURE_STATS)
    _, cache = decoder.prefill(lm_params, tokens_T[None, :prompt_len], cache, config=config)

    def step(cache, xs):
        i, token, teacher_logp = xs
        feats = stats.features(cache)[0]
        valid = cache.pos[0, 0, 0] >= 0
        budget = jnp.maximum(jnp.floor(ratio * cache.length[0]).astype(jnp.int32), min_budget)
        scores = scores_from_features(policy_params, feats, valid)
        selected, order = decide(
            scores,
            valid,
            budget,
            key=jax.random.fold_in(key, i),
            estimator=estimator,
            max_budget=max_budget(T, ratio=ratio, min_budget=min_budget),
        )
        active = jnp.sum(valid) > budget
        drop = valid & ~selected & active
        cache = kvcache.free_slots(cache, drop[None, None, None, :])
        logits, cache = decoder.decode_step(lm_params, token[None], cache, config=config)
        reward = -kl_rows(teacher_logp, jax.nn.log_softmax(logits[0]))
        return cache, Decisions(feats, valid, selected, order, budget, active, reward)

    S = T - prompt_len
    xs = (jnp.arange(S), tokens_T[prompt_len:], teacher_logp_SV)
    _, decisions = jax.lax.scan(step, cache, xs)
    return decisions


def rollouts(lm_params, policy_params, tokens_T, *, keys_K, **kwargs) -> Decisions:
    """K student rollouts of one stream (vmapped), with the teacher pass shared."""
    teacher = teacher_log_probs(
        lm_params, tokens_T, config=kwargs["config"], prompt_len=kwargs["prompt_len"]
    )
    one = lambda k: student_rollout(lm_params, policy_params, tokens_T, teacher, key=k, **kwargs)
    return jax.vmap(one)(keys_K)
