"""The prompt's ``wo_vnorm`` statistic (``jaxkv.stats.projected_value_norms``, CriticalKV's
||W_o v||_1 per token) of one SmolLM2-135M layer at batch 8 and a 4K prompt, computed 512
tokens at a time (the default) against the whole prompt at once: XLA's temporary memory of the
compiled program, then the two in turns, medians and ratio, and the largest relative
difference of their results. Written to ``results/bench_projected_norms.md``.

    .venv/bin/python scripts/bench_projected_norms.py [--reps 7] [--batch 8] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxkv import stats

RESULTS = Path(__file__).resolve().parents[1] / "results"
WHOLE = 1 << 30  # a chunk longer than any prompt: the whole prompt at once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", default=str(RESULTS / "bench_projected_norms.md"))
    args = ap.parse_args()
    if min(args.reps, args.batch, args.tokens) < 1:
        ap.error("--reps, --batch and --tokens must be >= 1")
    K, G, H, D = 3, 3, 64, 576  # SmolLM2-135M: 3 KV heads of 3 query heads, head 64, model 576
    v = jax.random.normal(jax.random.key(0), (args.batch, K, args.tokens, H))
    wo = jax.random.normal(jax.random.key(1), (K * G, H, D)) / H**0.5
    runs = {}
    for name, chunk in (("512 tokens at a time", 512), ("the whole prompt at once", WHOLE)):
        fn = jax.jit(lambda v, w, c=chunk: stats.projected_value_norms(v, w, chunk=c))
        temp = fn.lower(v, wo).compile().memory_analysis().temp_size_in_bytes
        runs[name] = (fn, temp, [])
        fn(v, wo).block_until_ready()
    load = [os.getloadavg()[0]]
    for _ in range(args.reps):
        for fn, _, times in runs.values():
            start = time.perf_counter()
            fn(v, wo).block_until_ready()
            times.append(time.perf_counter() - start)
    load.append(os.getloadavg()[0])
    (a, _, ta), (b, _, tb) = runs.values()
    diff = float(jnp.max(jnp.abs(a(v, wo) / b(v, wo) - 1.0)))
    rows = [
        f"| {name} | {temp / 2**20:,.0f} | {1e3 * statistics.median(t):,.0f} |"
        for name, (_, temp, t) in runs.items()
    ]
    text = "\n".join(
        [
            "# The prompt's wo_vnorm statistic, in chunks or at once",
            "",
            f"`python scripts/bench_projected_norms.py --reps {args.reps} --batch {args.batch} "
            f"--tokens {args.tokens}`: one layer, [{args.batch}, {K}, {args.tokens}, {H}] values, "
            f"W_o [{K * G}, {H}, {D}], float32; {args.reps} runs each, in turns.",
            "",
            "| computed | XLA temporary memory (MiB) | median (ms) |",
            "|---|---|---|",
            *rows,
            "",
            f"Chunked over whole: {statistics.median(ta) / statistics.median(tb):.2f}x the time; "
            f"largest relative difference of the results {diff:.1e}. Load average (1 min) "
            f"{load[0]:.1f} before, {load[1]:.1f} after, on {os.cpu_count()} CPUs.",
            "",
        ]
    )
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
