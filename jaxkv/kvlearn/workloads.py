"""Synthetic workloads: the README's Zipf multimodal requests and seeded Mooncake-format traces
of serving workloads that differ in structure.

``zipf_multimodal`` draws i.i.d. requests for whole prefixes from ``zipf_catalog`` (a ``Trace``
for the core simulator). The others return Mooncake records (``timestamp`` ms,
``input_length``, ``output_length``, ``hash_ids``, plus fields naming their structure), sorted by
time; ``traces.save_mooncake_jsonl`` writes them and ``load_mooncake_trace`` reads them back for
the serving simulator:

    kind       generator    config            unit of reuse
    chat       chat         ChatConfig        a conversation's history, resent every turn
    agent      agent        AgentConfig       long tool prompts; contexts growing by tool output
    rag        rag          RAGConfig         Zipf-popular documents, in varying order
    mmsession  mm_session   MMSessionConfig   multimodal sessions (system prompt, image, video)

(``WORKLOADS`` maps the first three names to their generator and config; each generator is
``f(n_requests, *, seed, cfg=None)``; ``mm_session`` counts sessions.) The shipped Mooncake
example trace (``traces.EXAMPLE``) is the fifth workload of the serving benchmarks.

Every prompt is a list of segments (a name that identifies the content, and a token count),
cut into 512-token blocks whose ids are chained hashes of (previous block id, the segment pieces
the block covers), made dense in order of first appearance (``_hash_blocks``): equal ids ⇔
equal prefixes, exactly as in a Mooncake trace. A block that straddles two segments depends on
both, so the same document after a different prefix, or in another position, shares nothing.

Sizes: ``chat``, ``agent`` and ``rag`` generate units (sessions, agents, queries) with Poisson
start times until the first ``n_requests`` requests by time are settled (no later unit can
start before the last of them), then keep those: a window of a stationary stream, with no
ramp-down at its end. The CLI's default sizes (10,000 / 6,000 / 10,000 requests) give
~70k–150k block references, which the serving simulator replays in seconds per policy.

MM-Session: each session picks a system prompt (Zipf over ``n_system``), optionally one image
(576 tokens, LLaVA-1.5) and/or one video (720–1440 tokens), each drawn from a shared catalog
with Zipf popularity, then runs 1..``max_turns`` turns. Turn k's prompt is the session's context
so far:

    system | media | user_1 | answer_1 | … | user_k          (input_length; output = answer_k)

so prefixes grow turn by turn. A media item is shared across sessions only behind the same
system prompt (prefix caching cannot reuse it elsewhere). Arrivals: sessions start as a Poisson
process (``rate_per_s``) or, with ``bursty=True``, in bursts (Poisson burst times at
``rate_per_s / burst_mean``, geometric burst sizes of mean ``burst_mean``, sessions of a burst
within one second); turn k+1 follows turn k after an exponential think time (mean ``think_s``)
plus the answer's length at ``decode_tok_per_s``.

``python -m jaxkv.eval kvlearn workload {chat,agent,rag,mmsession} --out F [--seed S]
[--requests N | --sessions N] ...`` writes one to a file.
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


# the heavy MM-Session workload of issue 15's tuning split (scripts/bench_kvlearn_serving.py:
# seeds 1 and 2, the second bursty; 8 nodes)
MM_HEAVY = dict(
    n_system=40,
    system_tokens=(1000, 12000),
    max_turns=10,
    user_tokens=(50, 3000),
    answer_tokens=(100, 800),
    n_images=400,
    n_videos=100,
    zipf_alpha=0.9,
    rate_per_s=0.5,
    think_s=60,
)


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


# ---- shared pieces of the request-count generators -------------------------------------------
@dataclasses.dataclass(frozen=True)
class LogNormal:
    """A token count: lognormal with this median and σ (of the log), rounded, clipped to
    [lo, hi]. Text lengths in chat logs are close to lognormal (long right tail)."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self):
        if not (self.median > 0 and self.sigma >= 0 and 1 <= self.lo <= self.hi):
            raise ValueError(f"LogNormal needs median > 0, sigma ≥ 0, 1 ≤ lo ≤ hi: {self}")

    def draw(self, rng) -> int:
        x = self.median * math.exp(self.sigma * rng.standard_normal())
        return int(min(max(round(x), self.lo), self.hi))


