"""Eviction cost and compressed-decode speed on the embedded model, one run, side by side.

Batch 8, a 4096-token context, 64 decode steps, r = 0.25. The caches are filled with random
keys, values and statistics of the right shapes (decode cost does not depend on the values;
a real 8 x 4K prefill would take minutes here). Per decode step (medians of steps that the
variants take in turns):

* full cache, no statistics (the baseline);
* compressed cache (capacity 1041 = 25 % + 1 slot): decode with the statistics the policy
  reads, then eviction, for the shared token set and per KV head (``--granularities``; under
  ``adaptive`` and ``global`` a row holds up to ``head_cap`` x B slots, so their caches have
  that capacity, B tokens in every row at the start, and a ``decode_nostats`` and
  ``decode_stats`` of their own). Each compressed cache starts in the steady state of a
  4K sequence: B tokens spread over the context's positions, its length the context, so
  the budget is about what the cache holds (before session 29 the length was B, so every
  eviction ran against a budget of B/4);
* the parts: decode without statistics, with the policy's statistics, with all of them, and
  eviction alone. (The decode-only variants free the slot they have just written, one
  elementwise op on ``pos``, so that no cache ever overflows.) "Measured apart" adds the
  statistics' cost per step and eviction alone per decode step, over a step without
  statistics plus both: with ``--evict-every K`` > 1 a compressed call fuses K steps in one
  program, which the single-step decode variants do not, so the whole-call difference mixes
  in the dispatch saved; for K > 1 a ``fused_nostats`` variant runs K decode steps without
  statistics in one program, and the compressed call's excess over it is reported too
  (the difference of medians, and the median of the differences paired turn by turn), and
  a ``fused_full`` variant runs the full cache's K steps in one program, against which the
  throughput is reported (before session 47 it was against single full steps, which pay a
  dispatch each and, on that session's host, ran up to 2x slower in such runs than alone).

Every decode step computes its logits and feeds their greedy token to the next step, as
generation does (before session 31 the logits were unused, so XLA dropped the tied
embedding's projection, about 5 ms of a batch-8 step, from every variant).

``--kv-dtype int8`` stores the compressed caches' keys and values in int8 (per-slot scales;
the full cache stays float32). With ``--evict-every K`` the compressed cache has K slots of
slack and eviction runs after every K-th decode step (``Compression.evict_every``, dropping
up to K tokens): one timed call of a compressed variant is K decode steps and one eviction,
reported per decode step.

Writes ``results/bench_eviction.{json,md}`` (``--out PATH``: ``PATH.{json,md}``).

    .venv/bin/python scripts/bench_eviction.py [--steps 64] [--context 4096] [--batch 8]
        [--policy h2o] [--evict-every 1] [--kv-dtype model] [--granularities shared,head]
        [--dtype float32] [--attention xla] [--matmul xla] [--out results/bench_eviction]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxkv
from jaxkv import eviction, kvcache
from jaxkv.config import ATTENTION_IMPLEMENTATIONS, MATMUL_IMPLEMENTATIONS
from jaxkv.evals import latency
from jaxkv.eviction import Compression
from jaxkv.generate import GREEDY, sample
from jaxkv.model import decoder

RESULTS = Path(__file__).resolve().parents[1] / "results"


def filled_cache(config, *, batch, capacity, n_valid, stats, dtype=None, length=None):
    """A cache whose first ``n_valid`` slots hold random tokens of a sequence of ``length``
    tokens (default ``n_valid``), at positions spread evenly over it, as a compressed cache
    holds them (``dtype="int8"``: random int8 keys and values, unit scales)."""
    length = n_valid if length is None else length
    cache = kvcache.init_cache(
        config, batch_size=batch, capacity=capacity, stats=stats, dtype=dtype
    )
    key = jax.random.key(0)
    shape = cache.k[:, :, :, :n_valid].shape
    filled = {
        n: jax.random.uniform(jax.random.fold_in(key, i), cache.pos.shape)
        for i, n in enumerate(cache.stats)
    }
    k, v = jax.random.normal(key, shape), jax.random.normal(jax.random.fold_in(key, 99), shape)
    if cache.k_scale is not None:
        k, v = (jnp.clip(jnp.round(16 * x), -127, 127) for x in (k, v))
        ones = jnp.ones(cache.pos.shape, jnp.float32)
        cache = cache.replace(k_scale=ones / 16, v_scale=ones / 16)
    return cache.replace(
        k=cache.k.at[:, :, :, :n_valid].set(k.astype(cache.k.dtype)),
        v=cache.v.at[:, :, :, :n_valid].set(v.astype(cache.v.dtype)),
        pos=cache.pos.at[:, :, :, :n_valid].set(jnp.arange(n_valid) * length // n_valid),
        stats=filled,
        length=jnp.full((batch,), length, jnp.int32),
    )


def time_interleaved(variants: dict, steps: int) -> dict:
    """Seconds of each call of each ``(step, state)`` variant, ``state = step(state)``.

    One warm-up (compile) call each, then the variants take turns step by step, so load
    from other processes hits them all alike and the ratios stay fair.
    """
    caches = {}
    for name, (step, cache) in variants.items():
        caches[name] = jax.block_until_ready(step(cache))
    times = {name: [] for name in variants}
    for _ in range(steps):
        for name, (step, _) in variants.items():
            t0 = time.perf_counter()
            caches[name] = jax.block_until_ready(step(caches[name]))
            times[name].append(time.perf_counter() - t0)
    return times


def paired_excess(times: dict, gran: str, k: int) -> float | None:
    """Median over turns of (compressed call - fused call without statistics) per decode
    step: the policy's cost (statistics + scoring + selection) paired turn by turn, which
    cancels the load that moves both calls of a turn alike (None without a fused variant)."""
    if f"fused_nostats_{gran}" not in times:
        return None
    pairs = zip(times[f"compressed_{gran}"], times[f"fused_nostats_{gran}"], strict=True)
    return statistics.median([a - b for a, b in pairs]) / k


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--policy", default="h2o")
    ap.add_argument("--evict-every", type=int, default=1, help="decode steps per eviction")
    ap.add_argument(
        "--kv-dtype",
        default="model",
        choices=("model", "int8"),
        help="the compressed caches' storage (the full cache stays the model's dtype)",
    )
    ap.add_argument(
        "--granularities",
        type=lambda text: text.split(","),
        default=["shared", "head"],
        help="selections to time, comma-separated (the first also sizes decode_stats)",
    )
    ap.add_argument(
        "--attention",
        default="xla",
        choices=ATTENTION_IMPLEMENTATIONS,
        help="config.attention of every variant (kernel: jaxkv.model.cache_kernel)",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "int8"),
        help="the model's weights (int8: weight-only int8, jaxkv.model.weights_int8)",
    )
    ap.add_argument(
        "--matmul",
        default="xla",
        choices=MATMUL_IMPLEMENTATIONS,
        help="config.matmul of every variant (kernel: cache_kernel.stacked_matmul, with the "
        "weights stored out-first)",
    )
    ap.add_argument("--out", default=str(RESULTS / "bench_eviction"), help="path without suffix")
    args = ap.parse_args()
    if not set(args.granularities) <= set(eviction.GRANULARITIES):
        ap.error(f"--granularities: choose from {eviction.GRANULARITIES}")
    model = jaxkv.load(
        "smollm2-135m", dtype=args.dtype, attention=args.attention, matmul=args.matmul
    )
    cfg, params = model.config, model.params
    kernel = cfg.attention == "kernel"  # eviction selects with the kernel too
    n_max = args.context + args.steps
    tok = jnp.zeros((args.batch,), jnp.int32)

    def decode(ct):
        """One step on (cache, token): the logits' greedy token is the next step's input."""
        logits, c = decoder.decode_step(params, ct[1], ct[0], config=cfg)
        return c, sample(logits, GREEDY, key=None)

    def evicting(comp, with_decode):
        # None for the heuristics; a learned policy's weights (and W_o for critical:, blends)
        state = comp.policy.init()
        k = comp.evict_every

        def step(ct):
            if with_decode:
                ct = jax.lax.fori_loop(0, k, lambda _, ct: decode(ct), ct)
            c = eviction.evict(ct[0], comp, state, key=jax.random.key(0), max_drop=k, kernel=kernel)
            return c, ct[1]

        return jax.jit(step, donate_argnums=0)

    def decode_and_forget(ct):
        return latency.decode_and_forget(params, ct[1], ct[0], config=cfg)

    plain = jax.jit(decode_and_forget, donate_argnums=0)
    k = args.evict_every
    fused = jax.jit(  # k steps in one program, as a compressed call runs them
        lambda c: jax.lax.fori_loop(0, k, lambda _, c: decode_and_forget(c), c),
        donate_argnums=0,
    )
    full = filled_cache(cfg, batch=args.batch, capacity=n_max, n_valid=args.context, stats=())
    variants = {"full": (plain, (full, jnp.zeros_like(tok)))}
    full_bytes = full.nbytes()
    if k > 1:  # the full cache's k steps in one program too, for a like-for-like throughput
        variants["fused_full"] = (fused, (jax.tree.map(jnp.copy, full), jnp.zeros_like(tok)))
    comps = {
        g: Compression.make(
            args.policy, ratio=args.ratio, granularity=g, evict_every=args.evict_every
        )
        for g in args.granularities
    }
    first = comps[args.granularities[0]]
    budget = first.max_budget(n_max)
    dtype = None if args.kv_dtype == "model" else args.kv_dtype

    def fresh(stats, comp=first):
        cap = comp.capacity(n_max)
        cache = filled_cache(  # a steady state: B tokens of the context, budget B_t ~ B
            cfg,
            batch=args.batch,
            capacity=cap,
            n_valid=budget,
            stats=stats,
            dtype=dtype,
            length=args.context,
        )
        return cache, jnp.zeros_like(tok)  # each state its own (donated) token

    variants["decode_nostats"] = (plain, fresh(()))
    variants["decode_stats"] = (plain, fresh(first.stats))
    variants["decode_all_stats"] = (plain, fresh(True))
    small_bytes = {}
    for gran, comp in comps.items():
        if comp.capacity(n_max) != first.capacity(n_max):
            variants[f"decode_nostats_{gran}"] = (plain, fresh((), comp))
            variants[f"decode_stats_{gran}"] = (plain, fresh(comp.stats, comp))
        if k > 1:
            variants[f"fused_nostats_{gran}"] = (fused, fresh((), comp))
        variants[f"compressed_{gran}"] = (evicting(comp, True), fresh(comp.stats, comp))
        variants[f"evict_only_{gran}"] = (evicting(comp, False), fresh(comp.stats, comp))
        small_bytes[gran] = variants[f"compressed_{gran}"][1][0].nbytes()
    load = [os.getloadavg()[0]]  # other processes' load skews absolute times, not ratios
    times = time_interleaved(variants, args.steps)
    load.append(os.getloadavg()[0])
    rows = {name: statistics.median(t) for name, t in times.items()}
    per_call = [k for k in rows if k.startswith(("compressed_", "evict_only_", "fused_"))]
    rows.update({k: rows[k] / args.evict_every for k in per_call})  # per decode step
    paired = {g: paired_excess(times, g, args.evict_every) for g in args.granularities}
    report = summarize(rows, full_bytes, small_bytes, args, first.stats, load, paired)
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # PATH.md, PATH.json: with_suffix would cut a name with a dot in it (cost_r0.25 -> cost_r0)
    out.with_name(out.name + ".md").write_text(report)
    out.with_name(out.name + ".json").write_text(
        json.dumps(
            dict(
                args=vars(args),
                ms={k: 1e3 * v for k, v in rows.items()},
                paired_excess_ms={g: v and 1e3 * v for g, v in paired.items()},
                full_bytes=full_bytes,
                load_average=load,
                compressed_bytes=small_bytes,
                policy_stats=list(first.stats),
            ),
            indent=1,
        )
    )


def summarize(rows, full_bytes, small_bytes, args, policy_stats, load, paired):
    ms = {k: 1e3 * v for k, v in rows.items()}
    lines = [
        f"# Eviction benchmark (SmolLM2-135M, batch {args.batch}, context {args.context}, "
        f"r = {args.ratio}, policy {args.policy}, evict every {args.evict_every} step(s), "
        f"weights {args.dtype}, compressed KV {args.kv_dtype}, attention {args.attention}, "
        f"matmul {args.matmul}, "
        f"median of {args.steps} interleaved calls)",
        "",
        f"Load average (1 min) {load[0]:.1f} before the timed calls, {load[1]:.1f} after, on"
        f" {os.cpu_count()} CPUs.",
        "",
        f"The cache carries the statistics the policy reads: {', '.join(policy_stats) or 'none'}"
        " (`decode_stats`); `decode_all_stats` carries all six (what the learned policy's"
        " features need, plus `attn_cum`).",
        "",
        "| measurement | ms / step |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v:.1f} |" for k, v in ms.items()]
    # k > 1: against the full cache's k fused steps (the module docstring says why)
    full_ms = ms.get("fused_full", ms["full"])
    for gran in args.granularities:
        total = ms[f"compressed_{gran}"]
        base = ms.get(f"decode_nostats_{gran}", ms["decode_nostats"])
        alone = ms[f"evict_only_{gran}"]
        stats = ms.get(f"decode_stats_{gran}", ms["decode_stats"]) - base
        apart = 100 * (stats + alone) / (base + stats + alone)
        lines += [
            "",
            f"- {gran}: decode throughput vs full cache: **{full_ms / total:.2f}x**"
            + (f" (single full steps: {ms['full'] / total:.2f}x); " if "fused_full" in ms else "; ")
            + f"statistics + scoring + selection = {total - base:.1f} ms = "
            f"**{100 * (total - base) / total:.1f} %** of a step; measured apart, statistics "
            f"{stats:.1f} ms + eviction alone {alone:.1f} ms per decode step = **{apart:.1f} %**"
            " of a step; "
            + (
                f"against {args.evict_every} fused decode steps without statistics, "
                f"**{100 * (total - ms[f'fused_nostats_{gran}']) / total:.1f} %** of a step "
                f"(paired turn by turn: {1e3 * paired[gran]:.1f} ms = "
                f"**{1e5 * paired[gran] / total:.1f} %**); "
                if paired[gran] is not None
                else ""
            )
            + "cache bytes "
            f"{small_bytes[gran] / 2**20:.0f} MiB = "
            f"**{100 * small_bytes[gran] / full_bytes:.1f} %** of the full cache's",
        ]
    extra = ms["decode_all_stats"] - ms["decode_nostats"]
    lines += [
        "",
        f"- all six statistics (a superset of what the learned policy reads): +{extra:.1f} ms ="
        f" {100 * extra / ms['decode_nostats']:.1f} % of a decode step without statistics",
    ]
    full = f"- full cache: {full_bytes / 2**20:.0f} MiB; compressed bytes include the statistics"
    lines += ["", full, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
