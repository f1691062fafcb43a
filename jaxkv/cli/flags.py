"""Checked flag types of the evaluation command lines (``python -m jaxkv.eval ...``).

Each is an ``argparse`` ``type=``: a bad value ends the command at parse time, before any model,
policy or data is loaded and before anything is written, with
``python -m jaxkv.eval <cmd>: error: argument --batch: must be an integer >= 1, got '0'`` and exit
status 2. Comma lists (``--ratios``, ``--seeds``) are checked by ``parse_seeds`` and
``jaxkv.evals.runner.parse_ratios`` at the start of every suite subcommand
(``jaxkv.cli.suite``), also before anything loads.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from jaxkv.config import ATTENTION_IMPLEMENTATIONS, MATMUL_IMPLEMENTATIONS
from jaxkv.model import cache_kernel, loading

SEED_LIMIT = 2**31
"""Seeds are integers in [0, SEED_LIMIT) (``jax.random.key`` takes them as int32)."""


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (no upper bound when ``hi`` is None)."""
    want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = want  # argparse names the type in some messages
    return parse


def float_range(lo: float, hi: float, *, lo_open: bool, hi_open: bool) -> Callable[[str], float]:
    """An argparse type: a finite float in the interval from ``lo`` to ``hi``."""
    want = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}") from None
        ok = math.isfinite(value) and (lo < value if lo_open else lo <= value)
        ok = ok and (value < hi if hi_open else value <= hi)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {want}, got {text!r}")
        return value

    parse.__name__ = want
    return parse


positive_int = int_range(1)
nonnegative_int = int_range(0)
seed = int_range(0, SEED_LIMIT - 1)
fraction = float_range(0.0, 1.0, lo_open=True, hi_open=False)
"""(0, 1]: budget ratios, top-p, the held-out share of a text file."""
nonnegative_float = float_range(0.0, math.inf, lo_open=False, hi_open=True)


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: distinct integers in [0, 2**31), comma separated.

    Raises:
        ValueError: an empty list, a non-integer, a value out of range, or a repeated seed.
    """
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError("--seeds: empty list")
    try:
        seeds = [int(t) for t in items]
    except ValueError:
        raise ValueError(f"--seeds: cannot parse {text!r} as integers") from None
    bad = [s for s in seeds if not 0 <= s < SEED_LIMIT]
    if bad:
        raise ValueError(f"--seeds must lie in [0, 2**31), got {bad}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds names a seed twice: {seeds}")
    return seeds


DEFAULT_DTYPE = "float32"


def attention_flag(parser: argparse.ArgumentParser) -> None:
    """``--attention``: ``config.attention`` (``jaxkv.config.ATTENTION_IMPLEMENTATIONS``)."""
    parser.add_argument(
        "--attention",
        default="xla",
        choices=ATTENTION_IMPLEMENTATIONS,
        help="how decode steps attend over the cache and prompts over themselves: xla "
        "(default) or kernel, C++ CPU kernels built on first use with the machine's compiler: "
        "decode reads each cached key and value once (about 1.3x faster at 4K context on the "
        "2-core CPU), a prompt's attention is flash-style (about 3x faster at 2048 tokens)",
    )


def matmul_flag(parser: argparse.ArgumentParser) -> None:
    """``--matmul``: ``config.matmul`` (``jaxkv.config.MATMUL_IMPLEMENTATIONS``)."""
    parser.add_argument(
        "--matmul",
        default="xla",
        choices=MATMUL_IMPLEMENTATIONS,
        help="how decode steps of 1-16 rows (a batch of prompts) multiply by the weights: xla "
        "(default) or kernel, a C++ CPU kernel built on first use that reads each layer's "
        "weights in place (float weights are then stored out-first)",
    )


def check_kernels(args: argparse.Namespace) -> None:
    """``--attention kernel`` or ``--matmul kernel`` where the kernels cannot be built: a
    ValueError before any model loads or output is written."""
    for flag in ("attention", "matmul"):
        if getattr(args, flag, "xla") == "kernel" and not cache_kernel.available():
            why = cache_kernel.unavailable_reason()
            raise ValueError(f"--{flag} kernel: the CPU kernels are unavailable: {why}")


def dtype_flag(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: the model weights' dtype (``jaxkv.load``; int8 is weight-only int8)."""
    parser.add_argument(
        "--dtype",
        default=DEFAULT_DTYPE,
        choices=loading.DTYPES,
        help="model weights: float32 (default), bfloat16, float16, or int8 (weight-only int8 "
        "through qwix, float32 activations)",
    )
