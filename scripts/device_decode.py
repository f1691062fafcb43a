"""Decode speed on an accelerator: Mistral-7B shapes, dummy bf16 weights, full vs compressed.

Issue 17, item 5. Measures, on whatever device JAX finds first (a GPU when there is one):

* decode tokens/s with the full cache at batch 1 and batch 8, context ``--context`` (4096);
* the compressed-decode speed-up at r = ``--ratio`` (0.25, policy ``--policy``, h2o) at
  batch 8: every step decodes one token and evicts one slot (``jaxkv.eviction.evict`` with
  ``max_drop=1``, the decode protocol), against the full cache's step;
* the same two at batch 8 with the int8 KV cache (``init_cache(dtype="int8")``; skip with
  ``--no-int8``).

The weights are random (``jaxkv.init_params``, no download) and the caches are filled with
random keys and values at the right positions: decode cost does not depend on their values.
The full cache holds ``context`` tokens and frees the slot it has just written after each step
(so the context stays ``context``); the compressed cache has the capacity that
``Compression.capacity`` gives for the whole run and holds the budget of ``context`` tokens.
Each timed run is one jitted ``lax.fori_loop`` of ``--steps`` decode steps (greedy: the next
token is the argmax, so steps depend on each other), the cache donated; after ``--warmup``
untimed runs (the first compiles), the variants take turns run by run and the medians of
``--runs`` runs are reported. ``GB/s`` is (weights + the K/V slots attention reads) / step
time, a floor on the memory traffic.

``--profile NAME[,NAME]`` then traces one more run of each named variant with
``jax.profiler`` and writes ``device_profile.md``: the ops that took the most time per step
(HLO ops on a GPU's "XLA Ops" line, or its kernels per stream; XLA's CPU thunks on a CPU),
summed over the run, with the compiled HLO of each profiled variant beside it
(``hlo_<name>.txt``, to look an op's shape up) — where a step's time goes, for the next tuning.

Writes ``device_decode.json`` and ``device_decode.md`` into ``--out`` (default: ``$OUT``
when set, else ``runs/device_decode``). ``--small`` runs tiny shapes (``ModelConfig.tiny``,
context 96) so that the script can be checked on a CPU in seconds.

    python scripts/device_decode.py [--small] [--out DIR] [--steps 32] [--runs 7] \
        [--profile full_b1,compressed_b8]

On the device machine (JAX with CUDA is there; of jaxkv's imports ``gguf`` and ``qwix`` are not,
so their wheels travel in ``.whl``: here, ``python3 -m pip download --no-deps
--only-binary=:all: -d .whl gguf==0.19.0 qwix==0.1.8``; there, with ``.whl`` carried):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 scripts/device_decode.py

At ``--context 16384`` add ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.92`` (all five variants' caches
live at once). The H200 runs of session 25 are in ``results/device_decode/``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv import eviction, kvcache
from jaxkv.eviction import Compression
from jaxkv.model import decoder


def filled_cache(config, *, batch, capacity, n_valid, context, stats, dtype=None):
    """A cache with ``n_valid`` random tokens spread over positions 0..context-1.

    Filled by one jitted program with the empty cache donated, so that the random keys and
    values are never materialized in f32 beside the cache (at 16K x batch 8, two 17 GB arrays).
    """
    cache = kvcache.init_cache(
        config, batch_size=batch, capacity=capacity, stats=stats, dtype=dtype
    )
    return jax.jit(functools.partial(_fill, n_valid=n_valid, context=context), donate_argnums=0)(
        cache
    )


def _fill(cache, *, n_valid, context):
    batch = cache.length.shape[0]
    key = jax.random.key(0)
    shape = cache.k[:, :, :, :n_valid].shape
    kv = [jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32) for i in (0, 1)]
    if cache.quantized:
        (k, k_scale), (v, v_scale) = map(kvcache.quantize, kv)
        scales = dict(
            k_scale=cache.k_scale.at[:, :, :, :n_valid].set(k_scale),
            v_scale=cache.v_scale.at[:, :, :, :n_valid].set(v_scale),
        )
    else:
        (k, v), scales = kv, {}
    return cache.replace(
        k=cache.k.at[:, :, :, :n_valid].set(k.astype(cache.k.dtype)),
        v=cache.v.at[:, :, :, :n_valid].set(v.astype(cache.v.dtype)),
        pos=cache.pos.at[:, :, :, :n_valid].set((jnp.arange(n_valid) * context) // n_valid),
        stats={
            n: jax.random.uniform(jax.random.fold_in(key, 2 + i), s.shape)
            for i, (n, s) in enumerate(cache.stats.items())
        },
        length=jnp.full((batch,), context, jnp.int32),
        **scales,
    )


def make_runner(config, *, steps, compression):
    """A jitted ``(params, cache, token_B) -> (cache, token_B)`` that decodes ``steps`` tokens.

    The weights are an argument, never closed over: closed over, XLA would embed them in the
    program as constants (14.5 GB for Mistral-7B, which ran the first GPU try out of memory).
    Without ``compression`` every step frees the slot it wrote (the context stays the same);
    with it every step evicts at most one slot.
    """

    def one(params, carry):
        cache, tok_B = carry
        logits_BV, cache = decoder.decode_step(params, tok_B, cache, config=config)
        if compression is None:
            newest = cache.pos == (cache.length - 1)[None, :, None, None]
            cache = cache.replace(pos=jnp.where(newest, kvcache.FREE, cache.pos))
            cache = cache.replace(length=cache.length - 1)
        else:
            cache = eviction.evict(cache, compression, None, key=jax.random.key(0), max_drop=1)
        return cache, jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

    @functools.partial(jax.jit, donate_argnums=1)
    def run(params, cache, tok_B):
        return jax.lax.fori_loop(0, steps, lambda _, c: one(params, c), (cache, tok_B))

    return run


def kv_bytes_read(cache) -> int:
    """Bytes of the keys, values and their scales that one decode step's attention reads."""
    leaves = [cache.k, cache.v, cache.k_scale, cache.v_scale]
    return sum(x.nbytes for x in leaves if x is not None)


