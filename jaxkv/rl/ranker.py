"""Supervised training of the per-head ranker (``jaxkv.policies.ranker``): no RL.

Data. Windows of ``window`` tokens are drawn from the text of the training domains
(``jaxkv.rl.data.TRAIN_DOMAINS``; the held-out domain is never read), or, for the ``recall``
domain, built around the points (``jaxkv.rl.recall``). Each window runs through
the model with a full cache: a prefill of ``points[0]`` tokens, then ``extend`` passes of
``chunk`` tokens. At each point P (tokens processed) the cache's per-row features are recorded
(``head_features``), and the target of every cached token is the attention that the next
``horizon`` queries give it under the full cache: ``attn_cum`` after P + horizon tokens minus
``attn_cum`` after P (``attn_cum`` sums every query's mass, mean over the KV group, so the
difference is exactly the oracle's future attention over that horizon). The compress-once
protocol compresses at such a point.

The decode protocol evicts from caches already pruned, whose statistics differ (attention
renormalizes over fewer tokens). For each ratio in ``pruned_ratios`` (none by default) a cache
runs the same chunks but is compressed by H2O per head to ``max(r * N, min_budget)`` tokens
after the prefill and after every chunk; its rows at each point are recorded too, each kept
token with the full cache's future attention at its position as the target. They train
unless ``fit_pruned`` is off (then they only validate).

With ``target="peak"`` the future attention is the most that any one of the next ``horizon``
queries pays the token (mean over its KV group), not their sum, times its value norm: the
kind of score kvzip keeps by (the most attention any reconstruction query pays), which favours
a token one query needs badly over one many queries glance at. It reads each query's own
attention, so it needs ``chunk`` = 1 (one teacher-forced token per pass, where ``attn`` is
that query's attention).

With ``target="value"`` the target is that future attention times the token's value norm
(``||v||``, the ``vnorm`` statistic): what dropping the token removes from the attention
outputs, to first order, rather than from their weights (CriticalKV's argument). With
``target="critical"`` the norm is taken after the output projection, ``||W_o v||_1`` (mean
over the KV group's query heads: CriticalKV's own bound, the ``log_wo_vnorm`` feature).

A ranker whose features include kvzip's reconstruction scores (``ranker.RECON_FEATURES``,
prefill protocol only) gets them at every point P from kvzip's reconstruction pass over the
window's first P tokens (``jaxkv.evals.fidelity.prompt_reconstruction``: P + 15 more decode
steps per point, the costliest part of its data); other rankers get zeros in those columns.

Loss. ListNet per (point, window, layer, KV head) row: the cross-entropy between the row's
target distribution (future attention normalized over the row) and the softmax of its scores,
so the scores are log-odds of future attention, each row's up to a constant of its own. With
``pool`` > 1 the ListNet runs over groups of ``pool`` rows taken together (rows of one point,
drawn across windows, layers and heads): the softmax spans every slot of the group, so the
scores are the log target up to one constant shared by all rows, and a pooled granularity
(``adaptive``, ``global``), which compares raw scores across rows, ranks by the target across
rows as the oracle ranks by future attention. ``pool`` = L·K mimics ``global``'s pool of one
sequence.

With ``base`` (a feature name) the ranker is residual: score = that raw feature + the MLP, whose
output layer starts at zero (``ranker.init_params``), so training starts from ranking by the
base feature (``log_recon``: kvzip's own score) and moves away from it only where the loss says.

Windows are split once per domain: the first ``1 - val_fraction`` of each domain's text trains,
the rest validates (reported as loss and as the share of the oracle's kept mass that the
ranker's top-B keeps, beside H2O's accumulated attention on the same rows: ``evaluate_rows``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxkv import eviction, kvcache
from jaxkv.evals.fidelity import prompt_reconstruction, repeat_ids
from jaxkv.evals.tasks import token_ids
from jaxkv.model.decoder import extend, prefill
from jaxkv.policies import get_policy
from jaxkv.policies import kvzip as kvzip_lib
from jaxkv.policies import ranker as ranker_lib
from jaxkv.rl import recall as recall_lib
from jaxkv.rl.data import RECALL_DOMAIN, TRAIN_DOMAINS, domain_text

TARGETS = ("attention", "value", "critical", "peak")
_NORM = {  # the norm each target weights the future attention by, as a stored log feature
    "value": ranker_lib.FEATURES.index("log_vnorm"),
    "critical": ranker_lib.FEATURES.index("log_wo_vnorm"),
    "peak": ranker_lib.FEATURES.index("log_vnorm"),
}


@dataclasses.dataclass(frozen=True)
class RankerConfig:
    """Settings of ``train`` (the defaults are those of the shipped ranker)."""

    domains: tuple[str, ...] = TRAIN_DOMAINS
    windows_per_domain: int = 48
    window: int = 768
    points: tuple[int, ...] = (128, 256, 384, 512, 640)
    chunk: int = 64
    horizon: int = 128
    pruned_ratios: tuple[float, ...] = ()
    fit_pruned: bool = True  # False: the pruned caches' rows only validate
    min_budget: int = 32
    row_fraction: float = 0.34
    val_fraction: float = 0.1
    hidden: int = ranker_lib.HIDDEN
    steps: int = 3000
    rows_per_step: int = 256
    lr: float = 3e-3
    seed: int = 0
    batch: int = 4
    recent_fraction: float = 0.0  # saved with the ranker: see ranker.ranker_policy
    sinks: int = 0
    target: str = "attention"  # or "value" / "critical": times ||v|| / ||W_o v||_1
    features: tuple[str, ...] = ranker_lib.DEFAULT_FEATURES  # the columns the ranker reads
    pool: int = 1  # rows per ListNet softmax (module docstring)
    base: str | None = None  # a residual ranker's base feature, one of ``features``
    kvzip_request: str = kvzip_lib.DEFAULT_REQUEST  # the reconstruction features' repeat request

    def __post_init__(self):
        if self.pool < 1 or self.rows_per_step % self.pool:
            raise ValueError(f"pool must be >= 1 and divide rows_per_step: {self}")
        if not all(0 < p and p + self.horizon <= self.window for p in self.points):
            raise ValueError(f"every point + horizon must fit in the window: {self}")
        if any((p - self.points[0]) % self.chunk for p in self.points) or (
            self.horizon % self.chunk
        ):
            raise ValueError("points and horizon must lie on the chunk grid")
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.target == "peak" and self.chunk != 1:
            raise ValueError(
                "the peak target reads each future query's own attention: it needs chunk=1 "
                f"(one query per teacher-forced pass), got chunk={self.chunk}"
            )
        unknown = set(self.features) - set(ranker_lib.FEATURES)
        if not self.features or unknown:
            raise ValueError(f"features must be some of {ranker_lib.FEATURES}, got {unknown}")
        if self.base is not None and self.base not in self.features:
            raise ValueError(f"base must be one of the features, got {self.base!r}")
        kvzip_lib.check_request(self.kvzip_request)
        if self.reconstructs and self.pruned_ratios:
            raise ValueError(
                "the reconstruction features (kvzip's scores of the prompt) exist only in the "
                "prefill protocol: give no pruned_ratios with them"
            )

    @property
    def reconstructs(self) -> bool:
        """Whether the ranker reads kvzip's reconstruction scores (``RECON_FEATURES``): the
        data then runs kvzip's reconstruction pass over every point's prefix."""
        return any(n in ranker_lib.RECON_FEATURES for n in self.features)

    @property
    def columns(self) -> np.ndarray:
        """Indices of ``features`` among the collected ``ranker_lib.FEATURES``."""
        return np.asarray([ranker_lib.FEATURES.index(n) for n in self.features])


@dataclasses.dataclass
class RowSet:
    """Rows of one point P: every ``ranker_lib.FEATURES`` column [R, P, F] (float16), targets
    [R, P] (float32)."""

    point: int
    feats: np.ndarray
    target: np.ndarray
    future: np.ndarray  # the future attention alone (the target before any norm), [R, P]
    pruned: float | None = None  # the H2O ratio of the cache the rows come from (None: full)

    @property
    def name(self) -> str:
        return str(self.point) if self.pruned is None else f"{self.point}@{self.pruned}"


def domain_windows(tokenizer, cfg: RankerConfig, *, split: str) -> dict[str, np.ndarray]:
    """[n, window] token windows per domain, from its train or validation part (seeded)."""
    out = {}
    for i, domain in enumerate(cfg.domains):
        recalls = domain == RECALL_DOMAIN
        ids, cut = _split_ids(tokenizer, recall_lib.FILLER_DOMAINS if recalls else (domain,), cfg)
        part = ids[:cut] if split == "train" else ids[cut:]
        n = cfg.windows_per_domain if split == "train" else max(cfg.windows_per_domain // 8, 2)
        seed = [cfg.seed, i, split == "train"]
        if recalls:  # the filler of windows built around the training points
            out[domain] = recall_lib.recall_windows(
                tokenizer, part, n=n, window=cfg.window, points=cfg.points, seed=seed
            )
            continue
        starts = np.random.default_rng(seed).integers(0, part.size - cfg.window, size=n)
        out[domain] = np.stack([part[s : s + cfg.window] for s in starts])
    return out


def validation_text(
    tokenizer, cfg: RankerConfig | None = None, *, windows: int = 2, window: int = 384
) -> str:
    """Text for ``python -m jaxkv.eval fidelity --text`` from the validation part of each
    training domain (``domain_windows``' split: tokens after ``1 - val_fraction`` of the
    domain, never trained on): ``windows`` × ``window`` tokens (plus 40 of slack) starting 100
    tokens after the cut, decoded and concatenated. The validation windows the ranker
    selection rules were written for (results/ranker_global_selection.md)."""
    cfg = cfg or RankerConfig()
    parts = []
    for domain in cfg.domains:
        ids, cut = _split_ids(tokenizer, (domain,), cfg)
        start = cut + 100
        parts.append(tokenizer.decode(ids[start : start + windows * window + 40].tolist()))
    return "".join(parts)


def _split_ids(tokenizer, sources, cfg: RankerConfig) -> tuple[np.ndarray, int]:
    """The token ids of the ``sources`` domains' text, and where their validation part
    starts (the last ``val_fraction`` of them)."""
    chat = tokenizer if hasattr(tokenizer, "apply_chat_template") else None
    text = "".join(domain_text(d, tokenizer=chat) for d in sources)
    ids = np.asarray(token_ids(tokenizer, text), np.int32)
    return ids, int(ids.size * (1 - cfg.val_fraction))


@functools.partial(jax.jit, static_argnames=("config", "capacity", "n"))
def _prefill(params, tokens, *, config, capacity, n):
    cache = kvcache.init_cache(
        config,
        batch_size=tokens.shape[0],
        capacity=capacity,
        stats=ranker_lib.stats_for(ranker_lib.FEATURES),
    )
    return prefill(params, tokens[:, :n], cache, config=config)[1]


@functools.partial(jax.jit, static_argnames=("config",))
def _extend(params, tokens, cache, *, config):
    return extend(params, tokens, cache, config=config)[1]


def _rows(cache, future_LBKT, reconstruction):
    """Features [L, B, K, m, F] and targets [L, B, K, m] of the m valid slots of every row
    (every row holds the same number), the targets read at each slot's position."""
    m = int(jnp.sum(cache.valid[0, 0, 0]))
    return _rows_jit(cache, future_LBKT, reconstruction, m=m)


