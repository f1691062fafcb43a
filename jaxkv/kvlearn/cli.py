"""Command lines: ``python -m jaxkv.eval kvlearn`` (simulator) and ``python -m jaxkv.train kvlearn``
(offline PRP pre-training). ``eval_main`` / ``train_main`` take argv without the subcommand.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from jaxkv.kvlearn import baselines as B
from jaxkv.kvlearn import cli_common
from jaxkv.kvlearn import simulate as S
from jaxkv.kvlearn import traces as T
from jaxkv.kvlearn.control import KVLearnConfig
from jaxkv.kvlearn.cost import GIB, PRESETS, CostModel
from jaxkv.kvlearn.pool import MAX_CAPACITY_KIB

EVAL_PROG = "python -m jaxkv.eval kvlearn"
TRAIN_PROG = "python -m jaxkv.train kvlearn"
DEFAULTS = {"n_requests": 3000, "zipf_alpha": 1.1, "pool_gib": 4.0}
MAX_POOL_GIB = MAX_CAPACITY_KIB / 2**20
"""The core simulator's largest pool (its block table counts KiB in int32)."""


# ---- argument types -------------------------------------------------------------------------
def _float(s: str, what: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be a number, got {s!r}") from None


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def _alpha(s: str) -> float:
    v = _float(s, "zipf alpha")
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"zipf alpha must be > 0, got {s}")
    return v


def _pool(s: str) -> float:
    v = _float(s, "pool size")
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"pool size must be ≥ 0 GiB, got {s}")
    return v


def _core_pool(s: str) -> float:
    v = _pool(s)
    if v > MAX_POOL_GIB:
        raise argparse.ArgumentTypeError(f"pool size must be ≤ {MAX_POOL_GIB:g} GiB, got {s}")
    return v


def _policies(s: str) -> list[str]:
    from jaxkv.kvlearn.serving import POLICIES as SERVING

    names = [x for x in s.split(",") if x]
    known = list(B.POLICIES) + [n for n in SERVING if n not in B.POLICIES]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policies {bad}; choose from {','.join(known)}")
    return names


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seed",
        type=cli_common.number(int, ge=0),
        default=7,
        help="trace and policy seed (default 7)",
    )
    p.add_argument(
        "--cost-preset",
        default="llama3-8b-a100",
        choices=PRESETS,
        help="llama3-8b-a100 (default), mistral-7b-a100 or smollm2-135m-cpu",
    )
    p.add_argument(
        "--horizon",
        type=cli_common.number(float, gt=0),
        default=5.0,
        help="PRP label horizon H in seconds",
    )
    p.add_argument("--tick-every", type=_positive_int, default=20, help="requests between ticks")


def _cost(args) -> CostModel:
    if getattr(args, "calibration", None):
        from jaxkv.kvlearn.calibrate import cost_model_from

        return cost_model_from(args.calibration)
    return CostModel.preset(args.cost_preset)


def _sim_cfg(args, cost: CostModel) -> S.SimConfig:
    return S.SimConfig(
        kvlearn=KVLearnConfig(cost=cost, horizon_s=args.horizon), tick_every=args.tick_every
    )


def _resolve_traces(args) -> None:
    """Sets ``trace_file`` / ``mooncake_file`` (``example`` → the shipped trace); at most one of
    ``--trace`` and ``--mooncake``."""
    if args.trace and args.mooncake:
        raise T.TraceError("give at most one of --trace and --mooncake")
    args.trace_file = T.trace_path(args.trace) if args.trace else None
    args.mooncake_file = T.trace_path(args.mooncake) if args.mooncake else None


def _trace(args, n_requests, alpha) -> T.Trace:
    if args.trace or args.mooncake:
        path = args.trace_file or args.mooncake_file
        load = T.load_jsonl if args.trace else T.load_mooncake
        with cli_common.file_progress(path) as bar:
            tr = load(path, progress=bar.update)
        return tr.head(n_requests) if n_requests is not None else tr
    return T.zipf_multimodal(
        n_requests or DEFAULTS["n_requests"], alpha or DEFAULTS["zipf_alpha"], seed=args.seed
    )


