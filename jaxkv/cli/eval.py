"""``python -m jaxkv.eval``: evaluation and generation from the command line.

With no arguments: the main job, a small fidelity comparison of the full cache, four heuristics
and the shipped learned policy on the embedded model (``jaxkv.cli.suite.DEFAULT_JOB``), written
to a new ``runs/fidelity-<YYYYmmdd-HHMMSS>/``.

Every flag is checked before the model loads: ``generate --budget 0`` says "must be an integer
>= 1", ``--ratio``/``--budget``/``--min-budget``/``--granularity``/``--evict-every``/``--protocol``
without an evicting ``--policy`` are an error (not silently ignored), ``--policy oracle`` is one
(it needs a teacher-forced stream: fidelity only), and a bad ``learned:`` folder is one line,
``error: ...``, exit status 2.

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

import jaxkv
from jaxkv.cli import flags, suite
from jaxkv.cli import kvlearn as kvlearn_cli
from jaxkv.evals import runner
from jaxkv.evals.fidelity import KV_DTYPES
from jaxkv.eviction import GRANULARITIES, PROTOCOLS, Compression
from jaxkv.model import loading
from jaxkv.policies import needs_window, policy_names

PROG = "python -m jaxkv.eval"
COMPRESSION_FLAGS = ("ratio", "budget", "min_budget", "granularity", "evict_every", "protocol")
SETTINGS = ("min_budget", "granularity", "evict_every", "protocol")
DEFAULT_RATIO = 0.25


# ----------------------------------------------------------------------------------------------
# generate


def generate_compression(args: argparse.Namespace) -> dict:
    """The ``jaxkv.generate`` compression keywords of ``generate``'s flags ({} = full cache).

    A learned policy is resolved and loaded here (``runner.load_learned_policy``), so a bad
    checkpoint folder fails before the model loads.

    Raises:
        ValueError: compression flags without an evicting ``--policy``, both ``--ratio`` and
            ``--budget``, a bad value (``Compression``'s message), or a bad learned policy.
    """
    given = [f for f in COMPRESSION_FLAGS if getattr(args, f) is not None]
    if args.policy in (None, "full"):
        if given:
            names = "/".join("--" + f.replace("_", "-") for f in given)
            need = "need" if len(given) > 1 else "needs"
            raise ValueError(
                f"{names} {need} --policy (an evicting one, e.g. --policy snapkv); "
                f"{'--policy full' if args.policy else 'without --policy, the cache'} keeps "
                f"every token"
            )
        return {}
    if args.ratio is not None and args.budget is not None:
        raise ValueError("give --ratio or --budget, not both")
    policy = args.policy
    if policy.startswith("learned:"):
        spec = policy.split(":", 1)[1]
        if not spec.strip():
            raise ValueError("--policy learned: needs a checkpoint folder")
        policy = runner.load_learned_policy(spec)
    compression = dict(
        policy=policy,
        ratio=DEFAULT_RATIO if args.ratio is None and args.budget is None else args.ratio,
        budget=args.budget,
    )
    compression.update({f: getattr(args, f) for f in SETTINGS if f in given})
    if needs_window(Compression.make(**compression).policy):  # validate before the model loads
        raise ValueError(
            f"--policy {args.policy} needs a full-cache pass over a fixed token stream; only "
            f"'fidelity' computes it (python -m jaxkv.eval fidelity --policies {args.policy},...)"
        )
    return compression


def _generate(args: argparse.Namespace) -> int:
    try:
        return _generate_cmd(args)
    except (ValueError, OSError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate_cmd(args: argparse.Namespace) -> int:
    compression = generate_compression(args)
    flags.check_kernels(args)  # before the model loads
    if args.matmul == "kernel" and args.weight_layout == "canonical":
        raise ValueError("--matmul kernel reads out-first weights: drop --weight-layout canonical")
    t0 = time.perf_counter()
    out_first = loading.out_first_for(args.weight_layout, batch_size=len(args.prompt))
    model = jaxkv.load(
        args.model,
        dtype=args.dtype,
        out_first=out_first,
        attention=args.attention,
        matmul=args.matmul,
    )
    t1 = time.perf_counter()
    outs = jaxkv.generate(
        model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        chat=not args.no_chat,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        kv_dtype=None if args.kv_dtype == "model" else args.kv_dtype,
        **compression,
    )
    t2 = time.perf_counter()
    for prompt, out in zip(args.prompt, outs, strict=True):
        if len(args.prompt) > 1:
            print(f"### {prompt}")
        print(out)
    print(f"[load {t1 - t0:.1f} s, generate {t2 - t1:.1f} s (incl. compile)]", file=sys.stderr)
    return 0


def _generate_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="'smollm2-135m' (embedded), a .gguf file or a HF safetensors directory",
    )
    flags.dtype_flag(parser)
    parser.add_argument(
        "--weight-layout",
        default="auto",
        choices=loading.WEIGHT_LAYOUTS,
        help="float weights' storage: out-first (output channels first, which a batch-1 "
        "decode step reads in place: about 1.6x faster on CPU), canonical, or auto (default: "
        "out-first for one prompt; int8 weights are out-first already)",
    )
    flags.attention_flag(parser)
    flags.matmul_flag(parser)
    parser.add_argument(
        "--prompt", action="append", required=True, help="prompt text (repeat for a batch)"
    )
    parser.add_argument("--max-new-tokens", type=flags.positive_int, default=128)
    parser.add_argument(
        "--temperature", type=flags.nonnegative_float, default=0.0, help=">= 0; 0 = greedy"
    )
    parser.add_argument("--top-p", type=flags.fraction, default=1.0, help="nucleus mass in (0, 1]")
    parser.add_argument("--seed", type=flags.seed, default=0, help="sampling seed (>= 0)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument(
        "--kv-dtype",
        default="model",
        choices=KV_DTYPES,
        help="KV-cache storage: model (the model's dtype) or int8 (per-slot scales)",
    )
    g = parser.add_argument_group("KV-cache compression (these flags need an evicting --policy)")
    g.add_argument(
        "--policy",
        default=None,
        help=f"eviction policy: {', '.join(policy_names())} (default: full cache); "
        "learned:<checkpoint> is a folder or the name of a shipped checkpoint",
    )
    g.add_argument(
        "--ratio",
        type=flags.fraction,
        default=None,
        help=f"budget ratio r in (0, 1] (default {DEFAULT_RATIO} unless --budget)",
    )
    g.add_argument(
        "--budget", type=flags.positive_int, default=None, help="absolute budget instead of --ratio"
    )
    g.add_argument("--min-budget", type=flags.positive_int, default=None, help="B_min (default 32)")
    g.add_argument(
        "--granularity",
        default=None,
        choices=GRANULARITIES,
        help="default: shared; adaptive = AdaKV (a layer's budget pooled over its KV heads); "
        "global = one pool over every layer and KV head",
    )
    g.add_argument(
        "--evict-every",
        type=flags.positive_int,
        default=None,
        help="evict every k decode steps (default 1)",
    )
    g.add_argument(
        "--protocol",
        default=None,
        choices=PROTOCOLS,
        help="decode: evict during decoding (default, the paper); prefill: compress the prompt "
        "once, then keep every generated token",
    )


# ----------------------------------------------------------------------------------------------
# Entry point


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m jaxkv.eval``: ``generate``, the suite, and ``kvlearn``."""
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="generate text from a prompt")
    _generate_flags(gen)
    gen.set_defaults(func=_generate)
    suite.add_parsers(sub)
    # kvlearn parses its own flags: its parser takes every later word as is ("\0": no option
    # prefix, so --help and the rest reach kvlearn too)
    kv = sub.add_parser(
        "kvlearn",
        help="KVLearn pool simulator (see: kvlearn --help)",
        add_help=False,
        prefix_chars="\0",
    )
    kv.add_argument("argv", nargs=argparse.REMAINDER)
    kv.set_defaults(func=lambda args: kvlearn_cli.eval_main(args.argv))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs ``python -m jaxkv.eval`` (no subcommand: the main job); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        print(f"default job: {PROG} " + " ".join(suite.DEFAULT_JOB), file=sys.stderr)
        args = parser.parse_args(suite.DEFAULT_JOB)
    return args.func(args)