@functools.partial(jax.jit, static_argnames=("m",))
def _rows_jit(cache, future_LBKT, reconstruction, *, m):
    order = jnp.argsort(~cache.valid, axis=-1, stable=True)[..., :m]
    feats = ranker_lib.head_features(cache, reconstruction=reconstruction)
    feats = jnp.take_along_axis(feats, order[..., None], axis=3)
    pos = jnp.take_along_axis(cache.pos, order, axis=-1)
    return feats, jnp.take_along_axis(future_LBKT, pos, axis=-1)


def _h2o(ratio: float, min_budget: int) -> eviction.Compression:
    return eviction.Compression(
        get_policy("h2o"), ratio=ratio, min_budget=min_budget, granularity="head"
    )


@functools.partial(jax.jit, static_argnames=("compression",))
def _evict(cache, compression):
    return eviction.evict(cache, compression, None, key=jax.random.key(0))


def collect(
    params, config, windows: np.ndarray, cfg: RankerConfig, *, rng, repeat_R=None
) -> list[RowSet]:
    """Feature and target rows of every point of ``windows`` [n, window] (module docstring):
    one RowSet per point for the full cache, then one per (point, pruned ratio).

    ``repeat_R``: kvzip's repeat request (``fidelity.repeat_ids``), needed when ``cfg``
    ``reconstructs``; the reconstruction columns are 0 otherwise."""
    if cfg.reconstructs and repeat_R is None:
        raise ValueError("reconstruction features need kvzip's repeat request (repeat_R)")
    kinds = [None, *cfg.pruned_ratios]
    feats = {(k, p): [] for k in kinds for p in cfg.points}
    target = {(k, p): [] for k in kinds for p in cfg.points}
    fut = {(k, p): [] for k in kinds for p in cfg.points}
    for b in tqdm(range(0, len(windows), cfg.batch), desc="ranker data", leave=False):
        tokens = jnp.asarray(windows[b : b + cfg.batch], jnp.int32)
        caches = {
            k: _prefill(params, tokens, config=config, capacity=cfg.window, n=cfg.points[0])
            for k in kinds
        }
        states = {k: {} for k in kinds}  # kind -> point -> cache at that point
        ends = {*cfg.points, *(p + cfg.horizon for p in cfg.points)}
        cum = {cfg.points[0]: caches[None].stats["attn_cum"]}
        peak = {}  # point P -> the most attention any query in (P, P + horizon] paid each slot
        n = cfg.points[0]
        while n < max(cfg.points) + cfg.horizon:
            for k in kinds:
                if n in cfg.points:
                    states[k][n] = caches[k]
                if k is not None:
                    caches[k] = _evict(caches[k], _h2o(k, cfg.min_budget))
                caches[k] = _extend(params, tokens[:, n : n + cfg.chunk], caches[k], config=config)
            n += cfg.chunk
            if n in ends:
                cum[n] = caches[None].stats["attn_cum"]
            if cfg.target == "peak":  # chunk 1: ``attn`` is this one query's attention
                a = caches[None].stats["attn"]
                for p in (p for p in cfg.points if p < n <= p + cfg.horizon):
                    peak[p] = jnp.maximum(peak[p], a) if p in peak else a
        for p in cfg.points:
            future = peak[p] if cfg.target == "peak" else cum[p + cfg.horizon] - cum[p]
            recon = _reconstruction(params, config, windows[b : b + cfg.batch, :p], cfg, repeat_R)
            for k in kinds:
                f, t = (np.asarray(x) for x in _rows(states[k][p], future, recon))
                f = f.reshape(-1, f.shape[-2], f.shape[-1]).astype(np.float16)
                t = t.reshape(-1, t.shape[-1])
                keep = rng.random(len(t)) < cfg.row_fraction
                feats[k, p].append(f[keep])
                fut[k, p].append(t[keep])
                target[k, p].append(weighted(t[keep], f[keep], cfg.target))
    return [
        RowSet(
            p,
            np.concatenate(feats[k, p]),
            np.concatenate(target[k, p]),
            np.concatenate(fut[k, p]),
            pruned=k,
        )
        for k in kinds
        for p in cfg.points
    ]


