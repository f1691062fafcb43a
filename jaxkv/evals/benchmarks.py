"""Generation benchmarks under compression: GSM8K, BIG-Bench Hard, LongBench (paper Table 1).

One engine, ``run_generation``: examples are read lazily in batches; each batch is generated
greedily with the full cache and then under every policy × ratio (× seed), every completion is
scored, and the batch's records are saved before the next batch is read. Before the model
loads, every LongBench file must exist and be UTF-8 text with a valid first record (an empty
file is an error, not an empty result); a malformed line later in a file stops the run with its
line number while the finished examples stay on disk. Records keep the completion text and
token count, so ``jaxkv.evals.agreement`` compares the same generations with the full cache's.

The jobs (``python -m jaxkv.eval gsm8k|bbh|longbench``) read the shipped copies (``tasks``) or,
given a ``hub`` source, the full public sets (``jaxkv.evals.hub``):

* ``evaluate_gsm8k``: 8-shot chain of thought, exact match of ``metrics.gsm8k_extract`` with the
  target.
* ``evaluate_bbh``: 3-shot chain of thought, ``metrics.bbh_match``.
* ``evaluate_longbench``: LongBench-format JSONL files (or the public set), the official
  prompts, generation lengths and metrics; prompts longer than ``max_length`` tokens keep their
  first and last halves (LongBench's ``truncate_middle``); the datasets LongBench runs with a
  chat template get the model's.

Scores are in [0, 1] per example; tables show 100 × the mean and the share of the full cache's.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from jaxkv.evals import hub as hub_lib
from jaxkv.evals import metrics, report, runner, tasks
from jaxkv.evals.runner import (
    ByteTokenizer,
    EvalModel,
    Job,
    PolicyGroup,
    check_fits,
    generate_ids,
    strip_stop,
    switch_compression,
    switch_policy,
    switch_state,
)
from jaxkv.evals.tasks import Example
from jaxkv.generate import encode_prompt

Scorer = Callable[[str, Example], float]
FULL = "full"


# ----------------------------------------------------------------------------------------------
# Scoring


def score_gsm8k(completion: str, example: Example) -> float:
    """1.0 when the extracted final number equals the target."""
    return float(metrics.gsm8k_extract(completion) == example.target)


def score_bbh(completion: str, example: Example) -> float:
    """BBH exact match after answer extraction."""
    return metrics.bbh_match(completion, str(example.target))


def score_longbench(completion: str, example: Example) -> float:
    """The dataset's LongBench metric, max over the accepted answers."""
    m = example.meta
    return metrics.longbench_score(
        completion,
        list(example.target),
        metric=m["metric"],
        all_classes=m.get("all_classes", ()),
        first_line_only=m.get("first_line_only", False),
    )


SCORERS: dict[str, Scorer] = {"gsm8k": score_gsm8k, "bbh": score_bbh, "longbench": score_longbench}


def scorer_for(example: Example) -> Scorer:
    """The scorer of an example's task (``meta["task"]`` prefix)."""
    return SCORERS[example.meta["task"].split("/")[0]]


# ----------------------------------------------------------------------------------------------
# Prompts


def prompt_ids(model: EvalModel, example: Example, *, max_length: int | None) -> list[int]:
    """Token ids of an example's prompt: middle-truncated, chat-wrapped when asked for."""
    ids = model.encode(example.prompt)
    if max_length is not None and len(ids) > max_length:
        ids = tasks.truncate_middle(ids, max_length)
        if example.meta.get("chat_template"):
            example_text = model.tokenizer.decode(ids, skip_special_tokens=True)
            return _chat_ids(model, example_text)
    if example.meta.get("chat_template"):
        return _chat_ids(model, example.prompt)
    return ids


def _chat_ids(model: EvalModel, text: str) -> list[int]:
    if isinstance(model.tokenizer, ByteTokenizer) or not getattr(
        model.tokenizer, "chat_template", None
    ):
        return model.encode(text)
    return list(encode_prompt(model.tokenizer, text, chat=True))


# ----------------------------------------------------------------------------------------------
# The engine


def _batches(examples: Iterable[Example], size: int) -> Iterator[list[Example]]:
    it = iter(examples)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _generate_records(
    model: EvalModel,
    batch: Sequence[Example],
    ids: Sequence[Sequence[int]],
    *,
    policy: str,
    member: str,
    ratio: float,
    seed: int,
    max_new_tokens: int,
    **gen,
) -> list[dict]:
    outs = generate_ids(model, ids, max_new_tokens=max_new_tokens, seed=seed, **gen)
    records = []
    for example, prompt, out in zip(batch, ids, outs, strict=True):
        text = model.decode(strip_stop(out, model.stop_tokens))
        records.append(
            {
                "task": example.meta["task"],
                "id": example.id,
                "policy": policy,
                "member": member,
                "ratio": ratio,
                "seed": seed,
                "score": scorer_for(example)(text, example),
                "completion": text,
                "n_tokens": len(out),
                "prompt_tokens": len(prompt),
                "max_new_tokens": max_new_tokens,
                "target": example.target,
            }
        )
    return records


