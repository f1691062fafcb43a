"""One DistillCache training step: rollouts, returns, RLOO/EMA baselines, AdamW update."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxkv.config import ModelConfig
from jaxkv.rl.config import TrainConfig
from jaxkv.rl.objectives import discounted_returns, reinforce_loss, rloo_advantages
from jaxkv.rl.rollout import FROZEN, max_budget, rollouts, rows_for


@struct.dataclass
class TrainState:
    """Everything a resume needs (the data and keys derive from seed and step)."""

    step: jax.Array
    params: dict
    opt_state: optax.OptState
    ema_return: jax.Array  # EMA of the mean return per decision step [S]


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warm-up and cosine decay, gradients clipped by global norm; a
    per-head ranker's ``FROZEN`` parameters are never updated (nor decayed)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps, end_value=0.0
    )
    opt = optax.adamw(schedule, weight_decay=cfg.weight_decay)
    if cfg.decisions == "head":
        opt = optax.multi_transform({"fit": opt, "frozen": optax.set_to_zero()}, _labels)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), opt)


def _labels(params: dict) -> dict:
    return {
        k: jax.tree.map(lambda _, k=k: "frozen" if k in FROZEN else "fit", v)
        for k, v in params.items()
    }


def init_state(cfg: TrainConfig, policy_params: dict) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=policy_params,
        opt_state=make_optimizer(cfg).init(policy_params),
        ema_return=jnp.zeros((cfg.decode_steps,), jnp.float32),
    )


def advantages(returns_KS, ema_S, *, decay: float):
    """RLOO across rollouts when K >= 2, else the EMA baseline; and the updated EMA."""
    new_ema = decay * ema_S + (1 - decay) * jnp.mean(returns_KS, axis=0)
    if returns_KS.shape[0] >= 2:
        return rloo_advantages(returns_KS), new_ema
    return returns_KS - ema_S, new_ema


@functools.partial(jax.jit, static_argnames=("cfg", "config"), donate_argnames=("state",))
def train_step(
    lm_params, state: TrainState, tokens_T, keys_K, *, cfg: TrainConfig, config: ModelConfig
):
    """Rollouts on one stream, then one policy-gradient update.

    Args:
        lm_params: language-model params (frozen).
        state: the training state.
        tokens_T: the token stream (prompt + continuation), length ``cfg.stream_len``.
        keys_K: one PRNG key per rollout (shard over a ``data`` mesh axis for data
            parallelism).
        cfg: training settings.
        config: the language model's config.

    Returns:
        The new state and a dict of scalar metrics.
    """
    rows = rows_for(cfg.decisions, cfg.score_scale)
    d = rollouts(
        lm_params,
        state.params,
        tokens_T,
        keys_K=keys_K,
        config=config,
        prompt_len=cfg.prompt_len,
        ratio=cfg.ratio,
        min_budget=cfg.min_budget,
        estimator=cfg.estimator,
        rows=rows,
    )
    returns = discounted_returns(d.reward, cfg.gamma)
    adv, ema = advantages(returns, state.ema_return, decay=cfg.ema_decay)
    loss_fn = functools.partial(
        reinforce_loss,
        estimator=cfg.estimator,
        beta=cfg.beta,
        exact_entropy=cfg.exact_entropy,
        max_budget=max_budget(cfg.stream_len, ratio=cfg.ratio, min_budget=cfg.min_budget),
        scores_fn=rows.scores,
    )
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, d, adv)
    updates, opt_state = make_optimizer(cfg).update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss,
        "reward": jnp.mean(d.reward),
        "kl": -jnp.mean(d.reward),
        "entropy": aux["entropy"],
        "grad_norm": optax.global_norm(grads),
        "active": jnp.mean(d.active.astype(jnp.float32)),
    }
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, ema_return=ema)
    return new_state, metrics
