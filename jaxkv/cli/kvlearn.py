"""The KVLearn command lines: ``python -m jaxkv.eval kvlearn SUBCOMMAND`` and
``python -m jaxkv.train kvlearn``. ``eval_main(argv)`` and ``train_main(argv)`` take the
arguments after ``kvlearn``.

Subcommands of ``python -m jaxkv.eval kvlearn``:

    sim [n_requests] [zipf_alpha] [pool_GiB] [options]
        the ``lax.scan`` simulator of whole-prefix requests: the README's Zipf workload, a JSONL
        trace (``--trace``) or a Mooncake trace block by block (``--mooncake``); ``--sweep``
        runs a grid. The pool size is the third positional argument.
    serve --trace MOONCAKE.jsonl (--pool-gib G | --pool-frac F) [n_requests] [options]
        the serving simulator (block-level prefix cache, prefill nodes, decode slots) on a
        Mooncake trace; ``--sweep`` runs pool fractions × load scales.
    calibrate [--model M] [--lengths 128,...] [--repeats N] [--json F] [--plot F]
        α_bw, α_flop from timing jaxkv's decoder; both simulators take ``--calibration F``.
    workload {chat,agent,rag} --out F [--requests N] [--seed S] [--rate R]
    workload mmsession --out F [--sessions N] [--seed S] [--rate R] [--bursty]
        writes a synthetic trace (Mooncake format) for ``serve``.

A first argument that is not a subcommand name means ``sim``: ``kvlearn 3000 1.1 4`` is
``kvlearn sim 3000 1.1 4``. The simulator is always the subcommand's, never guessed from a
trace file. Every check that needs no trace contents (ranges, policy names, flag combinations,
output paths) runs before anything is loaded, simulated or written: a bad flag is argparse's
usage error, a bad combination, file or path ``<prog>: error: <message>``, both exit status 2.
Progress bars go to stderr; stdout keeps the tables and ``wrote`` lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxkv import checkpoint as checkpoint_lib
from jaxkv.config import ModelConfig
from jaxkv.kvlearn import calibrate as calibrate_lib
from jaxkv.kvlearn import report, workloads
from jaxkv.kvlearn import traces as traces_lib
from jaxkv.kvlearn.core import checkpoint as prp_checkpoint
from jaxkv.kvlearn.core import pretrain
from jaxkv.kvlearn.core.control import KVLearnConfig
from jaxkv.kvlearn.core.pool import MAX_CAPACITY_KIB
from jaxkv.kvlearn.cost import GIB, PRESETS, CostModel
from jaxkv.kvlearn.serving import engine as serving_engine
from jaxkv.kvlearn.serving import metrics as serving_metrics
from jaxkv.kvlearn.serving.policies import BLOCK_POLICIES
from jaxkv.kvlearn.sim import simulate as simulate_lib
from jaxkv.kvlearn.sim.policies import POOL_POLICIES

EVAL_PROG = "python -m jaxkv.eval kvlearn"
TRAIN_PROG = "python -m jaxkv.train kvlearn"
SUBCOMMANDS = ("sim", "serve", "calibrate", "workload")
SIM_DEFAULTS = {"n_requests": 3000, "zipf_alpha": 1.1, "pool_gib": 4.0}
MAX_POOL_GIB = MAX_CAPACITY_KIB / 2**20
"""The core simulator's largest pool (its block table counts KiB in int32)."""
PROGRESS_MIN_REQUESTS = 100_000
"""Requests (sim: requests × policies; serve: block requests × policies) from which a replay
shows a progress bar."""
PROGRESS_MIN_BYTES = 4 * 2**20
"""Trace files from this size on (~60,000 lines of the core format, ~15,000 Mooncake
requests) show a loading progress bar."""
SIM_FLAGS = (
    "--mooncake",
    "--prp-checkpoint",
    "--horizon",
    "--tick-every",
    "--pools",
    "--alphas",
    "--seeds",
    "--sweep-mode",
)
"""Flags of ``sim`` only (named in ``serve``'s error when given to it)."""
SERVE_FLAGS = (
    "--pool-gib",
    "--pool-frac",
    "--prefill-nodes",
    "--load-scale",
    "--slo-ms",
    "--rate-search",
    "--attainment",
    "--decode-nodes",
    "--decode-slots",
    "--tpot-ms",
    "--loads",
    "--fracs",
)
"""Flags of ``serve`` only (named in ``sim``'s error when given to it)."""


