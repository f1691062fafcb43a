"""Decoder speed: jaxkv vs transformers' PyTorch model, same SmolLM2 weights, one run.

Prefill tokens/s (512 and 2048 tokens) and decode ms/token at 1K and 4K context, batch 1
and 8. Decode caches are filled with random keys/values of the right shape (the cost does not
depend on their values). Prints medians and the jaxkv/torch ratio, and writes
``results/bench_decoder.{json,md}``. Compile time is reported separately.

    .venv/bin/python scripts/bench_decoder.py [--reps 5] [--decode-steps 16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

import jaxkv
from jaxkv import kvcache
from jaxkv.model import decoder
from jaxkv.model.loading import embedded_model_path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def timed(fn, reps):
    """(first-call seconds, median seconds of the next ``reps`` calls)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def jax_prefill(model, batch, n_tokens, reps):
    cfg = model.config
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, n_tokens)))
    fn = jax.jit(lambda p, t, c: decoder.prefill(p, t, c, config=cfg)[0])
    params = model.params

    def run():
        cache = kvcache.init_cache(cfg, batch_size=batch, capacity=n_tokens)
        fn(params, toks, cache).block_until_ready()

    return timed(run, reps)


def jax_decode(model, batch, ctx, steps):
    cfg = model.config
    cache = kvcache.init_cache(cfg, batch_size=batch, capacity=ctx + steps + 1)
    rng = jax.random.key(0)
    shape = cache.k[:, :, :, :ctx].shape
    cache = cache.replace(
        k=cache.k.at[:, :, :, :ctx].set(jax.random.normal(rng, shape)),
        v=cache.v.at[:, :, :, :ctx].set(jax.random.normal(jax.random.fold_in(rng, 1), shape)),
        pos=cache.pos.at[:, :, :, :ctx].set(jnp.arange(ctx)),
        length=jnp.full((batch,), ctx, jnp.int32),
    )
    step = jax.jit(lambda p, t, c: decoder.decode_step(p, t, c, config=cfg), donate_argnums=2)
    tok = jnp.zeros((batch,), jnp.int32)
    params = model.params
    t0 = time.perf_counter()
    logits, cache = step(params, tok, cache)
    logits.block_until_ready()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits, cache = step(params, tok, cache)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def torch_prefill(model, batch, n_tokens, reps):
    ids = torch.tensor(np.random.default_rng(0).integers(0, 49152, (batch, n_tokens)))

    def run():
        with torch.no_grad():
            model(ids, use_cache=True, logits_to_keep=1)

    return timed(run, reps)


def torch_decode(model, cfg, batch, ctx, steps):
    cache = transformers.DynamicCache(config=model.config)
    g = torch.Generator().manual_seed(0)
    shape = (batch, cfg.n_kv_heads, ctx, cfg.head_dim)
    for layer in range(cfg.n_layers):
        cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), layer)
    tok = torch.zeros((batch, 1), dtype=torch.long)
    times = []
    with torch.no_grad():
        for i in range(steps + 1):
            pos = torch.full((batch, 1), ctx + i)
            t0 = time.perf_counter()
            model(tok, past_key_values=cache, position_ids=pos, use_cache=True)
            times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="short contexts (smoke run)")
    args = ap.parse_args()
    model = jaxkv.load("smollm2-135m")
    path = embedded_model_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    prefill_rows = [(1, 128), (1, 256)] if args.quick else [(1, 512), (1, 2048), (8, 512)]
    decode_rows = [(1, 256)] if args.quick else [(1, 1024), (1, 4096), (8, 1024), (8, 4096)]
    rows = []
    for batch, n in prefill_rows:
        jf, jm = jax_prefill(model, batch, n, args.reps)
        tf, tm = torch_prefill(ref, batch, n, args.reps)
        rows.append(
            dict(
                kind="prefill",
                batch=batch,
                tokens=n,
                unit="tokens/s",
                jaxkv=batch * n / jm,
                torch=batch * n / tm,
                ratio=tm / jm,
                jaxkv_compile_s=jf - jm,
            )
        )
        print(_fmt(rows[-1]), flush=True)
    for batch, ctx in decode_rows:
        jf, jm = jax_decode(model, batch, ctx, args.decode_steps)
        tf, tm = torch_decode(ref, model.config, batch, ctx, args.decode_steps)
        rows.append(
            dict(
                kind="decode",
                batch=batch,
                tokens=ctx,
                unit="ms/token",
                jaxkv=1e3 * jm,
                torch=1e3 * tm,
                ratio=tm / jm,
                jaxkv_compile_s=jf - jm,
            )
        )
        print(_fmt(rows[-1]), flush=True)
    meta = dict(
        jax=jax.__version__,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        devices=str(jax.devices()),
        reps=args.reps,
        decode_steps=args.decode_steps,
    )
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "bench_decoder.json").write_text(
            json.dumps(dict(meta=meta, rows=rows), indent=1)
        )
        (RESULTS / "bench_decoder.md").write_text(_markdown(rows, meta))
        print(f"wrote {RESULTS / 'bench_decoder.md'}")


def _fmt(r):
    return (
        f"{r['kind']:8s} B={r['batch']} n={r['tokens']:5d}  jaxkv {r['jaxkv']:9.1f}  "
        f"torch {r['torch']:9.1f} {r['unit']:9s} speed ratio jaxkv/torch {r['ratio']:.2f}x  "
        f"(compile {r['jaxkv_compile_s']:.1f} s)"
    )


def _markdown(rows, meta):
    lines = [
        "# Decoder benchmark: jaxkv vs PyTorch eager (SmolLM2-135M, float32, CPU)",
        "",
        f"`scripts/bench_decoder.py`; {meta}",
        "",
        "| phase | batch | tokens / context | jaxkv | torch | unit | speed-up of jaxkv | "
        "jaxkv compile (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['batch']} | {r['tokens']} | {r['jaxkv']:.1f} | "
            f"{r['torch']:.1f} | {r['unit']} | {r['ratio']:.2f}x | "
            f"{r['jaxkv_compile_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