# ---- eval -----------------------------------------------------------------------------------
def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=EVAL_PROG,
        description="Simulate the KV pool of a disaggregated serving system (prefill → pool → "
        "decode) under every policy on the README's Zipf multimodal workload or a trace file.",
    )
    p.add_argument("n_requests", nargs="?", type=_positive_int, help="requests (default 3000)")
    p.add_argument("zipf_alpha", nargs="?", type=_alpha, help="Zipf exponent (default 1.1)")
    p.add_argument("pool_gib", nargs="?", type=_pool, help="pool size in GiB (default 4)")
    p.add_argument(
        "--policies",
        type=_policies,
        default=None,
        help="comma-separated subset (default: every policy of the chosen simulator)",
    )
    p.add_argument("--json", metavar="PATH", help="write {config, results} as JSON")
    p.add_argument(
        "--trace",
        metavar="JSONL",
        help="replay a JSONL trace instead of the Zipf workload; a Mooncake-format file "
        "(timestamp, input_length, output_length, hash_ids) runs the serving simulator; "
        f"'{T.EXAMPLE}' is the Mooncake example trace shipped with jaxkv",
    )
    p.add_argument(
        "--mooncake",
        metavar="JSONL",
        help=f"replay a Mooncake trace block by block in the core simulator ('{T.EXAMPLE}': "
        "the shipped one)",
    )
    p.add_argument("--prp-checkpoint", metavar="DIR", help="start KVLearn from a pre-trained PRP")
    p.add_argument(
        "--calibration",
        metavar="JSON",
        help="cost model from `kvlearn calibrate --json` instead of --cost-preset",
    )
    _common(p)
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--sweep", action="store_true", help="run a grid; plot TTFT vs pool size per policy"
    )
    g.add_argument(
        "--pools",
        type=cli_common.number_list(_core_pool),
        default=[1, 2, 4, 8, 16],
        help="GiB list (sweep)",
    )
    g.add_argument(
        "--alphas",
        type=cli_common.number_list(_alpha),
        default=[0.8, 1.1, 1.4],
        help="alpha list (sweep)",
    )
    g.add_argument("--seeds", type=_positive_int, default=3, help="seeds per cell (sweep)")
    g.add_argument("--plot", metavar="PNG", default="kvlearn_sweep.png", help="sweep plot path")
    g.add_argument(
        "--sweep-mode",
        choices=("vmap", "loop"),
        default="vmap",
        help="one batched run per policy (faster once compiled), or one run after another",
    )
    from jaxkv.kvlearn import serving_cli

    serving_cli.add_arguments(p)
    return p


TABLE_COLUMNS: list[cli_common.Column] = [
    ("policy", 15, lambda m: m["policy"]),
    ("TTFT mean", 10, lambda m: f"{m['ttft_ms_mean']:.3f}"),
    ("p50", 8, lambda m: f"{m['ttft_ms_p50']:.2f}"),
    ("p99", 8, lambda m: f"{m['ttft_ms_p99']:.2f}"),
    ("hit %", 8, lambda m: f"{100 * m['hit_rate']:.1f}"),
    ("byte hit %", 11, lambda m: f"{100 * m['byte_hit_rate']:.1f}"),
    ("xfer GiB", 10, lambda m: f"{m['transfer_gib']:.1f}"),
    ("admits", 8, lambda m: f"{m['admits']:d}"),
    ("evictions", 10, lambda m: f"{m['evictions']:d}"),
    ("discards", 9, lambda m: f"{m['discards']:d}"),
]


def format_table(results: list[dict]) -> str:
    """The policy table (columns widen for wide values)."""
    return cli_common.format_columns(TABLE_COLUMNS, results)


def _load_prp(path):
    if not path:
        return None
    from jaxkv.kvlearn.checkpoint import load_prp

    state, _, _ = load_prp(path)
    return state


def _single(args, sim_cfg, prp) -> int:
    tr = _trace(args, args.n_requests, args.zipf_alpha)
    pool_gib = args.pool_gib if args.pool_gib is not None else DEFAULTS["pool_gib"]
    source = args.trace or args.mooncake or "zipf-multimodal"
    alpha = None if (args.trace or args.mooncake) else (args.zipf_alpha or DEFAULTS["zipf_alpha"])
    cost = sim_cfg.cost
    print("KVLearn simulator")
    print(
        f"  trace={source}  requests={len(tr)}  keys={tr.n_keys}  zipf_alpha={alpha}  "
        f"pool_GiB={pool_gib:g}"
    )
    print(
        f"  model={cost.shape.name}  fabric={cost.bandwidth_Bps * 8 / 1e9:g} Gbps  "
        f"seed={args.seed}\n"
    )
    t0 = time.perf_counter()
    work = len(tr) * len(args.policies)
    show = work >= cli_common.PROGRESS_MIN_REQUESTS
    with cli_common.progress_bar(work, desc="replay", unit="req", show=show) as bar:
        results = S.compare(
            tr,
            capacity_bytes=pool_gib * GIB,
            seed=args.seed,
            policies=args.policies,
            sim_cfg=sim_cfg,
            prp=prp,
            progress=bar.update,
        )
    print(format_table(results))
    print(f"\n({time.perf_counter() - t0:.1f} s including compilation; TTFT in ms)")
    if args.json:
        config = {
            "n_requests": len(tr),
            "zipf_alpha": alpha,
            "pool_gib": pool_gib,
            "seed": args.seed,
            "trace": source,
            "cost_preset": args.cost_preset,
            "horizon_s": args.horizon,
            "tick_every": args.tick_every,
            "prp_checkpoint": args.prp_checkpoint,
        }
        _write_json(args.json, {"config": config, "results": results})
    return 0