def _reconstruction(params, config, prompts_BS, cfg: RankerConfig, repeat_R):
    """kvzip's scores of the prompts when ``cfg`` reads them, else zeros of their shape."""
    if cfg.reconstructs:
        return prompt_reconstruction(params, prompts_BS, repeat_R, config=config)
    B, S = prompts_BS.shape
    return kvzip_lib.Reconstruction(jnp.zeros((config.n_layers, B, config.n_kv_heads, S)))


def weighted(future: np.ndarray, feats: np.ndarray, target: str) -> np.ndarray:
    """The ``target`` of rows [R, P] of future attention with their features [R, P, F]:
    itself, or times the norm the target names (read from its stored float16 log)."""
    if target not in _NORM:
        return future
    return future * np.exp(feats[..., _NORM[target]].astype(np.float32))


def listnet(scores: jax.Array, target: jax.Array) -> jax.Array:
    """Mean over rows [..., C] of the cross-entropy between the target's distribution over the
    row and the softmax of the scores (minimal, the target's entropy, at scores = log target)."""
    t = target / jnp.maximum(jnp.sum(target, axis=-1, keepdims=True), 1e-12)
    return -jnp.mean(jnp.sum(t * jax.nn.log_softmax(scores, axis=-1), axis=-1))


def listnet_loss(params, feats, target, *, pool: int = 1):
    """``listnet`` of the ranker's scores of feature rows [R, C, F], over groups of ``pool``
    consecutive rows taken as one list (R divisible by ``pool``)."""
    valid = jnp.ones(feats.shape[:-1], bool)
    scores = ranker_lib.scores_from_features(params, feats.astype(jnp.float32), valid)
    return listnet(pooled(scores, pool), pooled(target, pool))


