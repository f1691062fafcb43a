"""The evaluation suite's command line: ``python -m jaxkv.eval <subcommand> ...``.

Each subcommand is an ``Eval``: its flags (``add_flags``), then one library call (``run``:
``fidelity.evaluate``, ``benchmarks.evaluate_gsm8k``, ...) that returns the finished result
store; ``run_eval`` around it checks ``--out``, parses the shared flags into a
``runner.Job``, prints the table and turns errors into ``error: ...`` and exit status 2.

With no arguments ``python -m jaxkv.eval`` runs the default main job (``DEFAULT_JOB``): a small
fidelity comparison of the full cache, four heuristics (StreamingLLM, H2O, SnapKV, TOVA) and the
shipped learned policy (``learned:distillcache_smollm2_cpu``) at r ∈ {0.25, 0.125} on the
embedded model (4 held-out tinyshakespeare windows of 352 tokens: a 256-token prefix, then 96
teacher-forced tokens; one seed), printing the table. Measured on the shared 2-core CPU under
load (~3-6) from a cold start (process start, model load, ``JAXKV_NO_COMPILE_CACHE=1``, run):
4.6 min wall, 2.5 min of CPU (the former default, 7 heuristics at 3 ratios, took 8.9).
Compiled programs are cached on disk (``jaxkv.paths.cache_dir()/xla``;
``JAXKV_NO_COMPILE_CACHE=1`` turns that off), so later runs skip ~25-50 s of compilation per
ratio. ``--policies`` with every heuristic and more ratios reproduces the paper's Fig. 1 (see
README).

Every subcommand takes ``--model`` (``smollm2-135m``, a checkpoint path, or ``tiny``: random
weights with a byte tokenizer, for tests), ``--policies``, ``--ratios``, ``--seeds``,
``--limit`` and ``--out DIR``; it shows a progress bar and writes ``DIR/<name>.json``,
``DIR/<name>.md`` and PNG plots. Without ``--out`` a run gets a fresh folder,
``runs/<subcommand>-<YYYYmmdd-HHMMSS>/`` under the working directory (printed at the end); the
committed ``results/`` is only written when named. ``gsm8k``, ``bbh`` and ``longbench`` read
the full public sets with ``--hub SOURCE``, ``fidelity`` reads WikiText with ``--wikitext
SOURCE`` (a hub name, or a local file or folder in the hub's layout: ``jaxkv.evals.hub``; they
need the ``hf`` extra). ``fidelity``, ``retrieval`` and ``agreement`` also take ``--protocol
{decode,prefill}`` (evict at every decode step, or compress the prompt once) and
``--granularity {shared,layer,head,adaptive,global}`` (``jaxkv.eviction``; recorded in the result
file's config when not the default); ``fidelity`` also takes ``--kv-dtype {model,int8}``
(an int8 KV cache, ``jaxkv.kvcache``; recorded likewise) and ``--kvzip-request
{plain,chat}`` (what follows kvzip's repeat prompt; recorded when a policy reads kvzip's
reconstruction); ``fidelity`` alone can run the ``oracle`` bound.

Every argument is checked before anything loads or is written: numbers by their flag types
(``jaxkv.cli.flags``), then the lists, policies (learned checkpoints included), input files and
cross-field constraints (``--prompt-len`` < ``--window``, ...). Bad input ends the run with one
line, ``error: ...``, and exit status 2. Results are saved after every completed cell: an
interrupted or failing run keeps them (``"complete": false`` in the JSON). The first save of a
run atomically replaces ``<name>.json`` of an earlier run in the same ``--out`` folder; a run
that stops before its first cell leaves such a file untouched (``jaxkv.evals.report``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxkv import eviction
from jaxkv.cli import flags
from jaxkv.evals import (
    agreement,
    benchmarks,
    fidelity,
    hub,
    latency,
    positions,
    report,
    retrieval,
    runner,
)
from jaxkv.paths import cache_dir
from jaxkv.policies import kvzip, needs_window

HEURISTICS = "random,streaming_llm,h2o,snapkv,tova,keydiff,knorm"
SHIPPED_POLICY = "learned:distillcache_smollm2_cpu"
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
GENERATION_POLICIES = "full,streaming_llm,h2o,snapkv"
HUB_HELP = (
    "read the full public set: a hub name ({}) or a local file or folder in the hub's layout "
    "(needs the hf extra: pip install 'jaxkv[hf]')"
)


@dataclasses.dataclass(frozen=True)
class Eval:
    """One subcommand of the suite.

    Attributes:
        name: the subcommand, also the stem of its result files.
        help: its line in ``python -m jaxkv.eval --help``.
        add_flags: adds its flags to its parser.
        run: checks what the flags alone decide, then makes the one library call; returns the
            finished ``report.ResultStore``.
    """

    name: str
    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, runner.Job], report.ResultStore]


# ----------------------------------------------------------------------------------------------
# Flags every subcommand shares


def _common(parser: argparse.ArgumentParser, *, ratios: str, policies: str, limit: int) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m", help="smollm2-135m (embedded), a path, or 'tiny'"
    )
    flags.dtype_flag(parser)
    flags.attention_flag(parser)
    parser.add_argument(
        "--policies",
        default=policies,
        help="comma list: full, random, streaming_llm, h2o, snapkv, tova, keydiff, knorm, "
        "expected_attention, critical:<policy> (CriticalKV over a policy), oracle "
        "(future-attention upper bound; fidelity only), kvzip, "
        "rerank:<policy> / rerank@<w>:<policy> (kvzip's allocation, the policy's order or its "
        "blend with kvzip's; fidelity --protocol prefill only), blend@<w>:<a>+<b> (a's "
        "allocation, each row ordered by a's and b's ranks, w on b's), tier@<q>:<a>+<b> (a's "
        "allocation and order, b's top fraction q of each row first), ranker:<checkpoint> "
        "(the supervised per-head ranker: python -m jaxkv.train ranker), learned:<checkpoint> "
        "(a folder, or a checkpoint shipped in jaxkv/checkpoints/: "
        "learned:distillcache_smollm2_cpu); several checkpoints as the seeds of one row: "
        "learned:a+b, ranker:a+b or a glob; in fidelity, an item ending in @<granularity> "
        "(critical:h2o@head) selects with that granularity instead of --granularity",
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


def _job(args: argparse.Namespace, command: str) -> runner.Job:
    """The shared flags, checked (the policies loaded): ratios, seeds, then policies, then
    the policies ``command`` can run, then ``--attention``."""
    ratios = runner.parse_ratios(args.ratios)
    seeds = flags.parse_seeds(args.seeds)
    groups = runner.parse_policies(args.policies)
    _check_families(groups, command)
    flags.check_kernels(args)
    selection = {n: getattr(args, n) for n in ("protocol", "granularity") if hasattr(args, n)}
    return runner.Job(
        model=args.model,
        groups=tuple(groups),
        ratios=tuple(ratios),
        seeds=tuple(seeds),
        out=args.out,
        config={
            "policies": args.policies,
            "ratios": args.ratios,
            "seeds": args.seeds,
            "limit": args.limit,
            "min_budget": args.min_budget,
            # recorded only when not the default, so default runs keep their files as before
            **({"dtype": args.dtype} if args.dtype != flags.DEFAULT_DTYPE else {}),
            **({"attention": args.attention} if args.attention != "xla" else {}),
        },
        limit=args.limit,
        min_budget=args.min_budget,
        batch_size=args.batch,
        dtype=args.dtype,
        attention=args.attention,
        **selection,
    )


# Subcommands that can run the policies that need more than a cache: the oracle reads the
# full-cache attention of a fixed token stream, kvzip (and a ranker reading its scores) a
# reconstruction of each window's prompt (teacher forcing only).
ORACLE_COMMANDS = ("fidelity",)
ROW_GRANULARITY_COMMANDS = ("fidelity",)  # where a --policies item may end in @<granularity>


def _check_families(groups, command: str) -> None:
    members = [p for g in groups for p in g.members]
    window = [p.name for p in members if needs_window(p)]
    if command not in ORACLE_COMMANDS and window:
        raise ValueError(
            f"the {window[0]} policy needs a full-cache pass over each window of a fixed token "
            f"stream; only {', '.join(ORACLE_COMMANDS)} computes it"
            + (" (it is an upper bound, not a policy to run)" if window[0] == "oracle" else "")
        )
    own = [g.label for g in groups if g.granularity is not None]
    if own and command not in ROW_GRANULARITY_COMMANDS:
        raise ValueError(
            f"{own[0]}: a granularity of its own (@...) runs in "
            f"{', '.join(ROW_GRANULARITY_COMMANDS)} only; use --granularity"
        )


def _needs(args: argparse.Namespace, flag: str, *others: str) -> None:
    """Flags in ``others`` that mean nothing without ``flag`` are an error without it."""
    given = [o for o in others if getattr(args, o) is not None]
    if given and getattr(args, flag) is None:
        names = "/".join("--" + o.replace("_", "-") for o in given)
        need = "need" if len(given) > 1 else "needs"
        raise ValueError(f"{names} {need} --{flag.replace('_', '-')}")


# ----------------------------------------------------------------------------------------------
# The subcommands: flags, then one library call


def _fidelity_flags(parser: argparse.ArgumentParser) -> None:
    _common(parser, ratios="1,0.5,0.25,0.125", policies="full," + HEURISTICS, limit=4)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", default=None, help="text file (default: tinyshakespeare)")
    source.add_argument("--wikitext", default=None, help=HUB_HELP.format(hub.WIKITEXT_HUB))
    parser.add_argument(
        "--wikitext-config", default=None, help=f"with --wikitext (default {hub.WIKITEXT_CONFIG})"
    )
    parser.add_argument("--wikitext-split", default=None, help="with --wikitext (default test)")
    parser.add_argument("--window", type=flags.int_range(2), default=384, help="tokens per window")
    parser.add_argument(
        "--prompt-len", type=flags.positive_int, default=256, help="prefilled tokens per window"
    )
    parser.add_argument(
        "--heldout",
        type=flags.fraction,
        default=None,
        help="tail fraction of the text used, in (0, 1] (1 = all of it; default 0.1, and 1 "
        "with --wikitext)",
    )
    parser.add_argument(
        "--offset",
        type=flags.int_range(0),
        default=0,
        help="tokens of the held-out part skipped before the first window (default 0); "
        "e.g. --limit 8 --offset 3072 reads the 8 windows of 384 after the first 8",
    )
    parser.add_argument(
        "--kv-dtype",
        default="model",
        choices=fidelity.KV_DTYPES,
        help="KV-cache storage of the compared streams: model (the model's dtype) or int8 "
        "(per-slot scales); the reference is always the model's full cache, and with int8 "
        "the full row is the int8 full cache",
    )
    parser.add_argument(
        "--kvzip-request",
        default=kvzip.DEFAULT_REQUEST,
        choices=kvzip.REQUESTS,
        help="what follows kvzip's repeat prompt in its reconstruction pass: plain, a newline "
        "(kvpress without a chat template; for raw-text windows) or chat, the chat template's "
        "assistant header (jaxkv before session 40); recorded in the result file's config "
        "when a policy reads the reconstruction",
    )
    _selection_flags(parser)
    _pooling_flags(parser)
    parser.add_argument(
        "--evict-every",
        type=flags.positive_int,
        default=None,
        help="decode protocol: evict after every k-th decode step, with k slots of slack "
        "(default 1, the paper's)",
    )


def _selection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--protocol",
        default="decode",
        choices=eviction.PROTOCOLS,
        help="decode: evict at every decode step, B_t = max(r*N_t, B_min) (the paper); "
        "prefill: compress the prompt once to max(r*N_prompt, B_min), then never evict "
        "(kvpress)",
    )
    parser.add_argument(
        "--granularity",
        default="shared",
        choices=eviction.GRANULARITIES,
        help="shared: one token set for all layers and heads (the paper); layer; head; "
        "adaptive: AdaKV, a layer's K*B tokens pooled over its KV heads (2x the slots of head); "
        "global: one pool of L*K*B tokens over every layer and KV head (KVzip's; 2x the slots)",
    )


def _pooling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--head-floor",
        type=flags.float_range(0.0, 1.0, lo_open=False, hi_open=False),
        default=None,
        help="adaptive/global: each KV head keeps at least floor(x*B) tokens (default 0.2)",
    )
    parser.add_argument(
        "--head-cap",
        type=flags.float_range(1.0, math.inf, lo_open=False, hi_open=True),
        default=None,
        help="adaptive/global: each KV head keeps at most floor(x*B) tokens, and has that many "
        "slots (default 2; a cap of 1/r or more keeps no memory: kvpress's masked KVzip)",
    )


def _fidelity(args: argparse.Namespace, job: runner.Job) -> report.ResultStore:
    _needs(args, "wikitext", "wikitext_config", "wikitext_split")
    return fidelity.evaluate(
        job,
        window=args.window,
        prompt_len=args.prompt_len,
        text=args.text,
        heldout=args.heldout,
        offset=args.offset,
        wikitext=args.wikitext,
        wikitext_config=args.wikitext_config or hub.WIKITEXT_CONFIG,
        wikitext_split=args.wikitext_split or "test",
        kv_dtype=args.kv_dtype,
        head_floor=args.head_floor,
        head_cap=args.head_cap,
        evict_every=args.evict_every,
        kvzip_request=args.kvzip_request,
    )


def _retrieval_flags(parser: argparse.ArgumentParser) -> None:
    _common(parser, ratios="0.5,0.25,0.125", policies="full,streaming_llm,h2o,snapkv,tova", limit=6)
    parser.add_argument("--tasks", default="passkey,needle", help="comma list: passkey, needle")
    parser.add_argument("--lengths", default="1024,2048", help="context lengths in tokens")
    parser.add_argument(
        "--data-seed", type=flags.seed, default=0, help="seed of keys, depths and filler"
    )
    parser.set_defaults(batch=6)
    _selection_flags(parser)
    _pooling_flags(parser)


def _retrieval(args: argparse.Namespace, job: runner.Job) -> report.ResultStore:
    names = list(dict.fromkeys(runner.parse_list(args.tasks, kind=str, what="--tasks")))
    lengths = list(dict.fromkeys(runner.parse_list(args.lengths, kind=int, what="--lengths")))
    return retrieval.evaluate(
        job,
        task_names=names,
        lengths=lengths,
        data_seed=args.data_seed,
        head_floor=args.head_floor,
        head_cap=args.head_cap,
    )


def _gsm8k_flags(parser: argparse.ArgumentParser) -> None:
    _common(parser, ratios="0.5,0.25,0.125", policies=GENERATION_POLICIES, limit=20)
    parser.add_argument("--split", default="test", choices=("test", "train"))
    parser.add_argument(
        "--shots", type=flags.int_range(0, 8), default=8, help="chain-of-thought exemplars"
    )
    parser.add_argument(
        "--max-new-tokens", type=flags.positive_int, default=None, help="default: 512"
    )
    parser.add_argument("--hub", default=None, help=HUB_HELP.format(hub.GSM8K_HUB))


def _gsm8k(args: argparse.Namespace, job: runner.Job) -> report.ResultStore:
    return benchmarks.evaluate_gsm8k(
        job,
        split=args.split,
        shots=args.shots,
        max_new_tokens=args.max_new_tokens,
        hub=args.hub,
    )


def _bbh_flags(parser: argparse.ArgumentParser) -> None:
    _common(parser, ratios="0.5,0.25,0.125", policies=GENERATION_POLICIES, limit=10)
    parser.add_argument("--tasks", default="date_understanding", help="comma list of BBH tasks")
    parser.add_argument(
        "--max-new-tokens", type=flags.positive_int, default=None, help="default: 512"
    )
    parser.add_argument("--hub", default=None, help=HUB_HELP.format(hub.BBH_HUB))


def _bbh(args: argparse.Namespace, job: runner.Job) -> report.ResultStore:
    names = list(dict.fromkeys(runner.parse_list(args.tasks, kind=str, what="--tasks")))
    return benchmarks.evaluate_bbh(
        job, task_names=names, max_new_tokens=args.max_new_tokens, hub=args.hub
    )


def _longbench_flags(parser: argparse.ArgumentParser) -> None:
    _common(parser, ratios="0.5,0.25,0.125", policies=GENERATION_POLICIES, limit=None)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", action="append", help="JSONL file (repeatable)")
    source.add_argument(
        "--hub",
        default=None,
        help=HUB_HELP.format(hub.LONGBENCH_HUB + "'s data.zip unzipped") + "; with --dataset",
    )
    parser.add_argument(
        "--dataset",
        default=None,
        help="dataset name (with --data, default: from the file name; with --hub, the config)",
    )
    parser.add_argument("--config-dir", default=None, help="LongBench config folder")
    parser.add_argument(
        "--max-length", type=flags.positive_int, default=3500, help="prompt tokens kept at most"
    )
    parser.add_argument(
        "--max-new-tokens", type=flags.positive_int, default=None, help="default: dataset's"
    )


def _longbench(args: argparse.Namespace, job: runner.Job) -> report.ResultStore:
    if args.hub is not None and args.dataset is None:
        raise ValueError("--hub needs --dataset NAME (the LongBench dataset, e.g. hotpotqa)")
    return benchmarks.evaluate_longbench(
        job,
        data=args.data,
        hub=args.hub,
        dataset=args.dataset,
        config_dir=args.config_dir,
        max_length=args.max_length,
        max_new_tokens=args.max_new_tokens,
    )


def _agreement_flags(parser: argparse.ArgumentParser) -> None:
    _common(parser, ratios="0.25", policies="streaming_llm,h2o,snapkv,tova", limit=8)
    parser.add_argument("--task", default="gsm8k", help="gsm8k, bbh/<task>, or longbench (--data)")
    parser.add_argument("--data", default=None, help="LongBench JSONL file (with --task longbench)")
    parser.add_argument(
        "--max-new-tokens", type=flags.positive_int, default=None, help="default: the task's"
    )
    parser.add_argument(
        "--max-length", type=flags.positive_int, default=3500, help="LongBench prompt tokens"
    )
    _selection_flags(parser)


def _agreement(args: argparse.Namespace, job: runner.Job) -> report.ResultStore:
    return agreement.evaluate(
        job,
        task=args.task,
        data=args.data,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
    )


def _positions_flags(parser: argparse.ArgumentParser) -> None:
    _common(parser, ratios="0.25", policies=HEURISTICS, limit=4)
    parser.add_argument("--text", default=None, help="text file (default: tinyshakespeare)")
    parser.add_argument("--window", type=flags.int_range(2), default=512, help="tokens per window")
    parser.add_argument(
        "--prompt-len", type=flags.positive_int, default=256, help="prefilled tokens per window"
    )


def _positions(args: argparse.Namespace, job: runner.Job) -> report.ResultStore:
    return positions.evaluate(job, window=args.window, prompt_len=args.prompt_len, text=args.text)


def _latency_flags(parser: argparse.ArgumentParser) -> None:
    _common(parser, ratios="0.25", policies="full,streaming_llm,h2o,snapkv,tova,knorm", limit=None)
    parser.add_argument("--context", type=flags.positive_int, default=1024, help="prompt tokens")
    parser.add_argument(
        "--new-tokens", type=flags.positive_int, default=32, help="generated tokens (end to end)"
    )
    parser.add_argument(
        "--repeats", type=flags.positive_int, default=3, help="timed repeats (medians)"
    )
    parser.set_defaults(batch=1)


def _latency(args: argparse.Namespace, job: runner.Job) -> report.ResultStore:
    return latency.evaluate(
        job, context=args.context, new_tokens=args.new_tokens, repeats=args.repeats
    )


EVALS = (
    Eval("fidelity", "teacher-forced KL and perplexity (Fig. 1)", _fidelity_flags, _fidelity),
    Eval(
        "retrieval",
        "passkey / needle retrieval vs context length (Table 2)",
        _retrieval_flags,
        _retrieval,
    ),
    Eval("gsm8k", "GSM8K 8-shot chain of thought (exact match)", _gsm8k_flags, _gsm8k),
    Eval("bbh", "BIG-Bench Hard 3-shot chain of thought (exact match)", _bbh_flags, _bbh),
    Eval(
        "longbench",
        "LongBench-format JSONL (official prompts/metrics)",
        _longbench_flags,
        _longbench,
    ),
    Eval(
        "agreement",
        "agreement with full-cache generations, error modes (Tab. 8)",
        _agreement_flags,
        _agreement,
    ),
    Eval(
        "positions", "histogram of retained token positions (Fig. 5)", _positions_flags, _positions
    ),
    Eval(
        "latency", "per-component decode latency and tokens/s (Table 3)", _latency_flags, _latency
    ),
)
SUBCOMMANDS = tuple(e.name for e in EVALS)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Adds every suite subcommand to ``python -m jaxkv.eval``'s subparsers."""
    for entry in EVALS:
        parser = sub.add_parser(entry.name, help=entry.help)
        entry.add_flags(parser)
        parser.set_defaults(func=functools.partial(run_eval, entry))