def _zipf_p(n: int, alpha: float) -> np.ndarray:
    """[n] Zipf probabilities over ranks 0..n-1 (rank 0 the most popular)."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return w / w.sum()


def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


def _record(t_s: float, segs: list, output: int, ids: dict, **extra) -> dict:
    return {
        "timestamp": round(t_s * 1e3, 3),
        "input_length": sum(n for _, n in segs),
        "output_length": output,
        "hash_ids": _hash_blocks(segs, ids),
        **extra,
    }


def _window(unit, n_requests: int, *, rng, rate_per_s: float) -> list[dict]:
    """Records of units (``unit(index, start_s)`` → its records) started as a Poisson process of
    ``rate_per_s``, until the first ``n_requests`` records by time are settled (a unit's records
    are never earlier than its start); those, sorted by time (ties keep generation order)."""
    if n_requests <= 0:
        raise ValueError(f"n_requests must be positive, got {n_requests}")
    out: list[dict] = []
    t, u = 0.0, 0
    while True:
        t += rng.exponential(1.0 / rate_per_s)
        if len(out) >= n_requests:
            times = np.fromiter((r["timestamp"] for r in out), np.float64, len(out))
            if t * 1e3 > np.partition(times, n_requests - 1)[n_requests - 1]:
                break
        out += unit(u, t)
        u += 1
    out.sort(key=lambda r: r["timestamp"])
    return out[:n_requests]


# ---- chat -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChatConfig:
    """Multi-turn chat sessions (``chat``).

    Defaults, and why: a few deployment system prompts (4, 200–1,500 tokens, Zipf α = 1 over
    them: one default prompt carries most traffic); the number of turns is geometric (a user
    leaves after each answer with probability 1/``mean_turns``; mean 3.5, about ShareGPT's
    turns per conversation), ended early when the context would exceed ``max_context``
    (32k tokens, a common context window); user turns are short (median 80 tokens, lognormal,
    up to 4k) and answers longer (median 250); a quarter of the sessions open with a pasted
    document (median 4k tokens, up to 32k: the long-context part of conversation traffic);
    the next turn comes after the answer is streamed (``decode_tok_per_s``) plus an
    exponential think time (mean 40 s: reading and typing); sessions start as a Poisson process
    of 1 per second, so ~150 sessions are open at once and the trace carries ~3.5 req/s.
    """

    n_system: int = 4
    system_tokens: tuple[int, int] = (200, 1500)
    system_alpha: float = 1.0
    mean_turns: float = 3.5
    max_turns: int = 40
    max_context: int = 32_768
    user_tokens: LogNormal = LogNormal(80, 1.0, 4, 4000)
    p_document: float = 0.25
    document_tokens: LogNormal = LogNormal(4000, 0.8, 500, 32_000)
    answer_tokens: LogNormal = LogNormal(250, 0.7, 10, 2000)
    think_s: float = 40.0
    decode_tok_per_s: float = 50.0
    rate_per_s: float = 1.0

    def __post_init__(self):
        name = "ChatConfig"
        _check(name, self.n_system >= 1 and self.max_turns >= 1, "n_system, max_turns ≥ 1")
        _check(name, 1 <= self.system_tokens[0] <= self.system_tokens[1], "system_tokens")
        _check(name, self.mean_turns >= 1, f"mean_turns must be ≥ 1, got {self.mean_turns}")
        _check(name, 0 <= self.p_document <= 1, "p_document in [0, 1]")
        _check(name, self.system_alpha > 0 and self.think_s >= 0, "system_alpha > 0, think ≥ 0")
        _check(name, self.rate_per_s > 0 and self.decode_tok_per_s > 0, "rates must be > 0")
        _check(name, self.max_context > self.system_tokens[1], "max_context above the system")


def chat(n_requests: int, *, seed: int, cfg: ChatConfig | None = None) -> list[dict]:
    """Multi-turn chat: turn k's prompt is the whole conversation so far,

        system | [document] | user_1 | answer_1 | … | user_k      (output = answer_k)

    so each turn's ``hash_ids`` extend the previous turn's full blocks. Records carry
    ``session``, ``turn`` and ``system``; the first ``n_requests`` by time (see the module
    docstring)."""
    cfg = cfg or ChatConfig()
    rng = np.random.default_rng(seed)
    sys_len = rng.integers(*cfg.system_tokens, size=cfg.n_system, endpoint=True)
    p_sys = _zipf_p(cfg.n_system, cfg.system_alpha)
    ids: dict[tuple, int] = {}

    def session(s: int, t: float) -> list[dict]:
        k = int(rng.choice(cfg.n_system, p=p_sys))
        segs = [(("sys", k), int(sys_len[k]))]
        if rng.random() < cfg.p_document:
            segs.append((("doc", s), cfg.document_tokens.draw(rng)))
        out = []
        for turn in range(cfg.max_turns):
            segs.append((("user", s, turn), cfg.user_tokens.draw(rng)))
            if sum(n for _, n in segs) > cfg.max_context:
                break
            answer = cfg.answer_tokens.draw(rng)
            out.append(_record(t, segs, answer, ids, session=s, turn=turn, system=k))
            segs.append((("answer", s, turn), answer))
            if rng.random() < 1.0 / cfg.mean_turns:
                break
            t += answer / cfg.decode_tok_per_s + rng.exponential(cfg.think_s)
        return out

    return _window(session, n_requests, rng=rng, rate_per_s=cfg.rate_per_s)


# ---- agent ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Tool-using agent loops (``agent``).

    Defaults, and why: 3 agent frameworks, each with one long system prompt of tool
    descriptions (2,000–8,000 tokens: a few dozen JSON tool schemas), Zipf α = 1 over them; a
    task of median 300 tokens; each step the model emits an action (a tool call, median 120
    tokens) and the tool's output is appended (median 400 tokens, σ = 1.2: file reads and search
    results have a long tail, up to 16k); the number of steps is geometric (mean 8, at most 40,
    ended when the context would exceed 32k); the next step follows after the action is
    streamed and the tool ran (exponential, mean 3 s): no human in the loop, so steps are
    seconds apart; agents start at 0.3 per second, so ~15 run concurrently and interleave.
    """

    n_system: int = 3
    system_tokens: tuple[int, int] = (2000, 8000)
    system_alpha: float = 1.0
    task_tokens: LogNormal = LogNormal(300, 0.8, 20, 4000)
    mean_steps: float = 8.0
    max_steps: int = 40
    max_context: int = 32_768
    action_tokens: LogNormal = LogNormal(120, 0.6, 10, 1000)
    observation_tokens: LogNormal = LogNormal(400, 1.2, 10, 16_000)
    tool_s: float = 3.0
    decode_tok_per_s: float = 50.0
    rate_per_s: float = 0.3

    def __post_init__(self):
        name = "AgentConfig"
        _check(name, self.n_system >= 1 and self.max_steps >= 1, "n_system, max_steps ≥ 1")
        _check(name, 1 <= self.system_tokens[0] <= self.system_tokens[1], "system_tokens")
        _check(name, self.mean_steps >= 1, f"mean_steps must be ≥ 1, got {self.mean_steps}")
        _check(name, self.system_alpha > 0 and self.tool_s >= 0, "system_alpha > 0, tool_s ≥ 0")
        _check(name, self.rate_per_s > 0 and self.decode_tok_per_s > 0, "rates must be > 0")
        _check(name, self.max_context > self.system_tokens[1], "max_context above the system")


