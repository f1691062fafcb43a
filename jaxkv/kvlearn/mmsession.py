"""MM-Session: a seeded multimodal multi-turn workload written in the Mooncake JSONL format.

Each session picks a system prompt (Zipf over ``n_system``), optionally one image (576 tokens,
LLaVA-1.5) and/or one video (720–1440 tokens), each drawn from a shared catalog with Zipf
popularity, then runs 1..``max_turns`` turns. Turn k's prompt is the session's context so far:

    system | media | user_1 | answer_1 | … | user_k          (input_length; output = answer_k)

so prefixes grow turn by turn. The prompt is cut into 512-token blocks whose ids are chained
hashes of (previous block id, the segments the block covers), made dense in order of first
appearance: equal ids ⇔ equal prefixes, exactly as in a Mooncake trace. A media item is shared
across sessions only behind the same system prompt (prefix caching cannot reuse it elsewhere).

Arrivals: sessions start as a Poisson process (``rate_per_s``) or, with ``bursty=True``, in
bursts (Poisson burst times at ``rate_per_s / burst_mean``, geometric burst sizes of mean
``burst_mean``, sessions of a burst within one second); turn k+1 follows turn k after an
exponential think time (mean ``think_s``) plus the answer's length at ``decode_tok_per_s``.

``python -m jaxkv.kvlearn.mmsession --sessions 500 --out mm.jsonl [--seed 0] [--bursty]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from jaxkv.kvlearn import cli_common

BLOCK = 512
IMAGE_TOKENS = 576


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


def generate(n_sessions: int, *, seed: int, cfg: MMSessionConfig | None = None) -> list[dict]:
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
            take = min(n - off, BLOCK - fill)
            piece.append((name, off, take))
            off, fill = off + take, fill + take
            if fill == BLOCK:
                parent = ids.setdefault((parent, tuple(piece)), len(ids))
                blocks.append(parent)
                piece, fill = [], 0
    if piece:
        blocks.append(ids.setdefault((parent, tuple(piece)), len(ids)))
    return blocks


def write_jsonl(records: list[dict], path: str | Path) -> None:
    """Writes records one per line (the Mooncake fields first)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    prog = "python -m jaxkv.kvlearn.mmsession"
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    p.add_argument("--sessions", type=cli_common.number(int, ge=1), default=500)
    p.add_argument("--seed", type=cli_common.number(int, ge=0), default=0)
    p.add_argument(
        "--rate", type=cli_common.number(float, gt=0), default=2.0, help="session starts per second"
    )
    p.add_argument("--bursty", action="store_true")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        cli_common.check_output(a.out, flag="--out")
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    recs = generate(
        a.sessions, seed=a.seed, cfg=MMSessionConfig(rate_per_s=a.rate, bursty=a.bursty)
    )
    write_jsonl(recs, a.out)
    print(f"wrote {len(recs)} requests from {a.sessions} sessions to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