# ---- argument types -------------------------------------------------------------------------
# Each raises argparse.ArgumentTypeError, so argparse prints ``error: argument FLAG: <message>``
# and exits 2 before anything runs.
def number(kind: type = float, *, gt=None, ge=None, lt=None, le=None) -> Callable[[str], float]:
    """An argparse type: ``kind(s)`` (finite for floats) within the given bounds, else an error
    naming the bound and the value (``must be > 0, got -1``)."""
    bounds = [(">", gt, lambda v, b: v > b), ("≥", ge, lambda v, b: v >= b)]
    bounds += [("<", lt, lambda v, b: v < b), ("≤", le, lambda v, b: v <= b)]
    what = "an integer" if kind is int else "a number"

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {s!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {s}")
        for sign, b, ok in bounds:
            if b is not None and not ok(v, b):
                raise argparse.ArgumentTypeError(f"must be {sign} {b:g}, got {s}")
        return v

    parse.__name__ = kind.__name__
    return parse


def number_list(item: Callable[[str], float]) -> Callable[[str], list]:
    """An argparse type: a non-empty comma-separated list of ``item`` values."""

    def parse(s: str) -> list:
        values = [item(x) for x in s.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"needs at least one value, got {s!r}")
        return values

    parse.__name__ = "list"
    return parse


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


def _core_pool(s: str) -> float:
    """A pool size for the core simulator: 0 ≤ GiB ≤ ``MAX_POOL_GIB``."""
    v = _float(s, "pool size")
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"pool size must be ≥ 0 GiB, got {s}")
    if v > MAX_POOL_GIB:  # the block table counts KiB in int32
        raise argparse.ArgumentTypeError(f"pool size must be ≤ {MAX_POOL_GIB:g} GiB, got {s}")
    return v


def _policy_list(known: tuple[str, ...], *, other: tuple[str, ...], other_cmd: str):
    """An argparse type: a comma-separated subset of ``known`` (names in ``other`` are the
    other simulator's: the error says which subcommand runs them)."""

    def parse(s: str) -> list[str]:
        names = [x for x in s.split(",") if x]
        bad = [n for n in names if n not in known]
        if bad or not names:
            hint = [n for n in bad if n in other]
            tail = f" ({','.join(hint)}: policies of `kvlearn {other_cmd}`)" if hint else ""
            raise argparse.ArgumentTypeError(
                f"unknown policies {bad}; choose from {','.join(known)}{tail}"
            )
        return names

    parse.__name__ = "policies"
    return parse


# ---- outputs and progress -------------------------------------------------------------------
def check_output(path: str | os.PathLike, *, flag: str, directory: bool = False) -> None:
    """Raises ValueError unless ``path`` can be written: a file (or, with ``directory``, a
    folder) that is not the other kind, whose nearest existing ancestor is a writable folder.
    Nothing is created."""
    p = Path(path)
    if not directory and (p.is_dir() or str(path).endswith(os.sep)):
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    if directory and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{flag} {path}: not writable")
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot create files in {parent} (not writable)")


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress_bar(total: int, *, desc: str, unit: str, show: bool):
    """A tqdm bar on stderr (stdout stays clean for tables and JSON) if ``show``, else a no-op
    with the same ``update`` / ``close`` / context manager."""
    if not show:
        return _NoBar()
    from tqdm.auto import tqdm  # lazy: only large replays show a bar

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit == "B",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )


