"""Agreement of compressed generations with the full cache's (paper App. F.3 Table 8, F.5).

The generations come from ``benchmarks.run_generation`` on a task (GSM8K by default, a BBH task,
or a LongBench file), so each compressed completion pairs with the full-cache completion of the
same prompt. Per policy × ratio (mean ± std over seeds where they apply):

* ``rouge_l``: ROUGE-L F1 of the completion against the full cache's;
* ``exact_match``: share of completions equal to the full cache's (after normalization);
* ``length_ratio``: mean generated tokens / the full cache's; ``length_ratio_solved`` only on
  the instances both solve (the paper's F.5);
* error modes on the instances the full cache solves (task score >= ``SOLVED``), as % of them:
  ``repetitive`` (a token loop), ``incorrect`` (wrong answer of normal length) and
  ``overlength`` (hit the token limit where the full cache stopped) — ``metrics.error_mode``.

``evaluate`` is the whole job (``python -m jaxkv.eval agreement``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxkv.evals import benchmarks, fidelity, metrics, report, runner, tasks
from jaxkv.evals.runner import Job

NAME = "agreement"
SOLVED = 0.5  # an example counts as solved when its task score reaches this
MODES = ("repetitive", "incorrect", "overlength")


def _pair_stats(run: list[dict], full: dict) -> dict:
    """Agreement numbers of one seed's records against the full-cache records."""
    pairs = [(r, full[(r["task"], r["id"])]) for r in run if (r["task"], r["id"]) in full]
    cand, ref = [p[0] for p in pairs], [p[1] for p in pairs]
    solved = [(c, f) for c, f in pairs if f["score"] >= SOLVED]
    both = [(c, f) for c, f in solved if c["score"] >= SOLVED]
    modes = [
        metrics.error_mode(
            c["completion"],
            f["completion"],
            max_new_tokens=c["max_new_tokens"],
            candidate_len=c["n_tokens"],
            reference_len=f["n_tokens"],
            correct=c["score"] >= SOLVED,
        )
        for c, f in solved
    ]
    stats = {
        "rouge_l": float(
            np.mean([metrics.rouge_l(c["completion"], f["completion"]) for c, f in pairs])
        ),
        "exact_match": float(
            np.mean([metrics.exact_match(c["completion"], f["completion"]) for c, f in pairs])
        ),
        "length_ratio": _ratio([c["n_tokens"] for c in cand], [f["n_tokens"] for f in ref]),
        "length_ratio_solved": _ratio(
            [c["n_tokens"] for c, _ in both], [f["n_tokens"] for _, f in both]
        ),
    }
    for mode in MODES:
        stats[mode] = 100 * modes.count(mode) / len(modes) if modes else float("nan")
    stats["n_solved_full"] = len(solved)
    return stats


def _ratio(cand: list[int], ref: list[int]) -> float:
    if not cand or sum(ref) == 0:
        return float("nan")
    return metrics.length_ratio(cand, ref)


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, policy, ratio) of compressed runs, paired with the full cache."""
    full = {(r["task"], r["id"]): r for r in records if r["policy"] == benchmarks.FULL}
    rows = []
    compressed = [r for r in records if r["policy"] != benchmarks.FULL]
    for (task, policy, ratio), rs in report.group_by(
        compressed, ("task", "policy", "ratio")
    ).items():
        per_seed = [
            _pair_stats(run, full) for run in report.group_by(rs, ("member", "seed")).values()
        ]
        row = {"task": task, "policy": policy, "ratio": ratio, "n_seeds": len(per_seed)}
        for key in ("rouge_l", "exact_match", "length_ratio", "length_ratio_solved", *MODES):
            values = [s[key] for s in per_seed if not np.isnan(s[key])]
            mean, std = metrics.mean_std(values) if values else (float("nan"), 0.0)
            row[key], row[f"{key}_std"] = mean, std
        row["n_examples"] = len({r["id"] for r in rs})
        row["n_solved_full"] = per_seed[0]["n_solved_full"]
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    """Markdown: one table per task and ratio."""
    header = ["policy", "ROUGE-L", "exact match", "length ratio", "len. ratio (both solve)"]
    header += [f"{m} %" for m in MODES]
    out = []
    for (task, ratio), rs in report.group_by(rows, ("task", "ratio")).items():
        body = []
        for r in rs:
            pm = lambda k, d=3, r=r: report.fmt_pm(r[k], r[f"{k}_std"], d, n=r["n_seeds"])
            body.append(
                [r["policy"], pm("rouge_l"), pm("exact_match"), pm("length_ratio", 2)]
                + [pm("length_ratio_solved", 2)]
                + [pm(m, 1) for m in MODES]
            )
        n, solved = rs[0]["n_examples"], rs[0]["n_solved_full"]
        out.append(
            f"## {task}, r = {ratio:g} ({n} prompts; the full cache solves {solved}; error modes "
            f"as % of those)\n\n" + report.markdown_table(header, body)
        )
    return "\n".join(out)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Stacked error-mode bars per policy, one PNG per (task, ratio)."""
    paths = []
    for (task, ratio), rs in report.group_by(rows, ("task", "ratio")).items():
        bars = {m: [np.nan_to_num(r[m]) for r in rs] for m in MODES}
        stem = task.replace("/", "_")
        paths.append(
            report.bar_plot(
                [r["policy"] for r in rs],
                bars,
                out_dir / f"{NAME}_{stem}_r{ratio:g}.png",
                ylabel="% of full-cache-solved instances that fail",
                title=f"Error modes, {task}, r = {ratio:g}",
                stacked=True,
            )
        )
    return paths


