"""Per-prefix history, the PRP's 16 features, and delayed reuse labels.

History is kept for every key ever requested (``[P]`` arrays), resident or not: after a block is
evicted or discarded its key stays as a *ghost*, so admission knows a prefix's past even when
the pool does not hold it.

The 16 features of key k at time t (all computed by ``featurize``, identically for training
windows, admission, hits and re-scoring at ``tick``):

====  ===================================================================================
 0    log1p(fast decayed request count), τ = ``tau_fast_s`` (recent popularity)
 1    log1p(slow decayed count / (1 − exp(−(age + τ_fast)/τ_slow))), τ_slow = ``tau_slow_s``:
      the long-run rate, corrected for a key younger than τ_slow
 2    log1p(requests · τ_fast / (age + τ_fast)): the mean rate since the first request
 3    log1p(t − last request time) (recency, s)
 4    log1p(last inter-request gap) (s; ``GAP_NEVER`` before a second request)
 5    ghost hits per request: requests that missed although k had been seen before
 6    evictions of k per request
 7    log1p(min(age, τ_slow)) (age = t − first request, s)
 8    log(prefix length in tokens)
 9    log(footprint in MiB)
10    modality: text (one-hot)
11    modality: image (one-hot)
12    modality: video (one-hot)
13    pool occupancy (used / capacity)
14    windowed pool hit rate (the ATC's EMA)
15    log1p(R − T): ms one reuse saves
====  ===================================================================================

All are rates, recencies or capped: a running total or an age grows without bound, so the
replay buffer would always describe a range the keys have left (``FEATURES_VERSION`` 2; version
1 used log1p of the totals and of the age).

Labels (one per key per horizon H): a *window* opens for key k when none is open and the
previous one opened ≥ H ago, at a request for k or, while k's block is resident, at a tick; it
stores the features at that moment (the admission or re-scoring features). The next
request for k within H closes it with label 1 (a block reused exactly once counts); if H passes
without one, the next tick (or request) closes it with label 0. Outcomes come from the request
stream, so windows of evicted and discarded keys are labelled too, without bias from eviction.
Each key also keeps its own labels, decayed with τ_slow (``label_posterior``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.kvlearn.cost import MIB, CostModel

N_FEATURES = 16
# Bumped whenever a feature's definition changes: a PRP trained on other features is refused.
FEATURES_VERSION = 2
GAP_NEVER = 1e4

# Columns of the per-key history table (float32; counts are exact below 2^24).
N_REQ, F_FAST, F_SLOW, FIRST_T, LAST_T, GAP, GHOST, N_EVICT = range(8)
TOKENS, MODALITY, WIN_OPEN, WIN_T0, NEXT_OPEN = range(8, 13)
WIN_X = slice(13, 13 + N_FEATURES)  # features stored when the key's window opened
# "Outbox" columns: ``record_request`` writes its outputs here and reads them back after the
# row update, so nothing reads the old row once the table has been updated in place. Without
# this XLA (CPU) fuses reads of the old row into consumers scheduled after the update and
# copies the whole table on every request (milliseconds at 10^5 keys).
OUT_LABEL_X = slice(13 + N_FEATURES, 13 + 2 * N_FEATURES)
OUT_X = slice(13 + 2 * N_FEATURES, 13 + 3 * N_FEATURES)
OUT_Y, OUT_EMIT = 13 + 3 * N_FEATURES, 14 + 3 * N_FEATURES
# The key's own labels, exponentially decayed: Σ y, Σ 1 and the time they were decayed to.
LABELS = slice(15 + 3 * N_FEATURES, 18 + 3 * N_FEATURES)
N_COLS = 18 + 3 * N_FEATURES


@struct.dataclass
class History:
    """Per-key history and open label windows.

    One row per key, so recording a request reads and writes a single row in place (separate
    [P] arrays cross-read each other and made XLA copy them on every call).

    Attributes:
        table_PJ: [P, J] float32 columns N_REQ (requests so far), F_FAST / F_SLOW (decayed
            counts at LAST_T), FIRST_T / LAST_T (s), GAP (last inter-request gap, s), GHOST
            (misses after the key had been seen), N_EVICT, TOKENS, MODALITY, WIN_OPEN (0/1),
            WIN_T0 (window opening time), NEXT_OPEN (earliest next opening), WIN_X (16
            features stored when the window opened) and the outbox columns (see above).
    """

    table_PJ: jax.Array

    @property
    def win_x_PI(self):
        """[P, I] features stored when each key's window opened."""
        return self.table_PJ[:, WIN_X]

    def col(self, c: int, keys=None):
        """Column ``c`` for ``keys`` (all keys when None)."""
        return self.table_PJ[:, c] if keys is None else self.table_PJ[keys, c]


