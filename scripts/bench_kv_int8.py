"""The int8 KV cache on the embedded model: fidelity (KL) with and without it, and cache bytes.

Runs the fidelity suite twice on the same windows (``python -m jaxkv.eval fidelity``, once with
``--kv-dtype model`` and once with ``--kv-dtype int8``), then sizes each run's decode-loop cache
(``KVCache.nbytes`` of the cache ``teacher_forced`` allocates: capacity, statistics, scales)
against the float32 full cache, and writes ``results/kv_int8.md``::

    .venv/bin/python scripts/bench_kv_int8.py [--limit 4] [--work runs/kv_int8] \
        [--out results/kv_int8.md]

Cache bytes are per sequence and computed from shapes (``jax.eval_shape``); the prefill cache,
which holds the whole prompt before the first eviction, is not counted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

from jaxkv import kvcache
from jaxkv.cli import eval as eval_cli
from jaxkv.config import ModelConfig
from jaxkv.eviction import Compression

POLICIES = ("full", "h2o", "tova")
RATIOS = (1.0, 0.25, 0.125)
WINDOW, PROMPT_LEN, MIN_BUDGET = 352, 256, 32
DTYPES = ("model", "int8")


def run_fidelity(kv_dtype: str, *, limit: int, out: Path) -> dict:
    """One fidelity run; returns its result JSON."""
    argv = [
        "fidelity",
        *("--policies", ",".join(POLICIES)),
        *("--ratios", ",".join(f"{r:g}" for r in RATIOS)),
        *("--seeds", "0", "--limit", str(limit), "--window", str(WINDOW)),
        *("--prompt-len", str(PROMPT_LEN), "--min-budget", str(MIN_BUDGET)),
        *("--kv-dtype", kv_dtype, "--out", str(out)),
    ]
    status = eval_cli.main(argv)
    if status != 0:
        raise SystemExit(f"fidelity --kv-dtype {kv_dtype} failed with status {status}")
    return json.loads((out / "fidelity.json").read_text())


def cache_bytes(config: ModelConfig, policy: str, ratio: float, kv_dtype: str) -> int:
    """Bytes of the decode-loop cache of one sequence of a fidelity window."""
    capacity, stats, window = WINDOW, (), 64
    if policy != "full":
        comp = Compression.make(policy, ratio=ratio, min_budget=MIN_BUDGET)
        capacity = comp.capacity(WINDOW, prompt_len=PROMPT_LEN)
        stats, window = comp.stats, comp.policy.window
    dtype = None if kv_dtype == "model" else kv_dtype
    shape = jax.eval_shape(
        lambda: kvcache.init_cache(
            config, batch_size=1, capacity=capacity, dtype=dtype, stats=stats, window=window
        )
    )
    return shape.nbytes()


def render(runs: dict, config: ModelConfig, *, limit: int) -> str:
    """The markdown report."""
    full_f32 = cache_bytes(config, "full", 1.0, "model")
    rows = {(dt, r["policy"], r["ratio"]): r for dt, res in runs.items() for r in res["results"]}
    head = "| policy | r | KL f32 cache | KL int8 cache | top-1 f32 / int8 (%) "
    head += "| cache bytes f32 | cache bytes int8 | int8 / f32 full |\n"
    lines = [head + "|---|---|---|---|---|---|---|---|"]
    for policy in POLICIES:
        for ratio in RATIOS:
            a, b = rows[("model", policy, ratio)], rows[("int8", policy, ratio)]
            n32 = cache_bytes(config, policy, ratio, "model")
            n8 = cache_bytes(config, policy, ratio, "int8")
            share32, share8 = 100 * n32 / full_f32, 100 * n8 / full_f32
            lines.append(
                f"| {policy} | {ratio:g} | {a['kl_mean']:.4f} | {b['kl_mean']:.4f} "
                f"| {100 * a['top1_agreement']:.1f} / {100 * b['top1_agreement']:.1f} "
                f"| {n32:,} ({share32:.1f} %) | {n8:,} | **{share8:.1f} %** |"
            )
    cfg = runs["model"]["config"]
    return "\n".join(
        [
            "# int8 KV cache: fidelity and bytes (issue 17, item 3)",
            "",
            f"SmolLM2-135M (float32 weights), {cfg['windows']} held-out tinyshakespeare windows "
            f"of {WINDOW} tokens ({PROMPT_LEN} prefilled + {WINDOW - PROMPT_LEN} "
            f"teacher-forced), decode protocol, shared granularity, B_min = {MIN_BUDGET}. "
            "KL is the mean per-step KL(P_full || P) in nats against the float32 full cache in "
            "both columns: the int8 `full` row is what int8 storage alone costs. "
            "Cache bytes: `KVCache.nbytes` of one sequence's decode-loop cache (keys, values, "
            "int8 scales, positions, the policy's statistics), against the float32 full cache "
            f"({full_f32:,} bytes). Written by `scripts/bench_kv_int8.py --limit {limit}`.",
            "",
            *lines,
            "",
            "Per slot and KV head a float32 cache stores 2 x 64 x 4 bytes of keys and values; "
            "int8 stores 2 x 64 bytes plus two float32 scales (136 bytes, 26.6 %), next to "
            "4 bytes of position and 4 per statistic a policy reads.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4, help="windows")
    parser.add_argument("--work", default="runs/kv_int8", help="folder of the two fidelity runs")
    parser.add_argument("--out", default="results/kv_int8.md")
    args = parser.parse_args(argv)
    work = Path(args.work)
    runs = {dt: run_fidelity(dt, limit=args.limit, out=work / dt) for dt in DTYPES}
    text = render(runs, ModelConfig.smollm2_135m(), limit=args.limit)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