# ----------------------------------------------------------------------------------------------
# Running one


def run_eval(entry: Eval, args: argparse.Namespace) -> int:
    """Runs one parsed subcommand; returns the exit status (2: bad input, 130: interrupted)."""
    _enable_compile_cache()
    start = time.perf_counter()
    out, before = None, None
    try:
        out = args.out = check_out_dir(args.out or new_run_dir(entry.name))
        before = _identity(out / f"{entry.name}.json")
        _print_results(entry.run(args, _job(args, entry.name)))
    except (ValueError, OSError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        _note_partial(out, entry.name, before)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _note_partial(out, entry.name, before)
        return 130
    seconds = time.perf_counter() - start
    print(f"[{entry.name}: {seconds:.0f} s; results in {out}/]", file=sys.stderr)
    return 0


def _print_results(store: report.ResultStore) -> None:
    print(store.md_path.read_text(encoding="utf-8"))
    print(
        f"wrote {store.json_path.name}, {store.md_path.name} and {len(store.plots)} plot(s) to "
        f"{store.out_dir}/",
        file=sys.stderr,
    )


def _enable_compile_cache() -> None:
    """Persists compiled programs across runs (a 30-layer compile costs ~25 s here)."""
    if os.environ.get("JAXKV_NO_COMPILE_CACHE") or jax.config.jax_compilation_cache_dir:
        return
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


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, mtime) of a file, None if absent: every save replaces the file (a new inode)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _note_partial(out: Path | None, name: str, before: tuple[int, int] | None) -> None:
    """Points at the records this run saved before it stopped (says nothing when it saved none:
    a file from an earlier run in ``--out`` is then still that run's)."""
    if out is None:
        return  # stopped before --out was checked
    path = out / f"{name}.json"
    now = _identity(path)
    if now is None or now == before:
        return
    try:
        n = len(json.loads(path.read_text(encoding="utf-8"))["records"])
    except (OSError, ValueError, KeyError):
        return
    if n:
        print(f"results finished so far ({n} records) are kept in {path}", file=sys.stderr)
