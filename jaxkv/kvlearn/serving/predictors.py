"""The reuse predictors of the block-level KVLearn (``policies.kvlearn``): the core's PRP driven
from the host (``HostPRP``, and ``DeferredPRP``, the same predictions with one device call per
training round) and a numpy logistic regression (``Logistic``, an ablation).

Both take [B, I] float32 block features (``N_FEATURES`` = 16, the core PRP's input width) and
answer ``predict`` once per request; ``learn`` gets the labels closed since the last request.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import numpy as np

from jaxkv.kvlearn.core import prp as prp_lib
from jaxkv.kvlearn.core.features import N_FEATURES

_CHUNK = 1024  # labels per jitted push (one padded shape: one compilation)


class BlockPredictor(Protocol):
    """What the block KVLearn needs of a predictor."""

    trained: bool  # False until the first training step: P̂ is not used before

    def learn(self, x_BI: np.ndarray, y_B: np.ndarray) -> None: ...

    def predict(self, x_BI: np.ndarray) -> np.ndarray: ...


class Logistic:
    """Online logistic regression (numpy): minibatch SGD every ``batch`` labels."""

    def __init__(self, *, lr: float, batch: int):
        self.w = np.zeros(N_FEATURES + 1)
        self.lr, self.batch = lr, batch
        self.trained = False
        self.bx: list[np.ndarray] = []
        self.by: list[np.ndarray] = []
        self.n = 0

    def learn(self, x_BI, y_B):
        self.bx.append(x_BI)
        self.by.append(y_B)
        self.n += len(y_B)
        if self.n >= self.batch:
            xx = np.concatenate(self.bx)
            xx = np.concatenate([xx, np.ones((len(xx), 1), np.float32)], axis=1)
            yy = np.concatenate(self.by)
            p = 1.0 / (1.0 + np.exp(-(xx @ self.w)))
            self.w -= self.lr * xx.T @ (p - yy) / len(yy)
            self.trained = True
            self.bx, self.by, self.n = [], [], 0

    def predict(self, x_BI):
        return 1.0 / (1.0 + np.exp(-(x_BI @ self.w[:N_FEATURES] + self.w[N_FEATURES])))


class HostPRP:
    """The core's PRP (``core.prp``): its optax training rounds run in one jitted call per chunk
    of labels; the whitening statistics and the forward pass run on the host
    (``prp.host_observe`` / ``prp.host_predict``) from the current parameters, which saves a
    device round trip per request. The host mirrors the state's ``labels_since``, so it knows
    when a round ran; the new parameters are fetched when first read (``params``), so a caller
    can do other work while the round runs (``ShadowPolicy`` defers the ``gd`` shadow's
    prediction for that).
    """

    def __init__(self, *, seed: int):
        self.cfg = prp_lib.PRPConfig()
        self.state = _init_prp(self.cfg, key=jax.random.key(seed))
        self.key = jax.random.key(seed + 1)
        self.step = 0
        self.trained = False
        self.labels_since = 0  # mirrors state.labels_since
        self.stats = prp_lib.host_stats()
        self._params = jax.device_get(self.state.params)
        self._round = None  # the parameters of a round not fetched yet (device arrays)

    @property
    def params(self):
        """The PRP's parameters on the host, after the last training round (waits for it)."""
        if self._round is not None:
            self._params, self._round = jax.device_get(self._round), None
        return self._params

    def predict(self, x_BI):
        """Observes the rows, then P̂ with the new statistics."""
        self.stats = prp_lib.host_observe(self.stats, x_BI)
        return prp_lib.host_predict(self.params, self.stats, x_BI)

    def learn(self, x_BI, y_B):
        for s in range(0, len(y_B), _CHUNK):
            n = len(y_B[s : s + _CHUNK])
            xp = np.zeros((_CHUNK, N_FEATURES), np.float32)
            yp = np.zeros(_CHUNK, np.float32)
            xp[:n], yp[:n] = x_BI[s : s + _CHUNK], y_B[s : s + _CHUNK]
            self.step += 1
            args = (self.state, self.stats, xp, yp, np.arange(_CHUNK) < n, self.key, self.step)
            self.state = _push_train(*args, cfg=self.cfg)
            self.labels_since += n
            if self.labels_since >= self.cfg.train_every:  # prp.maybe_train ran a round
                self.labels_since -= self.cfg.train_every
                self.trained = True
                self._round = self.state.params


class DeferredPRP(HostPRP):
    """``HostPRP`` whose label pushes wait on the host until they would start a training round.

    ``HostPRP.learn`` makes one jitted call (a padded chunk of labels into the PRP's replay
    ring) per request that closes labels; a training round runs inside the call that brings
    the labels since the last round to ``train_every``. Only that call changes what the PRP
    predicts, so this class holds the chunks on the host and pushes them, in order, in that
    call: the same rows reach the ring in the same order, the round sees the same whitening
    statistics and the same random key (``step`` counts the chunks ``HostPRP`` would have
    pushed), and the parameters and P̂ are identical at every request (tested). One call per
    round instead of one per request; labels held when a run ends are never pushed (no round
    would have used them).
    """

    def __init__(self, *, seed: int):
        super().__init__(seed=seed)
        self.held: list[tuple[np.ndarray, np.ndarray]] = []
        self.n_held = 0

    def learn(self, x_BI, y_B):
        for s in range(0, len(y_B), _CHUNK):  # HostPRP's chunks: one call (step) each
            self.held.append((x_BI[s : s + _CHUNK], y_B[s : s + _CHUNK]))
            self.n_held += len(self.held[-1][1])
            if self.labels_since + self.n_held >= self.cfg.train_every:
                self._flush()

    def _flush(self) -> None:
        """Pushes the held chunks; the last one starts the round with ``HostPRP``'s step."""
        step = self.step + len(self.held)
        *early, (x, y) = self.held
        self.held, self.n_held = [], 0
        if early:
            ex, ey = (np.concatenate(a) for a in zip(*early, strict=True))
            if len(ey) + len(y) <= _CHUNK:
                x, y = np.concatenate([ex, x]), np.concatenate([ey, y])
            else:  # fewer than ``train_every`` labels: no round, so its step is immaterial
                super().learn(ex, ey)
        self.step = step - 1
        super().learn(x, y)  # one chunk (HostPRP counts its step), the round inside


_init_prp = jax.jit(prp_lib.init_prp, static_argnums=0)  # one compilation, not one per op


@functools.partial(jax.jit, static_argnames="cfg", donate_argnums=0)
def _push_train(state, stats, x_BI, y_B, mask_B, key, step, *, cfg):
    n_obs, mean_I, m2_I = stats  # the host's whitening statistics, used by the round
    state = state.replace(n_obs=n_obs, mean_F=mean_I, m2_F=m2_I)
    state = prp_lib.push_labels(state, x_BI, y_B, mask_B)
    return prp_lib.maybe_train(state, key=jax.random.fold_in(key, step), cfg=cfg)