def _sweep(args, sim_cfg, prp) -> int:
    n = args.n_requests or DEFAULTS["n_requests"]
    seeds = list(range(args.seeds))
    print(
        f"KVLearn sweep: requests={n} alphas={args.alphas} pools_GiB={args.pools} "
        f"seeds={len(seeds)}"
    )
    rows, seconds = S.sweep(
        n_requests=n,
        alphas=args.alphas,
        pools_gib=args.pools,
        seeds=seeds,
        policies=args.policies,
        sim_cfg=sim_cfg,
        prp=prp,
        mode=args.sweep_mode,
    )
    summary = S.summarize(rows)
    for alpha in args.alphas:
        print(f"\nalpha={alpha}: median TTFT (ms) over {len(seeds)} seeds")
        print(_sweep_table(summary, alpha=alpha, pools=args.pools, policies=args.policies))
    print(
        "\nbatched run time per policy (s, incl. compile): "
        + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())
    )
    plot_sweep(summary, path=args.plot, alphas=args.alphas, policies=args.policies)
    print(f"plot: {args.plot}")
    if args.json:
        config = {
            "n_requests": n,
            "alphas": args.alphas,
            "pools_gib": args.pools,
            "seeds": seeds,
            "cost_preset": args.cost_preset,
        }
        _write_json(
            args.json, {"config": config, "summary": summary, "runs": rows, "seconds": seconds}
        )
    return 0


def _sweep_table(summary: list[dict], *, alpha, pools, policies) -> str:
    """Median mean TTFT per policy (rows) and pool size (columns) at one alpha."""
    cells = {(r["policy"], r["pool_gib"]): r for r in summary if r["alpha"] == alpha}
    columns: list[cli_common.Column] = [("policy", 15, lambda row: row["policy"])]
    columns += [
        (f"{g:g}G", 10, lambda row, g=g: f"{cells[(row['policy'], g)]['ttft_ms_mean_median']:.3f}")
        for g in pools
    ]
    return cli_common.format_columns(columns, [{"policy": p} for p in policies], rule=False)


def plot_sweep(summary: list[dict], *, path, alphas, policies) -> None:
    """TTFT (median over seeds, min–max band) vs pool size, one panel per alpha."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(alphas), figsize=(5 * len(alphas), 4), squeeze=False)
    for ax, alpha in zip(axes[0], alphas, strict=True):
        for name in policies:
            rs = sorted(
                (r for r in summary if r["policy"] == name and r["alpha"] == alpha),
                key=lambda r: r["pool_gib"],
            )
            x = [r["pool_gib"] for r in rs]
            ax.plot(
                x,
                [r["ttft_ms_mean_median"] for r in rs],
                marker="o",
                label=name,
                lw=2.5 if name == "kvlearn" else 1.2,
            )
            ax.fill_between(
                x,
                [r["ttft_ms_mean_min"] for r in rs],
                [r["ttft_ms_mean_max"] for r in rs],
                alpha=0.15,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pool size (GiB)")
        ax.set_title(f"Zipf α = {alpha}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean TTFT (ms)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_json(path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    print(f"wrote {path}")


def _check_core_args(args) -> None:
    """The core simulator's argument rules (fills ``pool_gib`` and ``policies``)."""
    if args.sweep and (args.trace or args.mooncake):
        raise T.TraceError("--sweep runs the Zipf workload; it does not take --trace/--mooncake")
    if args.pool_gib is not None and args.serving_pool_gib is not None:
        raise ValueError("give the pool size once: positionally or with --pool-gib")
    if args.pool_gib is None:
        args.pool_gib = args.serving_pool_gib
    if args.pool_gib is not None and args.pool_gib > MAX_POOL_GIB:
        raise ValueError(
            f"pool size must be ≤ {MAX_POOL_GIB:g} GiB (the core simulator counts KiB in int32), "
            f"got {args.pool_gib:g}"
        )
    if args.policies is None:
        args.policies = list(B.POLICIES)
    extra = [n for n in args.policies if n not in B.POLICIES]
    if extra:
        raise ValueError(f"policies {extra} need a Mooncake trace (--trace)")
    for flag, given in (
        ("--pool-frac", args.pool_frac is not None),
        ("--rate-search", args.rate_search),
    ):
        if given:
            raise ValueError(f"{flag} applies to Mooncake traces given with --trace only")


