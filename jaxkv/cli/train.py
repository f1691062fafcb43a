"""``python -m jaxkv.train``: training entry points.

Subcommands:
    distillcache  train the DistillCache eviction policy (REINFORCE, teacher/student caches)
    ranker        train the per-head eviction ranker by supervision (no RL; ranker:<path>)
    kvlearn       pre-train KVLearn's reuse predictor offline on a trace
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxkv.cli import flags
from jaxkv.cli.kvlearn import train_main as kvlearn_main
from jaxkv.cli.suite import check_out_dir, new_run_dir
from jaxkv.evals.runner import load_eval_model, parse_ratios
from jaxkv.policies import kvzip as kvzip_lib
from jaxkv.rl import loop
from jaxkv.rl import ranker as ranker_lib
from jaxkv.rl.config import TrainConfig
from jaxkv.rl.data import DOMAINS, HELDOUT_DOMAIN

USAGE = (
    "usage: python -m jaxkv.train {distillcache,ranker,kvlearn} [options]  "
    "(add --help after a subcommand)"
)
SUBCOMMANDS = (__doc__ or "").partition("\n")[2].strip()  # the docstring's list (None under -OO)


def distillcache_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m jaxkv.train distillcache",
        description="Train the DistillCache eviction policy.",
    )
    ap.add_argument("--config", required=True, help="YAML file (configs/distillcache_*.yaml)")
    ap.add_argument("--workdir", required=True, help="checkpoints, metrics and the policy")
    ap.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop after this many total steps (resume later with the same command)",
    )
    ap.add_argument("overrides", nargs="*", help="key=value settings overriding the config")
    return ap


def distillcache_main(argv: list[str]) -> int:
    """``python -m jaxkv.train distillcache ...``: parses flags, then ``loop.run``."""
    args = distillcache_parser().parse_args(argv)
    try:
        cfg = TrainConfig.from_yaml(args.config, args.overrides)
        loop.run(cfg, Path(args.workdir), stop_after=args.stop_after)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def ranker_parser() -> argparse.ArgumentParser:
    d = ranker_lib.RankerConfig()
    ap = argparse.ArgumentParser(
        prog="python -m jaxkv.train ranker",
        description="Train the per-head eviction ranker to predict the attention future "
        "queries give each cached token under the full cache (supervised, no RL).",
    )
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, a path, or 'tiny'")
    ap.add_argument("--out", default=None, help="checkpoint folder (default: runs/ranker-<time>)")
    ap.add_argument(
        "--domains",
        default=",".join(d.domains),
        help=f"comma list of training domains from {DOMAINS} (default: all but the held-out "
        f"{HELDOUT_DOMAIN!r})",
    )
    ap.add_argument("--windows-per-domain", type=flags.positive_int, default=d.windows_per_domain)
    ap.add_argument("--steps", type=flags.positive_int, default=d.steps)
    ap.add_argument("--hidden", type=flags.positive_int, default=d.hidden)
    ap.add_argument("--seed", type=flags.seed, default=d.seed)
    ap.add_argument(
        "--sinks", type=flags.nonnegative_int, default=d.sinks, help="first positions always kept"
    )
    ap.add_argument(
        "--recent-fraction",
        type=flags.float_range(0.0, 1.0, lo_open=False, hi_open=False),
        default=d.recent_fraction,
        help="share of the budget always given to the newest tokens",
    )
    ap.add_argument(
        "--target",
        choices=ranker_lib.TARGETS,
        default=d.target,
        help="rank by the future attention a token gets, or by that times its value norm "
        "(value) or its norm after the output projection, ||W_o v||_1 (critical), or by the "
        "most attention any one future query pays it times its value norm (peak; --chunk 1)",
    )
    ap.add_argument(
        "--no-fit-pruned",
        action="store_true",
        help="learn from the full caches only; the --pruned-ratios rows only validate",
    )
    ap.add_argument(
        "--features",
        default=",".join(d.features),
        help="comma list of the per-row features the ranker reads (jaxkv.policies.ranker."
        "FEATURES; default: all but log_wo_vnorm, whose cache statistic the shipped rankers do "
        "not carry, and kvzip's log_recon, z_recon)",
    )
    ap.add_argument(
        "--base",
        default=None,
        help="a residual ranker: score = this feature (one of --features, raw) + the MLP, "
        "whose output layer starts at zero (e.g. log_recon: start from kvzip's score)",
    )
    ap.add_argument(
        "--kvzip-request",
        default=d.kvzip_request,
        choices=kvzip_lib.REQUESTS,
        help="what follows kvzip's repeat prompt when the features read its reconstruction "
        "(log_recon, z_recon): plain, a newline, or chat, the chat template's assistant header "
        "(how the shipped kvzip rankers were trained)",
    )
    ap.add_argument(
        "--pool",
        type=flags.positive_int,
        default=d.pool,
        help="rows per ListNet list: > 1 makes scores comparable across rows, for the pooled "
        "granularities (adaptive, global); L*K is one sequence's pool (must divide "
        "--rows-per-step)",
    )
    ap.add_argument("--rows-per-step", type=flags.positive_int, default=d.rows_per_step)
    ap.add_argument(
        "--points",
        default=",".join(map(str, d.points)),
        help="comma list of the prefix lengths whose caches give training rows (each plus "
        "the horizon must fit the 768-token window, on the --chunk grid)",
    )
    ap.add_argument(
        "--horizon",
        type=flags.positive_int,
        default=d.horizon,
        help="how many future queries' attention the target sums (a multiple of --chunk)",
    )
    ap.add_argument(
        "--chunk",
        type=flags.positive_int,
        default=d.chunk,
        help="tokens per teacher-forced step while the futures are collected",
    )
    ap.add_argument(
        "--pruned-ratios",
        default="",
        help="comma list of r: also learn from caches H2O pruned to r (the decode protocol's)",
    )
    return ap


def parse_points(text: str) -> tuple[int, ...]:
    """``--points``: a comma list of positive integers."""
    try:
        points = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--points must be a comma list of integers, got {text!r}") from None
    if not points or min(points) < 1:
        raise ValueError(f"--points must be positive integers, got {text!r}")
    return points


def ranker_main(argv: list[str]) -> int:
    """``python -m jaxkv.train ranker ...``: parses flags, then ``ranker.train``."""
    args = ranker_parser().parse_args(argv)
    try:
        domains = tuple(x.strip() for x in args.domains.split(",") if x.strip())
        unknown = [x for x in domains if x not in DOMAINS]
        if unknown or not domains:
            raise ValueError(f"--domains: unknown {unknown}; choose from {DOMAINS}")
        cfg = ranker_lib.RankerConfig(
            domains=domains,
            windows_per_domain=args.windows_per_domain,
            steps=args.steps,
            hidden=args.hidden,
            seed=args.seed,
            sinks=args.sinks,
            target=args.target,
            recent_fraction=args.recent_fraction,
            pruned_ratios=tuple(parse_ratios(args.pruned_ratios)) if args.pruned_ratios else (),
            fit_pruned=not args.no_fit_pruned,
            features=tuple(x.strip() for x in args.features.split(",") if x.strip()),
            pool=args.pool,
            base=args.base,
            rows_per_step=args.rows_per_step,
            points=parse_points(args.points),
            horizon=args.horizon,
            chunk=args.chunk,
            kvzip_request=args.kvzip_request,
        )
        out = check_out_dir(args.out) if args.out else new_run_dir("ranker")
        model = load_eval_model(args.model)
        path = ranker_lib.train(model, cfg, out)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(f"ranker saved to {path}  (use it as --policies ranker:{path})")
    return 0


COMMANDS = {"distillcache": distillcache_main, "ranker": ranker_main, "kvlearn": kvlearn_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{SUBCOMMANDS}")
        return 0
    what = f"unknown subcommand {argv[0]!r}" if argv else "a subcommand is required"
    print(f"{USAGE}\nerror: {what}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
    return 2