def agent(n_requests: int, *, seed: int, cfg: AgentConfig | None = None) -> list[dict]:
    """Agent loops: step k's prompt is

        tools | task | action_1 | observation_1 | … | action_{k-1} | observation_{k-1}

    (output = action_k), so every step of an agent starts with its framework's tool prompt and
    extends the previous step. Records carry ``agent``, ``step`` and ``system``."""
    cfg = cfg or AgentConfig()
    rng = np.random.default_rng(seed)
    sys_len = rng.integers(*cfg.system_tokens, size=cfg.n_system, endpoint=True)
    p_sys = _zipf_p(cfg.n_system, cfg.system_alpha)
    ids: dict[tuple, int] = {}

    def loop(a: int, t: float) -> list[dict]:
        k = int(rng.choice(cfg.n_system, p=p_sys))
        segs = [(("tools", k), int(sys_len[k])), (("task", a), cfg.task_tokens.draw(rng))]
        out = []
        for step in range(cfg.max_steps):
            action = cfg.action_tokens.draw(rng)
            out.append(_record(t, segs, action, ids, agent=a, step=step, system=k))
            if rng.random() < 1.0 / cfg.mean_steps:
                break
            obs = cfg.observation_tokens.draw(rng)
            segs += [(("action", a, step), action), (("obs", a, step), obs)]
            if sum(n for _, n in segs) > cfg.max_context:
                break
            t += action / cfg.decode_tok_per_s + rng.exponential(cfg.tool_s)
        return out

    return _window(loop, n_requests, rng=rng, rate_per_s=cfg.rate_per_s)


