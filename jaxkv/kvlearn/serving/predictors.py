"""The reuse predictors of the block-level KVLearn (``policies.kvlearn``): the core's PRP driven
from the host (``HostPRP``, and ``DeferredPRP``, the same predictions with one device call per
training round) and a numpy logistic regression (``Logistic``, an ablation).

Both take [B, I] float32 block features (``N_FEATURES`` = 16, the core PRP's input width) and
answer ``predict`` once per request; ``learn`` gets the labels closed since the last request.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kvlearn.core import prp as prp_lib
from jaxkv.kvlearn.core.features import N_FEATURES

_CHUNK = 1024  # labels per jitted push (one padded shape: one compilation)


class BlockPredictor(Protocol):
    """What the block KVLearn needs of a predictor."""

    trained: bool  # False until the first training step: P̂ is not used before

    def learn(self, x_BI: np.ndarray, y_B: np.ndarray) -> None: ...

    def predict(self, x_BI: np.ndarray) -> np.ndarray: ...

    def observe(self, x_BI: np.ndarray) -> tuple: ...

    def resolve(self, observed: tuple) -> np.ndarray: ...


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
            self.w = self.w - self.lr * xx.T @ (p - yy) / len(yy)  # a new array: ``observe``
            self.trained = True
            self.bx, self.by, self.n = [], [], 0

    def predict(self, x_BI):
        return self.resolve(self.observe(x_BI))

    def observe(self, x_BI) -> tuple:
        """What ``resolve`` needs to predict the rows as ``predict`` does now."""
        return self.w, x_BI

    def resolve(self, observed: tuple) -> np.ndarray:
        w, x_BI = observed
        return 1.0 / (1.0 + np.exp(-(x_BI @ w[:N_FEATURES] + w[N_FEATURES])))


class HostPRP:
    """The core's PRP (``core.prp``): its optax training rounds run in one jitted call per chunk
    of labels; the whitening statistics and the forward pass run on the host
    (``prp.host_observe`` / ``prp.host_predict``) from the current parameters, which saves a
    device round trip per request. The host mirrors the state's ``labels_since``, so it knows
    when a round ran; the new parameters (one flat array: one fetch) are fetched when first
    read, so a caller can do other work while the round runs: ``observe`` takes a request's rows
    now and ``resolve`` predicts them later, as ``predict`` would have at the time of
    ``observe`` (``ShadowPolicy`` defers the ``gd`` shadow's predictions for that).
    """

    def __init__(self, *, seed: int):
        self.cfg = prp_lib.PRPConfig()
        state = _init_prp(self.cfg, key=jax.random.key(seed))
        self._leaves, self._state_def = jax.tree.flatten(state)  # a flat list: faster calls
        self.key = jax.random.key(seed + 1)
        self.step = 0
        self.trained = False
        self.labels_since = 0  # mirrors state.labels_since
        self.stats = prp_lib.host_stats()
        self._params = jax.device_get(state.params)
        leaves, self._treedef = jax.tree.flatten(self._params)
        self._shapes = [np.shape(x) for x in leaves]
        self._splits = np.cumsum([math.prod(s) for s in self._shapes])[:-1]  # of the flat array
        self.rounds = 0  # training rounds run so far
        self._params_round = 0  # the round ``_params`` come from
        self._flat: dict[int, jax.Array] = {}  # round → its parameters, not fetched yet

    @property
    def state(self) -> prp_lib.PRPState:
        """The PRP's state (device arrays)."""
        return jax.tree.unflatten(self._state_def, self._leaves)

    @property
    def params(self):
        """The PRP's parameters on the host, after the last training round (waits for it)."""
        return self._params_after(self.rounds)

    def predict(self, x_BI):
        """Observes the rows, then P̂ with the new statistics."""
        return self.resolve(self.observe(x_BI))

    def observe(self, x_BI) -> tuple:
        """Observes the rows (the whitening statistics); returns what ``resolve`` needs to
        predict them as ``predict`` does now."""
        self.stats = prp_lib.host_observe(self.stats, x_BI)
        return self.rounds, self.stats, x_BI

    def resolve(self, observed: tuple) -> np.ndarray:
        """P̂ of rows ``observe``d (resolve them in the order they were observed)."""
        r, stats, x_BI = observed
        for old in [k for k in self._flat if k < r]:  # no later ``resolve`` reads them
            del self._flat[old]
        return prp_lib.host_predict(self._params_after(r), stats, x_BI)

    def _params_after(self, r: int):
        """The parameters after round r (fetched once)."""
        if r != self._params_round:
            parts = np.split(np.asarray(self._flat[r]), self._splits)
            leaves = [x.reshape(s) for x, s in zip(parts, self._shapes, strict=True)]
            self._params = jax.tree.unflatten(self._treedef, leaves)
            self._params_round = r
        return self._params

    def learn(self, x_BI, y_B):
        for s in range(0, len(y_B), _CHUNK):
            n = len(y_B[s : s + _CHUNK])
            self.step += 1
            packed = _pack(x_BI[s : s + _CHUNK], y_B[s : s + _CHUNK], self.stats, self.step)
            self._leaves, flat = _push_train(
                self._leaves, packed, self.key, cfg=self.cfg, treedef=self._state_def
            )
            self.labels_since += n
            if self.labels_since >= self.cfg.train_every:  # prp.maybe_train ran a round
                self.labels_since -= self.cfg.train_every
                self.trained = True
                self.rounds += 1
                self._flat[self.rounds] = flat


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


# One float32 array carries a push's host inputs (one transfer instead of seven): [_CHUNK, I]
# features, [_CHUNK] labels, [_CHUNK] mask, the statistics (n_obs, [I] mean, [I] m2), the step.
# Every value is exact in float32 (the step below 2^24).
_X, _Y, _M = _CHUNK * N_FEATURES, _CHUNK, _CHUNK
_PACKED = _X + _Y + _M + 1 + 2 * N_FEATURES + 1


def _pack(x_BI, y_B, stats: prp_lib.HostStats, step: int) -> np.ndarray:
    """``_push_train``'s packed input: the first len(y_B) of ``_CHUNK`` rows hold labels."""
    if step >= 1 << 24:
        raise ValueError(f"step {step} is not exact in float32")
    n = len(y_B)
    out = np.zeros(_PACKED, np.float32)
    out[: n * N_FEATURES] = np.asarray(x_BI, np.float32).reshape(-1)
    out[_X : _X + n] = y_B
    out[_X + _Y : _X + _Y + n] = 1.0
    n_obs, mean_I, m2_I = stats
    o = _X + _Y + _M
    out[o], out[o + 1 : o + 1 + N_FEATURES], out[o + 1 + N_FEATURES : -1] = n_obs, mean_I, m2_I
    out[-1] = step
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "treedef"), donate_argnums=0)
def _push_train(leaves, packed, key, *, cfg, treedef):
    """One push of labels (``_pack``) into the PRP whose state is ``leaves`` (of ``treedef``),
    with the host's whitening statistics, then ``maybe_train``. Returns (the new state's
    leaves, its parameters as one flat array: one fetch)."""
    o = _X + _Y + _M
    x_BI = packed[:_X].reshape(_CHUNK, N_FEATURES)
    y_B, mask_B = packed[_X : _X + _Y], packed[_X + _Y : o] > 0
    n_obs, mean_I = packed[o], packed[o + 1 : o + 1 + N_FEATURES]
    m2_I = packed[o + 1 + N_FEATURES : -1]
    step = packed[-1].astype(jnp.int32)
    state = jax.tree.unflatten(treedef, leaves)
    state = state.replace(n_obs=n_obs, mean_F=mean_I, m2_F=m2_I)  # the host's statistics
    state = prp_lib.push_labels(state, x_BI, y_B, mask_B)
    state = prp_lib.maybe_train(state, key=jax.random.fold_in(key, step), cfg=cfg)
    flat = jnp.concatenate([x.ravel() for x in jax.tree.leaves(state.params)])
    return jax.tree.leaves(state), flat
