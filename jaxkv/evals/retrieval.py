"""Retrieval under compression: passkey and needle in a haystack (paper Table 2's axis).

Seeded prompts from ``jaxkv.evals.tasks`` at several context lengths, completion style:

* passkey: the classic "The grass is green..." filler, ending "The pass key is"
  (full cache, embedded SmolLM2-135M: 6/6 at 1K and 2K tokens, 5/6 at 4K);
* needle: a RULER-style "special magic number for {word}" needle in tinyshakespeare
  (full cache: 6/6 at 1K, 2K and 4K).

Greedy, 20 new tokens; an answer is correct when the key stands in its first non-empty line
(``metrics.retrieval_match``). Accuracy per policy × ratio × length, mean ± std over seeds for
the random policy. The generation engine is ``benchmarks.run_generation`` (same partial saving);
``evaluate`` is the whole job (``python -m jaxkv.eval retrieval``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from jaxkv.evals import benchmarks, fidelity, metrics, report, runner, tasks
from jaxkv.evals.runner import Job
from jaxkv.evals.tasks import Example

NAME = "retrieval"
TASKS = ("passkey", "needle")
MIN_LENGTH = 128  # tokens: room for the intro, the needle, the question and some filler


def score_retrieval(completion: str, example: Example) -> float:
    """1.0 when the key is in the completion's first non-empty line."""
    return metrics.retrieval_match(completion, str(example.target))


benchmarks.SCORERS.update({t: score_retrieval for t in TASKS})


def examples(task: str, *, n_tokens: int, n: int, seed: int, tokenizer) -> list[Example]:
    """``n`` seeded examples of ``task`` at ``n_tokens``, tagged ``task/n_tokens``.

    Raises:
        ValueError: unknown task (listing the valid ones).
    """
    if task == "passkey":
        found = tasks.passkey_examples(n_tokens=n_tokens, n=n, seed=seed, tokenizer=tokenizer)
    elif task == "needle":
        found = tasks.needle_examples(n_tokens=n_tokens, n=n, seed=seed, tokenizer=tokenizer)
    else:
        raise ValueError(f"unknown retrieval task {task!r}; valid: {', '.join(TASKS)}")
    return [
        dataclasses.replace(e, meta={**e.meta, "task": f"{task}/{n_tokens}", "length": n_tokens})
        for e in found
    ]


def render(rows: list[dict]) -> str:
    """Markdown: accuracy (%) per policy (rows) × task/length (columns), one table per ratio."""
    out = []
    full = {r["task"]: r["score"] for r in rows if r["policy"] == benchmarks.FULL}
    cols = sorted(full, key=lambda t: (t.split("/")[0], int(t.split("/")[1])))
    header = ["policy"] + cols
    out.append("## Full cache\n\n" + report.markdown_table(header, [["full"] + _cells(full, cols)]))
    for (ratio,), rs in report.group_by(rows, ("ratio",)).items():
        if all(r["policy"] == benchmarks.FULL for r in rs):
            continue
        body = []
        for (policy,), prs in report.group_by(rs, ("policy",)).items():
            by = {
                r["task"]: report.fmt_pm(r["score"], r["score_std"], 1, n=r["n_seeds"]) for r in prs
            }
            body.append([policy] + [by.get(c, "-") for c in cols])
        out.append(f"## r = {ratio:g}\n\n" + report.markdown_table(header, body))
    return "Accuracy (%).\n\n" + "\n".join(out)


def _cells(scores: dict, cols: list[str]) -> list[str]:
    return [report.fmt(scores.get(c), 1) for c in cols]


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Accuracy vs context length per policy, one PNG per (task, ratio)."""
    paths = []
    compressed = [r for r in rows if r["policy"] != benchmarks.FULL]
    full = [r for r in rows if r["policy"] == benchmarks.FULL]
    for task in TASKS:
        for (ratio,), rs in report.group_by(compressed, ("ratio",)).items():
            series = {}
            for (policy,), prs in report.group_by(rs, ("policy",)).items():
                pts = sorted(
                    (int(r["task"].split("/")[1]), r["score"], r["score_std"])
                    for r in prs
                    if r["task"].startswith(task + "/")
                )
                if pts:
                    series[policy] = ([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])
            ref = sorted(
                (int(r["task"].split("/")[1]), r["score"])
                for r in full
                if r["task"].startswith(task + "/")
            )
            if ref:
                series["full cache"] = ([p[0] for p in ref], [p[1] for p in ref], None)
            if series:
                paths.append(
                    report.line_plot(
                        series,
                        out_dir / f"{NAME}_{task}_r{ratio:g}.png",
                        xlabel="context length (tokens)",
                        ylabel="accuracy (%)",
                        title=f"{task} retrieval at r = {ratio:g}",
                        invert_x=False,
                    )
                )
    return paths


def evaluate(
    job: Job,
    *,
    task_names: Sequence[str],
    lengths: Sequence[int],
    data_seed: int = 0,
    head_floor: float | None = None,
    head_cap: float | None = None,
) -> report.ResultStore:
    """``job.limit`` seeded prompts of every task × length through
    ``benchmarks.run_generation``; returns the finished store.

    Args:
        job: the shared settings.
        task_names: names from ``TASKS``.
        lengths: context lengths in tokens, each at least ``MIN_LENGTH``.
        data_seed: seed of the keys, depths and filler.
        head_floor, head_cap: per-head bounds of ``adaptive`` and ``global``
            (``Compression.head_floor`` / ``head_cap``; None: the defaults; an error with any
            other granularity).

    Raises:
        ValueError: an unknown task, a short length, a policy that does not support
            ``job.granularity``, or per-head bounds without a pooled granularity or out of
            range, before the model loads; a prompt longer than the model's context, before
            the first cell runs.
    """
    for name in task_names:
        if name not in TASKS:
            raise ValueError(f"unknown retrieval task {name!r}; valid: {', '.join(TASKS)}")
    if min(lengths) < MIN_LENGTH:
        raise ValueError(f"--lengths must be >= {MIN_LENGTH} tokens, got {list(lengths)}")
    pooling = fidelity.pooling_options(job, head_floor=head_floor, head_cap=head_cap)
    fidelity.check_selection(job, fidelity.FidelitySettings(**pooling))
    model = runner.load_eval_model(job.model, dtype=job.dtype, attention=job.attention)
    for n_tokens in lengths:
        need = n_tokens + 64 + tasks.RETRIEVAL_MAX_NEW_TOKENS
        runner.check_fits(model, need, what="--lengths")
    store = report.ResultStore(
        job.out,
        NAME,
        model=model.name,
        config={
            **job.config,
            "tasks": task_names,
            "lengths": lengths,
            "data_seed": data_seed,
            **benchmarks.selection_config(job),
            **pooling,  # only when given: default runs keep their earlier files
        },
        summarize=benchmarks.summarize,
        render=render,
        plot=plot,
        title="Retrieval accuracy under KV compression (passkey / needle)",
    )
    # every prompt is built (and checked) before the first cell runs and saves
    batches = [
        examples(name, n_tokens=n, n=job.limit, seed=data_seed, tokenizer=model.tokenizer)
        for name in task_names
        for n in lengths
    ]
    for batch in batches:
        benchmarks.run_generation(
            model,
            job.groups,
            examples=batch,
            ratios=job.ratios,
            seeds=job.seeds,
            store=store,
            batch_size=job.batch_size,
            min_budget=job.min_budget,
            total=len(batch),
            protocol=job.protocol,
            granularity=job.granularity,
            compression_options=pooling,
        )
    store.finish()
    return store
