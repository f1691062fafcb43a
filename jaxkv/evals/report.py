"""Writing evaluation results: JSON, Markdown tables, PNG plots, progress bars.

Every subcommand keeps a ``ResultStore``: fine-grained ``records`` (one per completed cell:
a policy × ratio × seed run, or one example under one policy) and a ``summarize`` function
that turns them into the table ``results``. After **every** record the store rewrites
``DIR/<name>.json`` and ``DIR/<name>.md`` (atomically: a unique temporary file in ``DIR``, then
a rename), so an interrupted or failing run leaves every finished cell on disk with
``"complete": false``; ``finish`` marks the run complete and draws the plots.

Nothing is written before the first record (or ``finish``): creating a store neither creates
``DIR`` nor touches files in it. When ``DIR`` already holds ``<name>.json`` from an earlier run,
that file stays intact until the new run has its first record, and is then replaced atomically
(readers see the old version or the new one, never a mix); a run that fails earlier — bad
arguments, a missing file, a model that does not load — leaves it as it was. The suite's
command line writes each run to a fresh folder unless ``--out`` is given (``jaxkv.cli.suite``).
The JSON layout:

``{"model": ..., "complete": bool, "config": {...}, "results": [...], "records": [...]}``
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Summarize = Callable[[list[dict]], list[dict]]
Render = Callable[[list[dict]], str]
Plot = Callable[[list[dict], Path], list[Path]]


def progress(total: int, *, desc: str, disable: bool = False):
    """A tqdm progress bar on stderr (one tick per completed cell)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=disable, dynamic_ncols=True)


