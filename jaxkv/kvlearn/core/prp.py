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
import numpy as np
import optax
from flax import struct

from jaxkv.kvlearn.core.features import N_FEATURES

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
    def __call__(self, x_BI):
        h_BU = nn.relu(nn.Dense(self.hidden)(x_BI))
        return nn.Dense(1)(h_BU)[..., 0]


@struct.dataclass
class PRPState:
    """Attributes:
    params, opt_state: MLP parameters and Adam state.
    n_obs, mean_F, m2_F: Welford whitening statistics ([I] features).
    buf_x_MF, buf_y_M: replay ring buffer ([M, I] raw features, [M] labels); buf_ptr, buf_size.
    labels_since: labels since the last training round.  n_labels, n_updates: totals.

    The field names keep ``F`` for the feature axis (``I`` in the glossary): they are the
    keypaths of every saved PRP checkpoint (``checkpoint.save_prp``), whose checksums and the
    shipped ``results/kvlearn/prp_pretrained`` depend on them.
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


def observe(state: PRPState, x_I) -> PRPState:
    """Welford update of the whitening statistics with one feature vector."""
    n = state.n_obs + 1.0
    delta = x_I - state.mean_F
    mean = state.mean_F + delta / n
    return state.replace(n_obs=n, mean_F=mean, m2_F=state.m2_F + delta * (x_I - mean))


def whiten(state: PRPState, x_I):
    """(x − mean) / std with the running statistics (std floored at 1e-2)."""
    return _whiten(state.n_obs, state.mean_F, state.m2_F, x_I)


def _whiten(n_obs, mean_F, m2_F, x_I):
    var = m2_F / jnp.maximum(n_obs, 1.0)
    return (x_I - mean_F) * jax.lax.rsqrt(var + VAR_FLOOR)


def logits(params, x_whitened_I, *, hidden: int):
    return PRPNet(hidden).apply({"params": params}, x_whitened_I)


def predict(state: PRPState, x_I, *, cfg: PRPConfig):
    """P̂ ∈ (0, 1) for raw features ``x_I`` ([..., 16])."""
    return jax.nn.sigmoid(logits(state.params, whiten(state, x_I), hidden=cfg.hidden))


def push_labels(state: PRPState, x_BI, y_B, mask_B) -> PRPState:
    """Appends the masked (x, y) rows to the replay ring buffer."""
    m = state.buf_y_M.shape[0]
    count = jnp.sum(mask_B, dtype=jnp.int32)
    pos_B = (state.buf_ptr + jnp.cumsum(mask_B, dtype=jnp.int32) - 1) % m
    idx_B = jnp.where(mask_B, pos_B, m)  # unmasked rows → dropped
    return state.replace(
        buf_x_MF=state.buf_x_MF.at[idx_B].set(x_BI, mode="drop"),
        buf_y_M=state.buf_y_M.at[idx_B].set(y_B, mode="drop"),
        buf_ptr=(state.buf_ptr + count) % m,
        buf_size=jnp.minimum(state.buf_size + count, m),
        labels_since=state.labels_since + count,
        n_labels=state.n_labels + count,
    )


def push_one(state: PRPState, x_I, y, emit) -> PRPState:
    """Appends one (x, y) row if ``emit`` (a dynamic-update-slice: in place under donation)."""
    m = state.buf_y_M.shape[0]
    ptr = state.buf_ptr
    x_old, y_old = state.buf_x_MF[ptr], state.buf_y_M[ptr]
    x_new = jnp.where(emit, x_I, x_old)
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


def bce_loss(params, x_whitened_BI, y_B, *, hidden: int):
    """Mean binary cross-entropy of the logits against 0/1 labels."""
    z_B = logits(params, x_whitened_BI, hidden=hidden)
    return jnp.mean(optax.sigmoid_binary_cross_entropy(z_B, y_B))


def _minibatch_indices(buf_size, *, key, cfg: PRPConfig):
    """[U, Bm] replay rows of one training round: U uniform minibatches of the filled buffer."""
    draw = lambda k: jax.random.randint(k, (cfg.batch_size,), 0, jnp.maximum(buf_size, 1))
    return jax.vmap(draw)(jax.random.split(key, cfg.updates_per_round))


def _fit(params, opt_state, x_ABI, y_AB, *, cfg: PRPConfig):
    """U Adam steps, one per whitened minibatch. Returns (params, opt_state)."""
    opt = _optimizer(cfg)
    grad_fn = jax.grad(bce_loss)

    def update(carry, batch):
        params, opt_state = carry
        grads = grad_fn(params, *batch, hidden=cfg.hidden)
        upd, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, upd), opt_state), None

    (params, opt_state), _ = jax.lax.scan(update, (params, opt_state), (x_ABI, y_AB))
    return params, opt_state


def train_round(state: PRPState, *, key, cfg: PRPConfig) -> PRPState:
    """``updates_per_round`` Adam steps on uniform minibatches from the replay buffer."""
    idx_AB = _minibatch_indices(state.buf_size, key=key, cfg=cfg)
    x_ABI = whiten(state, state.buf_x_MF[idx_AB])
    params, opt_state = _fit(state.params, state.opt_state, x_ABI, state.buf_y_M[idx_AB], cfg=cfg)
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
        (sel_Q,) = jnp.nonzero(pending_B, size=m, fill_value=b)
        safe_Q = jnp.minimum(sel_Q, b - 1)
        idx_QAB = jax.vmap(lambda n, k: _minibatch_indices(n, key=k, cfg=cfg))(
            state_B.buf_size[safe_Q], key_B[safe_Q]
        )
        x_QABI = state_B.buf_x_MF[safe_Q[:, None, None], idx_QAB]
        stats_Q = (state_B.n_obs[safe_Q], state_B.mean_F[safe_Q], state_B.m2_F[safe_Q])
        x_QABI = jax.vmap(_whiten)(*stats_Q, x_QABI)
        y_QAB = state_B.buf_y_M[safe_Q[:, None, None], idx_QAB]
        take = lambda tree: jax.tree.map(lambda a: a[safe_Q], tree)
        fit = jax.vmap(lambda p, o, x, y: _fit(p, o, x, y, cfg=cfg))
        params_Q, opt_Q = fit(take(params_B), take(opt_B), x_QABI, y_QAB)
        put = lambda tree, new: jax.tree.map(
            lambda a, u: a.at[sel_Q].set(u, mode="drop"), tree, new
        )
        pending_B = pending_B.at[sel_Q].set(False, mode="drop")
        return pending_B, put(params_B, params_Q), put(opt_B, opt_Q)

    carry = (due_B, state_B.params, state_B.opt_state)
    _, params_B, opt_B = jax.lax.while_loop(lambda c: jnp.any(c[0]), body, carry)
    n = due_B.astype(jnp.int32)
    return state_B.replace(
        params=params_B,
        opt_state=opt_B,
        labels_since=state_B.labels_since - n * cfg.train_every,
        n_updates=state_B.n_updates + n * cfg.updates_per_round,
    )


# ---- host twins (numpy) ---------------------------------------------------------------------
# The serving simulator's block KVLearn (``serving.predictors.HostPRP``) whitens and predicts on
# the host, once per request, from the parameters the jitted rounds above produce. These are the
# same formulas in float32 numpy: equal to ``observe`` + ``predict`` up to float rounding (a
# batched Welford update instead of one row at a time, numpy's matmul and sqrt instead of XLA's),
# which is why they are not replaced by the JAX functions: that changes the simulator's numbers.
HostStats = tuple[np.float32, np.ndarray, np.ndarray]
"""(n_obs, mean_I, m2_I): whitening statistics on the host (float32)."""


def host_stats() -> HostStats:
    """Empty statistics (nothing observed)."""
    return np.float32(0.0), np.zeros(N_FEATURES, np.float32), np.zeros(N_FEATURES, np.float32)


def host_observe(stats: HostStats, x_BI: np.ndarray) -> HostStats:
    """The statistics after also observing the rows ``x_BI`` (batched Welford, Chan et al.)."""
    n_obs, mean_I, m2_I = stats
    nb = np.float32(len(x_BI))
    mean_b = x_BI.mean(0, dtype=np.float32)
    m2_b = ((x_BI - mean_b) ** 2).sum(0, dtype=np.float32)
    n = n_obs + nb
    delta = mean_b - mean_I
    mean_I = mean_I + delta * nb / n
    m2_I = m2_I + m2_b + delta**2 * n_obs * nb / n
    return n, mean_I, m2_I


def host_predict(params, stats: HostStats, x_BI: np.ndarray) -> np.ndarray:
    """[B] P̂ of raw features ``x_BI`` whitened with ``stats`` (which must have observed them)."""
    n, mean_I, m2_I = stats
    inv_std_I = 1.0 / np.sqrt(m2_I / n + np.float32(VAR_FLOOR))
    return host_forward(params, (x_BI - mean_I) * inv_std_I)


def host_forward(params, z_BI: np.ndarray) -> np.ndarray:
    """σ(PRPNet(z)) for whitened ``z_BI``: Dense(U) → ReLU → Dense(1), flax's parameter layout."""
    d0, d1 = params["Dense_0"], params["Dense_1"]
    h_BU = np.maximum(z_BI @ d0["kernel"] + d0["bias"], 0.0)
    logit_B = (h_BU @ d1["kernel"] + d1["bias"])[:, 0]
    with np.errstate(over="ignore"):  # exp(−logit) → inf gives P̂ = 0, as it should
        return 1.0 / (1.0 + np.exp(-logit_B))