def _check_eval_args(args) -> bool:
    """Every check that needs no trace contents, before anything is loaded, simulated or
    written. Returns whether ``--trace`` is a Mooncake file (the serving simulator)."""
    from jaxkv.kvlearn import serving_cli

    _resolve_traces(args)
    serving = bool(args.trace) and T.is_mooncake_file(args.trace_file)
    if serving:
        serving_cli.check_args(args)
    else:
        _check_core_args(args)
    if args.json:
        cli_common.check_output(args.json, flag="--json")
    if args.sweep:
        cli_common.check_output(args.plot, flag="--plot")
    return serving


def eval_main(argv: list[str]) -> int:
    """``python -m jaxkv.eval kvlearn [n_requests] [zipf_alpha] [pool_GiB] [options]``."""
    if argv and argv[0] == "calibrate":
        from jaxkv.kvlearn import calibrate

        return calibrate.main(argv[1:])
    parser = eval_parser()
    args = parser.parse_args(argv)
    try:
        serving = _check_eval_args(args)
        cost = _cost(args)
        if serving:
            from jaxkv.kvlearn import serving_cli

            return serving_cli.main(args, cost=cost)
        sim_cfg = _sim_cfg(args, cost)
        prp = _load_prp(args.prp_checkpoint)
        return _sweep(args, sim_cfg, prp) if args.sweep else _single(args, sim_cfg, prp)
    except (T.TraceError, FileNotFoundError, ValueError) as e:
        print(f"{EVAL_PROG}: error: {e}", file=sys.stderr)
        return 2


# ---- train ----------------------------------------------------------------------------------
def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=TRAIN_PROG,
        description="Pre-train the PRP offline: replay a trace through KVLearn to collect delayed "
        "reuse labels, fit the MLP for several epochs, save it with orbax. Start the simulator "
        f"from it with `{EVAL_PROG} --prp-checkpoint DIR`.",
    )
    p.add_argument("--trace", metavar="JSONL", help="JSONL trace (default: the Zipf workload)")
    p.add_argument(
        "--mooncake",
        metavar="JSONL",
        help=f"Mooncake trace, block by block ('{T.EXAMPLE}': the one shipped with jaxkv)",
    )
    p.add_argument(
        "--n-requests",
        type=_positive_int,
        default=None,
        help="Zipf requests (20000) or trace prefix",
    )
    p.add_argument(
        "--alpha", type=_alpha, default=1.1, help="Zipf exponent for the synthetic trace"
    )
    p.add_argument(
        "--pool-gib", type=_core_pool, default=4.0, help="pool size while collecting labels"
    )
    p.add_argument("--epochs", type=_positive_int, default=20)
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory")
    _common(p)
    return p


def _check_checkpoint_out(path) -> None:
    """``--out`` must be creatable, an empty folder or a checkpoint (``save_prp`` replaces only
    those), checked before the labels are collected."""
    from jaxkv import checkpoint as checkpoint_lib

    cli_common.check_output(path, flag="--out", directory=True)
    p = Path(path)
    if p.is_dir() and any(p.iterdir()) and not (p / checkpoint_lib.META).is_file():
        raise ValueError(f"--out {path}: a non-empty folder that is not a checkpoint")


def train_main(argv: list[str]) -> int:
    """``python -m jaxkv.train kvlearn --out DIR [--trace JSONL] [options]``."""
    import jax

    from jaxkv.kvlearn import pretrain
    from jaxkv.kvlearn.checkpoint import save_prp

    args = train_parser().parse_args(argv)
    try:
        _resolve_traces(args)
        _check_checkpoint_out(args.out)
        sim_cfg = _sim_cfg(args, _cost(args))
        n = args.n_requests if (args.trace or args.mooncake) else (args.n_requests or 20_000)
        tr = _trace(args, n, args.alpha)
        t0 = time.perf_counter()
        state, _ = pretrain.collect(
            tr, capacity_bytes=args.pool_gib * GIB, seed=args.seed, sim_cfg=sim_cfg
        )
        stats = pretrain.label_stats(state)
        print(
            f"collected {stats['labels_total']} labels from {len(tr)} requests in "
            f"{time.perf_counter() - t0:.1f} s ({stats['labels_in_buffer']} in the replay buffer, "
            f"{100 * stats['positive_rate']:.1f} % positive)"
        )
        state, history = pretrain.fit(
            state, cfg=sim_cfg.kvlearn.prp, epochs=args.epochs, key=jax.random.key(args.seed)
        )
        for h in history:
            print(f"epoch {h['epoch']:3d}  loss {h['loss']:.4f}  accuracy {h['accuracy']:.3f}")
        info = {
            "trace": args.trace or args.mooncake or f"zipf-multimodal(alpha={args.alpha})",
            "requests": len(tr),
        }
        save_prp(args.out, state, cfg=sim_cfg.kvlearn.prp, info=info | stats | {"history": history})
        print(f"saved PRP to {args.out}")
        return 0
    except (T.TraceError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"{TRAIN_PROG}: error: {e}", file=sys.stderr)
        return 2