@struct.dataclass
class Signals:
    """Pool-level inputs to the features: occupancy and windowed hit rate ([] float32)."""

    occupancy: jax.Array
    hit_rate: jax.Array


def init_history(max_keys: int) -> History:
    table = jnp.zeros((max_keys, N_COLS), jnp.float32)
    table = table.at[:, GAP].set(GAP_NEVER).at[:, TOKENS].set(1.0)
    return History(table_PJ=table)


def observe_row(row_J, *, t, tokens, modality, hit, tau_fast_s, tau_slow_s):
    """A key's history row after one more request at time ``t`` (its lookup resolved ``hit``)."""
    seen = row_J[N_REQ] > 0
    dt = t - row_J[LAST_T]
    new = {
        N_REQ: row_J[N_REQ] + 1.0,
        F_FAST: jnp.where(seen, row_J[F_FAST] * jnp.exp(-dt / tau_fast_s), 0.0) + 1.0,
        F_SLOW: jnp.where(seen, row_J[F_SLOW] * jnp.exp(-dt / tau_slow_s), 0.0) + 1.0,
        FIRST_T: jnp.where(seen, row_J[FIRST_T], t),
        LAST_T: t,
        GAP: jnp.where(seen, dt, GAP_NEVER),
        GHOST: row_J[GHOST] + (seen & ~hit),
        TOKENS: tokens,
        MODALITY: modality,
    }
    return _set(row_J, new)


def _set(row, new: dict):
    for c, v in new.items():
        row = row.at[c].set(jnp.asarray(v, jnp.float32))
    return row


def count_evictions(hist: History, *, evicted_keys) -> History:
    """Adds one eviction to each key in ``evicted_keys`` (entries < 0 are ignored)."""
    idx = jnp.where(evicted_keys >= 0, evicted_keys, hist.table_PJ.shape[0])
    return hist.replace(table_PJ=hist.table_PJ.at[idx, N_EVICT].add(1.0, mode="drop"))


def featurize(hist: History, keys, *, t, signals: Signals, cost: CostModel, tau_fast_s, tau_slow_s):
    """[..., 16] float32 features of ``keys`` (any shape) at time ``t`` (see module table)."""
    return featurize_rows(
        hist.table_PJ[keys],
        t=t,
        signals=signals,
        cost=cost,
        tau_fast_s=tau_fast_s,
        tau_slow_s=tau_slow_s,
    )


