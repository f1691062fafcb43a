"""The evaluation suite's command line: ``python -m jaxkv.eval <subcommand> ...``.

With no arguments it runs the default main job (``DEFAULT_JOB``): a small fidelity comparison
of the full cache, four heuristics (StreamingLLM, H2O, SnapKV, TOVA) and the shipped learned
policy (``learned:policies/distillcache_smollm2_cpu``) at r ∈ {0.25, 0.125} on the embedded
model (4 held-out tinyshakespeare windows of 352 tokens: a 256-token prefix, then 96
teacher-forced tokens; one seed), printing the table. Measured on the shared 2-core CPU under
load (~3-6) from a cold start (process start, model load, ``JAXKV_NO_COMPILE_CACHE=1``, run):
4.6 min wall, 2.5 min of CPU (the former default, 7 heuristics at 3 ratios, took 8.9).
Compiled programs are cached on disk (``jaxkv.model.loading.cache_dir()/xla``;
``JAXKV_NO_COMPILE_CACHE=1`` turns that off), so later runs skip ~25-50 s of compilation per
ratio. ``--policies`` with every
heuristic and more ratios reproduces the paper's Fig. 1 (see README).

Every subcommand takes ``--model`` (``smollm2-135m``, a checkpoint path, or ``tiny``: random
weights with a byte tokenizer, for tests), ``--policies``, ``--ratios``, ``--seeds``,
``--limit`` and ``--out DIR``; it shows a progress bar and writes ``DIR/<name>.json``,
``DIR/<name>.md`` and PNG plots. Without ``--out`` a run gets a fresh folder,
``runs/<subcommand>-<YYYYmmdd-HHMMSS>/`` under the working directory (printed at the end); the
committed ``results/`` is only written when named.

Every argument is checked before anything loads or is written: numbers by their flag types
(``jaxkv.evals.flags``), then the lists, policies (learned checkpoints included), input files and
cross-field constraints (``--prompt-len`` < ``--window``, ...). Bad input ends the run with one
line, ``error: ...``, and exit status 2. Results are saved after every completed cell: an
interrupted or failing run keeps them (``"complete": false`` in the JSON). The first save of a
run atomically replaces ``<name>.json`` of an earlier run in the same ``--out`` folder; a run
that stops before its first cell leaves such a file untouched (``jaxkv.evals.report``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from jaxkv.evals import flags, report

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
SHIPPED_POLICY = "learned:policies/distillcache_smollm2_cpu"
DEFAULT_JOB = [
    "fidelity",
    "--policies",
    "full,streaming_llm,h2o,snapkv,tova," + SHIPPED_POLICY,
    "--ratios",
    "0.25,0.125",
    "--seeds",
    "0",
    "--window",
    "352",
]
RUNS_DIR = "runs"
"""Where runs without ``--out`` go: ``runs/<subcommand>-<YYYYmmdd-HHMMSS>/``."""


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
        "learned:<folder> (found from the working directory, the repository root or its "
        "policies/ folder: learned:distillcache_smollm2_cpu is the shipped one; several "
        "checkpoints as seeds: learned:a+b or a glob)",
    )
    parser.add_argument("--ratios", default=ratios, help="budget ratios r in (0, 1], comma list")
    parser.add_argument(
        "--seeds", default="0,1,2", help="seeds of the random policy (mean ± std over them)"
    )
    parser.add_argument(
        "--limit", type=flags.positive_int, default=limit, help="examples (windows) to run"
    )
    parser.add_argument(
        "--out",
        default=None,
        help=f"output folder (default: a new {RUNS_DIR}/<subcommand>-<YYYYmmdd-HHMMSS>)",
    )
    parser.add_argument(
        "--min-budget", type=flags.positive_int, default=32, help="B_min of the budget"
    )
    parser.add_argument(
        "--batch", type=flags.positive_int, default=4, help="sequences per compiled call"
    )


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
    fid.add_argument("--window", type=flags.int_range(2), default=384, help="tokens per window")
    fid.add_argument(
        "--prompt-len", type=flags.positive_int, default=256, help="prefilled tokens per window"
    )
    fid.add_argument(
        "--heldout",
        type=flags.fraction,
        default=0.1,
        help="tail fraction of the text file used, in (0, 1] (1 = the whole file)",
    )
    fid.set_defaults(func=_fidelity_cmd)
    for module in (retrieval, benchmarks, agreement, positions, latency):
        module.add_parsers(sub, common=_common)
    return parser


def _parse_common(args: argparse.Namespace):
    """Checks the shared list flags (and loads the policies); returns (groups, ratios, seeds).

    The scalar flags are already checked by their argparse types.
    """
    from jaxkv.evals import runner

    ratios = runner.parse_ratios(args.ratios)
    seeds = flags.parse_seeds(args.seeds)
    groups = runner.parse_policies(args.policies)
    return groups, ratios, seeds


def check_prompt_len(args: argparse.Namespace) -> None:
    """``--prompt-len`` must leave at least one token of the ``--window`` to teacher-force."""
    if not 0 < args.prompt_len < args.window:
        raise ValueError(
            f"--prompt-len must be in [1, {args.window - 1}] (less than --window {args.window}), "
            f"got {args.prompt_len}"
        )


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
    check_prompt_len(args)
    tasks.check_text_windows(
        args.text, window=args.window, n_windows=args.limit, heldout_fraction=args.heldout
    )
    model = runner.load_eval_model(args.model)
    runner.check_fits(model, args.window, what="--window")
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
    n_plots = len(store.plots)
    print(
        f"wrote {store.json_path.name}, {store.md_path.name} and {n_plots} plot(s) to "
        f"{store.out_dir}/",
        file=sys.stderr,
    )
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


def new_run_dir(command: str, *, root: str | os.PathLike = RUNS_DIR) -> Path:
    """A folder name for a run without ``--out``: ``root/<command>-<YYYYmmdd-HHMMSS>``, with
    ``-2``, ``-3``, ... appended when a run of the same second has it (not created here)."""
    base = Path(root) / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_out_dir(path: str | os.PathLike) -> Path:
    """``--out`` as a Path, checked to be a folder that exists or can be created (not made).

    Raises:
        ValueError: the path is a file, or its nearest existing parent is not a writable folder.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path} is a file, not a folder")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: cannot write in {parent}")
    return path