def run_generation(
    model: EvalModel,
    groups: Sequence[PolicyGroup],
    *,
    examples: Iterable[Example],
    ratios: Sequence[float],
    seeds: Sequence[int],
    store: report.ResultStore,
    max_new_tokens: int | None = None,
    max_length: int | None = None,
    batch_size: int = 4,
    min_budget: int = 32,
    total: int | None = None,
    protocol: str = "decode",
    granularity: str = "shared",
    compression_options: dict | None = None,
) -> list[dict]:
    """Generates and scores every example under the full cache and each policy × ratio.

    Args:
        model: the model.
        groups: policy groups (a ``full`` group adds nothing: the reference always runs).
        examples: examples, read lazily ``batch_size`` at a time.
        ratios: budget ratios.
        seeds: seeds of seeded groups.
        store: where records go, after every batch × cell.
        max_new_tokens: generation limit (default: each example's ``meta["max_new_tokens"]``).
        max_length: prompt tokens kept at most (middle truncation).
        batch_size: prompts per generation call.
        min_budget: B_min.
        total: number of examples, for the progress bar (optional).
        protocol: ``decode`` (evict at every decode step) or ``prefill`` (compress the prompt
            once).
        granularity: ``shared``, ``layer``, ``head``, ``adaptive`` or ``global``
            (``jaxkv.eviction``).
        compression_options: further ``Compression`` settings of every policy row (the
            per-head bounds ``head_floor``, ``head_cap``); None: the defaults.

    Returns:
        The store's summarized rows.

    Raises:
        ValueError: ``examples`` is empty (a run without examples is no result), a policy
            does not support ``granularity``, or a prompt does not fit the model's context.
    """
    members = [p for g in groups if not g.is_full for p in g.members]
    runs = [(g, m, s) for g in groups if not g.is_full for m, s in g.runs(seeds)]
    switch = switch_policy(members, granularity=granularity) if members else None
    comps = {
        r: switch_compression(
            switch,
            ratio=r,
            min_budget=min_budget,
            protocol=protocol,
            granularity=granularity,
            **(compression_options or {}),
        )
        for r in (ratios if members else [])
    }
    n_cells = 1 + len(ratios) * len(runs)
    bar_total = None if total is None else -(-total // batch_size) * n_cells
    n_examples = 0
    with report.progress(bar_total or 0, desc=store.name) as bar:
        for batch in _batches(examples, batch_size):
            n_examples += len(batch)
            ids = [prompt_ids(model, e, max_length=max_length) for e in batch]
            new = max_new_tokens or max(e.meta["max_new_tokens"] for e in batch)
            check_fits(model, max(map(len, ids)) + new, what=batch[0].id)
            common = dict(max_new_tokens=new, batch_size=batch_size)
            store.add(
                _generate_records(
                    model,
                    batch,
                    ids,
                    policy=FULL,
                    member=FULL,
                    ratio=1.0,
                    seed=seeds[0],
                    compression=None,
                    **common,
                )
            )
            bar.update()
            for ratio in comps:
                for group, member, seed in runs:
                    state = switch_state(members, members.index(member))
                    store.add(
                        _generate_records(
                            model,
                            batch,
                            ids,
                            policy=group.label,
                            member=member.name,
                            ratio=ratio,
                            seed=seed,
                            compression=comps[ratio],
                            policy_state=state,
                            **common,
                        )
                    )
                    bar.update()
    if not n_examples:
        raise ValueError(f"{store.name}: no examples to run")
    return store.results()


def selection_config(job: Job) -> dict:
    """``job``'s protocol and granularity for the result file's config, each only when it is
    not the default (so that default runs keep their earlier files byte for byte)."""
    return {
        name: getattr(job, name)
        for name in ("protocol", "granularity")
        if getattr(job, name) != _JOB_DEFAULTS[name]
    }


_JOB_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Job)}


# ----------------------------------------------------------------------------------------------
# Tables


