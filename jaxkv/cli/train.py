"""``python -m jaxkv.train``: training entry points.

Subcommands:
    distillcache  train the DistillCache eviction policy (REINFORCE, teacher/student caches)
    kvlearn       pre-train KVLearn's reuse predictor offline on a trace
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxkv.cli.kvlearn import train_main as kvlearn_main
from jaxkv.rl import loop
from jaxkv.rl.config import TrainConfig

USAGE = (
    "usage: python -m jaxkv.train {distillcache,kvlearn} [options]  (add --help after a subcommand)"
)


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


COMMANDS = {"distillcache": distillcache_main, "kvlearn": kvlearn_main}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    print(USAGE, file=sys.stderr)
    return 0 if argv and argv[0] in ("-h", "--help") else 2