def file_progress(path: str | os.PathLike, *, desc: str = "loading trace"):
    """``progress_bar`` over the bytes of ``path`` (a no-op for small or missing files)."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        size = 0
    return progress_bar(size, desc=desc, unit="B", show=size >= PROGRESS_MIN_BYTES)


def _write_json(path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
    print(f"wrote {path}")


# ---- shared options -------------------------------------------------------------------------
def _add_cost(p: argparse.ArgumentParser, *, calibration: bool = True) -> None:
    p.add_argument(
        "--cost-preset",
        default="llama3-8b-a100",
        choices=PRESETS,
        help="llama3-8b-a100 (default), mistral-7b-a100 or smollm2-135m-cpu",
    )
    if calibration:
        p.add_argument(
            "--calibration",
            metavar="JSON",
            help="cost model from `kvlearn calibrate --json` instead of --cost-preset",
        )


def _add_seed(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--seed", type=number(int, ge=0), default=7, help=help)


def _add_prp_schedule(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--horizon", type=number(float, gt=0), default=5.0, help="PRP label horizon H in seconds"
    )
    p.add_argument("--tick-every", type=_positive_int, default=20, help="requests between ticks")


def _cost(args) -> CostModel:
    if getattr(args, "calibration", None):
        return calibrate_lib.cost_model_from(args.calibration)
    return CostModel.preset(args.cost_preset)


def _sim_cfg(args, cost: CostModel) -> simulate_lib.SimConfig:
    return simulate_lib.SimConfig(
        kvlearn=KVLearnConfig(cost=cost, horizon_s=args.horizon), tick_every=args.tick_every
    )


def _load_trace(path, load) -> traces_lib.Trace:
    with file_progress(path) as bar:
        return load(path, progress=bar.update)


def _core_trace(args, n_requests, alpha) -> traces_lib.Trace:
    """The core simulator's requests: ``--trace`` (JSONL), ``--mooncake`` (block by block) or
    the Zipf workload."""
    if args.trace or args.mooncake:
        if args.trace:
            tr = _load_trace(traces_lib.trace_path(args.trace), traces_lib.load_jsonl)
        else:
            tr = _load_trace(traces_lib.trace_path(args.mooncake), traces_lib.load_mooncake)
        return tr.head(n_requests) if n_requests is not None else tr
    return workloads.zipf_multimodal(
        n_requests or SIM_DEFAULTS["n_requests"],
        alpha or SIM_DEFAULTS["zipf_alpha"],
        seed=args.seed,
    )


def _add_trace_sources(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--trace",
        metavar="JSONL",
        help="replay a JSONL trace ({t, key, tokens, modality} per line) instead of the Zipf "
        "workload (Mooncake traces: --mooncake here, or `kvlearn serve --trace`)",
    )
    src.add_argument(
        "--mooncake",
        metavar="JSONL",
        help=f"replay a Mooncake trace block by block ('{traces_lib.EXAMPLE}': the Mooncake "
        "example trace shipped with jaxkv)",
    )


# ---- sim ------------------------------------------------------------------------------------
def _sim_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sim",
        help="the lax.scan simulator (Zipf workload or a trace file); the default subcommand",
        description="Simulate the KV pool of a disaggregated serving system (prefill → pool → "
        "decode) under every pool policy, on the README's Zipf multimodal workload or a trace "
        "file. The pool size is the third positional argument.",
    )
    p.add_argument("n_requests", nargs="?", type=_positive_int, help="requests (default 3000)")
    p.add_argument("zipf_alpha", nargs="?", type=_alpha, help="Zipf exponent (default 1.1)")
    p.add_argument("pool_gib", nargs="?", type=_core_pool, help="pool size in GiB (default 4)")
    p.add_argument(
        "--policies",
        type=_policy_list(POOL_POLICIES, other=BLOCK_POLICIES, other_cmd="serve"),
        default=list(POOL_POLICIES),
        help=f"comma-separated subset of {','.join(POOL_POLICIES)} (default: all)",
    )
    p.add_argument("--json", metavar="PATH", help="write {config, results} as JSON")
    _add_trace_sources(p)
    p.add_argument("--prp-checkpoint", metavar="DIR", help="start KVLearn from a pre-trained PRP")
    _add_cost(p)
    _add_seed(p, "trace and policy seed (default 7)")
    _add_prp_schedule(p)
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--sweep", action="store_true", help="run a grid; plot TTFT vs pool size per policy"
    )
    g.add_argument(
        "--pools",
        type=number_list(_core_pool),
        default=[1, 2, 4, 8, 16],
        help="GiB list (sweep)",
    )
    g.add_argument(
        "--alphas", type=number_list(_alpha), default=[0.8, 1.1, 1.4], help="alpha list (sweep)"
    )
    g.add_argument("--seeds", type=_positive_int, default=3, help="seeds per cell (sweep)")
    g.add_argument("--plot", metavar="PNG", default="kvlearn_sweep.png", help="sweep plot path")
    g.add_argument(
        "--sweep-mode",
        choices=("vmap", "loop"),
        default="vmap",
        help="one batched run per policy (faster once compiled), or one run after another",
    )
    p.set_defaults(run=_sim_main)
    return p


def _check_sim_args(args) -> None:
    """``sim``'s rules that need no trace contents; then the output paths."""
    if args.sweep and (args.trace or args.mooncake):
        raise ValueError("--sweep runs the Zipf workload; it does not take --trace/--mooncake")
    if args.json:
        check_output(args.json, flag="--json")
    if args.sweep:
        check_output(args.plot, flag="--plot")