def summarize(records: list[dict]) -> list[dict]:
    """One row per (task, policy, ratio): mean score (mean ± std over seeds), share of full."""
    full = {(r["task"], r["id"]): r["score"] for r in records if r["policy"] == FULL}
    rows = []
    for (task, policy, ratio), rs in report.group_by(records, ("task", "policy", "ratio")).items():
        per_seed = report.group_by(rs, ("member", "seed"))
        means = [float(np.mean([r["score"] for r in s])) for s in per_seed.values()]
        mean, std = metrics.mean_std(means)
        ids = {r["id"] for r in rs}
        full_mean = float(np.mean([full[(task, i)] for i in ids if (task, i) in full] or [np.nan]))
        rows.append(
            {
                "task": task,
                "policy": policy,
                "ratio": ratio,
                "score": 100 * mean,
                "score_std": 100 * std,
                "score_full": 100 * full_mean,
                "retained": mean / full_mean if full_mean > 0 else None,
                "n_examples": len(ids),
                "n_seeds": len(means),
            }
        )
    return rows


def render(rows: list[dict]) -> str:
    """Markdown: score (100 × mean) per policy × ratio, one table per task."""
    out = []
    for (task,), rs in report.group_by(rows, ("task",)).items():
        n = max(r["n_examples"] for r in rs)
        table = report.pivot(
            [r for r in rs if r["policy"] != FULL],
            row_key="policy",
            col_key="ratio",
            cell=lambda r: report.fmt_pm(r["score"], r["score_std"], 1, n=r["n_seeds"]),
            col_label=lambda c: f"r={c:g}",
        )
        full = next((r["score"] for r in rs if r["policy"] == FULL), float("nan"))
        out.append(f"## {task} ({n} examples; full cache {full:.1f})\n\n{table}")
    return "\n".join(out)


def plot(rows: list[dict], out_dir: Path, *, name: str) -> list[Path]:
    """Score vs ratio per policy, one PNG per task."""
    paths = []
    for (task,), rs in report.group_by(rows, ("task",)).items():
        full = next((r["score"] for r in rs if r["policy"] == FULL), None)
        series = {}
        for (policy,), prs in report.group_by(rs, ("policy",)).items():
            if policy == FULL:
                continue
            prs = sorted(prs, key=lambda r: r["ratio"])
            series[policy] = ([r["ratio"] for r in prs], [r["score"] for r in prs], None)
        if full is not None and series:
            xs = sorted({x for s in series.values() for x in s[0]})
            series["full cache"] = (xs, [full] * len(xs), None)
        if series:
            stem = task.replace("/", "_")
            paths.append(
                report.line_plot(
                    series,
                    out_dir / f"{name}_{stem}.png",
                    xlabel="KV-cache budget ratio r",
                    ylabel="score (100 × mean)",
                    title=f"{task}: score vs budget",
                )
            )
    return paths


# ----------------------------------------------------------------------------------------------
# The jobs


def evaluate_gsm8k(
    job: Job,
    *,
    split: str = "test",
    shots: int = 8,
    max_new_tokens: int | None = None,
    hub: str | None = None,
) -> report.ResultStore:
    """GSM8K chain of thought through ``run_generation``; returns the finished store.

    Args:
        job: the shared settings.
        split: ``"test"`` or ``"train"``.
        shots: exemplars per prompt.
        max_new_tokens: generation limit (None: ``tasks.GSM8K_MAX_NEW_TOKENS``).
        hub: the public set's source for ``hub.gsm8k_examples`` (None: the shipped copy).

    Raises:
        ValueError, FileNotFoundError: bad data or settings, before the model loads.
        ImportError: ``hub`` without the ``datasets`` extra.
    """
    if hub is None:
        examples = tasks.gsm8k_examples(split, n_shot=shots, limit=job.limit)
    else:
        examples = hub_lib.gsm8k_examples(hub, split, n_shot=shots, limit=job.limit)
    return _evaluate(
        job,
        name="gsm8k",
        title="GSM8K 8-shot CoT under KV compression (exact match, %)",
        examples=lambda model: examples,
        total=len(examples),
        max_new_tokens=max_new_tokens,
        config=dict(split=split, shots=shots, **_source(hub=hub)),
    )


