"""Where the retained tokens sit (paper Fig. 5): histograms of kept positions per policy.

Each held-out window (as in ``fidelity``) is prefilled and teacher-forced to its end under the
policy; the final cache's occupied slots give the kept positions, normalized by the tokens seen
(0 = the first token, 1 = the newest). With shared granularity every layer and head keeps the
same set; with other granularities every (layer, head) row counts equally. Also reported: the
mean normalized position and the share of kept tokens in the first 10 %, the middle 80 % and
the last 10 % of the sequence.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from jaxkv.evals import flags, report
from jaxkv.evals.fidelity import FidelitySettings
from jaxkv.evals.runner import (
    EvalModel,
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


def add_parsers(sub, *, common) -> None:
    """Adds ``positions`` to the suite's subparsers."""
    p = sub.add_parser(NAME, help="histogram of retained token positions (Fig. 5)")
    common(p, ratios="0.25", policies="random,streaming_llm,h2o,snapkv,tova,keydiff,knorm", limit=4)
    p.add_argument("--text", default=None, help="text file (default: tinyshakespeare)")
    p.add_argument("--window", type=flags.int_range(2), default=512, help="tokens per window")
    p.add_argument(
        "--prompt-len", type=flags.positive_int, default=256, help="prefilled tokens per window"
    )
    p.set_defaults(func=_positions_cmd)


def _positions_cmd(args: argparse.Namespace) -> int:
    from jaxkv.evals import runner, tasks
    from jaxkv.evals.cli import _finish, _parse_common, check_prompt_len, common_config

    groups, ratios, seeds = _parse_common(args)
    if all(g.is_full for g in groups):
        raise ValueError("positions needs at least one evicting policy (not only 'full')")
    check_prompt_len(args)
    tasks.check_text_windows(args.text, window=args.window, n_windows=args.limit)
    model = runner.load_eval_model(args.model)
    runner.check_fits(model, args.window, what="--window")
    windows = tasks.text_windows(
        args.text, window=args.window, n_windows=args.limit, tokenizer=model.tokenizer
    )
    store = report.ResultStore(
        args.out,
        NAME,
        model=model.name,
        config=common_config(args, window=args.window, prompt_len=args.prompt_len),
        summarize=summarize,
        render=render,
        plot=plot,
        title="Retained token positions (paper Fig. 5)",
    )
    settings = FidelitySettings(
        prompt_len=args.prompt_len, batch_size=args.batch, min_budget=args.min_budget
    )
    run(
        model,
        groups,
        ratios=ratios,
        seeds=seeds,
        windows_NT=windows,
        settings=settings,
        store=store,
    )
    return _finish(store)
