"""Offline PRP pre-training: fit the MLP for several epochs on the labels of its replay buffer.

The labels come from the same online pipeline as serving (``sim.simulate.collect_labels``
replays a trace through ``control.lookup`` / ``tick``), so features are computed identically;
only the training schedule differs: several epochs over the replay buffer instead of one round
per 100 labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxkv.kvlearn.core import prp as prp_lib


def fit(
    state: prp_lib.PRPState, *, cfg: prp_lib.PRPConfig, epochs: int, key
) -> tuple[prp_lib.PRPState, list[dict]]:
    """``epochs`` shuffled passes of Adam over the replay buffer; per-epoch loss and accuracy."""
    n = int(state.buf_size)
    if n < cfg.batch_size:
        raise ValueError(f"only {n} labels collected; need at least batch_size={cfg.batch_size}")
    steps = n // cfg.batch_size
    opt = optax.adam(cfg.learning_rate)
    x_MI = prp_lib.whiten(state, state.buf_x_MF[:n])
    y_M = state.buf_y_M[:n]

    @jax.jit
    def epoch(carry, ekey):
        params, opt_state = carry
        perm = jax.random.permutation(ekey, n)[: steps * cfg.batch_size].reshape(steps, -1)

        def step(c, idx):
            p, o = c
            loss, g = jax.value_and_grad(prp_lib.bce_loss)(
                p, x_MI[idx], y_M[idx], hidden=cfg.hidden
            )
            u, o = opt.update(g, o, p)
            return (optax.apply_updates(p, u), o), loss

        (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), perm)
        z = prp_lib.logits(params, x_MI, hidden=cfg.hidden)
        acc = jnp.mean((z > 0) == (y_M > 0.5))
        return (params, opt_state), (jnp.mean(losses), acc)

    carry = (state.params, state.opt_state)
    history = []
    for i, ekey in enumerate(jax.random.split(key, epochs)):
        carry, (loss, acc) = epoch(carry, ekey)
        history.append({"epoch": i + 1, "loss": float(loss), "accuracy": float(acc)})
    params, opt_state = carry
    updates = state.n_updates + epochs * steps
    return state.replace(params=params, opt_state=opt_state, n_updates=updates), history


def label_stats(state: prp_lib.PRPState) -> dict:
    """Labels seen in all, labels in the replay buffer and their positive share."""
    n = int(state.buf_size)
    y = np.asarray(state.buf_y_M[:n])
    return {
        "labels_total": int(state.n_labels),
        "labels_in_buffer": n,
        "positive_rate": float(y.mean()) if n else 0.0,
    }
