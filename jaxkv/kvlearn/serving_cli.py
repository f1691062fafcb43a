"""``python -m jaxkv.eval kvlearn --trace MOONCAKE.jsonl ...``: the serving-scale simulator.

Chosen by ``cli.eval_main`` when the ``--trace`` file is in the Mooncake format (its first
record has ``hash_ids``); the core's own JSONL format keeps going to the core simulator.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from jaxkv.kvlearn import cli_common
from jaxkv.kvlearn import serving as SV
from jaxkv.kvlearn.cost import GIB, CostModel
from jaxkv.kvlearn.traces import load_mooncake_trace


def add_arguments(p) -> None:
    """The serving flags, each checked for range as it is parsed."""
    num = cli_common.number
    g = p.add_argument_group("serving (Mooncake traces given with --trace)")
    g.add_argument(
        "--pool-gib",
        dest="serving_pool_gib",
        metavar="GIB",
        type=num(float, gt=0),
        default=None,
        help="pool size in GiB",
    )
    g.add_argument(
        "--pool-frac",
        type=num(float, ge=0, le=1),
        default=None,
        help="pool size as a fraction of the trace's distinct blocks (instead of --pool-gib)",
    )
    g.add_argument(
        "--prefill-nodes", type=num(int, ge=1), default=24, help="prefill nodes (default 24)"
    )
    g.add_argument(
        "--load-scale",
        type=num(float, gt=0),
        default=1.0,
        help="arrival-rate multiplier (default 1)",
    )
    g.add_argument("--slo-ms", type=num(float, gt=0), default=30_000.0, help="TTFT SLO (ms)")
    g.add_argument(
        "--rate-search",
        action="store_true",
        help="also search each policy's max sustainable rate (throughput_rps) at the SLO",
    )
    g.add_argument(
        "--attainment",
        type=num(float, gt=0, le=1),
        default=0.9,
        help="fraction of requests that must meet the SLO for a rate to count as sustained",
    )
    g.add_argument(
        "--decode-nodes", type=num(int, ge=1), default=8, help="decode nodes (default 8)"
    )
    g.add_argument(
        "--decode-slots", type=num(int, ge=1), default=32, help="sequences per decode node"
    )
    g.add_argument(
        "--tpot-ms", type=num(float, ge=0), default=25.0, help="decode time per output token"
    )
    g.add_argument(
        "--loads",
        type=cli_common.number_list(num(float, gt=0)),
        default=[0.5, 1.0, 1.5, 2.0],
        help="load scales (--sweep)",
    )
    g.add_argument(
        "--fracs",
        type=cli_common.number_list(num(float, ge=0, le=1)),
        default=[0.1, 0.25, 0.5],
        help="pool fractions (--sweep)",
    )


def check_args(args) -> None:
    """The serving simulator's argument rules, checked before the trace is read (fills
    ``policies``)."""
    if args.prp_checkpoint:
        raise ValueError(
            "--prp-checkpoint applies to the core simulator; the serving simulator's KVLearn "
            "learns online"
        )
    args.policies = args.policies or list(SV.POLICIES)
    bad = [p for p in args.policies if p not in SV.POLICIES]
    if bad:
        raise ValueError(f"policies {bad} are not serving policies; choose from {SV.POLICIES}")
    if args.sweep:
        return
    if args.pool_gib is not None and args.serving_pool_gib is not None:
        raise ValueError("give the pool size once: positionally or with --pool-gib")
    gib = args.serving_pool_gib if args.serving_pool_gib is not None else args.pool_gib
    if gib is not None and args.pool_frac is not None:
        raise ValueError("give at most one of --pool-gib and --pool-frac")
    if gib is None and args.pool_frac is None:
        raise ValueError("serving mode needs --pool-gib X (or --pool-frac F)")


COLUMNS: list[cli_common.Column] = [
    ("policy", 14, lambda m: m["policy"]),
    ("TTFT mean", 11, lambda m: f"{m['ttft_ms_mean']:.1f}"),
    ("p50", 10, lambda m: f"{m['ttft_ms_p50']:.1f}"),
    ("p99", 11, lambda m: f"{m['ttft_ms_p99']:.1f}"),
    ("blk hit %", 10, lambda m: f"{100 * m['hit_rate']:.1f}"),
    ("tok hit %", 10, lambda m: f"{100 * m['token_hit_rate']:.1f}"),
    ("xfer GiB", 10, lambda m: f"{m['transfer_gib']:.0f}"),
    ("wait ms", 10, lambda m: f"{m['wait_ms_mean']:.1f}"),
    ("goodput", 9, lambda m: f"{m['goodput_rps']:.3f}"),
    (
        "max rps",
        9,
        lambda m: "-" if m.get("throughput_rps") is None else f"{m['throughput_rps']:.3f}",
    ),
    ("e2e ms", 10, lambda m: f"{m['e2e_ms_mean']:.0f}"),
    ("sim s", 7, lambda m: f"{m['wall_s']:.2f}"),
]


def format_table(results: list[dict]) -> str:
    """The serving policy table (columns widen for wide values)."""
    return cli_common.format_columns(COLUMNS, results)


def _replay_bar(trace, runs: int):
    """A progress bar over ``runs`` replays of ``trace`` (in requests), shown when they touch
    at least ``cli_common.PROGRESS_MIN_REQUESTS`` blocks."""
    blocks = sum(len(b) for b in trace.blocks)
    show = runs * blocks >= cli_common.PROGRESS_MIN_REQUESTS
    return cli_common.progress_bar(runs * len(trace), desc="replay", unit="req", show=show)


def _config(args, trace, cost: CostModel):
    """The deployment; the pool arguments were checked by ``check_args``."""
    if args.pool_frac is not None:
        blocks = int(args.pool_frac * trace.n_blocks)
    else:
        gib = args.serving_pool_gib if args.serving_pool_gib is not None else args.pool_gib
        blocks = SV.pool_blocks_for(gib, cost, trace.block_tokens)
    return SV.ServingConfig(pool_blocks=blocks, **_deployment(args))


def _deployment(args) -> dict:
    return {
        "prefill_nodes": args.prefill_nodes,
        "slo_ms": args.slo_ms,
        "decode_nodes": args.decode_nodes,
        "decode_slots": args.decode_slots,
        "tpot_ms": args.tpot_ms,
    }


def main(args, *, cost: CostModel) -> int:
    """Runs the serving simulator; ``args`` passed ``check_args`` and the output checks."""
    with cli_common.file_progress(args.trace_file) as bar:
        base = load_mooncake_trace(args.trace_file, progress=bar.update)
    if args.n_requests is not None:
        base = base.head(args.n_requests)
    policies = args.policies
    if args.sweep:
        return _sweep(args, base, cost, policies)
    trace = base.scaled(args.load_scale)
    cfg = _config(args, trace, cost)
    blk_gib = cost.footprint_bytes(trace.block_tokens) / GIB
    print("KVLearn serving simulator (Mooncake trace, block-level prefix cache)")
    print(
        f"  trace={args.trace}  requests={len(trace)}  distinct_blocks={trace.n_blocks}  "
        f"pool={cfg.pool_blocks} blocks ({cfg.pool_blocks * blk_gib:.1f} GiB, "
        f"{100 * cfg.pool_blocks / trace.n_blocks:.1f} % of distinct)"
    )
    print(
        f"  prefill_nodes={cfg.prefill_nodes}  load_scale={args.load_scale:g}  "
        f"slo_ms={cfg.slo_ms:g}  model={cost.shape.name}\n"
    )
    with _replay_bar(trace, len(policies)) as bar:
        results = SV.compare(
            trace,
            cfg=cfg,
            cost=cost,
            policies=policies,
            rate_search=args.rate_search,
            attainment=args.attainment,
            progress=bar.update,
        )
    print(format_table(results))
    print(
        "\n(TTFT, wait and end-to-end in ms; goodput = requests meeting the TTFT SLO per second; "
        f"max rps = highest arrival rate with ≥ {args.attainment:.0%} meeting it (--rate-search))"
    )
    if args.json:
        config = {
            "n_requests": len(trace),
            "trace": args.trace,
            "pool_gib": cfg.pool_blocks * blk_gib,
            "pool_blocks": cfg.pool_blocks,
            "distinct_blocks": trace.n_blocks,
            "prefill_nodes": cfg.prefill_nodes,
            "load_scale": args.load_scale,
            "slo_ms": cfg.slo_ms,
            "decode_nodes": cfg.decode_nodes,
            "decode_slots": cfg.decode_slots,
            "tpot_ms": cfg.tpot_ms,
            "rate_search": args.rate_search,
            "attainment": args.attainment,
            "cost_preset": None if args.calibration else args.cost_preset,
            "calibration": args.calibration,
            "seed": args.seed,
        }
        _write_json(args.json, {"config": config, "results": results})
    return 0


def _sweep(args, base, cost, policies) -> int:
    rows = []
    t0 = time.perf_counter()
    runs = len(args.fracs) * len(args.loads) * len(policies)
    with _replay_bar(base, runs) as bar:
        for frac in args.fracs:
            cfg = SV.ServingConfig(pool_blocks=int(frac * base.n_blocks), **_deployment(args))
            for load in args.loads:
                for r in SV.compare(
                    base.scaled(load), cfg=cfg, cost=cost, policies=policies, progress=bar.update
                ):
                    rows.append(r | {"pool_frac": frac, "load_scale": load})
    print(f"serving sweep: {len(rows)} runs in {time.perf_counter() - t0:.1f} s")
    for frac in args.fracs:
        print(f"\npool {100 * frac:g} % of distinct blocks: mean TTFT (ms) per load scale")
        print(_sweep_table(rows, frac=frac, loads=args.loads, policies=policies))
    plot_sweep(rows, path=args.plot, fracs=args.fracs, loads=args.loads, policies=policies)
    print(f"plot: {args.plot}")
    if args.json:
        config = {"trace": args.trace, "fracs": args.fracs, "loads": args.loads}
        _write_json(args.json, {"config": config | {"nodes": args.prefill_nodes}, "runs": rows})
    return 0


def _sweep_table(rows, *, frac, loads, policies) -> str:
    """Mean TTFT per policy (rows) and load scale (columns) at one pool fraction."""
    cells = {(r["policy"], r["load_scale"]): r for r in rows if r["pool_frac"] == frac}
    columns: list[cli_common.Column] = [("policy", 14, lambda row: row["policy"])]
    columns += [
        (f"{x:g}x", 12, lambda row, x=x: f"{cells[(row['policy'], x)]['ttft_ms_mean']:.1f}")
        for x in loads
    ]
    return cli_common.format_columns(columns, [{"policy": p} for p in policies], rule=False)


def plot_sweep(rows, *, path, fracs, loads, policies) -> None:
    """Mean TTFT vs pool fraction (at load 1 or the first load) and vs load (largest pool)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load0 = 1.0 if 1.0 in loads else loads[0]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in policies:
        rs = [r for r in rows if r["policy"] == p]
        x = [f for f in fracs]
        a1.plot(x, [_cell(rs, f, load0)["ttft_ms_mean"] for f in x], marker="o", label=p)
        a2.plot(loads, [_cell(rs, fracs[-1], s)["ttft_ms_mean"] for s in loads], marker="o")
    a1.set_xlabel("pool size (fraction of distinct blocks)")
    a1.set_title(f"load scale {load0:g}")
    a2.set_xlabel("load scale")
    a2.set_title(f"pool {100 * fracs[-1]:g} % of distinct blocks")
    for a in (a1, a2):
        a.set_ylabel("mean TTFT (ms)")
        a.set_yscale("log")
        a.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cell(rows, frac, load):
    return next(r for r in rows if r["pool_frac"] == frac and r["load_scale"] == load)


def _write_json(path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    print(f"wrote {path}")