def _load_prp(path):
    if not path:
        return None
    state, _, _ = prp_checkpoint.load_prp(path)
    return state


def _sim_main(args) -> int:
    try:
        _check_sim_args(args)
        sim_cfg = _sim_cfg(args, _cost(args))
        prp = _load_prp(args.prp_checkpoint)
        return _sim_sweep(args, sim_cfg, prp) if args.sweep else _sim_single(args, sim_cfg, prp)
    except (traces_lib.TraceError, FileNotFoundError, ValueError) as e:
        print(f"{EVAL_PROG} sim: error: {e}", file=sys.stderr)
        return 2


def _sim_single(args, sim_cfg, prp) -> int:
    tr = _core_trace(args, args.n_requests, args.zipf_alpha)
    pool_gib = args.pool_gib if args.pool_gib is not None else SIM_DEFAULTS["pool_gib"]
    source = args.trace or args.mooncake or "zipf-multimodal"
    from_file = bool(args.trace or args.mooncake)
    alpha = None if from_file else (args.zipf_alpha or SIM_DEFAULTS["zipf_alpha"])
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
    show = work >= PROGRESS_MIN_REQUESTS
    with progress_bar(work, desc="replay", unit="req", show=show) as bar:
        results = simulate_lib.compare(
            tr,
            capacity_bytes=pool_gib * GIB,
            seed=args.seed,
            policies=args.policies,
            sim_cfg=sim_cfg,
            prp=prp,
            progress=bar.update,
        )
    print(report.sim_table(results))
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


def _sim_sweep(args, sim_cfg, prp) -> int:
    n = args.n_requests or SIM_DEFAULTS["n_requests"]
    seeds = list(range(args.seeds))
    print(
        f"KVLearn sweep: requests={n} alphas={args.alphas} pools_GiB={args.pools} "
        f"seeds={len(seeds)}"
    )
    rows, seconds = simulate_lib.sweep(
        n_requests=n,
        alphas=args.alphas,
        pools_gib=args.pools,
        seeds=seeds,
        policies=args.policies,
        sim_cfg=sim_cfg,
        prp=prp,
        mode=args.sweep_mode,
    )
    summary = simulate_lib.summarize(rows)
    for alpha in args.alphas:
        print(f"\nalpha={alpha}: median TTFT (ms) over {len(seeds)} seeds")
        print(
            report.sim_sweep_table(summary, alpha=alpha, pools=args.pools, policies=args.policies)
        )
    print(
        "\nbatched run time per policy (s, incl. compile): "
        + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items())
    )
    report.plot_sim_sweep(summary, path=args.plot, alphas=args.alphas, policies=args.policies)
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