def main(argv: list[str] | None = None) -> int:
    """Runs one subcommand (no arguments: the default fidelity job); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("default job: python -m jaxkv.eval " + " ".join(DEFAULT_JOB), file=sys.stderr)
        argv = DEFAULT_JOB
    args = build_parser().parse_args(argv)
    _enable_compile_cache()
    start = time.perf_counter()
    before = None
    try:
        args.out = check_out_dir(args.out or new_run_dir(args.command))
        before = _identity(_json_path(args))
        status = args.func(args)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        _note_partial(args, before)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _note_partial(args, before)
        return 130
    seconds = time.perf_counter() - start
    print(f"[{args.command}: {seconds:.0f} s; results in {args.out}/]", file=sys.stderr)
    return status


def _json_path(args: argparse.Namespace) -> Path:
    return Path(args.out) / f"{args.command}.json"


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, mtime) of a file, None if absent: every save replaces the file (a new inode)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _note_partial(args: argparse.Namespace, before: tuple[int, int] | None) -> None:
    """Points at the records this run saved before it stopped (says nothing when it saved none:
    a file from an earlier run in ``--out`` is then still that run's)."""
    if not isinstance(args.out, Path):
        return  # stopped before --out was checked
    path = _json_path(args)
    now = _identity(path)
    if now is None or now == before:
        return
    try:
        n = len(json.loads(path.read_text(encoding="utf-8"))["records"])
    except (OSError, ValueError, KeyError):
        return
    if n:
        print(f"results finished so far ({n} records) are kept in {path}", file=sys.stderr)
