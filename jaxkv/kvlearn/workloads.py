"""Synthetic workloads: the README's Zipf multimodal requests and MM-Session conversations.

``zipf_multimodal`` draws i.i.d. requests for whole prefixes from ``zipf_catalog`` (a ``Trace``
for the core simulator). ``mm_session`` generates MM-Session, a seeded multimodal multi-turn
workload as Mooncake records (``traces.save_mooncake_jsonl`` writes them; ``load_mooncake_trace``
reads them back for the serving simulator).

MM-Session: each session picks a system prompt (Zipf over ``n_system``), optionally one image
(576 tokens, LLaVA-1.5) and/or one video (720–1440 tokens), each drawn from a shared catalog
with Zipf popularity, then runs 1..``max_turns`` turns. Turn k's prompt is the session's context
so far:

    system | media | user_1 | answer_1 | … | user_k          (input_length; output = answer_k)

so prefixes grow turn by turn. The prompt is cut into 512-token blocks whose ids are chained
hashes of (previous block id, the segments the block covers), made dense in order of first
appearance: equal ids ⇔ equal prefixes, exactly as in a Mooncake trace. A media item is shared
across sessions only behind the same system prompt (prefix caching cannot reuse it elsewhere).

Arrivals: sessions start as a Poisson process (``rate_per_s``) or, with ``bursty=True``, in
bursts (Poisson burst times at ``rate_per_s / burst_mean``, geometric burst sizes of mean
``burst_mean``, sessions of a burst within one second); turn k+1 follows turn k after an
exponential think time (mean ``think_s``) plus the answer's length at ``decode_tok_per_s``.

``python -m jaxkv.eval kvlearn workload mmsession --sessions 500 --out mm.jsonl [--seed 0]
[--bursty]`` writes one to a file.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxkv.kvlearn.traces import BLOCK_TOKENS, IMAGE, TEXT, VIDEO, Trace, TraceError

IMAGE_TOKENS = 576
"""Tokens of one image (LLaVA-1.5), in both workloads."""


# ---- Zipf multimodal --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Catalog:
    """The prefixes a synthetic workload draws from: [J] arrays plus names."""

    names: tuple[str, ...]
    tokens: np.ndarray
    modality: np.ndarray
    popularity: np.ndarray


def zipf_catalog(
    alpha: float, *, n_text: int = 40, n_image: int = 80, n_video: int = 10
) -> Catalog:
    """The README simulator's catalog: Zipf weights over ranks, text first, then images, videos.

    Text prefixes are 64–288 tokens (64 + 32·(i mod 8)), images 576 tokens (LLaVA-1.5), videos
    720–1440 tokens (720 + 180·(i mod 5)). Weights are ``m / (rank+1)^α`` with modality factor
    m = 0.6 (text), 1.4 (image, heavier visual reuse), 1.1 (video), normalised to sum to one.
    """
    if not alpha > 0 or not math.isfinite(alpha):
        raise TraceError(f"zipf alpha must be a positive finite number, got {alpha}")
    if min(n_text, n_image, n_video) < 0 or n_text + n_image + n_video == 0:
        raise TraceError("catalog sizes must be ≥ 0 and not all zero")
    i_t, i_i, i_v = np.arange(n_text), np.arange(n_image), np.arange(n_video)
    tokens = np.concatenate(
        [64 + (i_t % 8) * 32, np.full(n_image, IMAGE_TOKENS), 720 + (i_v % 5) * 180]
    )
    modality = np.concatenate(
        [np.full(n_text, TEXT), np.full(n_image, IMAGE), np.full(n_video, VIDEO)]
    )
    factor = np.array([0.6, 1.4, 1.1])[modality]
    weight = factor / np.power(np.arange(tokens.size) + 1.0, alpha)
    names = tuple(
        [f"sys/text{i}" for i in i_t] + [f"img/{i}" for i in i_i] + [f"vid/{i}" for i in i_v]
    )
    return Catalog(names, tokens.astype(np.int32), modality.astype(np.int32), weight / weight.sum())


def zipf_multimodal(
    n_requests: int,
    alpha: float,
    *,
    seed: int,
    rate_per_s: float = 20.0,
    poisson: bool = False,
    catalog: Catalog | None = None,
) -> Trace:
    """The README's Zipf multimodal workload: i.i.d. draws from ``zipf_catalog(alpha)``.

    Arrivals are evenly spaced at ``rate_per_s`` (the reference simulator's 20 req/s) or, with
    ``poisson=True``, a Poisson process of that rate. Seeded and reproducible.
    """
    if n_requests <= 0:
        raise TraceError(f"n_requests must be positive, got {n_requests}")
    if not rate_per_s > 0:
        raise TraceError(f"rate_per_s must be positive, got {rate_per_s}")
    cat = catalog if catalog is not None else zipf_catalog(alpha)
    rng = np.random.default_rng(seed)
    key = rng.choice(len(cat.names), size=n_requests, p=cat.popularity).astype(np.int32)
    if poisson:
        time_s = np.cumsum(rng.exponential(1.0 / rate_per_s, size=n_requests))
    else:
        time_s = np.arange(1, n_requests + 1, dtype=np.float64) / rate_per_s
    return Trace(key, cat.tokens[key], cat.modality[key], time_s, cat.names, cat.popularity)


# ---- MM-Session -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MMSessionConfig:
    """Workload knobs (see the module docstring)."""

    n_system: int = 8
    system_tokens: tuple[int, int] = (300, 2000)
    n_images: int = 200
    n_videos: int = 40
    zipf_alpha: float = 1.1
    p_image: float = 0.5
    p_video: float = 0.2
    max_turns: int = 6
    user_tokens: tuple[int, int] = (30, 400)
    answer_tokens: tuple[int, int] = (30, 300)
    rate_per_s: float = 2.0
    bursty: bool = False
    burst_mean: float = 8.0
    think_s: float = 20.0
    decode_tok_per_s: float = 50.0

    def __post_init__(self):
        if min(self.n_system, self.n_images, self.n_videos, self.max_turns) <= 0:
            raise ValueError("MMSessionConfig: catalog sizes and max_turns must be positive")
        if not (self.rate_per_s > 0 and self.think_s >= 0 and self.zipf_alpha > 0):
            raise ValueError("MMSessionConfig: rate_per_s, zipf_alpha > 0 and think_s ≥ 0")
        if not (0 <= self.p_image <= 1 and 0 <= self.p_video <= 1 and self.burst_mean >= 1):
            raise ValueError("MMSessionConfig: probabilities in [0, 1], burst_mean ≥ 1")


def _zipf(rng, n: int, alpha: float) -> int:
    w = 1.0 / np.arange(1, n + 1) ** alpha
    return int(rng.choice(n, p=w / w.sum()))


def _session_starts(rng, n: int, cfg: MMSessionConfig) -> np.ndarray:
    if not cfg.bursty:
        return np.cumsum(rng.exponential(1.0 / cfg.rate_per_s, n))
    starts: list[float] = []
    t = 0.0
    while len(starts) < n:
        t += rng.exponential(cfg.burst_mean / cfg.rate_per_s)
        size = rng.geometric(1.0 / cfg.burst_mean)
        starts += list(t + np.sort(rng.random(size)))
    return np.array(starts[:n])


def mm_session(n_sessions: int, *, seed: int, cfg: MMSessionConfig | None = None) -> list[dict]:
    """Mooncake records (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``,
    plus ``session`` and ``turn``), sorted by time."""
    cfg = cfg or MMSessionConfig()
    if n_sessions <= 0:
        raise ValueError(f"n_sessions must be positive, got {n_sessions}")
    rng = np.random.default_rng(seed)
    sys_len = rng.integers(*cfg.system_tokens, size=cfg.n_system, endpoint=True)
    vid_len = 720 + 180 * rng.integers(0, 5, size=cfg.n_videos)
    ids: dict[tuple, int] = {}
    out = []
    for s, t in enumerate(_session_starts(rng, n_sessions, cfg)):
        k = _zipf(rng, cfg.n_system, cfg.zipf_alpha)
        segs = [(("sys", k), int(sys_len[k]))]
        if rng.random() < cfg.p_image:
            segs.append((("img", _zipf(rng, cfg.n_images, cfg.zipf_alpha)), IMAGE_TOKENS))
        if rng.random() < cfg.p_video:
            v = _zipf(rng, cfg.n_videos, cfg.zipf_alpha)
            segs.append((("vid", v), int(vid_len[v])))
        for turn in range(int(rng.integers(1, cfg.max_turns, endpoint=True))):
            segs.append((("user", s, turn), int(rng.integers(*cfg.user_tokens, endpoint=True))))
            answer = int(rng.integers(*cfg.answer_tokens, endpoint=True))
            n_in = sum(n for _, n in segs)
            out.append(
                {
                    "timestamp": round(t * 1e3, 3),
                    "input_length": n_in,
                    "output_length": answer,
                    "hash_ids": _hash_blocks(segs, ids),
                    "session": s,
                    "turn": turn,
                }
            )
            segs.append((("answer", s, turn), answer))
            t += rng.exponential(cfg.think_s) + answer / cfg.decode_tok_per_s
    out.sort(key=lambda r: r["timestamp"])
    return out


def _hash_blocks(segs, ids: dict) -> list[int]:
    """Chained block ids of a segment list: each block is (parent id, covered segment pieces)."""
    blocks, parent, piece, fill = [], -1, [], 0
    for name, n in segs:
        off = 0
        while off < n:
            take = min(n - off, BLOCK_TOKENS - fill)
            piece.append((name, off, take))
            off, fill = off + take, fill + take
            if fill == BLOCK_TOKENS:
                parent = ids.setdefault((parent, tuple(piece)), len(ids))
                blocks.append(parent)
                piece, fill = [], 0
    if piece:
        blocks.append(ids.setdefault((parent, tuple(piece)), len(ids)))
    return blocks