# ---- serve ----------------------------------------------------------------------------------
def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="the serving simulator on a Mooncake trace (prefix cache, prefill and decode)",
        description="Replay a Mooncake trace through the serving simulator: a block-level "
        "prefix cache under every block policy, FCFS prefill nodes and decode slots. The pool "
        "size is --pool-gib or --pool-frac (exactly one; --sweep takes --fracs instead).",
    )
    p.add_argument(
        "n_requests", nargs="?", type=_positive_int, help="replay the first N requests only"
    )
    p.add_argument(
        "--trace",
        metavar="JSONL",
        required=True,
        help=f"Mooncake trace (timestamp, input_length, output_length, hash_ids); "
        f"'{traces_lib.EXAMPLE}' is the Mooncake example trace shipped with jaxkv",
    )
    pool = p.add_mutually_exclusive_group()
    pool.add_argument(
        "--pool-gib", metavar="GIB", type=number(float, gt=0), help="pool size in GiB"
    )
    pool.add_argument(
        "--pool-frac",
        metavar="F",
        type=number(float, ge=0, le=1),
        help="pool size as a fraction of the trace's distinct blocks",
    )
    p.add_argument(
        "--policies",
        type=_policy_list(BLOCK_POLICIES, other=POOL_POLICIES, other_cmd="sim"),
        default=list(BLOCK_POLICIES),
        help=f"comma-separated subset of {','.join(BLOCK_POLICIES)} (default: all)",
    )
    p.add_argument("--json", metavar="PATH", help="write {config, results} as JSON")
    p.add_argument(
        "--prefill-nodes", type=number(int, ge=1), default=24, help="prefill nodes (default 24)"
    )
    p.add_argument(
        "--load-scale",
        type=number(float, gt=0),
        default=None,
        help="arrival-rate multiplier (default 1)",
    )
    p.add_argument("--slo-ms", type=number(float, gt=0), default=30_000.0, help="TTFT SLO (ms)")
    p.add_argument(
        "--rate-search",
        action="store_true",
        help="also search each policy's max sustainable rate (throughput_rps) at the SLO",
    )
    p.add_argument(
        "--attainment",
        type=number(float, gt=0, le=1),
        default=0.9,
        help="fraction of requests that must meet the SLO for a rate to count as sustained",
    )
    p.add_argument(
        "--decode-nodes", type=number(int, ge=1), default=8, help="decode nodes (default 8)"
    )
    p.add_argument(
        "--decode-slots", type=number(int, ge=1), default=32, help="sequences per decode node"
    )
    p.add_argument(
        "--tpot-ms", type=number(float, ge=0), default=25.0, help="decode time per output token"
    )
    _add_cost(p)
    _add_seed(p, "recorded in the JSON config (the serving simulator is deterministic)")
    g = p.add_argument_group("sweep")
    g.add_argument(
        "--sweep", action="store_true", help="mean TTFT over pool fractions × load scales"
    )
    g.add_argument(
        "--fracs",
        type=number_list(number(float, ge=0, le=1)),
        default=[0.1, 0.25, 0.5],
        help="pool fractions (sweep)",
    )
    g.add_argument(
        "--loads",
        type=number_list(number(float, gt=0)),
        default=[0.5, 1.0, 1.5, 2.0],
        help="load scales (sweep)",
    )
    g.add_argument("--plot", metavar="PNG", default="kvlearn_sweep.png", help="sweep plot path")
    p.set_defaults(run=_serve_main)
    return p


def _check_serve_args(args) -> None:
    """``serve``'s flag combinations; then the output paths."""
    if args.sweep:
        given = [
            f
            for f, v in (
                ("--pool-gib", args.pool_gib),
                ("--pool-frac", args.pool_frac),
                ("--load-scale", args.load_scale),
            )
            if v is not None
        ] + ["--rate-search"] * args.rate_search
        if given:
            raise ValueError(
                f"--sweep takes pool sizes from --fracs and loads from --loads; drop "
                f"{', '.join(given)}"
            )
    elif args.pool_gib is None and args.pool_frac is None:
        raise ValueError("serve needs the pool size: --pool-gib G or --pool-frac F")
    if args.json:
        check_output(args.json, flag="--json")
    if args.sweep:
        check_output(args.plot, flag="--plot")


def _serve_main(args) -> int:
    try:
        _check_serve_args(args)
        cost = _cost(args)
        base = _load_trace(traces_lib.trace_path(args.trace), traces_lib.load_mooncake_trace)
        if args.n_requests is not None:
            base = base.head(args.n_requests)
        return _serve_sweep(args, base, cost) if args.sweep else _serve_single(args, base, cost)
    except (traces_lib.TraceError, FileNotFoundError, ValueError) as e:
        print(f"{EVAL_PROG} serve: error: {e}", file=sys.stderr)
        return 2


def _replay_bar(trace, runs: int):
    """A progress bar over ``runs`` replays of ``trace`` (in requests), shown when they touch
    at least ``PROGRESS_MIN_REQUESTS`` blocks."""
    blocks = sum(len(b) for b in trace.blocks)
    show = runs * blocks >= PROGRESS_MIN_REQUESTS
    return progress_bar(runs * len(trace), desc="replay", unit="req", show=show)


def _deployment(args) -> dict:
    return {
        "prefill_nodes": args.prefill_nodes,
        "slo_ms": args.slo_ms,
        "decode_nodes": args.decode_nodes,
        "decode_slots": args.decode_slots,
        "tpot_ms": args.tpot_ms,
    }