def featurize_rows(rows_J, *, t, signals: Signals, cost: CostModel, tau_fast_s, tau_slow_s):
    """[..., 16] features from history rows [..., J]."""
    col = lambda c: rows_J[..., c]
    dt = jnp.maximum(t - col(LAST_T), 0.0)
    seen = col(N_REQ) > 0
    fast = jnp.where(seen, col(F_FAST) * jnp.exp(-dt / tau_fast_s), 0.0)
    slow = jnp.where(seen, col(F_SLOW) * jnp.exp(-dt / tau_slow_s), 0.0)
    tokens = col(TOKENS)
    mib = cost.footprint_bytes(tokens) / MIB
    onehot = jax.nn.one_hot(col(MODALITY).astype(jnp.int32), 3, dtype=jnp.float32)
    net = jnp.maximum(cost.net_benefit_ms(tokens), 0.0)
    scalar = lambda v: jnp.broadcast_to(v, dt.shape).astype(jnp.float32)
    age = jnp.where(seen, t - col(FIRST_T), 0.0)
    n = jnp.maximum(col(N_REQ), 1.0)
    # rates, not running totals: totals and ages grow without bound, so the replay buffer would
    # always describe a range the keys have already left
    exposure = 1.0 - jnp.exp(-(age + tau_fast_s) / tau_slow_s)
    cols = [
        jnp.log1p(fast),
        jnp.log1p(slow / exposure),
        jnp.log1p(col(N_REQ) * tau_fast_s / (age + tau_fast_s)),
        jnp.log1p(jnp.where(seen, dt, GAP_NEVER)),
        jnp.log1p(col(GAP)),
        col(GHOST) / n,
        col(N_EVICT) / n,
        jnp.log1p(jnp.minimum(age, tau_slow_s)),
        jnp.log(tokens),
        jnp.log(mib),
        onehot[..., 0],
        onehot[..., 1],
        onehot[..., 2],
        scalar(signals.occupancy),
        scalar(signals.hit_rate),
        jnp.log1p(net),
    ]
    return jnp.stack(cols, axis=-1).astype(jnp.float32)


def _decayed(sums, *, t, tau_s):
    """(Σ y, Σ 1) of label sums [..., 3] (Σ y, Σ 1, time) decayed to ``t``."""
    d = jnp.exp(-jnp.maximum(t - sums[..., 2], 0.0) / tau_s)
    return sums[..., 0] * d, sums[..., 1] * d


def _add_label(sums, y, emit, *, t, tau_s):
    """Label sums [..., 3] decayed to ``t`` plus label ``y`` where ``emit``."""
    pos, n = _decayed(sums, t=t, tau_s=tau_s)
    t_ = jnp.broadcast_to(t, pos.shape).astype(jnp.float32)
    return jnp.where(emit[..., None], jnp.stack([pos + y, n + 1.0, t_], axis=-1), sums)


def label_posterior(hist: History, keys, p_hat, *, t, tau_s, prior_labels):
    """P̂ of ``keys`` refined by their own labels: (m·P̂ + Σ y) / (m + Σ 1), both sums decayed
    with time constant ``tau_s``; a Beta prior of m = ``prior_labels`` pseudo-labels centred on
    the MLP's prediction ``p_hat``."""
    pos, n = _decayed(hist.table_PJ[keys, LABELS], t=t, tau_s=tau_s)
    return (prior_labels * p_hat + pos) / (prior_labels + n)


def rate_posterior(hist: History, keys, p_hat, *, t, t0, horizon_s, prior_s, expected_reuses=False):
    """P̂ of ``keys`` from their exact request counts: 1 − exp(−H·λ̂) with the Gamma-posterior
    rate λ̂ = (s·λ₀ + n) / (s + t − t0), n the key's requests since ``t0`` (the first request
    of the stream), λ₀ = −ln(1 − P̂)/H the rate the MLP's ``p_hat`` implies and s =
    ``prior_s`` seconds of pseudo-exposure. At one time t every key shares the exposure, so
    among blocks of equal value per byte the order is the exact count's (LFU's) once n
    outweighs the prior.

    With ``expected_reuses`` it returns H·λ̂ instead, the expected number of requests within
    H (not capped at 1): the same order, but additive over reuses (see
    ``KVLearnConfig.expected_reuses``)."""
    lam0 = -jnp.log1p(-jnp.clip(p_hat, 0.0, 1.0 - 1e-6)) / horizon_s
    n = hist.table_PJ[keys, N_REQ]
    lam = (prior_s * lam0 + n) / (prior_s + jnp.maximum(t - t0, 0.0))
    if expected_reuses:
        return horizon_s * lam
    return -jnp.expm1(-horizon_s * lam)


def resolve_row(row_J, *, t, horizon_s):
    """Closes the row's open window at a new request: label 1 within H, else 0.

    Returns:
        (row_J, y, emitted): the label and whether a window was open to emit it.
    """
    emitted = row_J[WIN_OPEN] > 0
    y = (t - row_J[WIN_T0] <= horizon_s).astype(jnp.float32)
    return row_J.at[WIN_OPEN].set(0.0), y, emitted


