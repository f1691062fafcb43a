"""Request traces for the KVLearn simulator: the README's Zipf multimodal workload and JSONL files.

A trace is a sequence of requests, each naming a reusable prefix (its KV block) by key. Keys are
mapped to dense ids ``0..K-1`` so the simulator can keep per-key arrays; ``names[k]`` is the key.

JSONL trace format (one request per line, every field required, no others allowed)::

    {"t": 0.05, "key": "img/17", "tokens": 576, "modality": "image"}

``t`` is the arrival time in seconds (finite, ≥ 0, non-decreasing), ``key`` a non-empty string,
``tokens`` the prefix length (integer > 0) and ``modality`` one of ``text``, ``image``,
``video``. A key always names the same prefix, so its ``tokens`` and ``modality`` must not
change between lines; ``tokens`` is at most ``MAX_TOKENS`` (token counts are int32 on the device).
Blank lines are skipped; any other defect raises ``TraceError`` with the line number.

Mooncake traces (FAST'25; ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``) are
read by one validating loader, ``load_mooncake_trace`` (request level, for the serving
simulator); ``load_mooncake`` turns the same records into one pool request per prefix block for
the core simulator. The name ``EXAMPLE`` (``"example"``) stands for the Mooncake example trace
shipped with jaxkv (``trace_path``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from jaxkv import data as data_lib

MODALITIES = ("text", "image", "video")
TEXT, IMAGE, VIDEO = 0, 1, 2
_FIELDS = {"t", "key", "tokens", "modality"}
MAX_TOKENS = 2**31 - 1
"""Largest prefix length a trace may give (the simulator carries token counts as int32)."""
EXAMPLE = "example"
"""Trace name that stands for the shipped Mooncake example trace (``trace_path``)."""
_PROGRESS_EVERY = 1 << 20  # bytes between calls of a loader's ``progress`` callback

Progress = Callable[[int], None]
"""``progress(n)``: n more units (bytes read, requests replayed) are done."""


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


def trace_path(name: str | Path) -> Path:
    """The file a trace argument names: ``EXAMPLE`` is the shipped Mooncake example trace
    (``jaxkv.data.MOONCAKE_EXAMPLE``); anything else is a path (``./example`` for a file of
    that name)."""
    if str(name) == EXAMPLE:
        return data_lib.data_file(data_lib.MOONCAKE_EXAMPLE)
    return Path(name)


def _lines(path: Path, progress: Progress | None) -> Iterator[tuple[int, str]]:
    """(line number, text) of every non-blank line of an existing UTF-8 file; ``progress`` is
    told the bytes read, in steps of ``_PROGRESS_EVERY``."""
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    pending = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            pending += len(raw)
            if progress is not None and pending >= _PROGRESS_EVERY:
                progress(pending)
                pending = 0
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{path}:{lineno}: not UTF-8 text") from None
            if line.strip():
                yield lineno, line
    if progress is not None and pending:
        progress(pending)


def load_jsonl(path: str | Path, *, progress: Progress | None = None) -> Trace:
    """Reads and validates a JSONL trace; raises ``TraceError`` naming the file and line.

    ``progress`` (optional) is called with the number of bytes read as the file is parsed.
    """
    path = Path(path)
    ids: dict[str, int] = {}
    meta: list[tuple[int, int]] = []
    rows: list[tuple[int, int, int, float]] = []
    last_t = 0.0
    for lineno, line in _lines(path, progress):
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
    if tokens > MAX_TOKENS:
        raise TraceError(
            f"{where}: 'tokens' must be at most {MAX_TOKENS:,} (token counts are int32), "
            f"got {tokens:,}"
        )
    if mod not in MODALITIES:
        raise TraceError(f"{where}: 'modality' must be one of {MODALITIES}, got {mod!r}")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: 't' must be a finite number ≥ 0 (seconds), got {t!r}")
    return key, tokens, MODALITIES.index(mod), float(t)


# ---- Mooncake -------------------------------------------------------------------------------
BLOCK_TOKENS = 512
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclasses.dataclass(frozen=True)
class MooncakeTrace:
    """Mooncake requests in arrival order.

    Attributes:
        time_s: [N] float64 arrival times (s).
        input_len: [N] int64 prompt tokens.
        output_len: [N] int64 generated tokens.
        blocks: N int64 arrays of dense block ids, one per ``block_tokens`` prompt block.
        n_blocks: distinct block ids.
        block_tokens: tokens per block (the last block of a request holds the remainder).
        hashes: the file's hash id of each dense block id (None for a trace built by hand).
    """

    time_s: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    blocks: tuple[np.ndarray, ...]
    n_blocks: int
    block_tokens: int = BLOCK_TOKENS
    hashes: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return int(self.time_s.shape[0])

    def scaled(self, load_scale: float) -> MooncakeTrace:
        """Arrivals compressed ``load_scale``× (S > 1 is heavier load)."""
        if not load_scale > 0 or not math.isfinite(load_scale):
            raise ValueError(f"load_scale must be a positive number, got {load_scale}")
        return dataclasses.replace(self, time_s=self.time_s / load_scale)

    def head(self, n: int) -> MooncakeTrace:
        """The first n requests (same block ids)."""
        return dataclasses.replace(
            self,
            time_s=self.time_s[:n],
            input_len=self.input_len[:n],
            output_len=self.output_len[:n],
            blocks=self.blocks[:n],
        )

    def block_tokens_of(self, i: int) -> np.ndarray:
        """[n_i] tokens in each block of request i (the last one holds the remainder)."""
        nb = len(self.blocks[i])
        tok = np.full(nb, self.block_tokens, np.int64)
        tok[-1] = int(self.input_len[i]) - (nb - 1) * self.block_tokens
        return tok


def load_mooncake_trace(
    path: str | Path, *, block_tokens: int = BLOCK_TOKENS, progress: Progress | None = None
) -> MooncakeTrace:
    """Reads a Mooncake (FAST'25) JSONL trace; raises ``TraceError`` naming file and line.

    Each line needs ``timestamp`` (ms, finite, ≥ 0, non-decreasing), ``input_length`` (integer
    > 0), ``output_length`` (integer ≥ 0) and ``hash_ids`` (a list of integers, one per
    ``block_tokens`` block of the input; equal ids are the same prefix block). Booleans,
    strings and floats are not integers here. Blank lines are skipped. ``progress`` (optional)
    is called with the number of bytes read.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    path = Path(path)
    ids: dict[int, int] = {}
    t_ms, n_in, n_out, blocks = [], [], [], []
    for lineno, line in _lines(path, progress):
        t, i, o, h = _parse_mooncake_line(line, where=f"{path}:{lineno}", bt=block_tokens)
        if t_ms and t < t_ms[-1]:
            raise TraceError(f"{path}:{lineno}: timestamp {t} goes backwards (previous {t_ms[-1]})")
        t_ms.append(t)
        n_in.append(i)
        n_out.append(o)
        blocks.append(np.array([ids.setdefault(x, len(ids)) for x in h], np.int64))
    if not blocks:
        raise TraceError(f"{path}: trace has no requests")
    return MooncakeTrace(
        time_s=np.array(t_ms, np.float64) / 1e3,
        input_len=np.array(n_in, np.int64),
        output_len=np.array(n_out, np.int64),
        blocks=tuple(blocks),
        n_blocks=len(ids),
        block_tokens=block_tokens,
        hashes=tuple(ids),
    )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_mooncake_line(line: str, *, where: str, bt: int) -> tuple[float, int, int, list[int]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in _MOONCAKE_FIELDS if k not in row]
    if missing:
        raise TraceError(f"{where}: missing field(s) {missing}")
    t, n_in, n_out, h = (row[k] for k in _MOONCAKE_FIELDS)
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: 'timestamp' must be a finite number ≥ 0 (ms), got {t!r}")
    if not _is_int(n_in) or n_in <= 0:
        raise TraceError(f"{where}: 'input_length' must be an integer > 0, got {n_in!r}")
    if not _is_int(n_out) or n_out < 0:
        raise TraceError(f"{where}: 'output_length' must be an integer ≥ 0, got {n_out!r}")
    if not isinstance(h, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers, got {h!r}")
    bad = next((x for x in h if not _is_int(x)), None)
    if bad is not None:
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers, got element {bad!r}")
    if len(h) != -(-n_in // bt):
        raise TraceError(
            f"{where}: {len(h)} hash_ids for input_length {n_in} (expected {-(-n_in // bt)} "
            f"blocks of {bt} tokens)"
        )
    return float(t), n_in, n_out, h


def is_mooncake_file(path: str | Path) -> bool:
    """Whether the first non-blank line of ``path`` looks like a Mooncake record."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    return b'"hash_ids"' in line
    except OSError:
        return False
    return False


def mooncake_blocks(trace: MooncakeTrace) -> Trace:
    """One pool request per prefix block of every Mooncake request (in prefix order, at the
    request's time), for the core simulator. All blocks are text; a block id's ``tokens`` is the
    largest length it has anywhere (the last, partial block of one request may be a full block
    in another)."""
    n_blk = np.array([len(b) for b in trace.blocks], np.int64)
    key = np.concatenate(trace.blocks).astype(np.int32)
    tokens = np.full(key.shape, trace.block_tokens, np.int64)
    tokens[np.cumsum(n_blk) - 1] = trace.input_len - (n_blk - 1) * trace.block_tokens
    per_key = np.zeros(trace.n_blocks, np.int32)
    np.maximum.at(per_key, key, tokens.astype(np.int32))
    time_s = np.repeat(trace.time_s, n_blk)
    order = np.argsort(time_s, kind="stable")
    hashes = trace.hashes if trace.hashes is not None else range(trace.n_blocks)
    return Trace(
        key=key[order],
        tokens=per_key[key][order],
        modality=np.zeros(len(key), dtype=np.int32),
        time_s=time_s[order],
        names=tuple(f"mc/{h}" for h in hashes),
    )


def load_mooncake(
    path: str | Path, *, block_tokens: int = BLOCK_TOKENS, progress: Progress | None = None
) -> Trace:
    """Reads a Mooncake trace (``load_mooncake_trace``, same validation) block by block
    (``mooncake_blocks``): each ``block_tokens``-token prefix block is one pool request."""
    return mooncake_blocks(load_mooncake_trace(path, block_tokens=block_tokens, progress=progress))