def _serve_single(args, base, cost: CostModel) -> int:
    load_scale = 1.0 if args.load_scale is None else args.load_scale
    trace = base.scaled(load_scale)
    if args.pool_frac is not None:
        blocks = int(args.pool_frac * trace.n_blocks)
    else:
        blocks = serving_engine.pool_blocks_for(args.pool_gib, cost, trace.block_tokens)
    cfg = serving_engine.ServingConfig(pool_blocks=blocks, **_deployment(args))
    blk_gib = cost.footprint_bytes(trace.block_tokens) / GIB
    print("KVLearn serving simulator (Mooncake trace, block-level prefix cache)")
    print(
        f"  trace={args.trace}  requests={len(trace)}  distinct_blocks={trace.n_blocks}  "
        f"pool={cfg.pool_blocks} blocks ({cfg.pool_blocks * blk_gib:.1f} GiB, "
        f"{100 * cfg.pool_blocks / trace.n_blocks:.1f} % of distinct)"
    )
    print(
        f"  prefill_nodes={cfg.prefill_nodes}  load_scale={load_scale:g}  "
        f"slo_ms={cfg.slo_ms:g}  model={cost.shape.name}\n"
    )
    with _replay_bar(trace, len(args.policies)) as bar:
        results = serving_metrics.compare(
            trace,
            cfg=cfg,
            cost=cost,
            policies=args.policies,
            rate_search=args.rate_search,
            attainment=args.attainment,
            progress=bar.update,
        )
    print(report.serve_table(results))
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
            "load_scale": load_scale,
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


def _serve_sweep(args, base, cost: CostModel) -> int:
    rows = []
    policies = args.policies
    t0 = time.perf_counter()
    runs = len(args.fracs) * len(args.loads) * len(policies)
    with _replay_bar(base, runs) as bar:
        for frac in args.fracs:
            cfg = serving_engine.ServingConfig(
                pool_blocks=int(frac * base.n_blocks), **_deployment(args)
            )
            for load in args.loads:
                for r in serving_metrics.compare(
                    base.scaled(load), cfg=cfg, cost=cost, policies=policies, progress=bar.update
                ):
                    rows.append(r | {"pool_frac": frac, "load_scale": load})
    print(f"serving sweep: {len(rows)} runs in {time.perf_counter() - t0:.1f} s")
    for frac in args.fracs:
        print(f"\npool {100 * frac:g} % of distinct blocks: mean TTFT (ms) per load scale")
        print(report.serve_sweep_table(rows, frac=frac, loads=args.loads, policies=policies))
    report.plot_serve_sweep(
        rows, path=args.plot, fracs=args.fracs, loads=args.loads, policies=policies
    )
    print(f"plot: {args.plot}")
    if args.json:
        config = {"trace": args.trace, "fracs": args.fracs, "loads": args.loads}
        _write_json(args.json, {"config": config | {"nodes": args.prefill_nodes}, "runs": rows})
    return 0


# ---- calibrate ------------------------------------------------------------------------------
def _calibrate_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate",
        help="fit the cost model's α_bw, α_flop to jaxkv's decoder on this machine",
        description=calibrate_lib.__doc__.split("\n\n")[0],
    )
    p.add_argument("--model", default="smollm2-135m", help="model preset (or 'tiny')")
    p.add_argument(
        "--lengths",
        type=number_list(number(int, ge=1)),
        default=[128, 256, 512, 768, 1024, 1536, 2048],
        help="prompt lengths to time (default 128,256,512,768,1024,1536,2048)",
    )
    p.add_argument("--repeats", type=number(int, ge=1), default=3)
    p.add_argument("--json", metavar="PATH", help="write the calibration (use with --calibration)")
    p.add_argument("--plot", metavar="PNG", help="plot measured points and the fit")
    p.set_defaults(run=_calibrate_main)
    return p