def open_row(row_J, *, t, horizon_s):
    """Opens a window at ``t`` if none is open and H has passed. Returns (row_J, opened)."""
    do = (row_J[WIN_OPEN] == 0) & (t >= row_J[NEXT_OPEN])
    new = {WIN_OPEN: 1.0, WIN_T0: t, NEXT_OPEN: t + horizon_s}
    return jnp.where(do, _set(row_J, new), row_J), do


def record_request(
    hist: History, *, key, t, tokens, modality, hit, horizon_s, tau_fast_s, tau_slow_s, featurize_fn
):
    """Everything a request does to the history, reading and writing ``key``'s rows once.

    Resolves the open window (label), adds the request, featurizes the key with
    ``featurize_fn(row_J)`` and opens a new window if due.

    Returns:
        (hist, x_I, (label_x_I, label_y, label_emitted)).
    """
    row = hist.table_PJ[key]
    x_win = row[WIN_X]
    row, y, emitted = resolve_row(row, t=t, horizon_s=horizon_s)
    row = row.at[LABELS].set(_add_label(row[LABELS], y, emitted, t=t, tau_s=tau_slow_s))
    row = observe_row(
        row,
        t=t,
        tokens=tokens,
        modality=modality,
        hit=hit,
        tau_fast_s=tau_fast_s,
        tau_slow_s=tau_slow_s,
    )
    x_I = featurize_fn(row)
    row, opened = open_row(row, t=t, horizon_s=horizon_s)
    row = (
        row.at[WIN_X]
        .set(jnp.where(opened, x_I, x_win))
        .at[OUT_LABEL_X]
        .set(x_win)
        .at[OUT_X]
        .set(x_I)
        .at[OUT_Y]
        .set(y)
        .at[OUT_EMIT]
        .set(emitted.astype(jnp.float32))
    )
    table = jax.lax.dynamic_update_slice(hist.table_PJ, row[None], (key, 0))
    out = table[key]  # read back after the write (see OUT_* above)
    label = (out[OUT_LABEL_X], out[OUT_Y], out[OUT_EMIT] > 0)
    return hist.replace(table_PJ=table), out[OUT_X], label


def expire_windows(hist: History, *, t, horizon_s, tau_s):
    """Closes every window older than H with label 0 (also added to the key's label sums,
    decayed with ``tau_s``). Returns (hist, x_PI, mask_P)."""
    mask_P = (hist.col(WIN_OPEN) > 0) & (t - hist.col(WIN_T0) > horizon_s)
    table = hist.table_PJ.at[:, WIN_OPEN].set(jnp.where(mask_P, 0.0, hist.col(WIN_OPEN)))
    sums = _add_label(table[:, LABELS], 0.0, mask_P, t=t, tau_s=tau_s)
    return hist.replace(table_PJ=table.at[:, LABELS].set(sums)), hist.table_PJ[:, WIN_X], mask_P


def open_windows(hist: History, *, t, keys_Z, x_ZI, live_Z, horizon_s) -> History:
    """Opens windows (features ``x_ZI``) for the resident blocks ``keys_Z`` that have none and are
    due one. Keys outside the pool get windows only at their requests, so long-gone prefixes
    do not flood the replay buffer with negatives."""
    rows = hist.table_PJ[keys_Z]
    do_Z = live_Z & (rows[:, WIN_OPEN] == 0) & (t >= rows[:, NEXT_OPEN])
    idx_Z = jnp.where(do_Z, keys_Z, hist.table_PJ.shape[0])  # others → dropped
    new = rows.at[:, WIN_OPEN].set(1.0).at[:, WIN_T0].set(t).at[:, NEXT_OPEN].set(t + horizon_s)
    new = new.at[:, WIN_X].set(x_ZI)
    return hist.replace(table_PJ=hist.table_PJ.at[idx_Z].set(new, mode="drop"))