def _json_default(x: Any):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, (set, tuple)):
        return list(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file and a rename (never half a file).

    The temporary file has a unique name in the same folder (``tempfile.mkstemp``), so
    concurrent writers never share one: the file always holds one writer's complete text.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ResultStore:
    """Results of one subcommand run, saved after every completed cell.

    Files are first written at the first ``add`` (or ``finish``), see the module docstring.

    Args:
        out_dir: the output folder (created at the first save).
        name: file stem (``fidelity`` -> ``fidelity.json``, ``fidelity.md``, ``fidelity*.png``).
        model: the model name written as ``"model"``.
        config: the run's settings (written as ``"config"``).
        summarize: records -> table rows (``"results"``).
        render: table rows -> Markdown.
        plot: (table rows, out_dir) -> written PNG paths (called by ``finish``).
        title: the Markdown heading.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        name: str,
        *,
        model: str,
        config: dict,
        summarize: Summarize,
        render: Render,
        plot: Plot | None = None,
        title: str = "",
    ):
        self.out_dir = Path(out_dir)
        self.name = name
        self.model = model
        self.config = config
        self.records: list[dict] = []
        self._summarize, self._render, self._plot = summarize, render, plot
        self.title = title or name
        self.complete = False
        self.plots: list[Path] = []

    @property
    def json_path(self) -> Path:
        return self.out_dir / f"{self.name}.json"

    @property
    def md_path(self) -> Path:
        return self.out_dir / f"{self.name}.md"

    def add(self, record: dict | list[dict]) -> None:
        """Appends one completed cell (one record or several) and rewrites the files."""
        self.records.extend([record] if isinstance(record, dict) else record)
        self.save()

    def results(self) -> list[dict]:
        """The summarized table rows of the records so far."""
        return self._summarize(self.records) if self.records else []

    def save(self) -> None:
        """Writes ``<name>.json`` and ``<name>.md`` with what is done so far."""
        rows = self.results()
        doc = {
            "model": self.model,
            "complete": self.complete,
            "config": self.config,
            "results": rows,
            "records": self.records,
        }
        write_atomic(self.json_path, json.dumps(doc, indent=1, default=_json_default) + "\n")
        status = "" if self.complete else "\n_Partial results: the run has not finished._\n"
        body = self._render(rows) if rows else "_No results yet._\n"
        md = f"# {self.title}\n\nModel: `{self.model}`\n{status}\n{body}{config_md(self.config)}"
        write_atomic(self.md_path, md)

    def finish(self) -> list[dict]:
        """Marks the run complete, saves, draws the plots; returns the table rows."""
        self.complete = True
        self.save()
        if self._plot is not None and self.records:
            self.plots = self._plot(self.results(), self.out_dir)
        return self.results()


def config_md(config: dict) -> str:
    """The run settings as a Markdown footnote."""
    items = ", ".join(f"{k}={_short(v)}" for k, v in config.items())
    return f"\nSettings: {items}\n"


def _short(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_short(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


# ----------------------------------------------------------------------------------------------
# Tables


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for a table (``-`` for None / NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def fmt_pm(mean: float | None, std: float | None, digits: int = 3, *, n: int = 1) -> str:
    """``mean ± std`` (just the mean when a single seed gave it)."""
    if n <= 1 or std is None:
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} ± {fmt(std, digits)}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pivot(
    rows: Sequence[dict],
    *,
    row_key: str,
    col_key: str,
    cell: Callable[[dict], str],
    col_label: Callable[[Any], str] = str,
    corner: str = "",
) -> str:
    """A Markdown table with one row per ``row_key`` value and one column per ``col_key``."""
    row_vals = list(dict.fromkeys(r[row_key] for r in rows))
    col_vals = sorted({r[col_key] for r in rows}, reverse=True)
    by = {(r[row_key], r[col_key]): r for r in rows}
    body = [
        [rv] + [cell(by[(rv, cv)]) if (rv, cv) in by else "-" for cv in col_vals] for rv in row_vals
    ]
    return markdown_table([corner or row_key] + [col_label(c) for c in col_vals], body)


def group_by(records: Sequence[dict], keys: Sequence[str]) -> dict[tuple, list[dict]]:
    """Records grouped by the values of ``keys`` (first-seen order)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


# ----------------------------------------------------------------------------------------------
# Plots


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plot(
    series: dict[str, tuple[Sequence[float], Sequence[float], Sequence[float] | None]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logy: bool = False,
    logx: bool = False,
    invert_x: bool = True,
) -> Path:
    """One line per label: ``{label: (x, y, yerr or None)}`` -> PNG."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (x, y, err) in series.items():
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logy:
        ax.set_yscale("symlog", linthresh=1e-2)
        if all(v >= 0 for _, y, _ in series.values() for v in y):
            ax.set_ylim(bottom=0)
    if logx:
        ax.set_xscale("log", base=2)
        xs = sorted({v for x, _, _ in series.values() for v in x})
        ax.set_xticks(xs, [f"{v:g}" for v in xs])
    if invert_x:
        ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def bar_plot(
    groups: Sequence[str],
    bars: dict[str, Sequence[float]],
    path: Path,
    *,
    ylabel: str,
    title: str,
    stacked: bool = False,
) -> Path:
    """Grouped (or stacked) bars: one group per ``groups`` entry, one bar series per label."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(groups) + 2), 4.2))
    x = np.arange(len(groups))
    width = 0.8 if stacked else 0.8 / max(len(bars), 1)
    bottom = np.zeros(len(groups))
    for i, (label, values) in enumerate(bars.items()):
        v = np.asarray(values, dtype=float)
        offset = 0 if stacked else (i - (len(bars) - 1) / 2) * width
        ax.bar(x + offset, v, width, bottom=bottom if stacked else None, label=label)
        if stacked:
            bottom = bottom + v
    ax.set_xticks(x, groups, rotation=30, ha="right")
    ax.set(ylabel=ylabel, title=title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(fig, path)


def histogram_plot(
    hists: dict[str, Sequence[float]],
    edges: Sequence[float],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
) -> Path:
    """Step histograms (precomputed densities over ``edges``), one per label."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, density in hists.items():
        ax.stairs(density, edges, label=label, linewidth=1.5)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