def evaluate_bbh(
    job: Job,
    *,
    task_names: Sequence[str] = ("date_understanding",),
    max_new_tokens: int | None = None,
    hub: str | None = None,
) -> report.ResultStore:
    """BIG-Bench Hard chain of thought through ``run_generation``, ``job.limit`` examples per
    task; returns the finished store.

    Args:
        job: the shared settings.
        task_names: BBH tasks.
        max_new_tokens: generation limit (None: ``tasks.BBH_MAX_NEW_TOKENS``).
        hub: the public set's source for ``hub.bbh_examples`` (None: the shipped copy).

    Raises:
        ValueError, FileNotFoundError: an unknown task or bad data, before the model loads.
        ImportError: ``hub`` without the ``datasets`` extra.
    """
    if hub is None:
        examples = [e for t in task_names for e in tasks.bbh_examples(t, limit=job.limit)]
    else:
        examples = [e for t in task_names for e in hub_lib.bbh_examples(t, hub, limit=job.limit)]
    return _evaluate(
        job,
        name="bbh",
        title="BIG-Bench Hard 3-shot CoT under KV compression (exact match, %)",
        examples=lambda model: examples,
        total=len(examples),
        max_new_tokens=max_new_tokens,
        config=dict(tasks=list(task_names), **_source(hub=hub)),
    )


def evaluate_longbench(
    job: Job,
    *,
    data: Sequence[str] | None = None,
    hub: str | None = None,
    dataset: str | None = None,
    config_dir: str | None = None,
    max_length: int = 3500,
    max_new_tokens: int | None = None,
) -> report.ResultStore:
    """LongBench through ``run_generation``, ``job.limit`` examples per file; returns the
    finished store.

    The examples come from LongBench-format JSONL files (``data``, read lazily: a malformed
    line stops the run there, the examples before it saved), or from the public set
    (``hub.longbench_examples(dataset, hub)``, read before the model loads).

    Args:
        job: the shared settings.
        data: JSONL files, unless ``hub``.
        hub: the public set's source (a hub name or local folder), with ``dataset``.
        dataset: the LongBench dataset (for ``data``, default: from each file name).
        config_dir: the folder with LongBench's config files (default: the shipped ones).
        max_length: prompt tokens kept at most (middle truncation).
        max_new_tokens: generation limit (None: each dataset's).

    Raises:
        ValueError, FileNotFoundError: a missing or bad file, an unknown dataset, a file
            without records or with a bad first one, before the model loads.
        ImportError: ``hub`` without the ``datasets`` extra.
    """
    if (data is None) == (hub is None):
        raise ValueError("give LongBench files or a hub source, one of them")
    if hub is not None:
        if dataset is None:
            raise ValueError("a LongBench hub source needs the dataset (e.g. hotpotqa)")
        found = hub_lib.longbench_examples(dataset, hub, limit=job.limit, config_dir=config_dir)
        examples, config = (lambda model: found), _source(hub=hub, dataset=dataset)
    else:
        check_longbench_files(data, dataset=dataset, config_dir=config_dir)

        def examples(model):
            for path in data:
                it = tasks.iter_longbench_examples(path, dataset=dataset, config_dir=config_dir)
                yield from itertools.islice(it, job.limit)

        config = dict(data=data)
    return _evaluate(
        job,
        name="longbench",
        title="LongBench under KV compression (official metrics, 100 × mean)",
        examples=examples,
        max_new_tokens=max_new_tokens,
        max_length=max_length,
        config=config,
    )


def check_longbench_files(paths: Sequence[str], *, dataset: str | None, config_dir) -> None:
    """Fails fast, before a model loads: a missing or non-text file, an unknown dataset, a
    file without records, or a bad first record. Later lines are checked as they are read."""
    for path in paths:
        it = tasks.iter_longbench_examples(path, dataset=dataset, config_dir=config_dir)
        next(it)  # raises on an empty file (no StopIteration: the iterator raises instead)


def _source(*, hub: str | None, **more) -> dict:
    """The result file's record of a public set (nothing for the shipped data)."""
    return {} if hub is None else {"hub": hub, **more}


def _evaluate(
    job: Job,
    *,
    name: str,
    title: str,
    examples: Callable[[EvalModel], Iterable[Example]],
    max_new_tokens: int | None,
    config: dict,
    max_length: int | None = None,
    total: int | None = None,
) -> report.ResultStore:
    """Loads the model and runs ``examples(model)``; every argument is checked by now."""
    model = runner.load_eval_model(job.model, dtype=job.dtype, attention=job.attention)
    store = report.ResultStore(
        job.out,
        name,
        model=model.name,
        config={**job.config, "max_new_tokens": max_new_tokens, **config, **selection_config(job)},
        summarize=summarize,
        render=render,
        plot=lambda rows, out: plot(rows, out, name=name),
        title=title,
    )
    run_generation(
        model,
        job.groups,
        examples=examples(model),
        ratios=job.ratios,
        seeds=job.seeds,
        store=store,
        max_new_tokens=max_new_tokens,
        max_length=max_length,
        batch_size=job.batch_size,
        min_budget=job.min_budget,
        total=total,
        protocol=job.protocol,
        granularity=job.granularity,
    )
    store.finish()
    return store
