"""Where the retained tokens sit (paper Fig. 5): histograms of kept positions per policy.

Each held-out window (as in ``fidelity``) is prefilled and teacher-forced to its end under the
policy; the final cache's occupied slots give the kept positions, normalized by the tokens seen
(0 = the first token, 1 = the newest). With shared granularity every layer and head keeps the
same set; with other granularities every (layer, head) row counts equally. Also reported: the
mean normalized position and the share of kept tokens in the first 10 %, the middle 80 % and
the last 10 % of the sequence. ``evaluate`` is the whole job (``python -m jaxkv.eval positions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from jaxkv.evals import report, runner, tasks
from jaxkv.evals.fidelity import FidelitySettings, check_prompt_len
from jaxkv.evals.runner import (
    EvalModel,
    Job,
    PolicyGroup,
    switch_compression,
    switch_policy,
    switch_state,
)
from jaxkv.generate import teacher_forced

NAME = "positions"
BINS = 20


def kept_positions(
    model: EvalModel,
    windows_NT: np.ndarray,
    *,
    settings: FidelitySettings,
    compression,
    policy_state,
    seed: int,
) -> np.ndarray:
    """Normalized positions (in [0, 1)) of every kept (row, slot) after each window."""
    out = []
    b = min(settings.batch_size, len(windows_NT))
    for start in range(0, len(windows_NT), b):
        chunk = windows_NT[start : start + b]
        _, cache = teacher_forced(
            model.params,
            chunk,
            prompt_len=settings.prompt_len,
            config=model.config,
            compression=compression,
            policy_state=policy_state,
            key=jax.random.key(seed),
        )
        pos = np.moveaxis(np.asarray(cache.pos), 1, 0)  # [B, L, K, C]
        length = np.asarray(cache.length)
        for p, n in zip(pos, length, strict=True):
            out.append(p[p >= 0] / float(n))
    return np.concatenate(out)


def histogram(pos: np.ndarray) -> dict:
    """Density over ``BINS`` equal bins of [0, 1] and the summary shares."""
    counts, _ = np.histogram(pos, bins=BINS, range=(0.0, 1.0))
    return {
        "density": [float(c) for c in counts / max(pos.size, 1) * BINS],
        "mean_position": float(pos.mean()),
        "first_10pct": float(np.mean(pos < 0.1)),
        "middle_80pct": float(np.mean((pos >= 0.1) & (pos < 0.9))),
        "last_10pct": float(np.mean(pos >= 0.9)),
        "kept_per_row": float(pos.size),
    }


def run(
    model: EvalModel,
    groups: Sequence[PolicyGroup],
    *,
    ratios: Sequence[float],
    seeds: Sequence[int],
    windows_NT: np.ndarray,
    settings: FidelitySettings,
    store: report.ResultStore,
) -> list[dict]:
    """Records the kept-position histogram of every evicting policy × ratio (× seed)."""
    members = [p for g in groups if not g.is_full for p in g.members]
    if not members:
        raise ValueError("positions needs at least one evicting policy (not only 'full')")
    runs = [(g, m, s) for g in groups if not g.is_full for m, s in g.runs(seeds)]
    rows_per_window = model.config.n_layers * model.config.n_kv_heads
    with report.progress(len(ratios) * len(runs), desc=NAME) as bar:
        for ratio in ratios:
            comp = switch_compression(
                switch_policy(members), ratio=ratio, min_budget=settings.min_budget
            )
            for group, member, seed in runs:
                pos = kept_positions(
                    model,
                    windows_NT,
                    settings=settings,
                    compression=comp,
                    policy_state=switch_state(members, members.index(member)),
                    seed=seed,
                )
                hist = histogram(pos)
                hist["kept_per_row"] /= rows_per_window * len(windows_NT)
                store.add({"policy": group.label, "ratio": ratio, "seed": seed, **hist})
                bar.update()
    return store.results()


def summarize(records: list[dict]) -> list[dict]:
    """One row per (policy, ratio): histograms and shares averaged over seeds."""
    rows = []
    for (policy, ratio), rs in report.group_by(records, ("policy", "ratio")).items():
        row = {"policy": policy, "ratio": ratio, "n_seeds": len(rs)}
        row["density"] = [float(x) for x in np.mean([r["density"] for r in rs], axis=0)]
        for key in ("mean_position", "first_10pct", "middle_80pct", "last_10pct", "kept_per_row"):
            row[key] = float(np.mean([r[key] for r in rs]))
        rows.append(row)
    return rows


def render(rows: list[dict]) -> str:
    """Markdown: where kept tokens sit, per ratio."""
    header = ["policy", "mean position", "first 10 %", "middle 80 %", "last 10 %", "kept/row"]
    out = []
    for (ratio,), rs in report.group_by(rows, ("ratio",)).items():
        body = [
            [r["policy"], report.fmt(r["mean_position"])]
            + [f"{100 * r[k]:.1f}" for k in ("first_10pct", "middle_80pct", "last_10pct")]
            + [f"{r['kept_per_row']:.1f}"]
            for r in rs
        ]
        out.append(
            f"## r = {ratio:g} (shares of kept tokens, %)\n\n" + report.markdown_table(header, body)
        )
    return "\n".join(out)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Fig. 5: kept-position densities, one PNG per ratio."""
    edges = np.linspace(0.0, 1.0, BINS + 1)
    paths = []
    for (ratio,), rs in report.group_by(rows, ("ratio",)).items():
        paths.append(
            report.histogram_plot(
                {r["policy"]: r["density"] for r in rs},
                edges,
                out_dir / f"{NAME}_r{ratio:g}.png",
                xlabel="normalized position of kept token (0 = first, 1 = newest)",
                ylabel="density",
                title=f"Retained token positions, r = {ratio:g}",
            )
        )
    return paths


def evaluate(
    job: Job, *, window: int, prompt_len: int, text: str | None = None
) -> report.ResultStore:
    """Cuts ``job.limit`` held-out windows of ``text`` (None: tinyshakespeare) as ``fidelity``
    does and runs ``run``; returns the finished store.

    Raises:
        ValueError, FileNotFoundError: only ``full`` in ``job.groups``, ``prompt_len`` not
            below ``window``, a bad text or too little of it, before the model loads; windows
            longer than the model's context.
    """
    if all(g.is_full for g in job.groups):
        raise ValueError(f"{NAME} needs at least one evicting policy (not only 'full')")
    check_prompt_len(window=window, prompt_len=prompt_len)
    tasks.check_text_windows(text, window=window, n_windows=job.limit)
    model = runner.load_eval_model(job.model, dtype=job.dtype, attention=job.attention)
    runner.check_fits(model, window, what="--window")
    windows = tasks.text_windows(
        text, window=window, n_windows=job.limit, tokenizer=model.tokenizer
    )
    store = report.ResultStore(
        job.out,
        NAME,
        model=model.name,
        config={**job.config, "window": window, "prompt_len": prompt_len},
        summarize=summarize,
        render=render,
        plot=plot,
        title="Retained token positions (paper Fig. 5)",
    )
    settings = FidelitySettings(
        prompt_len=prompt_len, batch_size=job.batch_size, min_budget=job.min_budget
    )
    run(
        model,
        job.groups,
        ratios=job.ratios,
        seeds=job.seeds,
        windows_NT=windows,
        settings=settings,
        store=store,
    )
    store.finish()
    return store