def time_variants(variants: dict, *, warmup: int, runs: int) -> tuple[dict, dict]:
    """Seconds per run of each ``(run, cache, tok)`` variant: compile, warm up, take turns.
    Also returns each variant's last ``(cache, tok)`` (the first were donated)."""
    state, compile_s, times = {}, {}, {n: [] for n in variants}
    for name, (run, cache, tok) in variants.items():
        t0 = time.perf_counter()
        state[name] = jax.block_until_ready(run(cache, tok))
        compile_s[name] = time.perf_counter() - t0
        for _ in range(warmup - 1):
            state[name] = jax.block_until_ready(run(*state[name]))
        print(f"  {name}: first run {compile_s[name]:.1f} s (compile included)", flush=True)
    for _ in range(runs):
        for name, (run, _, _) in variants.items():
            t0 = time.perf_counter()
            state[name] = jax.block_until_ready(run(*state[name]))
            times[name].append(time.perf_counter() - t0)
    for name, (c, _) in state.items():
        if bool(c.overflow):
            raise RuntimeError(f"{name}: the cache overflowed (a bug in this script)")
    timings = {
        n: dict(runs_s=t, median_s=statistics.median(t), first_s=compile_s[n])
        for n, t in times.items()
    }
    return timings, state


_CONTAINERS = ("while", "conditional", "call")  # profile events whose time is their ops'


def op_times(xplane: Path) -> tuple[str, dict[str, list[float]]]:
    """Where a traced run's device time went: (what the events are, {op: [durations, s]}).

    An accelerator's plane (``/device:GPU:0``, ``/device:TPU:0``) gives its "XLA Ops" line
    (HLO op names) or else its streams' kernels; without one, XLA's CPU worker threads. Loops
    and calls (their ops are counted) and the runtime's own events (``A::B``) are left out."""
    data = jax.profiler.ProfileData.from_file(str(xplane))
    device = [p for p in data.planes if p.name.startswith("/device:") and "CPU" not in p.name]
    lines, kind = [], "XLA CPU thunks"
    for plane in device:
        ops = [ln for ln in plane.lines if ln.name == "XLA Ops"]
        lines += ops or [ln for ln in plane.lines if ln.name.startswith("Stream")]
        kind = f"{plane.name}: " + ("HLO ops" if ops else "kernels")
    if not device:
        lines = [ln for p in data.planes for ln in p.lines if ln.name.startswith("tf_XLA")]
    times = collections.defaultdict(list)
    for line in lines:
        for e in line.events:
            if e.name.split(".")[0] not in _CONTAINERS and "::" not in e.name:
                times[e.name].append(e.duration_ns / 1e9)
    return kind, times