def pooled(rows: jax.Array | np.ndarray, pool: int):
    """Rows [R, C] as [R / pool, pool * C]: each group of ``pool`` consecutive rows one row."""
    return rows.reshape(rows.shape[0] // pool, pool * rows.shape[1])


def kept_mass(scores: np.ndarray, target: np.ndarray, ratio: float) -> float:
    """Mean over rows of the future mass a top-B by ``scores`` keeps, over the oracle's top-B."""
    B = max(int(ratio * scores.shape[-1]), 1)
    top = np.argpartition(-scores, B - 1, axis=-1)[:, :B]
    best = -np.partition(-target, B - 1, axis=-1)[:, :B]
    got = np.take_along_axis(target, top, axis=-1).sum(-1)
    return float(np.mean(got / np.maximum(best.sum(-1), 1e-12)))


def standardization(sets: list[RowSet], cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and scale of every feature of ``cols`` over all training entries."""
    x = np.concatenate([s.feats[..., cols].reshape(-1, len(cols)) for s in sets])
    x = x.astype(np.float64)
    return x.mean(0).astype(np.float32), np.maximum(x.std(0), 1e-3).astype(np.float32)


def fit(sets: list[RowSet], cfg: RankerConfig, *, log=None) -> dict:
    """Trains the ranker on ``sets`` with Adam; returns its params."""
    key = jax.random.key(cfg.seed)
    cols = cfg.columns
    base = None if cfg.base is None else cfg.features.index(cfg.base)
    params = ranker_lib.init_params(key=key, hidden=cfg.hidden, n_features=len(cols), base=base)
    mean, scale = standardization(sets, cols)
    params = {**params, "mean": jnp.asarray(mean), "scale": jnp.asarray(scale)}
    opt = optax.adam(optax.cosine_decay_schedule(cfg.lr, cfg.steps))
    opt_state = opt.init(params["mlp"])

    @jax.jit
    def step(params, opt_state, feats, target):
        def loss_fn(mlp):
            return listnet_loss({**params, "mlp": mlp}, feats, target, pool=cfg.pool)

        loss, grads = jax.value_and_grad(loss_fn)(params["mlp"])
        updates, opt_state = opt.update(grads, opt_state)
        return {**params, "mlp": optax.apply_updates(params["mlp"], updates)}, opt_state, loss

    rng = np.random.default_rng(cfg.seed)
    bar = tqdm(range(cfg.steps), desc="ranker fit")
    for i in bar:
        s = sets[i % len(sets)]
        idx = rng.integers(0, len(s.target), size=cfg.rows_per_step)
        feats = s.feats[idx][..., cols]
        params, opt_state, loss = step(params, opt_state, feats, s.target[idx])
        if i % 100 == 0:
            bar.set_postfix(loss=f"{float(loss):.4f}")
            if log:
                log({"step": i, "loss": float(loss)})
    return params


def evaluate_rows(params, sets: list[RowSet], cols: np.ndarray, *, pool: int = 1) -> dict:
    """Validation loss and kept future mass, by the ranker reading feature columns ``cols``
    and by accumulated attention (H2O's score): of the training target, and of the
    ``critical`` one (every ranker's common yardstick), at r = 0.25 and 0.125 on full-cache
    rows and r = 0.5 on pruned ones (the decode protocol drops few of a pruned cache). With
    ``pool`` > 1 also ``kept_pooled_*``: the same over groups of ``pool`` consecutive rows
    (fewer when a set has fewer rows) taken as one list (what a pooled granularity keeps; the
    remainder rows are left out)."""
    out = {}
    cum = ranker_lib.FEATURES.index("log_attn_cum")
    for s in sets:
        feats = jnp.asarray(s.feats[..., cols], jnp.float32)
        valid = jnp.ones(feats.shape[:-1], bool)
        scores = np.asarray(ranker_lib.scores_from_features(params, feats, valid))
        h2o = s.feats[..., cum].astype(np.float32)
        critical = weighted(s.future, s.feats, "critical")
        row = {"loss": float(listnet_loss(params, feats, jnp.asarray(s.target)))}
        group = min(pool, len(scores))
        n = len(scores) // group * group if group else 0
        lists = [pooled(x[:n], group) for x in (scores, h2o, s.target)] if pool > 1 and n else None
        for r in (0.25, 0.125) if s.pruned is None else (0.5,):
            row[f"kept_{r}"] = kept_mass(scores, s.target, r)
            row[f"kept_attn_cum_{r}"] = kept_mass(h2o, s.target, r)
            row[f"kept_critical_{r}"] = kept_mass(scores, critical, r)
            row[f"kept_critical_attn_cum_{r}"] = kept_mass(h2o, critical, r)
            if lists:
                row[f"kept_pooled_{r}"] = kept_mass(lists[0], lists[2], r)
                row[f"kept_pooled_attn_cum_{r}"] = kept_mass(lists[1], lists[2], r)
        out[s.name] = row
    return out


def train(model, cfg: RankerConfig, out: Path) -> Path:
    """Collects data, fits, validates and saves a ranker at ``out`` (``collect_splits``, then
    ``fit_and_save``)."""
    t0 = time.time()
    return fit_and_save(collect_splits(model, cfg), cfg, out, seconds=time.time() - t0)


def collect_splits(model, cfg: RankerConfig) -> dict[str, list[list[RowSet]]]:
    """Rows of every training domain's train and validation windows: split -> per domain."""
    rng = np.random.default_rng(cfg.seed)
    repeat = repeat_ids(model.tokenizer, cfg.kvzip_request) if cfg.reconstructs else None
    return {
        split: [
            collect(model.params, model.config, w, cfg, rng=rng, repeat_R=repeat)
            for w in domain_windows(model.tokenizer, cfg, split=split).values()
        ]
        for split in ("train", "val")
    }


def fit_and_save(data: dict, cfg: RankerConfig, out: Path, *, seconds: float = 0.0) -> Path:
    """Fits a ranker on ``data["train"]`` (``collect_splits``), validates it on
    ``data["val"]`` and saves it at ``out`` (the validation in its meta)."""
    t0 = time.time()
    train_sets = [[s for s in sets if cfg.fit_pruned or s.pruned is None] for sets in data["train"]]
    params = fit(merge_domains(train_sets), cfg)
    val = {
        domain: evaluate_rows(params, sets, cfg.columns, pool=cfg.pool)
        for domain, sets in zip(cfg.domains, data["val"], strict=True)
    }
    meta = {
        "recent_fraction": cfg.recent_fraction,
        "sinks": cfg.sinks,
        "config": dataclasses.asdict(cfg),
        "trained_on": list(cfg.domains),
        "validation": val,
        "seconds": round(seconds + time.time() - t0, 1),
    }
    return ranker_lib.save_ranker(Path(out), params, meta, features=cfg.features)


def merge_domains(per_domain: list[list[RowSet]]) -> list[RowSet]:
    """One RowSet per (point, pruned ratio): every domain's rows of it concatenated."""
    return [
        RowSet(
            sets[0].point,
            np.concatenate([s.feats for s in sets]),
            np.concatenate([s.target for s in sets]),
            np.concatenate([s.future for s in sets]),
            pruned=sets[0].pruned,
        )
        for sets in zip(*per_domain, strict=True)
    ]