# ---- rag --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RAGConfig:
    """Retrieval-augmented generation over a document corpus (``rag``).

    Defaults, and why: 5,000 retrievable chunks of 256–1,024 tokens (common chunk sizes),
    retrieved with Zipf popularity (α = 1: a few documents answer most questions); 4 chunks
    per query, drawn without replacement; ``shuffle`` (default) puts them in a random order
    each time, since the retriever's scores, and so the order, depend on the question: in a
    prefix cache a different order is a different prefix, so only the leading run of chunks
    can be reused (``shuffle=False`` sorts them by id, what a cache-aware reordering does);
    2 system prompts (300–800 tokens); a question of median 30 tokens and an answer of median
    200; independent queries, Poisson at 4 per second.
    """

    n_docs: int = 5000
    doc_tokens: tuple[int, int] = (256, 1024)
    zipf_alpha: float = 1.0
    docs_per_query: int = 4
    shuffle: bool = True
    n_system: int = 2
    system_tokens: tuple[int, int] = (300, 800)
    question_tokens: LogNormal = LogNormal(30, 0.6, 5, 300)
    answer_tokens: LogNormal = LogNormal(200, 0.6, 10, 1500)
    rate_per_s: float = 4.0

    def __post_init__(self):
        name = "RAGConfig"
        _check(name, self.n_system >= 1, "n_system ≥ 1")
        _check(name, 1 <= self.docs_per_query <= self.n_docs, "1 ≤ docs_per_query ≤ n_docs")
        _check(name, 1 <= self.doc_tokens[0] <= self.doc_tokens[1], "doc_tokens")
        _check(name, 1 <= self.system_tokens[0] <= self.system_tokens[1], "system_tokens")
        _check(name, self.zipf_alpha > 0 and self.rate_per_s > 0, "zipf_alpha, rate_per_s > 0")


def rag(n_requests: int, *, seed: int, cfg: RAGConfig | None = None) -> list[dict]:
    """RAG queries: ``system | doc_a | doc_b | … | question`` (output = answer). Document ids
    are popularity ranks (0 the most popular); records carry ``query`` and ``docs`` (in prompt
    order) and ``system``."""
    cfg = cfg or RAGConfig()
    rng = np.random.default_rng(seed)
    sys_len = rng.integers(*cfg.system_tokens, size=cfg.n_system, endpoint=True)
    doc_len = rng.integers(*cfg.doc_tokens, size=cfg.n_docs, endpoint=True)
    cdf = np.cumsum(_zipf_p(cfg.n_docs, cfg.zipf_alpha))
    cdf[-1] = 1.0
    ids: dict[tuple, int] = {}

    def query(q: int, t: float) -> list[dict]:
        k = int(rng.integers(cfg.n_system))
        docs: list[int] = []
        while len(docs) < cfg.docs_per_query:  # without replacement, by popularity
            d = int(np.searchsorted(cdf, rng.random(), side="right"))
            if d not in docs:
                docs.append(d)
        docs = [docs[i] for i in rng.permutation(len(docs))] if cfg.shuffle else sorted(docs)
        segs = [(("sys", k), int(sys_len[k]))] + [(("doc", d), int(doc_len[d])) for d in docs]
        segs.append((("question", q), cfg.question_tokens.draw(rng)))
        answer = cfg.answer_tokens.draw(rng)
        return [_record(t, segs, answer, ids, query=q, docs=docs, system=k)]

    return _window(query, n_requests, rng=rng, rate_per_s=cfg.rate_per_s)


WORKLOADS = {"chat": (chat, ChatConfig), "agent": (agent, AgentConfig), "rag": (rag, RAGConfig)}
"""The request-count generators by name: (``f(n_requests, *, seed, cfg=None)``, its config)."""