def profile_variant(name, run, carry, steps, out: Path, top: int = 30) -> list[str]:
    """Traces one run of ``run`` (a ``make_runner`` bound to its weights, compiled and warm) from
    ``carry`` = (cache, token_B); its top ops as Markdown, and its compiled HLO written to
    ``out/hlo_<name>.txt``."""
    (out / f"hlo_{name}.txt").write_text(run.func.lower(*run.args, *carry).compile().as_text())
    trace_dir = tempfile.mkdtemp(prefix="jaxkv_device_profile_")
    try:
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            jax.block_until_ready(run(*carry))
            wall = time.perf_counter() - t0
        (xplane,) = Path(trace_dir).rglob("*.xplane.pb")
        kind, times = op_times(xplane)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    total = sum(sum(t) for t in times.values())
    lines = [
        f"## {name}",
        "",
        f"One traced run of {steps} steps: {1e3 * wall / steps:.2f} ms / step wall; {kind}, "
        f"{1e3 * total / steps:.2f} ms / step summed over {len(times)} distinct ops "
        f"(ops on different streams or threads overlap, so the sum may exceed the wall time).",
        "",
        "| op | calls / step | ms / step | share of the sum |",
        "|---|---|---|---|",
    ]
    ranked = sorted(times.items(), key=lambda kv: -sum(kv[1]))
    for op, t in ranked[:top]:
        lines.append(
            f"| `{op}` | {len(t) / steps:g} | {1e3 * sum(t) / steps:.3f} | "
            f"{100 * sum(t) / max(total, 1e-12):.1f} % |"
        )
    return lines + [""]


def variant_specs(args) -> list[tuple[str, int, bool, str | None]]:
    """(name, batch, compressed, KV dtype) of every variant the arguments ask for."""
    specs = [("full_b1", 1, False, None)] if args.batch > 1 else []
    for dt in [None] if args.no_int8 else [None, kvcache.INT8]:
        suffix = "_int8" if dt else ""
        specs += [(f"full_b{args.batch}{suffix}", args.batch, False, dt)]
        specs += [(f"compressed_b{args.batch}{suffix}", args.batch, True, dt)]
    return specs


def build_variants(params, config, args):
    """``{name: (run, cache, token_B)}`` and the static facts of each variant."""
    n_max = args.context + (args.warmup + args.runs) * args.steps + 1
    comp = Compression.make(args.policy, ratio=args.ratio)
    cap = comp.capacity(n_max)
    n_kept = int(comp.budget_for(args.context))
    full_run = functools.partial(make_runner(config, steps=args.steps, compression=None), params)
    comp_run = functools.partial(make_runner(config, steps=args.steps, compression=comp), params)
    variants, facts = {}, {}
    for name, batch, compressed, dt in variant_specs(args):
        c = comp if compressed else None
        if c is None:
            cache = filled_cache(
                config,
                batch=batch,
                capacity=args.context + 1,
                n_valid=args.context,
                context=args.context,
                stats=(),
                dtype=dt,
            )
        else:
            cache = filled_cache(
                config,
                batch=batch,
                capacity=cap,
                n_valid=n_kept,
                context=args.context,
                stats=c.stats,
                dtype=dt,
            )
        tok = jnp.zeros((batch,), jnp.int32)
        variants[name] = (full_run if c is None else comp_run, cache, tok)
        facts[name] = dict(
            batch=batch,
            capacity=cache.capacity,
            kv_dtype=str(cache.k.dtype),
            compressed=c is not None,
            cache_bytes=cache.nbytes(),
            kv_bytes_read=kv_bytes_read(cache),
        )
    return variants, facts


def summarize(timings, facts, meta, param_bytes):
    """Rows per variant and the speed-ups, as a dict (the JSON) and Markdown."""
    steps = meta["steps"]
    rows = {}
    for name, t in timings.items():
        f = facts[name]
        step_s = t["median_s"] / steps
        rows[name] = dict(
            f,
            ms_per_step=1e3 * step_s,
            tokens_per_s=f["batch"] / step_s,
            gb_per_s=(param_bytes + f["kv_bytes_read"]) / step_s / 1e9,
            first_run_s=t["first_s"],
            runs_ms_per_step=[1e3 * r / steps for r in t["runs_s"]],
        )
    b = meta["batch"]
    speedups = {}
    for suffix in ("", "_int8"):
        full, comp = rows.get(f"full_b{b}{suffix}"), rows.get(f"compressed_b{b}{suffix}")
        if full and comp:
            speedups[f"compressed{suffix}_vs_full"] = full["ms_per_step"] / comp["ms_per_step"]
    if "compressed_int8_vs_full" in speedups:
        speedups["compressed_int8_vs_full_bf16"] = (
            rows[f"full_b{b}"]["ms_per_step"] / rows[f"compressed_b{b}_int8"]["ms_per_step"]
        )
    return dict(meta=meta, param_bytes=param_bytes, rows=rows, speedups=speedups)


