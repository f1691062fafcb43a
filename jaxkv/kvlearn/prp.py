"""Prefix Reuse Predictor: an online MLP P̂(b) = σ(f_θ(whiten(x(b)))) trained with optax.

The state (parameters, Adam moments, running whitening statistics and the replay ring buffer)
is one pytree. ``observe`` must see a feature vector before ``predict`` uses it, so the first
prediction is already whitened. Raw features are stored in the replay buffer and whitened with
the current statistics at training time, exactly as at serving time.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct

from jaxkv.kvlearn.features import N_FEATURES

VAR_FLOOR = 1e-4  # added to the variance in whitening (std floored at 0.01)


@dataclasses.dataclass(frozen=True)
class PRPConfig:
    """PRP hyper-parameters (README defaults: d=16, h=32, η=5e-3, replay 20k, every 100 labels).

    ``updates_per_round`` Adam steps on minibatches of ``batch_size`` replayed labels are taken
    each time ``train_every`` new labels have arrived.
    """

    hidden: int = 32
    learning_rate: float = 5e-3
    replay_size: int = 20_000
    train_every: int = 100
    batch_size: int = 128
    updates_per_round: int = 32

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise ValueError(f"PRPConfig.{f.name} must be positive, got {v}")


class PRPNet(nn.Module):
    """d=16 → h (ReLU) → 1 logit."""

    hidden: int

    @nn.compact
    def __call__(self, x_BF):
        h_BH = nn.relu(nn.Dense(self.hidden)(x_BF))
        return nn.Dense(1)(h_BH)[..., 0]


@struct.dataclass
class PRPState:
    """Attributes:
    params, opt_state: MLP parameters and Adam state.
    n_obs, mean_F, m2_F: Welford whitening statistics.
    buf_x_MF, buf_y_M: replay ring buffer (raw features, labels); buf_ptr, buf_size.
    labels_since: labels since the last training round.  n_labels, n_updates: totals.
    """

    params: dict
    opt_state: optax.OptState
    n_obs: jax.Array
    mean_F: jax.Array
    m2_F: jax.Array
    buf_x_MF: jax.Array
    buf_y_M: jax.Array
    buf_ptr: jax.Array
    buf_size: jax.Array
    labels_since: jax.Array
    n_labels: jax.Array
    n_updates: jax.Array


def _optimizer(cfg: PRPConfig):
    return optax.adam(cfg.learning_rate)


def init_prp(cfg: PRPConfig, *, key) -> PRPState:
    """Fresh PRP with Flax-initialised weights and empty statistics and buffer."""
    params = PRPNet(cfg.hidden).init(key, jnp.zeros((1, N_FEATURES)))["params"]
    i0 = lambda: jnp.zeros((), jnp.int32)  # distinct buffers: the state may be donated
    return PRPState(
        params=params,
        opt_state=_optimizer(cfg).init(params),
        n_obs=jnp.zeros((), jnp.float32),
        mean_F=jnp.zeros((N_FEATURES,), jnp.float32),
        m2_F=jnp.zeros((N_FEATURES,), jnp.float32),
        buf_x_MF=jnp.zeros((cfg.replay_size, N_FEATURES), jnp.float32),
        buf_y_M=jnp.zeros((cfg.replay_size,), jnp.float32),
        buf_ptr=i0(),
        buf_size=i0(),
        labels_since=i0(),
        n_labels=i0(),
        n_updates=i0(),
    )


def observe(state: PRPState, x_F) -> PRPState:
    """Welford update of the whitening statistics with one feature vector."""
    n = state.n_obs + 1.0
    delta = x_F - state.mean_F
    mean = state.mean_F + delta / n
    return state.replace(n_obs=n, mean_F=mean, m2_F=state.m2_F + delta * (x_F - mean))


def whiten(state: PRPState, x_F):
    """(x − mean) / std with the running statistics (std floored at 1e-2)."""
    return _whiten(state.n_obs, state.mean_F, state.m2_F, x_F)


def _whiten(n_obs, mean_F, m2_F, x_F):
    var = m2_F / jnp.maximum(n_obs, 1.0)
    return (x_F - mean_F) * jax.lax.rsqrt(var + VAR_FLOOR)


def logits(params, x_whitened_F, *, hidden: int):
    return PRPNet(hidden).apply({"params": params}, x_whitened_F)


def predict(state: PRPState, x_F, *, cfg: PRPConfig):
    """P̂ ∈ (0, 1) for raw features ``x_F`` ([..., 16])."""
    return jax.nn.sigmoid(logits(state.params, whiten(state, x_F), hidden=cfg.hidden))


def push_labels(state: PRPState, x_BF, y_B, mask_B) -> PRPState:
    """Appends the masked (x, y) rows to the replay ring buffer."""
    m = state.buf_y_M.shape[0]
    count = jnp.sum(mask_B, dtype=jnp.int32)
    pos_B = (state.buf_ptr + jnp.cumsum(mask_B, dtype=jnp.int32) - 1) % m
    idx_B = jnp.where(mask_B, pos_B, m)  # unmasked rows → dropped
    return state.replace(
        buf_x_MF=state.buf_x_MF.at[idx_B].set(x_BF, mode="drop"),
        buf_y_M=state.buf_y_M.at[idx_B].set(y_B, mode="drop"),
        buf_ptr=(state.buf_ptr + count) % m,
        buf_size=jnp.minimum(state.buf_size + count, m),
        labels_since=state.labels_since + count,
        n_labels=state.n_labels + count,
    )


def push_one(state: PRPState, x_F, y, emit) -> PRPState:
    """Appends one (x, y) row if ``emit`` (a dynamic-update-slice: in place under donation)."""
    m = state.buf_y_M.shape[0]
    ptr = state.buf_ptr
    x_old, y_old = state.buf_x_MF[ptr], state.buf_y_M[ptr]
    x_new = jnp.where(emit, x_F, x_old)
    y_new = jnp.where(emit, y, y_old)
    n = emit.astype(jnp.int32)
    return state.replace(
        buf_x_MF=jax.lax.dynamic_update_slice(state.buf_x_MF, x_new[None], (ptr, 0)),
        buf_y_M=jax.lax.dynamic_update_slice(state.buf_y_M, y_new[None], (ptr,)),
        buf_ptr=(ptr + n) % m,
        buf_size=jnp.minimum(state.buf_size + n, m),
        labels_since=state.labels_since + n,
        n_labels=state.n_labels + n,
    )


def bce_loss(params, x_whitened_BF, y_B, *, hidden: int):
    """Mean binary cross-entropy of the logits against 0/1 labels."""
    z_B = logits(params, x_whitened_BF, hidden=hidden)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(z_B, y_B))


def _minibatch_indices(buf_size, *, key, cfg: PRPConfig):
    """[U, Bm] replay rows of one training round: U uniform minibatches of the filled buffer."""
    draw = lambda k: jax.random.randint(k, (cfg.batch_size,), 0, jnp.maximum(buf_size, 1))
    return jax.vmap(draw)(jax.random.split(key, cfg.updates_per_round))


def _fit(params, opt_state, x_UBF, y_UB, *, cfg: PRPConfig):
    """U Adam steps, one per whitened minibatch. Returns (params, opt_state)."""
    opt = _optimizer(cfg)
    grad_fn = jax.grad(bce_loss)

    def update(carry, batch):
        params, opt_state = carry
        grads = grad_fn(params, *batch, hidden=cfg.hidden)
        upd, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, upd), opt_state), None

    (params, opt_state), _ = jax.lax.scan(update, (params, opt_state), (x_UBF, y_UB))
    return params, opt_state


def train_round(state: PRPState, *, key, cfg: PRPConfig) -> PRPState:
    """``updates_per_round`` Adam steps on uniform minibatches from the replay buffer."""
    idx_UB = _minibatch_indices(state.buf_size, key=key, cfg=cfg)
    x_UBF = whiten(state, state.buf_x_MF[idx_UB])
    params, opt_state = _fit(state.params, state.opt_state, x_UBF, state.buf_y_M[idx_UB], cfg=cfg)
    return state.replace(
        params=params, opt_state=opt_state, n_updates=state.n_updates + cfg.updates_per_round
    )


def maybe_train(state: PRPState, *, key, cfg: PRPConfig) -> PRPState:
    """Runs one training round once ``train_every`` labels have accumulated since the last."""
    due = state.labels_since >= cfg.train_every

    def run(s):
        s = train_round(s, key=key, cfg=cfg)
        return s.replace(labels_since=s.labels_since - cfg.train_every)

    return jax.lax.cond(due, run, lambda s: s, state)


def maybe_train_batch(state_B: PRPState, *, key_B, cfg: PRPConfig, parallel: int = 16) -> PRPState:
    """``maybe_train`` for B independent PRPs (every leaf has a leading run axis B).

    Under ``vmap`` the ``lax.cond`` of ``maybe_train`` becomes a select, so every run would pay
    for a training round at every call. Here only the due runs train, ``parallel`` at a time
    (a ``while_loop`` over groups of due runs, each group one vmapped round on the gathered
    minibatch rows); the results equal ``maybe_train`` per run up to float rounding of the
    batched kernels.
    """
    b = state_B.buf_size.shape[0]
    m = min(parallel, b)
    due_B = state_B.labels_since >= cfg.train_every

    def body(carry):
        pending_B, params_B, opt_B = carry
        (sel_m,) = jnp.nonzero(pending_B, size=m, fill_value=b)
        safe_m = jnp.minimum(sel_m, b - 1)
        idx_mUB = jax.vmap(lambda n, k: _minibatch_indices(n, key=k, cfg=cfg))(
            state_B.buf_size[safe_m], key_B[safe_m]
        )
        x_mUBF = state_B.buf_x_MF[safe_m[:, None, None], idx_mUB]
        stats_m = (state_B.n_obs[safe_m], state_B.mean_F[safe_m], state_B.m2_F[safe_m])
        x_mUBF = jax.vmap(_whiten)(*stats_m, x_mUBF)
        y_mUB = state_B.buf_y_M[safe_m[:, None, None], idx_mUB]
        take = lambda tree: jax.tree.map(lambda a: a[safe_m], tree)
        fit = jax.vmap(lambda p, o, x, y: _fit(p, o, x, y, cfg=cfg))
        params_m, opt_m = fit(take(params_B), take(opt_B), x_mUBF, y_mUB)
        put = lambda tree, new: jax.tree.map(
            lambda a, u: a.at[sel_m].set(u, mode="drop"), tree, new
        )
        pending_B = pending_B.at[sel_m].set(False, mode="drop")
        return pending_B, put(params_B, params_m), put(opt_B, opt_m)

    carry = (due_B, state_B.params, state_B.opt_state)
    _, params_B, opt_B = jax.lax.while_loop(lambda c: jnp.any(c[0]), body, carry)
    n = due_B.astype(jnp.int32)
    return state_B.replace(
        params=params_B,
        opt_state=opt_B,
        labels_since=state_B.labels_since - n * cfg.train_every,
        n_updates=state_B.n_updates + n * cfg.updates_per_round,
    )
