"""``python -m jaxkv.eval``: evaluation and generation from the command line.

Subcommands:
    generate   generate text with the embedded (or any) model
    kvlearn    the KVLearn serving-pool simulator (``python -m jaxkv.eval kvlearn --help``)
"""

from __future__ import annotations

import argparse
import sys
import time


def _generate_cmd(args: argparse.Namespace) -> int:
    import jaxkv

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
    )
    t2 = time.perf_counter()
    for prompt, out in zip(args.prompt, outs, strict=True):
        if len(args.prompt) > 1:
            print(f"### {prompt}")
        print(out)
    print(f"[load {t1 - t0:.1f} s, generate {t2 - t1:.1f} s (incl. compile)]", file=sys.stderr)
    return 0


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
    gen.set_defaults(func=_generate_cmd)
    sub.add_parser("kvlearn", help="KVLearn pool simulator (see: kvlearn --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "kvlearn":
        from jaxkv.kvlearn.cli import eval_main

        return eval_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
