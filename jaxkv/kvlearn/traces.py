"""Request traces for the KVLearn simulator: the README's Zipf multimodal workload and JSONL files.

A trace is a sequence of requests, each naming a reusable prefix (its KV block) by key. Keys are
mapped to dense ids ``0..K-1`` so the simulator can keep per-key arrays; ``names[k]`` is the key.

JSONL trace format (one request per line, every field required, no others allowed)::

    {"t": 0.05, "key": "img/17", "tokens": 576, "modality": "image"}

``t`` is the arrival time in seconds (finite, ≥ 0, non-decreasing), ``key`` a non-empty string,
``tokens`` the prefix length (integer > 0) and ``modality`` one of ``text``, ``image``,
``video``. A key always names the same prefix, so its ``tokens`` and ``modality`` must not
change between lines. Blank lines are skipped; any other defect raises ``TraceError`` with the
line number.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

MODALITIES = ("text", "image", "video")
TEXT, IMAGE, VIDEO = 0, 1, 2
_FIELDS = {"t", "key", "tokens", "modality"}


class TraceError(ValueError):
    """A malformed trace file or trace argument."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """Requests in arrival order (numpy, host side).

    Attributes:
        key: [N] int32 dense key id per request.
        tokens: [N] int32 prefix length per request.
        modality: [N] int32 (0 text, 1 image, 2 video).
        time_s: [N] float64 arrival time.
        names: K key names, ``names[key[i]]`` is request i's key.
        popularity: [K] true request probabilities when known (synthetic traces), else None.
    """

    key: np.ndarray
    tokens: np.ndarray
    modality: np.ndarray
    time_s: np.ndarray
    names: tuple[str, ...]
    popularity: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.key.shape[0])

    @property
    def n_keys(self) -> int:
        return len(self.names)

    def head(self, n: int) -> Trace:
        """The first n requests (same key table)."""
        return dataclasses.replace(
            self,
            key=self.key[:n],
            tokens=self.tokens[:n],
            modality=self.modality[:n],
            time_s=self.time_s[:n],
        )

    def empirical_popularity(self) -> np.ndarray:
        """[K] request frequencies over the whole trace (future knowledge)."""
        counts = np.bincount(self.key, minlength=self.n_keys).astype(np.float64)
        return counts / max(len(self), 1)


@dataclasses.dataclass(frozen=True)
class Catalog:
    """The prefixes a synthetic workload draws from: [K] arrays plus names."""

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
    tokens = np.concatenate([64 + (i_t % 8) * 32, np.full(n_image, 576), 720 + (i_v % 5) * 180])
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


def next_use_index(key: np.ndarray) -> np.ndarray:
    """[N] int32: index of the next request for the same key, or N if there is none."""
    n = key.shape[0]
    nxt = np.full(n, n, dtype=np.int32)
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        k = int(key[i])
        nxt[i] = last.get(k, n)
        last[k] = i
    return nxt


# ---- JSONL ----------------------------------------------------------------------------------
def save_jsonl(trace: Trace, path: str | Path) -> None:
    """Writes a trace in the JSONL format above."""
    with open(path, "w") as f:
        for i in range(len(trace)):
            row = {
                "t": float(trace.time_s[i]),
                "key": trace.names[int(trace.key[i])],
                "tokens": int(trace.tokens[i]),
                "modality": MODALITIES[int(trace.modality[i])],
            }
            f.write(json.dumps(row) + "\n")


def load_jsonl(path: str | Path) -> Trace:
    """Reads and validates a JSONL trace; raises ``TraceError`` naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    ids: dict[str, int] = {}
    meta: list[tuple[int, int]] = []
    rows: list[tuple[int, int, int, float]] = []
    last_t = 0.0
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            key, tokens, mod, t = _parse_line(line, where=f"{path}:{lineno}")
            if t < last_t:
                raise TraceError(f"{path}:{lineno}: time {t} goes backwards (previous {last_t})")
            last_t = t
            k = ids.setdefault(key, len(ids))
            if k == len(meta):
                meta.append((tokens, mod))
            elif meta[k] != (tokens, mod):
                raise TraceError(
                    f"{path}:{lineno}: key {key!r} changed from tokens/modality {meta[k]} "
                    f"to {(tokens, mod)}"
                )
            rows.append((k, tokens, mod, t))
    if not rows:
        raise TraceError(f"{path}: trace has no requests")
    arr = np.array(rows, dtype=np.float64)
    return Trace(
        key=arr[:, 0].astype(np.int32),
        tokens=arr[:, 1].astype(np.int32),
        modality=arr[:, 2].astype(np.int32),
        time_s=arr[:, 3],
        names=tuple(ids),
    )


def _parse_line(line: str, *, where: str) -> tuple[str, int, int, float]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing, extra = _FIELDS - row.keys(), row.keys() - _FIELDS
    if missing:
        raise TraceError(f"{where}: missing fields {sorted(missing)}")
    if extra:
        raise TraceError(f"{where}: unknown fields {sorted(extra)} (allowed: {sorted(_FIELDS)})")
    key, tokens, mod, t = row["key"], row["tokens"], row["modality"], row["t"]
    if not isinstance(key, str) or not key:
        raise TraceError(f"{where}: 'key' must be a non-empty string, got {key!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise TraceError(f"{where}: 'tokens' must be an integer > 0, got {tokens!r}")
    if mod not in MODALITIES:
        raise TraceError(f"{where}: 'modality' must be one of {MODALITIES}, got {mod!r}")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: 't' must be a finite number ≥ 0 (seconds), got {t!r}")
    return key, tokens, MODALITIES.index(mod), float(t)


def load_mooncake(path: str | Path, *, block_tokens: int = 512) -> Trace:
    """Reads a Mooncake trace (``timestamp`` ms, ``input_length``, ``hash_ids``) block by block.

    Each request becomes one pool request per 512-token prefix block (in prefix order, at the
    request's time); equal hash ids are the same reusable block. The last block holds the
    remainder of ``input_length``. All blocks are text.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    ids: dict[int, int] = {}
    key, tokens, time_s = [], [], []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
                t_ms, n_in, hashes = row["timestamp"], int(row["input_length"]), row["hash_ids"]
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{where}: not a Mooncake trace line ({e})") from None
            if not hashes or n_in <= 0 or len(hashes) != -(-n_in // block_tokens):
                raise TraceError(f"{where}: {len(hashes)} hash_ids for input_length {n_in}")
            for j, h in enumerate(hashes):
                key.append(ids.setdefault(int(h), len(ids)))
                tokens.append(min(block_tokens, n_in - j * block_tokens))
                time_s.append(float(t_ms) / 1e3)
    if not key:
        raise TraceError(f"{path}: trace has no requests")
    tok = np.array(tokens, dtype=np.int32)
    # A block id names a fixed prefix; the last partial block of one request may be a full
    # block in another, so keep the largest length seen per id.
    k = np.array(key, dtype=np.int32)
    per_key = np.zeros(len(ids), dtype=np.int32)
    np.maximum.at(per_key, k, tok)
    order = np.argsort(np.array(time_s), kind="stable")
    return Trace(
        key=k[order],
        tokens=per_key[k][order],
        modality=np.zeros(len(k), dtype=np.int32),
        time_s=np.array(time_s)[order],
        names=tuple(f"mc/{h}" for h in ids),
    )