def _calibrate_main(args) -> int:
    try:
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            if path:
                check_output(path, flag=flag)
        config = ModelConfig.tiny() if args.model == "tiny" else ModelConfig.preset(args.model)
        lengths = args.lengths
        if len(lengths) < 2:
            raise ValueError(f"need ≥ 2 positive --lengths, got {lengths}")
        config = config.replace(max_seq_len=max(config.max_seq_len, max(lengths)))
        cal = calibrate_lib.calibrate(config, lengths, repeats=args.repeats)
    except ValueError as e:
        print(f"{EVAL_PROG} calibrate: error: {e}", file=sys.stderr)
        return 2
    for n, ms, f in zip(cal["lengths"], cal["prefill_ms"], cal["fit_ms"], strict=True):
        print(f"L={n:6d}  prefill {ms:10.2f} ms   fit {f:10.2f} ms")
    print(
        f"alpha_bw = {cal['alpha_bw_ms']:.4g} ms/token   alpha_flop = {cal['alpha_flop_ms']:.4g} "
        f"ms/token²   crossover = {cal['crossover_tokens']:.0f} tokens"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(cal, indent=2))
        print(f"wrote {args.json}")
    if args.plot:
        calibrate_lib.plot(cal, args.plot)
        print(f"plot: {args.plot}")
    return 0


# ---- workload -------------------------------------------------------------------------------
WORKLOAD_REQUESTS = {"chat": 10_000, "agent": 6_000, "rag": 10_000}
"""Default ``--requests`` of each request-count workload (~40k–150k block references)."""
_WORKLOAD_HELP = {
    "chat": "multi-turn chat sessions: each turn resends the conversation, so prefixes grow; "
    "a few shared system prompts; think time between turns; geometric session length",
    "agent": "tool-using agent loops: long shared tool prompts, contexts that grow by each "
    "tool output, many agents interleaved",
    "rag": "retrieval-augmented queries: system prompt + k Zipf-popular documents in varying "
    "order + a question",
}


def _workload_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "workload",
        help="write a synthetic Mooncake-format trace (chat, agent, rag, mmsession)",
        description="Write a synthetic workload as a Mooncake trace file (for `kvlearn serve "
        "--trace`): see jaxkv/kvlearn/workloads.py for each kind's structure and defaults.",
    )
    names = ",".join([*WORKLOAD_REQUESTS, "mmsession"])
    kinds = p.add_subparsers(dest="workload", required=True, metavar="{" + names + "}")
    for kind, n in WORKLOAD_REQUESTS.items():
        k = kinds.add_parser(kind, help=_WORKLOAD_HELP[kind], description=_WORKLOAD_HELP[kind])
        k.add_argument("--requests", type=number(int, ge=1), default=n, help=f"default {n}")
        k.add_argument("--seed", type=number(int, ge=0), default=0)
        default_rate = workloads.WORKLOADS[kind][1]().rate_per_s
        k.add_argument(
            "--rate",
            type=number(float, gt=0),
            default=default_rate,
            help=f"{'queries' if kind == 'rag' else kind + 's'} started per second "
            f"(default {default_rate:g})",
        )
        k.add_argument("--out", required=True, metavar="JSONL", help="the trace file to write")
        k.set_defaults(run=_synthetic_main)
    mm = kinds.add_parser(
        "mmsession",
        help="multimodal multi-turn sessions as a Mooncake trace (for `kvlearn serve`)",
        description="Write MM-Session, multimodal multi-turn sessions (shared system prompts, "
        "Zipf-popular images and videos, prompts that grow turn by turn, Poisson or bursty "
        "arrivals), as a Mooncake trace: see jaxkv/kvlearn/workloads.py.",
    )
    mm.add_argument("--sessions", type=number(int, ge=1), default=500)
    mm.add_argument("--seed", type=number(int, ge=0), default=0)
    mm.add_argument(
        "--rate", type=number(float, gt=0), default=2.0, help="session starts per second"
    )
    mm.add_argument("--bursty", action="store_true", help="sessions start in bursts")
    mm.add_argument("--out", required=True, metavar="JSONL", help="the trace file to write")
    mm.set_defaults(run=_mmsession_main)
    return p


def _checked_out(args) -> bool:
    try:
        check_output(args.out, flag="--out")
    except ValueError as e:
        print(f"{EVAL_PROG} workload {args.workload}: error: {e}", file=sys.stderr)
        return False
    return True


def _synthetic_main(args) -> int:
    if not _checked_out(args):
        return 2
    generate, config = workloads.WORKLOADS[args.workload]
    recs = generate(args.requests, seed=args.seed, cfg=config(rate_per_s=args.rate))
    traces_lib.save_mooncake_jsonl(recs, args.out)
    n_ref = sum(len(r["hash_ids"]) for r in recs)
    n_blk = len({h for r in recs for h in r["hash_ids"]})
    print(
        f"wrote {len(recs)} {args.workload} requests ({n_ref} block references, {n_blk} "
        f"distinct blocks) to {args.out}"
    )
    return 0