def markdown(report) -> str:
    m = report["meta"]
    lines = [
        f"# Decode on {m['device_kind']} ({m['model']}, {m['dtype']} dummy weights, "
        f"context {m['context']})",
        "",
        f"`scripts/device_decode.py`{' --small' if m['small'] else ''}: medians of "
        f"{m['runs']} runs of {m['steps']} decode steps (one jitted loop each, variants taking "
        f"turns), after {m['warmup']} warm-up run(s). Policy {m['policy']}, r = {m['ratio']}. "
        f"jax {m['jax']}, {m['backend']} backend, {m['host']}.",
        "",
        "| variant | batch | KV dtype | cache slots | ms / step | tokens / s | GB/s read "
        "| cache MiB | first run (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["rows"].items():
        lines.append(
            f"| {name} | {r['batch']} | {r['kv_dtype']} | {r['capacity']} | "
            f"{r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['gb_per_s']:.1f} | "
            f"{r['cache_bytes'] / 2**20:.0f} | {r['first_run_s']:.1f} |"
        )
    lines.append("")
    for k, v in report["speedups"].items():
        lines.append(f"- {k.replace('_', ' ')}: **{v:.2f}x** decode throughput")
    lines.append("")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, for a CPU check")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--context", type=int, default=None, help="4096 (96 with --small)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=None, help="per run: 32 (4 with --small)")
    ap.add_argument("--runs", type=int, default=None, help="timed runs: 7 (2 with --small)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8 KV cache variants")
    ap.add_argument(
        "--profile",
        default="",
        help="variants to trace after the timing, comma-separated (e.g. full_b1,compressed_b8)",
    )
    args = ap.parse_args(argv)
    small = args.small
    args.context = args.context or (96 if small else 4096)
    args.steps = args.steps or (4 if small else 32)
    args.runs = args.runs or (2 if small else 7)
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or "runs/device_decode")
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1 (the first run compiles)")
    names = [spec[0] for spec in variant_specs(args)]
    args.profile = [n for n in args.profile.split(",") if n]
    unknown = sorted(set(args.profile) - set(names))
    if unknown:
        raise SystemExit(f"--profile: no variant {unknown}; there are {names}")
    return args


def main(argv=None):
    args = parse_args(argv)
    base = jaxkv.ModelConfig.tiny() if args.small else jaxkv.ModelConfig.mistral_7b_v03()
    config = base.replace(dtype=args.dtype, max_seq_len=max(base.max_seq_len, 2 * args.context))
    device = jax.devices()[0]
    print(
        f"{config.name} {args.dtype} on {device.device_kind} ({jax.default_backend()})", flush=True
    )
    params = jax.jit(lambda k: jaxkv.init_params(config, key=k))(jax.random.key(0))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    variants, facts = build_variants(params, config, args)
    timings, last = time_variants(variants, warmup=args.warmup, runs=args.runs)
    meta = dict(
        model=config.name,
        dtype=args.dtype,
        small=args.small,
        context=args.context,
        batch=args.batch,
        steps=args.steps,
        runs=args.runs,
        warmup=args.warmup,
        ratio=args.ratio,
        policy=args.policy,
        jax=jax.__version__,
        backend=jax.default_backend(),
        device_kind=device.device_kind,
        n_devices=jax.device_count(),
        host=platform.node(),
    )
    report = summarize(timings, facts, meta, param_bytes)
    text = markdown(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device_decode.json").write_text(json.dumps(report, indent=1))
    (args.out / "device_decode.md").write_text(text)
    print(f"wrote {args.out / 'device_decode.md'}")
    if args.profile:
        lines = [f"# Decode profile on {device.device_kind} ({config.name}, {args.dtype})", ""]
        for name in args.profile:
            lines += profile_variant(name, variants[name][0], last[name], args.steps, args.out)
        (args.out / "device_profile.md").write_text("\n".join(lines))
        print("\n".join(lines))
        print(f"wrote {args.out / 'device_profile.md'}")


if __name__ == "__main__":
    main()