def examples(task: str, *, data: str | None = None, limit: int | None = None) -> list:
    """The prompts of ``task``: ``gsm8k`` (test split), ``bbh/<task>``, or ``longbench`` (the
    LongBench-format JSONL file ``data``).

    Raises:
        ValueError, FileNotFoundError: an unknown task, ``data`` without ``longbench`` or
            ``longbench`` without it, or bad data.
    """
    if data is not None and task != "longbench":
        raise ValueError(f"--data is only read with --task longbench (got --task {task})")
    if task == "gsm8k":
        return tasks.gsm8k_examples("test", limit=limit)
    if task.startswith("bbh/"):
        return tasks.bbh_examples(task.split("/", 1)[1], limit=limit)
    if task == "longbench":
        if data is None:
            raise ValueError("--task longbench needs --data PATH")
        return tasks.longbench_examples(data, limit=limit)
    raise ValueError(f"unknown agreement task {task!r}; valid: gsm8k, bbh/<task>, longbench")


def evaluate(
    job: Job,
    *,
    task: str = "gsm8k",
    data: str | None = None,
    max_new_tokens: int | None = None,
    max_length: int = 3500,
) -> report.ResultStore:
    """Generates ``job.limit`` prompts of ``task`` (``examples``) with the full cache and under
    every policy (``benchmarks.run_generation``); returns the finished store.

    Args:
        job: the shared settings.
        task: ``gsm8k``, ``bbh/<task>`` or ``longbench``.
        data: the LongBench-format JSONL file of ``longbench``.
        max_new_tokens: generation limit (None: the task's).
        max_length: LongBench prompt tokens kept at most (middle truncation).

    Raises:
        ValueError, FileNotFoundError: only ``full`` in ``job.groups``, a policy that does
            not support ``job.granularity``, or as ``examples``, before the model loads.
    """
    if all(g.is_full for g in job.groups):
        raise ValueError(f"{NAME} needs at least one evicting policy (not only 'full')")
    fidelity.check_selection(job)
    found = examples(task, data=data, limit=job.limit)
    model = runner.load_eval_model(job.model, dtype=job.dtype, attention=job.attention)
    store = report.ResultStore(
        job.out,
        NAME,
        model=model.name,
        config={
            **job.config,
            "task": task,
            "max_new_tokens": max_new_tokens,
            **benchmarks.selection_config(job),
        },
        summarize=summarize,
        render=render,
        plot=plot,
        title="Agreement with the full cache and error modes (App. F.3, F.5)",
    )
    benchmarks.run_generation(
        model,
        job.groups,
        examples=found,
        ratios=job.ratios,
        seeds=job.seeds,
        store=store,
        max_new_tokens=max_new_tokens,
        max_length=max_length if task == "longbench" else None,
        batch_size=job.batch_size,
        min_budget=job.min_budget,
        total=len(found),
        protocol=job.protocol,
        granularity=job.granularity,
    )
    store.finish()
    return store