def _mmsession_main(args) -> int:
    if not _checked_out(args):
        return 2
    cfg = workloads.MMSessionConfig(rate_per_s=args.rate, bursty=args.bursty)
    recs = workloads.mm_session(args.sessions, seed=args.seed, cfg=cfg)
    traces_lib.save_mooncake_jsonl(recs, args.out)
    print(f"wrote {len(recs)} requests from {args.sessions} sessions to {args.out}")
    return 0


# ---- eval entry -----------------------------------------------------------------------------
def eval_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``python -m jaxkv.eval kvlearn`` parser and its subcommands' parsers by name."""
    p = argparse.ArgumentParser(
        prog=EVAL_PROG,
        description="\n\n".join(__doc__.split("\n\n")[1:4]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{sim,serve,calibrate,workload}")
    parsers = {
        "sim": _sim_parser(sub),
        "serve": _serve_parser(sub),
        "calibrate": _calibrate_parser(sub),
        "workload": _workload_parser(sub),
    }
    return p, parsers


def eval_main(argv: list[str]) -> int:
    """``python -m jaxkv.eval kvlearn [sim|serve|calibrate|workload] ...`` (argv after
    ``kvlearn``; a first argument that is not a subcommand means ``sim``)."""
    argv = list(argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help")):
        argv = ["sim", *argv]
    parser, parsers = eval_parser()
    if argv[0] in ("sim", "serve"):  # before parsing: their values would read as positionals
        _refuse_foreign_flags(parsers[argv[0]], argv[0], argv[1:])
    args = parser.parse_args(argv)
    return args.run(args)


def _refuse_foreign_flags(parser: argparse.ArgumentParser, command: str, argv: list[str]) -> None:
    """Exits with a usage error naming the other simulator if ``argv`` has its flags."""
    other, flags = ("serve", SERVE_FLAGS) if command == "sim" else ("sim", SIM_FLAGS)
    given = [a.split("=")[0] for a in argv if a.split("=")[0] in flags]
    if given:
        what = (
            "the Mooncake serving simulator (`sim` takes the pool size as its third positional "
            "argument)"
            if other == "serve"
            else "the core simulator"
        )
        parser.error(f"{', '.join(given)}: flags of `kvlearn {other}`, {what}")


# ---- train ----------------------------------------------------------------------------------
def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=TRAIN_PROG,
        description="Pre-train the PRP offline: replay a trace through KVLearn to collect delayed "
        "reuse labels, fit the MLP for several epochs, save it with orbax. Start the simulator "
        f"from it with `{EVAL_PROG} sim --prp-checkpoint DIR`.",
    )
    _add_trace_sources(p)
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
    _add_cost(p, calibration=False)
    _add_seed(p, "trace and policy seed (default 7)")
    _add_prp_schedule(p)
    return p


def _check_checkpoint_out(path) -> None:
    """``--out`` must be creatable, an empty folder or a checkpoint (``save_prp`` replaces only
    those), checked before the labels are collected."""
    check_output(path, flag="--out", directory=True)
    p = Path(path)
    if p.is_dir() and any(p.iterdir()) and not (p / checkpoint_lib.META).is_file():
        raise ValueError(f"--out {path}: a non-empty folder that is not a checkpoint")


def train_main(argv: list[str]) -> int:
    """``python -m jaxkv.train kvlearn --out DIR [--trace JSONL | --mooncake F] [options]``."""
    args = train_parser().parse_args(argv)
    try:
        _check_checkpoint_out(args.out)
        sim_cfg = _sim_cfg(args, _cost(args))
        n = args.n_requests if (args.trace or args.mooncake) else (args.n_requests or 20_000)
        tr = _core_trace(args, n, args.alpha)
        t0 = time.perf_counter()
        state, _ = simulate_lib.collect_labels(
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
        prp_checkpoint.save_prp(
            args.out, state, cfg=sim_cfg.kvlearn.prp, info=info | stats | {"history": history}
        )
        print(f"saved PRP to {args.out}")
        return 0
    except (traces_lib.TraceError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"{TRAIN_PROG}: error: {e}", file=sys.stderr)
        return 2
