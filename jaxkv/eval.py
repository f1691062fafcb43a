"""``python -m jaxkv.eval``: evaluation and generation from the command line.

With no arguments: a small fidelity comparison of every policy on the embedded model.

Subcommands:
    generate   generate text with the embedded (or any) model, optionally compressed
    fidelity, retrieval, gsm8k, bbh, longbench, agreement, positions, latency
               the evaluation suite (``python -m jaxkv.eval fidelity --help``)
    kvlearn    the KVLearn serving-pool simulator (``python -m jaxkv.eval kvlearn --help``)
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxkv.evals.cli import SUBCOMMANDS
from jaxkv.eviction import Compression
from jaxkv.policies.base import GRANULARITIES, policy_names


def _generate_cmd(args: argparse.Namespace) -> int:
    import jaxkv

    compression = {}
    if args.policy not in (None, "full"):
        compression = dict(
            policy=args.policy,
            ratio=None if args.budget else args.ratio,
            budget=args.budget,
            min_budget=args.min_budget,
            granularity=args.granularity,
            evict_every=args.evict_every,
        )
        Compression.make(**compression)  # validate before the slow model load
    t0 = time.perf_counter()
    model = jaxkv.load(args.model)
    t1 = time.perf_counter()
    outs = jaxkv.generate(
        model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        chat=not args.no_chat,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        **compression,
    )
    t2 = time.perf_counter()
    for prompt, out in zip(args.prompt, outs, strict=True):
        if len(args.prompt) > 1:
            print(f"### {prompt}")
        print(out)
    print(f"[load {t1 - t0:.1f} s, generate {t2 - t1:.1f} s (incl. compile)]", file=sys.stderr)
    return 0


def _add_compression_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV-cache compression")
    g.add_argument(
        "--policy",
        default=None,
        help=f"eviction policy: {', '.join(policy_names())} (default: full cache)",
    )
    g.add_argument("--ratio", type=float, default=0.25, help="budget ratio r in (0, 1]")
    g.add_argument("--budget", type=int, default=None, help="absolute budget instead of --ratio")
    g.add_argument("--min-budget", type=int, default=32, help="B_min")
    g.add_argument("--granularity", default="shared", choices=GRANULARITIES)
    g.add_argument("--evict-every", type=int, default=1, help="evict every k decode steps")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxkv.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument(
        "--model",
        default="smollm2-135m",
        help="'smollm2-135m' (embedded), a .gguf file or a HF safetensors directory",
    )
    gen.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for a batch)"
    )
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    _add_compression_args(gen)
    gen.set_defaults(func=_generate_cmd)
    for name in SUBCOMMANDS:
        sub.add_parser(name, help=f"evaluation: {name} (see: {name} --help)", add_help=False)
    sub.add_parser("kvlearn", help="KVLearn pool simulator (see: kvlearn --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "kvlearn":
        from jaxkv.kvlearn.cli import eval_main

        return eval_main(argv[1:])
    if not argv or argv[0] in SUBCOMMANDS:
        from jaxkv.evals.cli import main as suite_main

        return suite_main(argv)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
