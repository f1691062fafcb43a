"""Request traces of the KVLearn simulators: the two types, their file formats and their loaders.

A ``Trace`` (the core simulator's) is a sequence of requests, each naming a reusable prefix (its
KV block) by key. Keys are mapped to dense ids ``0..P-1`` so the simulator can keep per-key
arrays; ``names[k]`` is the key.

JSONL trace format (one request per line, every field required, no others allowed)::

    {"t": 0.05, "key": "img/17", "tokens": 576, "modality": "image"}

``t`` is the arrival time in seconds (finite, ≥ 0, non-decreasing), ``key`` a non-empty string,
``tokens`` the prefix length (integer > 0) and ``modality`` one of ``text``, ``image``,
``video``. A key always names the same prefix, so its ``tokens`` and ``modality`` must not
change between lines; ``tokens`` is at most ``MAX_TOKENS`` (token counts are int32 on the device).
Blank lines are skipped; any other defect raises ``TraceError`` with the line number.

Mooncake traces (FAST'25; ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``) are
read by one validating loader, ``load_mooncake_trace`` (a ``MooncakeTrace``, request level, for
the serving simulator); ``load_mooncake`` turns the same records into one pool request per
prefix block for the core simulator. Each format has exactly one loader, and no loader guesses
the format of a file: the caller says which it reads. The name ``EXAMPLE`` (``"example"``)
stands for the Mooncake example trace shipped with jaxkv (``trace_path``). Synthetic traces
come from ``workloads``.
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
        key: [R] int32 dense key id per request.
        tokens: [R] int32 prefix length per request.
        modality: [R] int32 (0 text, 1 image, 2 video).
        time_s: [R] float64 arrival time.
        names: P key names, ``names[key[i]]`` is request i's key.
        popularity: [P] true request probabilities when known (synthetic traces), else None.
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
        """[P] request frequencies over the whole trace (future knowledge)."""
        counts = np.bincount(self.key, minlength=self.n_keys).astype(np.float64)
        return counts / max(len(self), 1)


def next_use_index(key: np.ndarray) -> np.ndarray:
    """[R] int32: index of the next request for the same key, or R if there is none."""
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
    if "hash_ids" in row and "key" not in row:
        raise TraceError(
            f"{where}: a Mooncake record (hash_ids), not this JSONL format: read Mooncake traces "
            "with load_mooncake_trace (request level) or load_mooncake (block by block)"
        )
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
        time_s: [R] float64 arrival times (s).
        input_len: [R] int64 prompt tokens.
        output_len: [R] int64 generated tokens.
        blocks: R int64 arrays of dense block ids, one per ``block_tokens`` prompt block.
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


def save_mooncake_jsonl(records: list[dict], path: str | Path) -> None:
    """Writes Mooncake records one per line (creating the folder; extra fields are kept)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


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
