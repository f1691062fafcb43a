"""The evaluation suite's command line: ``python -m jaxkv.eval <subcommand> ...``.

With no arguments it runs the default main job: a small fidelity comparison of every heuristic
policy at r ∈ {0.5, 0.25, 0.125} on the embedded model (4 held-out tinyshakespeare windows of
352 tokens: a 256-token prefix, then 96 teacher-forced tokens; one seed), printing the table.
Measured on the shared 2-core CPU under load (~5) with cold compilation: 8.9 min wall, 6.0 min
of CPU (128 teacher-forced tokens took 11.4 min, hence 96). Compiled programs are cached on disk
(``jaxkv.model.loading.cache_dir()/xla``; ``JAXKV_NO_COMPILE_CACHE=1`` turns that off), so
later runs skip ~25-50 s of compilation per ratio.

Every subcommand takes ``--model`` (``smollm2-135m``, a checkpoint path, or ``tiny``: random
weights with a byte tokenizer, for tests), ``--policies``, ``--ratios``, ``--seeds``,
``--limit`` and ``--out DIR``; it shows a progress bar and writes ``DIR/<name>.json``,
``DIR/<name>.md`` and PNG plots. Results are saved after every completed cell: an interrupted
or failing run keeps them (``"complete": false`` in the JSON). Bad input (a missing file, a
malformed JSONL line, an unknown task, an empty text) ends the run with ``error: ...`` and exit
status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from jaxkv.evals import report

SUBCOMMANDS = (
    "fidelity",
    "retrieval",
    "gsm8k",
    "bbh",
    "longbench",
    "agreement",
    "positions",
    "latency",
)
HEURISTICS = "random,streaming_llm,h2o,snapkv,tova,keydiff,knorm"
DEFAULT_JOB = [
    "fidelity",
    "--policies",
    "full," + HEURISTICS,
    "--ratios",
    "0.5,0.25,0.125",
    "--seeds",
    "0",
    "--window",
    "352",
]
DEFAULT_OUT = "results"


# ----------------------------------------------------------------------------------------------
# Arguments


def _common(parser: argparse.ArgumentParser, *, ratios: str, policies: str, limit: int) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m", help="smollm2-135m (embedded), a path, or 'tiny'"
    )
    parser.add_argument(
        "--policies",
        default=policies,
        help="comma list: full, random, streaming_llm, h2o, snapkv, tova, keydiff, knorm, "
        "learned:<path> (several checkpoints as seeds: learned:a+b or a glob)",
    )
    parser.add_argument("--ratios", default=ratios, help="budget ratios r in (0, 1], comma list")
    parser.add_argument(
        "--seeds", default="0,1,2", help="seeds of the random policy (mean ± std over them)"
    )
    parser.add_argument("--limit", type=int, default=limit, help="examples (windows) to run")
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--min-budget", type=int, default=32, help="B_min of the budget")
    parser.add_argument("--batch", type=int, default=4, help="sequences per compiled call")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    from jaxkv.evals import agreement, benchmarks, latency, positions, retrieval

    parser = argparse.ArgumentParser(
        prog="python -m jaxkv.eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fid = sub.add_parser("fidelity", help="teacher-forced KL and perplexity (Fig. 1)")
    _common(fid, ratios="1,0.5,0.25,0.125", policies="full," + HEURISTICS, limit=4)
    fid.add_argument("--text", default=None, help="text file (default: tinyshakespeare)")
    fid.add_argument("--window", type=int, default=384, help="tokens per window")
    fid.add_argument("--prompt-len", type=int, default=256, help="prefilled tokens per window")
    fid.add_argument(
        "--heldout", type=float, default=0.1, help="tail fraction of the text file used"
    )
    fid.set_defaults(func=_fidelity_cmd)
    for module in (retrieval, benchmarks, agreement, positions, latency):
        module.add_parsers(sub, common=_common)
    return parser


def _parse_common(args: argparse.Namespace):
    from jaxkv.evals import runner

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    groups = runner.parse_policies(args.policies)
    ratios = runner.parse_ratios(args.ratios)
    seeds = runner.parse_list(args.seeds, kind=int, what="--seeds")
    return groups, ratios, seeds


def common_config(args: argparse.Namespace, **extra) -> dict:
    """The settings every JSON file records."""
    return {
        "policies": args.policies,
        "ratios": args.ratios,
        "seeds": args.seeds,
        "limit": args.limit,
        "min_budget": args.min_budget,
        **extra,
    }


# ----------------------------------------------------------------------------------------------
# fidelity


def _fidelity_cmd(args: argparse.Namespace) -> int:
    from jaxkv.evals import fidelity, runner, tasks

    groups, ratios, seeds = _parse_common(args)
    model = runner.load_eval_model(args.model)
    windows = tasks.text_windows(
        args.text,
        window=args.window,
        n_windows=args.limit,
        tokenizer=model.tokenizer,
        heldout_fraction=args.heldout,
    )
    settings = fidelity.FidelitySettings(
        prompt_len=args.prompt_len, batch_size=args.batch, min_budget=args.min_budget
    )
    store = report.ResultStore(
        args.out,
        fidelity.NAME,
        model=model.name,
        config=common_config(
            args,
            text=args.text or "tinyshakespeare (held-out tail)",
            window=args.window,
            prompt_len=args.prompt_len,
            windows=len(windows),
            heldout=args.heldout,
        ),
        summarize=fidelity.summarize,
        render=fidelity.render,
        plot=fidelity.plot,
        title="Fidelity to the full cache (teacher forcing, paper Fig. 1)",
    )
    fidelity.run(
        model,
        groups,
        ratios=ratios,
        seeds=seeds,
        windows_NT=windows,
        settings=settings,
        store=store,
    )
    return _finish(store)


def _finish(store: report.ResultStore) -> int:
    store.finish()
    print(store.md_path.read_text(encoding="utf-8"))
    print(f"wrote {store.json_path}, {store.md_path} and plots", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# Entry point


def _enable_compile_cache() -> None:
    """Persists compiled programs across runs (a 30-layer compile costs ~25 s here)."""
    import jax

    if os.environ.get("JAXKV_NO_COMPILE_CACHE") or jax.config.jax_compilation_cache_dir:
        return
    from jaxkv.model.loading import cache_dir

    jax.config.update("jax_compilation_cache_dir", str(Path(cache_dir()) / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand (no arguments: the default fidelity job); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("default job: python -m jaxkv.eval " + " ".join(DEFAULT_JOB), file=sys.stderr)
        argv = DEFAULT_JOB
    args = build_parser().parse_args(argv)
    _enable_compile_cache()
    start = time.perf_counter()
    try:
        status = args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        _note_partial(args)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _note_partial(args)
        return 130
    print(f"[{args.command}: {time.perf_counter() - start:.0f} s]", file=sys.stderr)
    return status


def _note_partial(args: argparse.Namespace) -> None:
    path = Path(args.out) / f"{args.command}.json"
    try:
        n = len(json.loads(path.read_text(encoding="utf-8"))["records"])
    except (OSError, ValueError, KeyError):
        return
    if n:
        print(f"results finished so far ({n} records) are kept in {path}", file=sys.stderr)
